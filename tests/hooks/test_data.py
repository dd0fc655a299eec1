"""agents.hooks.data: the global sample cursor keeps one sample sequence across world sizes."""

from __future__ import annotations

import itertools

import pytest
import torch

from agents.hooks.data import GlobalCursorSampler, epoch_permutation


def train(dataset_size, batch_size, world_size, cursor, steps, seed=3):
    """Sample ids in (step, rank) order, as ``world_size`` ranks would train them from ``cursor``."""
    samplers = [GlobalCursorSampler(dataset_size, batch_size, rank=r, world_size=world_size, seed=seed,
                                    start_cursor=cursor) for r in range(world_size)]
    streams = [iter(s) for s in samplers]
    seen = []
    for _ in range(steps):
        for stream in streams:
            seen.extend(next(stream))
    return seen, cursor + steps * world_size * batch_size


def reference(dataset_size, count, seed=3):
    """The first ``count`` samples of the global stream: epoch after epoch of seeded shuffles."""
    epochs = itertools.count()
    stream = itertools.chain.from_iterable(epoch_permutation(dataset_size, e, seed) for e in epochs)
    return list(itertools.islice(stream, count))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_read_in_step_then_rank_order_train_on_the_global_stream(world_size):
    seen, _ = train(dataset_size=20, batch_size=4, world_size=world_size, cursor=0, steps=10)
    assert seen == reference(20, len(seen))


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3), (4, 2)])
def test_changing_world_size_mid_epoch_continues_the_same_stream(before, after):
    first, cursor = train(dataset_size=30, batch_size=3, world_size=before, cursor=0, steps=3)
    second, _ = train(dataset_size=30, batch_size=3, world_size=after, cursor=cursor, steps=8)
    assert first + second == reference(30, len(first) + len(second))


def test_every_epoch_is_a_permutation_and_epochs_differ():
    e0, e1 = epoch_permutation(50, 0, seed=1), epoch_permutation(50, 1, seed=1)
    assert sorted(e0) == sorted(e1) == list(range(50))
    assert e0 != e1
    assert e0 == epoch_permutation(50, 0, seed=1)  # deterministic
    assert epoch_permutation(50, 1, seed=0) != epoch_permutation(50, 0, seed=1)  # seed and epoch do not alias


def test_without_shuffle_the_stream_is_the_dataset_in_order():
    sampler = GlobalCursorSampler(5, 2, rank=1, world_size=2, shuffle=False, start_cursor=4)
    assert list(itertools.islice(iter(sampler), 2)) == [[1, 2], [0, 1]]  # positions 6,7 then 10,11


def test_iterating_never_touches_the_global_rng():
    before = torch.get_rng_state()
    sampler = GlobalCursorSampler(100, 8, rank=0, world_size=2, seed=5)
    list(itertools.islice(iter(sampler), 30))
    assert torch.equal(before, torch.get_rng_state())


def test_invalid_shapes_are_refused():
    with pytest.raises(ValueError):
        GlobalCursorSampler(10, 2, rank=2, world_size=2)
    with pytest.raises(ValueError):
        GlobalCursorSampler(0, 2)


def test_skip_forward_moves_past_every_range_a_step_would_touch():
    from agents.hooks.data import skip_forward

    assert skip_forward(0, 8, ()) == 0
    assert skip_forward(0, 8, [(100, 200)]) == 0  # untouched
    assert skip_forward(96, 8, [(100, 200)]) == 200  # the step [96, 104) overlaps: jump to its end
    assert skip_forward(100, 8, [(100, 200), (200, 204)]) == 204  # chained ranges
    assert skip_forward(200, 8, [(100, 200)]) == 200  # a range ends where the step begins: kept


def test_a_sampler_with_a_skip_range_never_yields_a_skipped_position():
    from agents.hooks.data import GlobalCursorSampler

    plain = GlobalCursorSampler(64, 2, rank=0, world_size=2, seed=3)
    skipping = GlobalCursorSampler(64, 2, rank=0, world_size=2, seed=3, skip=[(8, 20)])
    steps = iter(skipping)
    got = [next(steps) for _ in range(6)]
    # Step cursors 0, 4 as usual; 8..19 skipped; then 20, 24, 28, 32.
    assert got == [plain.indices_at(c) for c in (0, 4, 20, 24, 28, 32)]


def test_skip_data_is_read_from_the_environment_with_a_clear_error():
    import pytest

    from agents.hooks.settings import Environment, parse_skip_data

    assert Environment.from_env({"NIGHTWATCH_SKIP_DATA": "100-200,500-520"}).skip_data == ((100, 200), (500, 520))
    assert parse_skip_data("") == ()
    with pytest.raises(ValueError, match="'7-3' is not a range"):
        parse_skip_data("7-3")

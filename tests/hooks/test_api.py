"""agents.hooks.Hooks in one process (no torchrun): resume choice, control, contracts of the API."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from agents.hooks import Environment, GuardSettings, Hooks, StopTraining, config_fingerprint, latest_verified
from agents.protocol.hooks import EXIT_RESUME_REFUSED

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Pairs(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        x = torch.full((4,), float(index % 7))
        return x, x.sum(dim=0, keepdim=True)


def make_hooks(tmp_path, env: Environment | None = None, **options) -> Hooks:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return Hooks(model, optimizer, dataset=Pairs(), batch_size=4, ckpt_dir=str(tmp_path / "ckpt"),
                 env=env or Environment(), **options)


def train(nw: Hooks, steps: int | None, until=lambda: False, deadline_s: float = 20.0) -> None:
    deadline = time.monotonic() + deadline_s
    for x, y in nw.batches(max_steps=steps):
        loss = (nw.model(x) - y).pow(2).mean()
        loss.backward()
        nw.step(loss)
        if until() or time.monotonic() > deadline:
            break


def committed_steps(tmp_path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (tmp_path / "ckpt").glob("step-*") if (p / "COMMITTED").exists())


def test_a_fresh_run_checkpoints_on_schedule_and_at_the_end(tmp_path):
    with make_hooks(tmp_path, checkpoint_every=4) as nw:
        train(nw, 10)
        assert (nw.step_count, nw.data_cursor) == (10, 40)
    assert committed_steps(tmp_path) == [4, 8, 10]


def test_the_next_run_resumes_where_the_last_verified_checkpoint_left_off(tmp_path):
    with make_hooks(tmp_path, checkpoint_every=4) as nw:
        train(nw, 6)
    with make_hooks(tmp_path, checkpoint_every=4) as nw:
        assert (nw.step_count, nw.data_cursor) == (6, 24)
        assert "/step-00000006-g0-" in nw.resumed_from
        assert nw.batch_indices() == nw.sampler.indices_at(24)


def test_a_batch_without_a_step_is_a_usage_error(tmp_path):
    with make_hooks(tmp_path) as nw, pytest.raises(RuntimeError, match="exactly once"):
        for _ in nw.batches(max_steps=3):
            pass


def test_the_checkpoint_the_control_plane_names_wins_over_newer_ones(tmp_path):
    with make_hooks(tmp_path, checkpoint_every=2) as nw:
        train(nw, 6)
    rollback = sorted((tmp_path / "ckpt").glob("step-00000002-*"))[0]
    with make_hooks(tmp_path, env=Environment(generation=1, resume_from=str(rollback))) as nw:
        assert nw.step_count == 2 and nw.resumed_from == str(rollback)
        train(nw, 3)
    # A torchrun restart inside generation 1 continues from generation 1's own newer checkpoint.
    with make_hooks(tmp_path, env=Environment(generation=1, resume_from=str(rollback))) as nw:
        assert nw.step_count == 3 and "-g1-" in nw.resumed_from


def test_a_named_checkpoint_that_fails_verification_refuses_to_start(tmp_path):
    with make_hooks(tmp_path, checkpoint_every=2) as nw:
        train(nw, 4)
    named = sorted((tmp_path / "ckpt").glob("step-00000004-*"))[0]
    (named / "COMMITTED").unlink()
    with pytest.raises(StopTraining) as stopped:
        make_hooks(tmp_path, env=Environment(generation=1, resume_from=str(named)))
    assert stopped.value.code == EXIT_RESUME_REFUSED and "no commit marker" in stopped.value.reason


def test_a_checkpoint_of_another_model_shape_is_incompatible(tmp_path):
    with make_hooks(tmp_path, checkpoint_every=2, config={"lr": 1e-3}) as nw:
        train(nw, 2)
    with make_hooks(tmp_path, config={"lr": 2e-3}) as nw:
        assert nw.step_count == 0 and nw.resumed_from is None


def test_the_fingerprint_ignores_the_ddp_wrapper_and_follows_config_and_shapes():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(4, 1)

    assert config_fingerprint(nn.Linear(4, 1), {"a": 1}) == config_fingerprint(Wrapped(), {"a": 1})
    assert config_fingerprint(nn.Linear(4, 1), {"a": 1}) != config_fingerprint(nn.Linear(4, 1), {"a": 2})
    assert config_fingerprint(nn.Linear(4, 1), None) != config_fingerprint(nn.Linear(5, 1), None)


def test_control_plane_requests_a_checkpoint_and_a_new_interval(tmp_path, control_plane):
    control_plane.control = {"checkpoint_now": True, "checkpoint_interval_steps": 7}
    env = Environment(url=control_plane.url, job="job-3", spool_dir=str(tmp_path / "spool"))
    with make_hooks(tmp_path, env=env, guards=GuardSettings(check_every=5)) as nw:
        train(nw, None, until=lambda: nw.checkpoint_every == 7)
        applied_at = nw.step_count
        train(nw, applied_at + 15)  # a second batches() loop carries on from the same cursor
    steps = committed_steps(tmp_path)
    (requested,) = [s for s in steps if s <= applied_at]  # once, though the flag stays up on the server
    assert requested % 5 == 0  # acted on at an exchange point, where every rank learns of it
    assert [s for s in steps if s > applied_at] == [s for s in range(applied_at + 1, applied_at + 16)
                                                     if s % 7 == 0 or s == applied_at + 15]


def test_amp_grad_scaler_state_is_checkpointed(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with make_hooks(tmp_path, scaler=scaler, checkpoint_every=3) as nw:
        for x, y in nw.batches(max_steps=3):
            scaler.scale((nw.model(x) - y).pow(2).mean()).backward()
            nw.step(scaler.scale(torch.tensor(0.0)) + 1.0)
    (chosen, _) = latest_verified(tmp_path / "ckpt")
    assert "scaler" in chosen.manifest["parts"]
    fresh = torch.amp.GradScaler("cpu", init_scale=1.0)
    with make_hooks(tmp_path, scaler=fresh) as nw:
        assert nw.step_count == 3 and fresh.get_scale() == scaler.get_scale()


def test_committed_snapshots_are_reported_at_most_once_per_interval(tmp_path, monkeypatch):
    """With a snapshot every step a commit follows every step; the control plane hears of the first
    at once and then of one per ``SNAPSHOT_EVENT_INTERVAL_S``, with step, generation and size."""
    from agents.hooks import api
    from agents.hooks.snapshot import SnapshotCommit

    nw = make_hooks(tmp_path, env=Environment(generation=4))
    sent: list[tuple[int, str, dict]] = []
    monkeypatch.setattr(nw.telemetry, "event", lambda step, kind, message, detail=None, **_: sent.append(
        (step, kind, detail)))
    clock = [1000.0]
    monkeypatch.setattr(api.time, "monotonic", lambda: clock[0])
    for step in range(1, 40):
        nw._snapshot_committed(SnapshotCommit(f"/dev/shm/s{step}", step, 100 + step, 0.001, 0.01))
        clock[0] += 1.0  # a step a second: 39 commits in 39 s
    interval = api.SNAPSHOT_EVENT_INTERVAL_S
    assert [s for s, _, _ in sent] == [1, 1 + int(interval)]
    assert sent[0] == (1, "snapshot_committed", {"step": 1, "generation": 4, "size_bytes": 101})
    assert nw.last_snapshot is not None and nw.last_snapshot.step == 39  # every commit is still kept
    nw.close()

"""The job state machine: every legal and illegal move, fencing, audit rows, and a real race."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from jobs import state
from jobs.choices import JobState
from jobs.models import Event, Job

ALL_STATES = [s.value for s in JobState]
LEGAL = [(old, new) for old in ALL_STATES for new in ALL_STATES if new in state.ALLOWED[old]]
ILLEGAL = [(old, new) for old in ALL_STATES for new in ALL_STATES if new not in state.ALLOWED[old]]


def make_job(current: str, generation: int = 3) -> Job:
    return Job.objects.create(name="j", entrypoint="train.py", state=current, generation=generation,
                              created_by="test")


def test_every_state_is_in_the_table():
    assert set(state.ALLOWED) == set(ALL_STATES)
    for targets in state.ALLOWED.values():
        assert targets <= set(ALL_STATES)
    for terminal in JobState.TERMINAL:
        assert state.ALLOWED[terminal] == frozenset()


@pytest.mark.django_db
@pytest.mark.parametrize(("old", "new"), LEGAL)
def test_legal_transition_changes_state_and_appends_one_event(old, new):
    job = make_job(old)
    result = state.transition(job, new, actor="test:suite", reason="because", evidence={"incident": 1})
    job.refresh_from_db()
    assert job.state == new
    assert result.old_state == old
    expected_generation = 4 if new == JobState.INITIALIZING else 3
    assert job.generation == expected_generation
    [event] = Event.objects.filter(job=job)
    assert (event.old_state, event.new_state, event.actor, event.reason) == (old, new, "test:suite", "because")
    assert event.evidence == {"incident": 1}
    assert event.generation == expected_generation


@pytest.mark.django_db
@pytest.mark.parametrize(("old", "new"), ILLEGAL)
def test_illegal_transition_raises_and_writes_nothing(old, new):
    job = make_job(old)
    with pytest.raises(state.IllegalTransition, match=f"cannot go from {old} to {new}"):
        state.transition(job, new, actor="test")
    job.refresh_from_db()
    assert job.state == old and job.generation == 3
    assert not Event.objects.filter(job=job).exists()


@pytest.mark.django_db
def test_stale_generation_is_refused():
    job = make_job(JobState.RUNNING, generation=5)
    with pytest.raises(state.StaleGeneration, match="generation 4 is stale; the active generation is 5"):
        state.transition(job, JobState.QUIESCING, actor="node:gpu-01", generation=4)
    state.transition(job, JobState.QUIESCING, actor="node:gpu-01", generation=5)
    assert Job.objects.get(pk=job.pk).state == JobState.QUIESCING


@pytest.mark.django_db
def test_expect_state_guards_against_stale_intent():
    job = make_job(JobState.PAUSED)
    with pytest.raises(state.TransitionConflict, match="is paused, expected running"):
        state.transition(job, JobState.CANCELLED, actor="test", expect_state=JobState.RUNNING)


@pytest.mark.django_db
def test_a_recovery_cycle_bumps_generation_and_restart_count_monotonically():
    job = make_job(JobState.PENDING, generation=0)
    state.transition(job, JobState.INITIALIZING, actor="t")
    state.transition(job, JobState.RUNNING, actor="t", generation=1)
    state.transition(job, JobState.QUIESCING, actor="t", generation=1)
    state.transition(job, JobState.RECOVERING, actor="t", generation=1)
    state.transition(job, JobState.INITIALIZING, actor="t", restart=True)
    job.refresh_from_db()
    assert (job.state, job.generation, job.restart_count) == (JobState.INITIALIZING, 2, 1)
    assert list(Event.objects.filter(job=job).values_list("generation", flat=True)) == [1, 1, 1, 1, 2]


@pytest.mark.django_db
def test_pause_reason_is_kept_while_paused_and_cleared_after():
    job = make_job(JobState.RUNNING)
    state.transition(job, JobState.PAUSED, actor="t", pause_reason="circuit breaker: 6 restarts in 60 min")
    assert Job.objects.get(pk=job.pk).pause_reason.startswith("circuit breaker")
    state.transition(job, JobState.RECOVERING, actor="t")
    assert Job.objects.get(pk=job.pk).pause_reason == ""


@pytest.mark.django_db
def test_events_are_append_only():
    job = make_job(JobState.PENDING)
    event = state.transition(job, JobState.CANCELLED, actor="t").event
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError):
        event.save()
    with pytest.raises(ValidationError):
        event.delete()
    with pytest.raises(ValidationError):
        Event.objects.filter(pk=event.pk).update(reason="rewritten")


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_racing_transitions_on_two_connections_cannot_both_win():
    """Two threads, each with its own PostgreSQL connection, start the same job at once."""
    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL: run it through `make test` (DATABASE_URL)")
    for _ in range(10):
        job = make_job(JobState.PENDING, generation=0)
        barrier = threading.Barrier(2)
        outcomes: list[str] = []

        def contender(job=job, barrier=barrier, outcomes=outcomes):
            from django.db import connection as thread_connection

            try:
                barrier.wait(timeout=10)
                state.transition(job.pk, JobState.INITIALIZING, actor=f"thread:{threading.get_ident()}")
                outcomes.append("won")
            except state.TransitionError as exc:
                outcomes.append(type(exc).__name__)
            finally:
                thread_connection.close()

        threads = [threading.Thread(target=contender) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sorted(outcomes) == ["IllegalTransition", "won"]
        job.refresh_from_db()
        assert job.generation == 1
        assert Event.objects.filter(job=job).count() == 1

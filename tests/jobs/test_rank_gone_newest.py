"""The hang sweep waits on the newest ``rank_gone`` notice of the generation (``jobs.progress.
_await_exit_report``): a rank replaced in process (``jobs.inprocess``) may die again in the same
generation, and the steps that came after its first death must not make the sweep ignore the
second one and call the silence after it a hang."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from agents.protocol import agent as wire
from agents.protocol import dump, parse
from agents.protocol import hooks as hooks_protocol
from checkpoints.models import Checkpoint
from jobs import ingest, progress
from jobs.choices import JobState
from jobs.models import Generation, Incident, Job
from nodes.services import ingest as node_ingest

#: A day ahead of the real clock (as in test_progress_timeout): the generation starts before it.
T0 = (timezone.now() + timedelta(days=1)).replace(microsecond=0)
FAST = {"input": 0.01, "compute": 0.07, "optimizer": 0.02}  # a 0.1 s step: the 2 s floor applies


@pytest.fixture
def job(cast):
    """cast.job running generation 1 on node1, its timeout derived; a save measured at 50 ms."""
    Job.objects.filter(pk=cast.job.pk).update(state=JobState.RUNNING, generation=1, recovery_policy={})
    Generation.objects.create(job=cast.job, number=1, world_size=2, started_at=timezone.now()).nodes.add(cast.node1)
    Checkpoint.objects.create(job=cast.job, step=0, location=f"/ckpt/{cast.job.pk}/0", blocking_s=0.05)
    cast.job.refresh_from_db()
    return cast.job


def train(job, clock, first, last):
    """Rank 0 reports steps ``first``..``last``, one every 0.1 s, through the reports' ingest."""
    for step in range(first, last + 1):
        clock.shift(0.1)
        body = {"job": str(job.pk), "generation": 1,
                "reports": [{"job": str(job.pk), "generation": 1, "rank": 0, "step": step, "loss": 2.0,
                             "grad_norm": 1.0, "world_size": 2, "data_cursor": 8 * step, "samples": 8,
                             "phases": FAST, "time": timezone.now().timestamp()}]}
        ingest.record_reports(Job.objects.get(pk=job.pk), parse(hooks_protocol.ReportBatch, body), actor="test")


def rank_gone(job, node):
    """The agent of ``node`` says a rank of generation 1 died now (keyed per death, as
    ``Agent._rank_gone`` does); returns when."""
    died = timezone.now()
    notice = wire.RankGone(at=died.timestamp())
    batch = parse(wire.EventBatch, {"events": [{"key": f"rank_gone:{job.pk}:1:{notice.at:.3f}", "kind": "rank_gone",
                                                "time": died.timestamp(), "job": str(job.pk), "generation": 1,
                                                "detail": dump(notice)}]})
    node_ingest.record_agent_events(node, wire.parse_event_details(batch))
    return died


@pytest.mark.django_db
def test_a_second_death_after_steps_resumed_in_process_holds_the_verdict_and_dates_the_crash(cast, job):
    """Rank 1 dies at 1.0 s and is replaced in process; training goes on for 3 s (past the first
    notice by more than REPORT_DELAY_MAX_S); it dies again at 4.3 s, its budget spent, and the
    generation goes silent. The exit report is on its way: not a hang."""
    with time_machine.travel(T0, tick=False) as clock:
        train(job, clock, 1, 10)
        rank_gone(job, cast.node1)
        train(job, clock, 11, 40)  # round 1: steps 11-40, up to 4.0 s
        assert Job.objects.get(pk=job.pk).last_step_at > timezone.now() - timedelta(seconds=0.1)
        clock.shift(0.3)
        died = rank_gone(job, cast.node1)
        clock.shift(progress.PROGRESS_TIMEOUT_FLOOR_S)
        assert progress.expire_one_progress_deadline()  # handled: the deadline waits for the exit report...
        assert not Incident.objects.filter(job=job).exists()
        assert Job.objects.get(pk=job.pk).progress_deadline == died + timedelta(seconds=progress.RANK_GONE_WAIT_S)
        assert not progress.expire_one_progress_deadline()  # ...and nothing is due meanwhile

        # No exit report within the wait: a crash, dated from the second death (not the first).
        clock.shift(progress.RANK_GONE_WAIT_S)
        assert progress.expire_one_progress_deadline()
        incident = Incident.objects.get(job=job)
        assert (incident.kind, incident.evidence["signal"]) == ("crash", "exit")
        assert incident.fault_at == died and incident.evidence["nodes"] == ["gpu-01"]

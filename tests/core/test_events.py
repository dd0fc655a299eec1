"""The audit log's vocabulary: each kind's evidence shape takes what its writers send and refuses
anything else; ``record_event`` is the only writer and writes nothing it refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.events import EVIDENCE, EventKind, EvidenceError, check_evidence, record_event
from core.models import Event

CHECKPOINT = {"checkpoint": 7, "step": 200}
SCHEDULABILITY = {"health": "healthy"}

#: What the writers send for each kind (see the call sites of ``record_event``).
SENT: dict[EventKind, dict] = {
    EventKind.JOB_LAUNCH: {"spec": {"name": "llama", "nnodes": 2}},
    EventKind.JOB_STATE: {"nodes": ["gpu-1", "gpu-2"], "resume_from": None, "shrunk": False},
    EventKind.JOB_EFFICIENCY_TARGET: {"expected_mfu": 0.4, "mfu_margin": None, "flops_per_token": 6_000_000_000},
    EventKind.JOB_CHECKPOINT_REQUEST: {"last_step": 1200},
    EventKind.JOB_RESIZE: {"old_nnodes": 1, "old_nproc_per_node": 2, "nnodes": 1, "nproc_per_node": 1,
                           "last_step": 40, "state": "running"},
    EventKind.JOB_REPORTS_REFUSED: {"records": 1, "reason": "far_ahead", "reasons": {"far_ahead": 1},
                                    "examples": [{"rank": 0, "step": 100_400, "reason": "far_ahead"}]},
    EventKind.INCIDENT_OPEN: {"incident": 3, "decision": "restart"},
    EventKind.INCIDENT_RESOLVED: {"incident": 3, "decision": "restart", "lost_steps": 30},
    EventKind.NODE_REGISTER: {"address": "10.0.0.5", "labels": {"rack": "a"}, "gpus": [{"index": 0}],
                              "previous": None},
    EventKind.NODE_BOOTSTRAP_TOKEN: {"token": "gpu-1-bootstrap", "prefix": "nwb_ab12",
                                     "expires_at": "2026-12-01T08:00:00+00:00"},
    EventKind.NODE_COMMAND: {"command": 12, "idempotency_key": "launch-3-1"},
    EventKind.NODE_HEALTH: {"reasons": ["GPU 0 at 95 °C"], "gpus": {"0": "unhealthy"}},
    EventKind.NODE_DRAIN: SCHEDULABILITY,
    EventKind.NODE_DRAINED: SCHEDULABILITY,
    EventKind.NODE_UNDRAIN: SCHEDULABILITY,
    EventKind.NODE_BLAME: {"incident": 3, "jobs": [4, 5, 6]},
    EventKind.NODE_LEMON_CLEARED: {},
    EventKind.FLEET_SILENCE: {"silent": 3, "expected": 4, "oldest_missed_deadline": None,
                              "silent_since": "2026-12-01T07:00:00+00:00", "deadlines_reset": {"nodes": 3, "jobs": 1}},
    EventKind.FLEET_OVERLOAD: {"window_s": 15.0, "heartbeats_refused": 12, "refused": 340, "late_heartbeats": None,
                               "queue_depth": 4, "since": "2026-12-01T07:00:00+00:00", "holding": True,
                               "deadlines_reset": {"nodes": 40, "jobs": 2}},
    EventKind.SLURM_REACHABLE: {"cluster": "main", "last_error": "timeout"},
    EventKind.SLURM_UNREACHABLE: {"cluster": "main", "command": ["squeue", "--json"]},
    EventKind.SLURM_SUBMIT: {"slurm_job_id": 4242, "adopted": False, "excluded": []},
    EventKind.SLURM_REFUSED: {"command": ["sbatch", "--parsable"]},
    EventKind.SLURM_ENDED: {"exit_code": None, "slurm": {"job_id": 4242, "state": "CANCELLED"}},
    EventKind.TOKEN_ROTATE: {"old_prefix": "nwa_ab12", "new_prefix": "nwa_cd34"},
    EventKind.CHECKPOINT_COMMIT: {"checkpoint": 7, "blocking_s": 1.5, "total_s": None, "size_bytes": 4096},
    EventKind.CHECKPOINT_INTERVAL: {"job": 1, "computed_at": "2026-12-01T07:00:00+00:00", "save_cost_s": 2.0,
                                    "total_save_s": None, "cost_samples": 3, "mtbf_s": 86400.0,
                                    "mtbf_source": "assumed", "failures": 0, "exposure_s": 0.0, "gpus": 16,
                                    "gpu_mtbf_hours": 50000.0, "interval_s": 600.0, "step_time_s": 1.2,
                                    "step_samples": 50, "interval_steps": 500, "explanation": "Young/Daly"},
    EventKind.CHECKPOINT_VERIFY: {**CHECKPOINT, "location": "/ckpt/step-200"},
    EventKind.CHECKPOINT_PIN: CHECKPOINT,
    EventKind.CHECKPOINT_UNPIN: CHECKPOINT,
    EventKind.CHECKPOINT_DELETE: {**CHECKPOINT, "location": "/ckpt/step-200", "replica_location": "",
                                  "size_bytes": None},
    EventKind.CHECKPOINT_DELETE_FAILED: {**CHECKPOINT, "location": "/ckpt/step-200"},
    EventKind.CHECKPOINT_REPLICA: {**CHECKPOINT, "replica_location": "/replica/step-200"},
    EventKind.CHECKPOINT_RESTORE_FROM_REPLICA: {**CHECKPOINT, "location": "/ckpt/step-200",
                                                "replica_location": "/replica/step-200"},
    EventKind.STORAGE_TORN_REMOVED: {"location": "/ckpt/step-00000200-g2-ab12cd", "generation": 2,
                                     "size_bytes": 4096, "idle_s": 3600.0},
    EventKind.STORAGE_PRESSURE: {"directory": "/ckpt", "free_bytes": 1024, "total_bytes": 1 << 30,
                                 "target_bytes": 1 << 26, "out_of_space": True, "deleted": [3, 4],
                                 "released_permanent": [], "freed_bytes": 8192, "still_short": False},
    EventKind.ALERT_CHANNEL: {"channel": 2, "name": "pager", "kind": "webhook", "fields": ["url"]},
    EventKind.ALERT_CHANNEL_TEST: {"channel": 2, "delivery": 9},
}


def test_every_kind_has_a_shape_and_a_sample():
    assert set(EVIDENCE) == set(EventKind) == set(SENT)


@pytest.mark.parametrize("kind", list(EventKind))
def test_shape_takes_what_writers_send_and_refuses_an_unknown_key(kind):
    check_evidence(kind, SENT[kind])
    with pytest.raises(EvidenceError, match="unknown evidence key 'nonsense'"):
        check_evidence(kind, {**SENT[kind], "nonsense": 1})


@pytest.mark.parametrize("kind", [k for k in EventKind if SENT[k]])
def test_shape_refuses_a_wrong_type(kind):
    key = next(iter(SENT[kind]))
    with pytest.raises(EvidenceError, match=re.escape(repr(key))):
        check_evidence(kind, {**SENT[kind], key: object()})


def test_a_bool_is_not_an_int_and_an_int_is_a_float():
    with pytest.raises(EvidenceError):
        check_evidence(EventKind.NODE_COMMAND, {"command": True})
    check_evidence(EventKind.CHECKPOINT_COMMIT, {"blocking_s": 2})


@pytest.mark.django_db
def test_record_event_writes_one_row(cast):
    event = record_event(EventKind.JOB_STATE, actor="user:ops", job=cast.job.pk, old_state="pending",
                         new_state="initializing", evidence={"nodes": ["gpu-1"]})
    assert Event.objects.get() == event
    assert (event.kind, event.job_id, event.evidence) == ("job.state", cast.job.pk, {"nodes": ["gpu-1"]})


@pytest.mark.django_db
def test_record_event_refuses_a_bare_string_and_bad_evidence_before_writing(cast):
    with pytest.raises(ValueError):
        record_event("job.stat", actor="user:ops", job=cast.job)
    with pytest.raises(EvidenceError):
        record_event(EventKind.JOB_STATE, actor="user:ops", job=cast.job, evidence={"node": "gpu-1"})
    assert not Event.objects.exists()


def test_no_writer_creates_event_rows_but_record_event():
    root = Path(__file__).resolve().parents[2]
    writers = [str(path.relative_to(root)) for app in ("core", "controlplane", "jobs", "nodes", "checkpoints",
                                                       "alerts", "dashboard")
               for path in (root / app).rglob("*.py") if "Event.objects.create" in path.read_text()]
    assert writers == ["core/events.py"]

"""Incidents that cannot fail to be written (issue 24, item 1): whatever a crashing program
printed — a 10 KB error line, bytes that are not UTF-8, NUL, a traceback over many lines — the
incident is recorded with a bounded classification, the full text in its evidence, and the
"same failure twice" pause still fires.

The crash goes the way an agent's exit report goes: torchrun's output bytes through the agent's
own line decoding and scan (``agents.supervisor.output``), an ``ExitReport`` posted to the events
endpoint with the node's token, the receivers and the orchestrator task (run eagerly).
"""

from __future__ import annotations

import json
import time

import pytest

from agents.protocol import dump
from agents.protocol.agent import MAX_LOG_LINE, MAX_LOG_TAIL_LINES, ExitReport
from agents.supervisor.output import OutputScan, classify_exit, decode_line
from core.events import EventKind, record_event
from core.models import Event
from core.text import clean_json, clip, one_line
from jobs import orchestrator, services
from jobs.choices import JobState
from jobs.models import Incident, Job
from jobs.policy import failure_key

LONG = "x" * 10_000
#: What torchrun prints for a rank that raised: a traceback over several lines whose last line is
#: 10 KB long and holds bytes that are not UTF-8 and a NUL, then its failure table.
CRASH_OUTPUT = (
    b"[rank1]: Traceback (most recent call last):\n"
    b'[rank1]:   File "train.py", line 12, in <module>\n'
    b"[rank1]:     main()\n"
    b"[rank1]: RuntimeError: shard \xff\xfe\x00 unreadable: " + LONG.encode() + b"\n"
    b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    b"Root Cause (first observed failure):\n"
    b"[0]:\n"
    b"  rank      : 1 (local_rank: 1)\n"
    b"  exitcode  : 1 (pid: 4242)\n"
    b"==============================================\n"
)


def agent_exit_report(output: bytes) -> ExitReport:
    """What the agent's supervisor reports for ``output`` (``Supervisor._take_line`` per line)."""
    scan, tail = OutputScan(), []
    for raw in output.split(b"\n")[:-1]:
        line = decode_line(raw)
        tail.append(line[:MAX_LOG_LINE])
        scan.feed(line)
    signature, error_line = classify_exit(1, scan)
    return ExitReport(exit_code=1, ranks=list(scan.ranks.values()), root_cause_rank=scan.root_cause_rank,
                      signature=signature, error_line=error_line, log_tail=tail[-MAX_LOG_TAIL_LINES:])


# --- pure: the text helpers ---------------------------------------------------------------------

def test_clip_bounds_cleans_and_marks_the_cut() -> None:
    assert clip("short", 200) == "short"
    clipped = clip("a\x00b" + LONG, 200)
    assert len(clipped) == 200 and clipped.startswith("ab") and clipped.endswith("…")
    assert clip("\ud800 lone", 10) == "\ufffd lone"
    assert one_line("Traceback:\n  File x\n\tError: y ") == "Traceback: File x Error: y"
    assert clean_json({"k\x00": ["v\x00", {"n": 1}]}) == {"k": ["v", {"n": 1}]}


def test_the_agent_decodes_any_bytes_into_a_line_a_message_may_carry() -> None:
    assert decode_line(b"Error: \xff\xfe\x00 end\r") == "Error: \ufffd\ufffd\ufffd end"


def test_failure_key_is_bounded_and_equal_for_the_same_failure_only() -> None:
    a = "RuntimeError: at 0x7f3a2c001000 in pid 4242: " + LONG
    b = "RuntimeError: at 0x7f3a2c009999 in pid 777: " + LONG
    assert failure_key(a) == failure_key(b)  # addresses and pids differ between runs
    assert len(failure_key(a) or "") <= 120
    assert failure_key(a) != failure_key(a + "y")  # a difference past the kept start still counts
    assert failure_key("Error:\n  multi\tline") == "Error: multi line"
    assert failure_key(None) is None


def test_the_slurm_transport_reads_a_jobs_output_as_the_agent_does(tmp_path) -> None:
    from nodes.transports.slurm.ended import _read_output

    output = tmp_path / "slurm-7.out"
    output.write_bytes(CRASH_OUTPUT)
    tail, scan = _read_output(str(output))
    assert not any("\x00" in line for line in tail)  # jsonb holds no NUL: the whole poll would fail
    assert classify_exit(1, scan)[1] == agent_exit_report(CRASH_OUTPUT).error_line


# --- through the agent's exit report --------------------------------------------------------------

@pytest.fixture
def job(cast):
    job = Job.objects.create(name="gpt", entrypoint="examples/train.py", nnodes=1, nproc_per_node=2,
                             accelerator="cpu", created_by="test",
                             recovery_policy={"max_restarts": 5, "backoff_seconds": 0})
    services.start_job(job, actor="test")
    job.refresh_from_db()
    return job


def post_exit(api, cast, job, report: ExitReport, key: str):
    body = {"events": [{"key": key, "kind": "exited", "time": time.time(), "job": str(job.pk),
                        "generation": job.generation, "detail": dump(report)}]}
    # As the agent sends it: json.dumps escapes what is not ASCII.
    return api(cast.tokens["agent"]).post(f"/api/v1/nodes/{cast.node1.pk}/events", json.dumps(body),
                                          content_type="application/json")


@pytest.mark.django_db
def test_a_crash_with_a_huge_non_utf8_multiline_error_is_recorded_and_pauses_when_it_repeats(
        cast, job, api, eager_celery, django_capture_on_commit_callbacks):
    report = agent_exit_report(CRASH_OUTPUT)
    assert report.signature == "traceback" and len(report.error_line) == MAX_LOG_LINE
    with django_capture_on_commit_callbacks(execute=True):
        response = post_exit(api, cast, job, report, "exit-1")
    assert response.status_code == 202, response.content

    incident = Incident.objects.get(job=job)
    assert (incident.kind, incident.decision) == ("crash", "restart")
    assert len(incident.classification) == 200 and incident.classification.endswith("…")
    assert incident.classification.startswith("a rank exited (RuntimeError: shard \ufffd\ufffd\ufffd unreadable: xxx")
    # The whole of what the agent sent is in the evidence: the error line, the traceback's lines.
    assert incident.evidence["error_line"] == report.error_line
    assert report.error_line in incident.evidence["reason"]
    assert incident.evidence["detail"]["log_tail"][:3] == [
        "[rank1]: Traceback (most recent call last):", '[rank1]:   File "train.py", line 12, in <module>',
        "[rank1]:     main()"]
    assert Event.objects.filter(kind="incident.open", job=job).exists()

    orchestrator.advance_recovery(job.pk)
    orchestrator.advance_recovery(job.pk)
    job.refresh_from_db()
    assert (job.state, job.generation) == (JobState.INITIALIZING, 2)

    # The same failure again (another pid, another address would not matter): the job pauses.
    with django_capture_on_commit_callbacks(execute=True):
        assert post_exit(api, cast, job, report, "exit-2").status_code == 202
    orchestrator.advance_recovery(job.pk)
    job.refresh_from_db()
    second = Incident.objects.filter(job=job).order_by("-pk").first()
    assert (second.kind, second.decision, job.state) == ("deterministic", "pause", JobState.PAUSED)
    assert len(second.classification) <= 200
    # The pause reason is the full sentence (a text column), not the clipped classification.
    assert report.error_line in job.pause_reason and job.generation == 2


@pytest.mark.django_db
def test_audit_rows_clip_an_actor_longer_than_their_column(cast):
    hostname = "n" * 253  # the longest hostname registration accepts
    event = record_event(EventKind.NODE_BLAME, actor=f"node:{hostname}", node=cast.node1, reason="r\x00",
                         old_state="x" * 40)
    event.refresh_from_db()
    assert len(event.actor) == 200 and event.actor.startswith("node:nnn") and event.reason == "r"
    assert len(event.old_state) == 24


@pytest.mark.django_db
def test_a_checkpoint_path_longer_than_its_column_is_a_400_naming_the_field(cast, api):
    from checkpoints.models import Checkpoint
    from checkpoints.paths import checkpoint_dir
    from jobs import state
    from jobs.models import Generation

    state.transition(cast.job, JobState.INITIALIZING, actor="test")
    Generation.objects.create(job=cast.job, number=1, world_size=2).nodes.add(cast.node1)
    path = checkpoint_dir(cast.job) + "/" + "/".join(["d" * 200] * 6)  # the wire allows 4,096 characters
    body = {"job": str(cast.job.pk), "generation": 1, "step": 10, "path": path, "loss": 2.0, "config_hash": "abc",
            "data_cursor": 80, "world_size": 2, "size_bytes": 1000, "blocking_s": 0.03, "total_s": 1.2,
            "manifest": {"step": 10}}
    response = api(cast.tokens["agent"]).post(f"/api/v1/jobs/{cast.job.pk}/checkpoints", body, format="json")
    assert response.status_code == 400, response.content  # was a 500 (value too long), which the hooks retried
    assert response.json()["errors"][0]["field"] == "path" and "at most 1000" in response.json()["detail"]
    assert not Checkpoint.objects.exists()


@pytest.mark.django_db
def test_gpu_names_and_uuids_longer_than_their_columns_register_and_stay_the_same_card(cast, api):
    from agents.protocol.agent import GpuInfo
    from nodes.models import GPU, Node
    from nodes.services.fleet import _record_gpus

    uuid, name = "GPU-" + "u" * 92, "NVIDIA " + "N" * 121  # the wire's bounds: 96 and 128 characters
    body = {"bootstrap_token": cast.tokens["bootstrap"], "hostname": "gpu-long", "address": "10.0.0.9",
            "agent_version": "0.1.0", "gpus": [{"index": 0, "uuid": uuid, "name": name, "memory_total": 2**30}]}
    response = api().post("/api/v1/agents/register", body, format="json")
    assert response.status_code == 201, response.content  # was a 500 (value too long)
    gpu = GPU.objects.get(node__hostname="gpu-long")
    assert len(gpu.uuid) == 80 and len(gpu.name) == 100 and gpu.name.endswith("…")
    GPU.objects.filter(pk=gpu.pk).update(health="healthy")
    _record_gpus(Node.objects.get(hostname="gpu-long"), [GpuInfo(index=0, uuid=uuid, name=name, memory_total=2**30)])
    assert GPU.objects.get(pk=gpu.pk).health == "healthy"  # the same card: its history is kept

"""A generation's batch job ended: record it and report it exactly as an agent reports an exit.

Both the watch one-shot (Slurm says the job ended, or no longer knows it) and ``submit`` (a
generation stopped or refused before Slurm ran it) end an allocation here: one
``AgentEventRecord`` per node (kind ``exited``, or ``stopped`` when Nightwatch asked for the
stop) and ``nodes.signals.generation_exited`` after the commit, so ``jobs.receivers`` hands it to
the orchestrator and the same recovery policy decides. The record's key
(``slurm:<job id>:<generation>``) is unique per node: reporting twice changes nothing.

The evidence is the agent's too: the job's output file is scanned with the supervisor's own
``OutputScan``/``classify_exit`` (torchrun's failure table, exception lines, signatures).
"""

from __future__ import annotations

import logging
from collections import deque
from pathlib import Path

from django.db import transaction
from django.utils import timezone

from agents.protocol.agent import MAX_LOG_LINE, MAX_LOG_TAIL_LINES
from agents.supervisor import OutputScan, classify_exit
from agents.supervisor.output import decode_line
from core.events import EventKind, record_event
from core.models import ApiToken
from nodes import signals
from nodes.choices import SlurmAllocationState
from nodes.models import AgentEventRecord, Node, SlurmAllocation

log = logging.getLogger(__name__)
ACTOR = "system:slurm"
#: Only the end of a huge batch output is scanned for exit evidence.
MAX_SCANNED_BYTES = 16 * 2**20


def report_ended(row: SlurmAllocation, *, state: str, exit_status: int | None, exit_signal: int | None,
                 requested_stop: bool, note: str = "", signature: str | None = None,
                 error_line: str | None = None) -> int:
    """Record that ``row``'s batch job ended and tell the orchestrator, once; returns 1 if it did.

    Only a stop Nightwatch asked for counts as requested: a job cancelled behind its back (an
    admin's ``scancel``) is a fault like any other exit, and the policy decides. So is a job that
    Slurm says ended otherwise than ``CANCELLED`` although Nightwatch had asked for its stop: it
    ended on its own before the ``scancel`` took (a rank that died stalls the others, and the hang
    sweep may ask for the stop before the controller's next poll shows the failure).

    The fault's time is torchrun's own log time of closing the worker group
    (``torchrun_failed_at``, from the output as the agent reads it), when the output shows it."""
    if state not in ("CANCELLED", "VANISHED"):
        requested_stop = False
    else:
        requested_stop = requested_stop or SlurmAllocation.objects.filter(
            pk=row.pk, cancel_requested_at__isnull=False).exists()
    tail, scan = _read_output(row.output_path)
    if signature is None and not requested_stop:
        code = exit_status if exit_status is not None else (-exit_signal if exit_signal else None)
        signature, error_line = classify_exit(code, scan)
        if signature is None and (state != "COMPLETED" or code != 0):
            signature = "slurm_" + state.lower()  # ended badly without any log evidence (NODE_FAIL, TIMEOUT…)
    detail = {
        "exit_code": exit_status if exit_signal is None else None,
        "ranks": [{"rank": r.rank, "local_rank": r.local_rank, "pid": r.pid, "exit_code": r.exit_code,
                   "signal": r.signal} for r in sorted(scan.ranks.values(), key=lambda r: r.rank)],
        "root_cause_rank": scan.root_cause_rank, "signature": None if requested_stop else signature,
        "error_line": None if requested_stop else error_line, "log_tail": tail, "log_path": row.output_path,
        "requested_stop": requested_stop, "xids": [], "torchrun_failed_at": scan.closing_logged_at,
        "slurm": {"job_id": row.slurm_job_id, "state": state, "reason": note[:500], "exit_signal": exit_signal},
    }
    kind = "stopped" if requested_stop else "exited"
    now = timezone.now()
    with transaction.atomic():
        if not SlurmAllocation.objects.filter(pk=row.pk, state__in=SlurmAllocationState.OPEN).update(
                state=SlurmAllocationState.ENDED, slurm_state=state, slurm_reason=note[:200], exit_code=exit_status,
                exit_signal=exit_signal, ended_at=now):
            return 0
        if row.token_id:
            ApiToken.objects.filter(pk=row.token_id, revoked_at__isnull=True).update(revoked_at=now)
        record_event(EventKind.SLURM_ENDED, actor=ACTOR, job=row.job_id, generation=row.generation,
                     new_state=state, reason=f"Slurm job {row.slurm_job_id or '-'} {state}"
                     + (f": {note}" if note else ""), evidence={k: detail[k] for k in ("exit_code", "slurm")})
        for node in Node.objects.filter(hostname__in=row.hostnames):
            record = AgentEventRecord.objects.create(
                node=node, key=f"slurm:{row.job_id}:{row.generation}", kind=kind, time=now, job_id=row.job_id,
                job_ref=str(row.job_id), generation=row.generation, detail=detail, received_at=now)
            signals.send_on_commit(signals.generation_exited, node=node, job_id=row.job_id, generation=row.generation,
                                   kind=kind, detail=detail, time=now, record_id=record.pk)
    log.info("job %s generation %s: Slurm job %s %s (exit %s, signal %s)", row.job_id, row.generation,
             row.slurm_job_id, state, exit_status, exit_signal)
    return 1


def _read_output(path: str) -> tuple[list[str], OutputScan]:
    """The last lines of the job's output and the scan of all of it (empty when unreadable: the
    control plane may not share the nodes' file system)."""
    scan = OutputScan()
    tail: deque[str] = deque(maxlen=MAX_LOG_TAIL_LINES)
    if not path:
        return [], scan
    try:
        with Path(path).open("rb") as stream:
            size = stream.seek(0, 2)
            # torchrun's failure table and the root cause's traceback are at the end.
            stream.seek(max(0, size - MAX_SCANNED_BYTES))
            if size > MAX_SCANNED_BYTES:
                stream.readline()  # most likely a partial line
            for raw in stream:
                line = decode_line(raw.rstrip(b"\n"))  # as the agent reads it: no NUL reaches the evidence
                scan.feed(line)
                tail.append(line[:MAX_LOG_LINE])
    except OSError:
        return [], scan
    return list(tail), scan

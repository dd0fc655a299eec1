"""Celery tasks of the nodes app: thin wrappers around one-shot service functions. They sit above
what they run; the Slurm launch, which enqueues two of them after its commit, does so through a
deferred import (a module-level one would be a cycle).

Each is safe to run twice (the one-shots compare-and-set) and bounded, so that a poison row
never keeps a worker busy for ever.
"""

from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

from nodes import services
from nodes.services import retention, rollup
from nodes.transports.slurm import launch, mirror, watch

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def expire_heartbeats() -> int:
    """Beat, every heartbeat interval: nodes past their deadline become unreachable; stale commands close."""
    handled = services.expire_heartbeats(limit=1000)
    services.expire_commands()
    return handled


@shared_task(ignore_result=True)
def prepare_telemetry_partitions() -> int:
    """Beat, every 10 minutes: the telemetry partitions of the coming hours and days exist before they fill."""
    created = retention.prepare_partitions()
    if created:
        log.info("created %d telemetry partitions", created)
    return created


@shared_task(ignore_result=True)
def prune_telemetry() -> bool:
    """Beat, hourly: telemetry older than its retention goes, a partition at a time on PostgreSQL."""
    pruned = services.prune_telemetry()
    if pruned:
        log.info("pruned old telemetry: %d partitions dropped, %d rows deleted", pruned.partitions, pruned.rows)
    return bool(pruned)


@shared_task(ignore_result=True)
def roll_up_telemetry() -> int:
    """Beat, every minute: the minutes that closed are rolled up (recomputed: running twice is harmless)."""
    return rollup.roll_up_recent()


# --- Slurm (nodes.transports.slurm): each swallows nothing but never crash-loops: Slurm being
# down is recorded and backed off inside the one-shots. ------------------------------------------

def _slurm_enabled() -> bool:
    return bool(settings.NIGHTWATCH["SLURM"]["ENABLED"])


@shared_task(ignore_result=True)
def submit_slurm_job(allocation_id: int) -> bool:
    """After the commit that started a generation on Slurm nodes: sbatch it (re-driven by the poll)."""
    return launch.submit(allocation_id)


@shared_task(ignore_result=True)
def cancel_slurm_job(allocation_id: int) -> bool:
    """After the commit that asked a Slurm generation to stop: scancel it (re-driven by the poll)."""
    return launch.cancel(allocation_id)


@shared_task(ignore_result=True)
def poll_slurm_jobs() -> int:
    """Beat: read Slurm's job states; report the generations that ended to the orchestrator."""
    if not _slurm_enabled():
        return 0
    return watch.poll_jobs()


@shared_task(ignore_result=True)
def mirror_slurm_nodes() -> int:
    """Beat: reconcile the Slurm nodes' states and drains with their Node rows."""
    if not _slurm_enabled():
        return 0
    return mirror.mirror_nodes()

"""The jobs app listens to the nodes app (exits, stop acknowledgements, refused launches, health
changes, contact back after a fleet silence) and answers what it asks about the work placed on
its nodes (``nodes.workload``, registered by ``JobsConfig.ready``).

Receivers of the signals sent after commit run in whichever process committed the node's news
(usually the web process answering an agent), so they only enqueue a Celery task with primary
keys; the orchestrator does the work. ``fleet_contact_restored`` is sent inside its transaction:
its receiver moves the progress deadlines there and then.
"""

from __future__ import annotations

from collections.abc import Collection

from django.dispatch import receiver

from agents.protocol.agent import JOB_CHECKS
from jobs import progress
from jobs.choices import JobState
from jobs.models import Generation, Job
from jobs.tasks import confirm_stopped, handle_exit, handle_launch_refused, handle_node_health, handle_nodes_health
from nodes import signals
from nodes.models import Node


@receiver(signals.generation_exited, dispatch_uid="jobs.generation_exited")
def on_generation_exited(sender, node, job_id, generation, kind, detail, **kwargs):
    if job_id is None or generation is None:
        return
    at = kwargs.get("time")
    handle_exit.delay(job_id, generation, node.hostname, {**detail, "requested_stop": kind == "stopped"
                                                          or detail.get("requested_stop", False),
                                                          "exited_at": at.timestamp() if at else None})


@receiver(signals.command_acked, dispatch_uid="jobs.command_acked")
def on_command_acked(sender, node, kind, job_id, generation, status, **kwargs):
    """A stop acknowledged as done means nothing of that generation runs on the node any more."""
    if kind != "stop" or status != "done" or job_id is None or generation is None:
        return
    confirm_stopped.delay(job_id, generation, node.hostname)


@receiver(signals.launch_refused, dispatch_uid="jobs.launch_refused")
def on_launch_refused(sender, node, job_id, generation, reason, **kwargs):
    """The node failed its pre-launch check: it is not used for this generation (nor, healthy
    again, until placement picks it)."""
    if job_id is None or generation is None:
        return
    checks = (kwargs.get("detail") or {}).get("checks") or []
    job_problem = any(c.get("name") in JOB_CHECKS and not c.get("ok") for c in checks if isinstance(c, dict))
    handle_launch_refused.delay(job_id, generation, node.hostname, reason, job_problem=job_problem)


@receiver(signals.node_health_changed, dispatch_uid="jobs.node_health_changed")
def on_node_health_changed(sender, node, old, new, reasons, **kwargs):
    """``evidence["fault_at"]``: when the node's own report says the fault happened (a critical
    Xid's time, by the node's clock), the incident's fault time."""
    fault_at = (kwargs.get("evidence") or {}).get("fault_at")
    handle_node_health.delay(node.hostname, new, list(reasons),
                             fault_at=fault_at if isinstance(fault_at, int | float) else None)


@receiver(signals.nodes_health_changed, dispatch_uid="jobs.nodes_health_changed")
def on_nodes_health_changed(sender, new, changes, **kwargs):
    """A batch (the heartbeat sweeper's): one task for all of its nodes."""
    handle_nodes_health.delay(new, {change["node"].hostname: list(change["reasons"]) for change in changes})


@receiver(signals.fleet_contact_restored, dispatch_uid="jobs.fleet_contact_restored")
def on_fleet_contact_restored(sender, now, grace, **kwargs) -> int:
    """The hooks could not reach us either: progress deadlines that ran out start over, by the
    progress-timeout rule (``jobs.progress``); returns how many moved."""
    return progress.restart_after_silence(now, grace=grace)


class JobsWorkload:
    """The jobs app's answers to ``nodes.workload.Workload``."""

    def existing_jobs(self, job_ids: Collection[int]) -> set[int]:
        return set(Job.objects.filter(pk__in=job_ids).values_list("pk", flat=True))

    def runs_live_generation(self, node: Node) -> bool:
        return Generation.objects.filter(nodes=node, ended_at__isnull=True, job__state__in=JobState.ACTIVE).exists()


WORKLOAD = JobsWorkload()

"""The jobs app listens to the nodes app: exits, stop acknowledgements, health changes.

Receivers run in whichever process committed the node's news (usually the web process answering
an agent), so they only enqueue a Celery task with primary keys; the orchestrator does the work.
"""

from __future__ import annotations

from django.dispatch import receiver

from nodes import signals


@receiver(signals.generation_exited, dispatch_uid="jobs.generation_exited")
def on_generation_exited(sender, node, job_id, generation, kind, detail, **kwargs):
    if job_id is None or generation is None:
        return
    from jobs.tasks import handle_exit

    handle_exit.delay(job_id, generation, node.hostname, {**detail, "requested_stop": kind == "stopped"
                                                          or detail.get("requested_stop", False)})


@receiver(signals.command_acked, dispatch_uid="jobs.command_acked")
def on_command_acked(sender, node, kind, job_id, generation, status, **kwargs):
    """A stop acknowledged as done means nothing of that generation runs on the node any more."""
    if kind != "stop" or status != "done" or job_id is None or generation is None:
        return
    from jobs.tasks import confirm_stopped

    confirm_stopped.delay(job_id, generation, node.hostname)


@receiver(signals.launch_refused, dispatch_uid="jobs.launch_refused")
def on_launch_refused(sender, node, job_id, generation, reason, **kwargs):
    """The node failed its pre-launch check: it is not used for this generation (nor, healthy
    again, until placement picks it)."""
    if job_id is None or generation is None:
        return
    from jobs.tasks import handle_launch_refused

    handle_launch_refused.delay(job_id, generation, node.hostname, reason)


@receiver(signals.node_health_changed, dispatch_uid="jobs.node_health_changed")
def on_node_health_changed(sender, node, old, new, reasons, **kwargs):
    from jobs.tasks import handle_node_health

    handle_node_health.delay(node.hostname, new, list(reasons))

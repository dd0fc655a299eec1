"""The Celery app. Broker and schedule come from settings (CELERY_* names).

Every task's ``apply_async`` (and so ``.delay``) goes through ``OutboxTask``: a message the broker
does not take (Redis down) is held in PostgreSQL (``core.outbox``) and sent by beat once it can be,
so the request that enqueued it still answers and nothing is lost. Workers touch a liveness file
from their consumer's loop (``LivenessFile``) when ``NIGHTWATCH_WORKER_LIVENESS_FILE`` names one; the
compose healthcheck and the systemd units check it (``core.liveness``, docs/deployment.md).
"""

import logging
import os
import uuid

from celery import Celery, Task, bootsteps, signals

from core import liveness  # standard library only: safe before Django is set up

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
log = logging.getLogger(__name__)


class OutboxTask(Task):
    """A task whose messages are held in the outbox when the broker cannot take them."""

    def apply_async(self, args=None, kwargs=None, task_id=None, producer=None, link=None, link_error=None,
                    shadow=None, **options):
        direct = (self.app.conf.task_always_eager or options.get("expires") is not None
                  or link is not None or link_error is not None or producer is not None)
        if direct:
            return super().apply_async(args, kwargs, task_id=task_id, producer=producer, link=link,
                                       link_error=link_error, shadow=shadow, **options)
        # Imported here: core's models need the app registry, which is not ready when this module loads.
        from core import degraded, outbox

        task_id = task_id or str(uuid.uuid4())
        if degraded.down(outbox.COMPONENT):  # failed a moment ago: do not wait for another timeout
            outbox.hold(self.name, args, kwargs, options, "the broker failed within the last seconds")
            return self.AsyncResult(task_id)
        try:
            result = super().apply_async(args, kwargs, task_id=task_id, shadow=shadow, **options)
        except Exception as error:  # kombu's OperationalError, a socket error, a full disk (filesystem broker)
            outbox.hold(self.name, args, kwargs, options, error)
            return self.AsyncResult(task_id)
        degraded.recovered(outbox.COMPONENT)
        return result


app = Celery("nightwatch", task_cls=OutboxTask)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


class LivenessFile(bootsteps.StartStopStep):
    """Touch ``NIGHTWATCH_WORKER_LIVENESS_FILE`` every ``NIGHTWATCH_WORKER_LIVENESS_S`` seconds from the
    consumer's timer, and remove it on a clean stop. A worker that died, or whose consumer is stuck
    (the timer runs in the consumer's event loop under the prefork pool), stops touching it; the
    check (``python -m core.liveness``) then fails and the supervisor restarts the worker."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        self.path = os.environ.get("NIGHTWATCH_WORKER_LIVENESS_FILE", "")
        self.interval = float(os.environ.get("NIGHTWATCH_WORKER_LIVENESS_S", "10"))
        self.timer_ref = None

    def start(self, parent):
        if not self.path:
            return
        liveness.touch(self.path)
        self.timer_ref = parent.timer.call_repeatedly(self.interval, liveness.touch, (self.path,), priority=10)

    def stop(self, parent):
        if self.timer_ref is not None:
            self.timer_ref.cancel()
            self.timer_ref = None

    def shutdown(self, parent):
        self.stop(parent)
        if self.path:
            liveness.remove(self.path)


app.steps["consumer"].add(LivenessFile)


@signals.beat_init.connect
def run_at_beat_start(sender=None, **_) -> None:
    """Send the tasks of ``settings.BEAT_AT_START`` once as beat starts.

    An interval entry first runs an interval after beat starts (Celery dates a new entry's last run
    at its start), so on a fresh deployment the hourly node-window partitions would be made an hour
    late, and every window of that hour would land in the default partition (bench.fleet,
    2026-12-02: 1.5 GB a day of GPU samples and 1.5 of node windows were written there).
    """
    from django.conf import settings  # the app is configured by now; settings are not imported at load

    for name in settings.BEAT_AT_START:
        try:
            app.send_task(name)
        except Exception:  # a broker that does not answer: the schedule's own run comes later anyway
            log.warning("beat start: %s not sent", name, exc_info=True)


@signals.worker_init.connect
def preload_checkpoint_reader(**_) -> None:
    """Import torch's checkpoint reader before the pool forks, so that every child has it.

    Both kinds of worker need it: the default-queue worker because recovery re-verifies the
    checkpoint it restores from, the ``checkpoints``-queue worker (``CELERY_TASK_ROUTES``) for every
    verification. A process that has never read a checkpoint would otherwise pay torch's import
    (1.6–2.3 s here, far more on a loaded machine) in the middle of a recovery or a verification.
    """
    # Here, not at the top: torch is heavy and optional (the train extra); only a worker preloads it.
    import torch.distributed.checkpoint  # noqa: F401

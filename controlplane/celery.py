"""The Celery app. Broker and schedule come from settings (CELERY_* names)."""

import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("nightwatch")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


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

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

    Recovery re-verifies the checkpoint it restores from; a child that has never verified one would
    otherwise pay torch's import (seconds) in the middle of a recovery.
    """
    import torch.distributed.checkpoint  # noqa: F401

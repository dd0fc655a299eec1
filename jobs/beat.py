"""The jobs app's periodic tasks besides the sweeper, for ``CELERY_BEAT_SCHEDULE`` in
``controlplane/settings.py``. ``expires`` drops a run that waited in the queue past the next one.

- checkpoint interval push every 5 minutes (``jobs.checkpoint_interval``): failure rates and save
  costs change slowly, and the hooks pick the new value up on their next control poll.
- training output retention hourly (``jobs.logs.prune``).
- node-window partitions and retention hourly (``jobs.windows``): six hours of partitions are
  made ahead, so a missed run costs nothing.
"""

from __future__ import annotations

#: Run once as beat starts, not first an hour later: the node-window partitions of the coming hours.
AT_START: tuple[str, ...] = ("jobs.tasks.maintain_node_windows",)

BEAT_SCHEDULE: dict = {
    "jobs-checkpoint-interval": {
        "task": "jobs.tasks.push_checkpoint_intervals",
        "schedule": 300.0,
        "options": {"expires": 300},
    },
    "jobs-training-logs": {
        "task": "jobs.tasks.prune_training_logs",
        "schedule": 3600.0,
        "options": {"expires": 3600},
    },
    "jobs-node-windows": {
        "task": "jobs.tasks.maintain_node_windows",
        "schedule": 3600.0,
        "options": {"expires": 3600},
    },
}

"""The checkpoints app's periodic tasks, for ``CELERY_BEAT_SCHEDULE`` in ``controlplane/settings.py``.

Each calls a one-shot service that tests and the management command call too. ``expires`` drops a
run that waited in the queue past the next one.

- retention every 10 minutes: commits come every few minutes to hours, and a missed run only
  delays a deletion (permanent promotion is sticky, see ``services.retention``);
- replica reconciliation every 5 minutes: the on-commit enqueue does the normal case;
- interval push every 5 minutes: failure rates and save costs change slowly, and the hooks
  pick the new value up on their next control poll.
"""

from __future__ import annotations

BEAT_SCHEDULE: dict = {
    "checkpoints-retention": {
        "task": "checkpoints.tasks.retention_sweep",
        "schedule": 600.0,
        "options": {"expires": 600},
    },
    "checkpoints-replicas": {
        "task": "checkpoints.tasks.replica_sweep",
        "schedule": 300.0,
        "options": {"expires": 300},
    },
    "checkpoints-interval": {
        "task": "checkpoints.tasks.push_intervals",
        "schedule": 300.0,
        "options": {"expires": 300},
    },
}

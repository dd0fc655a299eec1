"""The checkpoints app's periodic tasks, for ``CELERY_BEAT_SCHEDULE`` in ``controlplane/settings.py``.

Each calls a one-shot service that tests and the management command call too. ``expires`` drops a
run that waited in the queue past the next one.

- retention every 10 minutes: commits come every few minutes to hours, and a missed run only
  delays a deletion (permanent promotion is sticky, see ``services.retention``);
- replica reconciliation every 5 minutes: the on-commit enqueue does the normal case.

(The interval push reads the jobs' failure history: it is scheduled by ``jobs.beat``.)
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
}

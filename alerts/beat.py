"""The alerts app's periodic task, for ``CELERY_BEAT_SCHEDULE`` in ``controlplane/settings.py``.

Once a minute by default: the sweep bounds how late a cleared condition is resolved when no event
said so, how late a lost delivery is re-sent, and how often MFU, utilisation and downtime are
judged.
"""

from __future__ import annotations

from core.env import env_int

ALERTS_SWEEP_S = float(env_int("NIGHTWATCH_ALERTS_SWEEP_S", 60))

BEAT_SCHEDULE: dict = {
    "alerts-sweep": {
        "task": "alerts.tasks.sweep",
        "schedule": ALERTS_SWEEP_S,
        "options": {"expires": ALERTS_SWEEP_S},
    },
}

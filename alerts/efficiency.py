"""The efficiency watch: MFU below the expected, GPU utilisation low while running, downtime high.

The figures are the jobs app's (``jobs.efficiency``); the alert specs are judged in
``alerts.rules.efficiency_alerts``. This module applies them: per job, and for beat over every
running job.
"""

from __future__ import annotations

from alerts import rules
from alerts.choices import AlertState
from alerts.models import Alert
from alerts.services import apply
from jobs.choices import JobState
from jobs.models import Job


def watch(job) -> list:
    """Evaluate the efficiency alerts of one job; returns the alerts that changed."""
    return [a for a in (apply(spec) for spec in rules.efficiency_alerts(job)) if a is not None]


def watch_running_jobs(limit: int = 200) -> int:
    """Beat: every running job (and jobs with a firing efficiency alert); returns alerts changed."""
    firing = Alert.objects.filter(rule__in=rules.EFFICIENCY_RULES, state=AlertState.FIRING).values("job_id")
    jobs = Job.objects.filter(state=JobState.RUNNING) | Job.objects.filter(pk__in=firing)
    return sum(len(watch(job)) for job in jobs.distinct()[:limit])

"""Fixtures shared by the jobs tests."""

from __future__ import annotations

import pytest

from jobs.choices import JobState
from jobs.models import Job


@pytest.fixture
def running(cast):
    """cast.job running generation 1, pausing after three loss spikes in a row."""
    Job.objects.filter(pk=cast.job.pk).update(state=JobState.RUNNING, generation=1,
                                              recovery_policy={"loss_spike_limit": 3})
    cast.job.refresh_from_db()
    return cast.job

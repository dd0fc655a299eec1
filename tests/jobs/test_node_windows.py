"""Node windows (rank timings per node and window) are kept for their retention, then go in one delete."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

pytestmark = pytest.mark.django_db


def _window(job, last_step, received_at):
    from jobs.models import NodeWindow

    return NodeWindow(job=job, generation=1, node=0, first_step=last_step - 9, last_step=last_step, ranks=8,
                      step_median_s=0.1, step_max_s=0.2, slowest_rank=3, slowest_s=0.15,
                      reported_at=received_at, received_at=received_at)


def test_windows_older_than_the_retention_go_in_one_delete(cast, settings, django_assert_max_num_queries):
    from jobs.models import NodeWindow
    from jobs.steps import prune_node_windows

    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "NODE_WINDOW_RETENTION_HOURS": 48}
    now = timezone.now()
    NodeWindow.objects.bulk_create([_window(cast.job, 10 * i, now - timedelta(hours=60 - i, minutes=30))
                                    for i in range(1, 21)])
    with django_assert_max_num_queries(2):
        assert prune_node_windows() == 12  # received 59.5 ... 48.5 hours ago
    assert sorted(NodeWindow.objects.values_list("last_step", flat=True)) == [10 * i for i in range(13, 21)]

"""The fleet benchmark's account of a hang: what became of its job's rank 0's requests before the
verdict (``bench._fleet_sim.fate_of``, ``bench._fleet_measure.fates_before``)."""

from __future__ import annotations

import pytest

from agents.http import Unreachable
from bench._fleet_measure import HANG_LOOKBACK_S, fates_before
from bench._fleet_sim import fate_of


def test_a_request_without_an_answer_to_act_on_is_its_5xx_a_timeout_or_an_error():
    assert fate_of(Unreachable("POST /x: HTTP 503", status=503, retry_after=4.0)) == 503
    assert fate_of(Unreachable("POST /x: TimeoutError()")) == "timeout"
    assert fate_of(Unreachable("POST /x: ConnectionRefusedError(111, 'Connect call failed')")) == "error"


def test_the_account_counts_each_fate_and_dates_the_last_answer_before_the_verdict():
    verdict = 1000.0
    fates = [
        [verdict - HANG_LOOKBACK_S - 1, "reports", 202, 0.1],  # before the window: not counted
        [950.0, "reports", 202, 0.5],  # answered at 950.5
        [960.0, "reports", 503, 0.2],
        [970.0, "control", 200, 0.1],  # answered at 970.1: the last answer
        [980.0, "reports", "timeout", 5.0],
        [990.0, "reports", "error", 0.0],
        [999.0, "reports", 202, 2.0],  # sent before the verdict, answered after it
        [1001.0, "reports", 202, 0.1],  # after the verdict: not counted
    ]
    account = fates_before(verdict, fates)
    assert account["requests"] == {"202": 2, "503": 1, "200": 1, "timeout": 1, "error": 1}
    assert account["last_answered_s_before"] == 29.9
    assert account["last_report_s_before"] == 49.5  # the control poll answered later; a hang is about reports
    assert account["last_requests"][0] == [50.0, "reports", 202, 0.5]
    assert account["last_requests"][-1] == [1.0, "reports", 202, 2.0]
    assert len(account["last_requests"]) == 6


def test_a_job_never_answered_in_the_window_says_so():
    account = fates_before(100.0, [[90.0, "reports", 503, 0.1]])
    assert account["last_answered_s_before"] is None and account["requests"] == {"503": 1}
    assert account["last_report_s_before"] is None
    assert fates_before(100.0, [])["last_requests"] == []


@pytest.mark.django_db
def test_every_hang_incident_of_the_run_gets_its_account(cast):
    """``hangs`` reads the incidents as the benchmark does, on its own psycopg connection's API (here
    Django's, so that it sees the test's rows), and names the job and its generation."""
    from django.db import connection
    from django.utils import timezone

    from bench._fleet_measure import hangs
    from jobs.models import Generation, Incident

    generation = Generation.objects.create(job=cast.job, number=3, world_size=2)
    detected = timezone.now()
    Incident.objects.create(job=cast.job, generation=generation, kind="hang", detected_at=detected)
    Incident.objects.create(job=cast.job, kind="crash", detected_at=detected)
    connection.ensure_connection()
    verdict = detected.timestamp()
    found = hangs(connection.connection, {str(cast.job.pk): [[verdict - 10, "reports", 202, 0.5]]})
    assert len(found) == 1
    assert found[0]["job"] == cast.job.pk and found[0]["generation"] == 3
    assert found[0]["requests"] == {"202": 1} and found[0]["last_answered_s_before"] == 9.5

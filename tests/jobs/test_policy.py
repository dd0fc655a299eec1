"""The failure policy table, one row at a time (pure: no database)."""

from __future__ import annotations

import pytest

from jobs.policy import (
    EXIT,
    HANG,
    INCONSISTENCY,
    NAN,
    NODE_UNHEALTHY,
    NODE_UNREACHABLE,
    SPIKE,
    STRAGGLER,
    Evidence,
    PastFailure,
    decide,
)


def test_crash_on_a_healthy_node_restarts():
    d = decide(Evidence(EXIT, signature="signal", nodes=("gpu-01",)))
    assert (d.classification, d.action, d.drain, d.page) == ("crash", "restart", (), False)


def test_exit_on_an_unhealthy_node_drains_and_uses_a_spare():
    d = decide(Evidence(EXIT, signature="xid", nodes=("gpu-01",), unhealthy_nodes=("gpu-01",), spares_available=1))
    assert (d.classification, d.action, d.drain) == ("hardware", "restart_on_spare", ("gpu-01",))


def test_unhealthy_node_without_spare_shrinks_only_when_allowed():
    ev = dict(signal=NODE_UNHEALTHY, nodes=("gpu-01",), unhealthy_nodes=("gpu-01",), spares_available=0)
    assert decide(Evidence(**ev, allow_shrink=True)).action == "shrink"
    paused = decide(Evidence(**ev, allow_shrink=False))
    assert (paused.action, paused.page, paused.drain) == ("pause", True, ("gpu-01",))


def test_hang_restarts():
    decision = decide(Evidence(HANG, step=40))
    assert (decision.classification, decision.action, decision.page) == ("hang", "restart", False)


def test_same_exception_twice_with_the_same_config_is_deterministic():
    past = PastFailure("traceback", "RuntimeError: boom at step 7", 7, "cfg1")
    d = decide(Evidence(EXIT, signature="traceback", error_line="RuntimeError: boom at step 7", step=7,
                        config_hash="cfg1", history=(past,)))
    assert (d.classification, d.action, d.page) == ("deterministic", "pause", True)


@pytest.mark.parametrize(
    "past",
    [
        PastFailure("traceback", "RuntimeError: boom at step 7", 7, "cfg2"),  # config changed
        PastFailure("traceback", "RuntimeError: other", 7, "cfg1"),  # another exception
        PastFailure("oom", "torch.OutOfMemoryError", 7, "cfg1"),  # another signature
        PastFailure("traceback", "RuntimeError: boom at step 7", 3, "cfg1"),  # another step
    ],
)
def test_a_different_failure_is_not_deterministic(past):
    d = decide(Evidence(EXIT, signature="traceback", error_line="RuntimeError: boom at step 7", step=7,
                        config_hash="cfg1", history=(past,)))
    assert d.action == "restart"


def test_two_sigkills_in_a_row_are_not_deterministic():
    past = PastFailure("signal", None, None, "cfg1")
    assert decide(Evidence(EXIT, signature="signal", config_hash="cfg1", history=(past,))).action == "restart"


def test_nan_pauses_and_proposes_a_rollback():
    d = decide(Evidence(NAN))
    assert (d.classification, d.action, d.propose_rollback, d.page) == ("numerical", "pause", True, True)


def test_spikes_alert_until_the_limit_then_pause():
    assert decide(Evidence(SPIKE, consecutive_spikes=2, spike_limit=3)).action == "alert"
    d = decide(Evidence(SPIKE, consecutive_spikes=3, spike_limit=3))
    assert (d.action, d.propose_rollback) == ("pause", True)


def test_cross_rank_inconsistency_pauses():
    assert decide(Evidence(INCONSISTENCY)).classification == "corruption"
    assert decide(Evidence(INCONSISTENCY)).action == "pause"


def test_lost_contact_escalates_instead_of_restarting():
    d = decide(Evidence(NODE_UNREACHABLE, nodes=("gpu-02",)))
    assert (d.classification, d.action, d.page) == ("partition", "escalate", True)
    many = decide(Evidence(EXIT, signature="signal", nodes_lost_in_window=3, partition_threshold=2))
    assert many.action == "escalate"


def test_stragglers_only_alert():
    assert decide(Evidence(STRAGGLER, nodes=("gpu-03",))).action == "alert"


def test_budget_exhausted_opens_the_breaker():
    d = decide(Evidence(EXIT, signature="signal", restarts_in_window=5, max_restarts=5))
    assert (d.classification, d.action, d.page) == ("retry_storm", "pause", True)


def test_backoff_grows_exponentially_with_recent_restarts():
    assert decide(Evidence(EXIT, signature="signal", restarts_in_window=0)).backoff_s == 0
    assert decide(Evidence(EXIT, signature="signal", restarts_in_window=1, backoff_base_s=5)).backoff_s == 10
    assert decide(Evidence(EXIT, signature="signal", restarts_in_window=3, backoff_base_s=5)).backoff_s == 40


def test_unknown_signal_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown signal"):
        decide(Evidence("cosmic-ray"))

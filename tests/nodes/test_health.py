"""nodes.health: the rules that turn GPU samples into a node verdict (pure, no database)."""

from __future__ import annotations

import pytest

from nodes import health
from nodes.choices import Health

GIB = 2**30


def gpu(index=0, **fields):
    base = {"gpu": index, "reachable": True, "temperature_c": 60.0, "memory_used": 1 * GIB, "memory_free": 79 * GIB,
            "ecc_uncorrected_recent": 0, "ecc_corrected_recent": 0, "nvlink_errors_recent": 0, "xid_recent": 0,
            "recent_xid_codes": [], "remap_pending": False, "remap_failed": False, "throttle_reasons": 0,
            "window_s": 600.0}
    base.update(fields)
    return base


def verdict(*samples, idle=False, **thresholds):
    return health.evaluate_node(samples, health.Thresholds.from_mapping(thresholds), idle=idle)


def test_verdict_names_match_the_node_health_choices():
    assert {health.HEALTHY, health.DEGRADED, health.UNHEALTHY, health.UNKNOWN} <= set(Health.values)


def test_no_samples_is_unknown_and_good_samples_are_healthy():
    assert verdict().health == health.UNKNOWN
    good = verdict(gpu(0), gpu(1))
    assert (good.health, good.reasons, good.gpus) == (health.HEALTHY, (), {0: "healthy", 1: "healthy"})


@pytest.mark.parametrize(
    ("fields", "expected", "words"),
    [
        ({"temperature_c": 92.0}, health.UNHEALTHY, "GPU 1 at 92 °C, above 85 °C"),
        ({"temperature_c": 85.0}, health.DEGRADED, "above the warning level 80 °C"),
        ({"temperature_c": 80.0}, health.HEALTHY, None),
        ({"ecc_uncorrected_recent": 1}, health.UNHEALTHY, "1 uncorrected ECC error(s) in the last 600 s"),
        ({"ecc_corrected_recent": 5000}, health.DEGRADED, "5000 corrected ECC errors"),
        ({"xid_recent": 1, "recent_xid_codes": [79]}, health.UNHEALTHY, "critical Xid 79"),
        ({"xid_recent": 1, "recent_xid_codes": [13]}, health.DEGRADED, "1 non-critical Xid(s) (13)"),
        ({"nvlink_errors_recent": 3}, health.UNHEALTHY, "3 NVLink error(s)"),
        ({"remap_failed": True}, health.UNHEALTHY, "row remapping failed"),
        ({"remap_pending": True}, health.DEGRADED, "a reset is pending"),
        ({"retired_pages_pending": True}, health.DEGRADED, "a reset is pending"),
        ({"throttle_reasons": 0x40}, health.DEGRADED, "hardware slowdown (throttle reasons 0x40)"),
        ({"throttle_reasons": 0x1}, health.HEALTHY, None),  # GPU idle clocks: not a problem
        ({"reachable": False}, health.UNHEALTHY, "GPU 1 is not reachable"),
    ],
)
def test_each_rule(fields, expected, words):
    result = verdict(gpu(0), gpu(1, **fields))
    assert result.health == expected, result.reasons
    assert result.gpus == {0: "healthy", 1: expected}
    if words:
        assert any(words in reason for reason in result.reasons), result.reasons
    else:
        assert result.reasons == ()


def test_lifetime_totals_do_not_condemn_a_node_only_the_window_does():
    old = gpu(0, ecc_uncorrected_aggregate=7, xid_total=12, xid_recent=0, recent_xid_codes=[],
              nvlink_replay_errors=900, nvlink_errors_recent=0)
    assert verdict(old).health == health.HEALTHY


def test_free_memory_counts_only_while_idle_and_scales_to_small_cards():
    busy = gpu(0, memory_used=75 * GIB, memory_free=5 * GIB)
    assert verdict(busy, idle=False).health == health.HEALTHY
    held = verdict(busy, idle=True)
    assert held.health == health.DEGRADED
    assert "5.0 GiB free while idle, below 10.0 GiB" in held.reasons[0]
    small = gpu(0, memory_used=0, memory_free=8 * GIB)  # an 8 GiB card with all of it free
    assert verdict(small, idle=True).health == health.HEALTHY


def test_the_worst_gpu_decides_and_every_reason_is_kept():
    result = verdict(gpu(0, temperature_c=83.0), gpu(1, recent_xid_codes=[48], xid_recent=1), gpu(2))
    assert result.health == health.UNHEALTHY
    assert result.gpus == {0: "degraded", 1: "unhealthy", 2: "healthy"}
    assert len(result.reasons) == 2
    assert result.evidence["gpus"] == {"0": "degraded", "1": "unhealthy", "2": "healthy"}


def test_counters_the_gpu_does_not_support_are_skipped():
    bare = {"gpu": 0, "reachable": True, "temperature_c": None, "memory_free": None, "ecc_uncorrected_recent": None,
            "nvlink_errors_recent": None, "xid_recent": 0, "recent_xid_codes": []}
    assert verdict(bare, idle=True).health == health.HEALTHY


def test_thresholds_are_configurable_and_validated():
    hot = gpu(0, temperature_c=88.0)
    assert verdict(hot, max_temperature_c=90, warn_temperature_c=89).health == health.HEALTHY
    assert verdict(gpu(0, recent_xid_codes=[13], xid_recent=1), critical_xids=[13]).health == health.UNHEALTHY
    with pytest.raises(ValueError, match="unknown threshold 'max_temp'"):
        health.Thresholds.from_mapping({"max_temp": 80})
    with pytest.raises(ValueError, match="non-negative number"):
        health.Thresholds.from_mapping({"max_temperature_c": "hot"})
    with pytest.raises(ValueError, match="list of integers"):
        health.Thresholds.from_mapping({"critical_xids": "79"})


def test_defaults_agree_with_the_agents_pre_launch_check():
    from agents.health import HealthThresholds

    agent, server = HealthThresholds(), health.Thresholds()
    for name in ("max_temperature_c", "max_uncorrected_ecc", "critical_xids", "max_nvlink_errors",
                 "min_free_memory_bytes"):
        assert getattr(server, name) == getattr(agent, name), name


def test_a_gpu_gone_silent_makes_the_node_unhealthy():
    result = health.evaluate_node([gpu(0)], health.Thresholds(), idle=False, silent={1: 412.0, 2: None})
    assert result.health == health.UNHEALTHY
    assert result.gpus == {0: "healthy", 1: "unhealthy", 2: "unhealthy"}
    assert result.reasons == ("GPU 1 has sent no sample for 412 s",
                              "GPU 2 has sent no sample since the agent registered")

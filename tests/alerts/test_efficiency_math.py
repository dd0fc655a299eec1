"""The efficiency arithmetic with plain numbers: peaks by GPU name, MFU, cost over the goodput split."""

from __future__ import annotations

import pytest

from jobs import efficiency_math as m


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0), ("Tesla V100-SXM2-32GB", 125.0), ("Tesla V100-PCIE-16GB", 112.0),
    ("NVIDIA A10G", 70.0), ("Tesla T4", 65.0), ("NVIDIA GH200 480GB", 989.0),
])
def test_the_peak_table_knows_common_gpus_by_their_nvml_names(name, tflops):
    assert m.peak_tflops_of(name) == tflops


def test_an_unknown_gpu_has_no_peak():
    assert m.peak_tflops_of("Some Accelerator 9000") is None


def test_flops_per_token_is_six_times_the_parameters_unless_overridden():
    assert m.flops_per_token(1_000_000) == 6e6
    assert m.flops_per_token(1_000_000, 7.5e6) == 7.5e6
    assert m.flops_per_token(None) is None


def test_mfu_is_achieved_model_flops_over_the_peak():
    # 7B parameters, 8 × H100: 4 M tokens per step in 10 s.
    speed = m.Throughput(tokens_per_step=4_000_000, step_s=10.0)
    value = m.mfu(speed, m.flops_per_token(7_000_000_000), 8 * 989e12)
    assert value == pytest.approx(400_000 * 42e9 / 7.912e15)
    assert m.mfu(m.Throughput(1000, 0.0), 6e6, 1e12) is None
    assert m.mfu(speed, 6e6, 0.0) is None


def test_cost_and_waste_add_up_to_the_goodput_split():
    badput = {"startup": 60.0, "detection": 30.0, "restart": 300.0, "paused": 600.0, "lost_work": 90.0,
              "checkpoint_stall": 120.0}
    wall = 7200.0
    productive = wall - sum(badput.values())
    rate = m.hourly_rate([(8, 2.5), (8, 3.0)])  # two nodes of 8 GPUs in pools of different prices
    assert rate == 44.0
    cost = m.cost(rate_per_hour=rate, wall_s=wall, productive_s=productive, badput_s=badput)
    assert cost.total == pytest.approx(88.0)
    assert cost.wasted["paused"] == pytest.approx(600 / 3600 * 44)
    assert cost.productive + cost.wasted_total == pytest.approx(cost.total)
    assert set(cost.wasted) == set(badput)


def test_below_expected_uses_a_relative_margin():
    assert m.below_expected(0.30, 0.40, 0.2)  # 0.30 < 0.32
    assert not m.below_expected(0.33, 0.40, 0.2)
    assert not m.below_expected(None, 0.40, 0.2)
    assert not m.below_expected(0.01, None, 0.2)


def test_bad_efficiency_settings_fail_the_system_check(settings):
    from alerts.checks import alert_settings

    assert alert_settings() == []
    settings.NIGHTWATCH = {**settings.NIGHTWATCH, "EFFICIENCY": {
        **settings.NIGHTWATCH["EFFICIENCY"], "MFU_MARGIN": 1.5, "POOL_PRICES": {"spot": -1}}}
    assert {e.id for e in alert_settings()} == {"nightwatch.alerts.E003", "nightwatch.alerts.E006"}

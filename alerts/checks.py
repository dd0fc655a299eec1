"""Checks of the alerts and efficiency settings (``NIGHTWATCH['ALERTS']``, ``['EFFICIENCY']``),
with stable ids: a margin of 1.5 or a negative price would make every alert wrong, silently."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, register


def _error(message: str, hint: str, number: int) -> Error:
    return Error(message, hint=hint, id=f"nightwatch.alerts.E{number:03d}")


@register()
def alert_settings(app_configs=None, **kwargs):
    alerts, efficiency = settings.NIGHTWATCH["ALERTS"], settings.NIGHTWATCH["EFFICIENCY"]
    errors = []
    if alerts["MAX_ATTEMPTS"] < 1:
        errors.append(_error("NIGHTWATCH_ALERTS_MAX_ATTEMPTS must be at least 1.", "A page needs one attempt.", 1))
    for name in ("UPDATE_INTERVAL_S", "RETRY_BASE_S", "RETRY_MAX_S", "CHANNEL_MAX_PER_HOUR"):
        if alerts[name] < 0:
            errors.append(_error(f"NIGHTWATCH_ALERTS_{name} is negative.", "Use 0 or more.", 2))
    if not 0 <= efficiency["MFU_MARGIN"] < 1:
        errors.append(_error("NIGHTWATCH_MFU_MARGIN must be in [0, 1).", "0.2 alerts below 80% of the expected MFU.",
                             3))
    if efficiency["CPU_PEAK_TFLOPS"] <= 0:
        errors.append(_error("NIGHTWATCH_CPU_PEAK_TFLOPS must be positive.", "The default is 0.1.", 4))
    if not 0 < efficiency["DOWNTIME_RATIO_MAX"] < 1:
        errors.append(_error("NIGHTWATCH_DOWNTIME_RATIO_MAX must be in (0, 1).", "The default is 0.05.", 5))
    prices = {"NIGHTWATCH_PRICE_PER_GPU_HOUR": efficiency["DEFAULT_PRICE_PER_GPU_HOUR"],
              **{f"POOL_PRICES[{pool!r}]": price for pool, price in efficiency["POOL_PRICES"].items()}}
    for name, price in prices.items():
        if not isinstance(price, int | float) or price < 0:
            errors.append(_error(f"{name} must be a price of 0 or more, got {price!r}.", "Prices per GPU-hour.", 6))
    return errors

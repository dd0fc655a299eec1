"""Checks of the alerts and efficiency settings (``NIGHTWATCH['ALERTS']``, ``['EFFICIENCY']``),
with stable ids: a margin of 1.5 or a negative price would make every alert wrong, silently; a
bad allow-list entry or secrets key would refuse every channel or lose every secret."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, Warning, register

from alerts import crypto
from alerts.channels import egress


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


@register()
def alert_egress_and_secrets(app_configs=None, **kwargs):
    alerts = settings.NIGHTWATCH["ALERTS"]
    problems = []
    try:
        egress.parse_allow_list(alerts["ALLOWED_NETWORKS"])
    except ValueError as exc:
        problems.append(_error(f"NIGHTWATCH_ALERT_ALLOWED_NETWORKS: {exc}.",
                               "A comma-separated list of CIDRs (10.0.0.0/8) or host names.", 7))
    for number, key in enumerate(crypto.configured_keys(), start=1):
        if problem := crypto.key_problem(key):
            problems.append(_error(f"NIGHTWATCH_SECRETS_KEY (key {number}) {problem}.",
                                   'Generate one: python -c "from cryptography.fernet import Fernet; '
                                   'print(Fernet.generate_key().decode())"', 8))
    if settings.PRODUCTION and not alerts["SECRETS_KEY"]:
        problems.append(Warning(
            "Alert channel secrets are encrypted with a key derived from SECRET_KEY.",
            hint="Set NIGHTWATCH_SECRETS_KEY (or NIGHTWATCH_SECRETS_KEY_FILE) to a Fernet key kept apart from "
                 "SECRET_KEY, then run manage.py reencrypt_alert_secrets.",
            id="nightwatch.alerts.W001"))
    return problems

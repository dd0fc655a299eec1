"""Configuration checks with stable ids; production refuses to start on an error.

``manage.py check`` reports them; the ASGI/WSGI entry points and the Celery app call
``refuse_unsafe_production()`` so a misconfigured production process exits instead of serving.
"""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.core.checks import Error, Tags, register
from django.core.exceptions import ImproperlyConfigured


@register(Tags.security)
def production_settings(app_configs=None, **kwargs):
    if not settings.PRODUCTION:
        return []
    errors = []
    if not settings.SECRET_KEY_PROVIDED:
        errors.append(
            Error(
                "SECRET_KEY is not set.",
                hint="Set SECRET_KEY (or SECRET_KEY_FILE) in the environment; production never invents one.",
                id="nightwatch.E001",
            )
        )
    if settings.DEBUG:
        errors.append(
            Error(
                "DEBUG is on in production.",
                hint="Unset DEBUG or set DEBUG=0: debug pages leak settings and source.",
                id="nightwatch.E002",
            )
        )
    if not settings.ALLOWED_HOSTS:
        errors.append(
            Error("ALLOWED_HOSTS is empty.", hint="Set ALLOWED_HOSTS=host1,host2.", id="nightwatch.E003")
        )
    return errors


@register(Tags.security)
def trusted_proxy_settings(app_configs=None, **kwargs):
    """A bad entry would fail every request that reads the client's address: refuse it up front."""
    errors = []
    for cidr in settings.NIGHTWATCH["TRUSTED_PROXIES"]:
        try:
            ipaddress.ip_network(cidr.strip(), strict=False)
        except ValueError:
            errors.append(Error(f"NIGHTWATCH_TRUSTED_PROXIES: {cidr!r} is not an address or network.",
                                hint="A comma-separated list of CIDRs, e.g. 10.0.0.5/32,fd00::/64.",
                                id="nightwatch.E004"))
    return errors


def refuse_unsafe_production() -> None:
    errors = production_settings() + trusted_proxy_settings()
    if errors:
        lines = "\n".join(f"{e.id}: {e.msg} {e.hint}" for e in errors)
        raise ImproperlyConfigured(f"refusing to start in production:\n{lines}")

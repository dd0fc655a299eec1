"""Nightwatch's project package: settings, URLs, ASGI/WSGI, the Celery app and routing."""

from controlplane.celery import app as celery_app

__all__ = ["celery_app"]

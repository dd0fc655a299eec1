"""The Celery app. Broker and schedule come from settings (CELERY_* names)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("nightwatch")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

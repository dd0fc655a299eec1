"""Telemetry retention: old samples go, a GPU at a time, so each delete walks the (node, gpu, time) key."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from nodes.models import GPU, GpuSample

DEFAULT_RETENTION_DAYS = 14


def prune_one_gpu(node_id: int, gpu: int, *, before) -> int:
    """Delete one GPU's samples older than ``before``; returns how many."""
    deleted, _ = GpuSample.objects.filter(node_id=node_id, gpu=gpu, time__lt=before).delete()
    return deleted


def prune_telemetry(*, now=None) -> int:
    """Delete samples older than ``NIGHTWATCH["TELEMETRY_RETENTION_DAYS"]``; returns how many.

    A delete per GPU rather than one ``time < cutoff`` over the table: the only index on samples
    is the (node, gpu, time) key, which a per-GPU range uses and a bare time range cannot.
    """
    days = settings.NIGHTWATCH.get("TELEMETRY_RETENTION_DAYS", DEFAULT_RETENTION_DAYS)
    before = (now or timezone.now()) - timedelta(days=days)
    return sum(prune_one_gpu(node_id, index, before=before)
               for node_id, index in GPU.objects.values_list("node_id", "index").order_by())

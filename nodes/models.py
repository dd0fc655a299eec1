"""GPU nodes and their GPUs."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from nodes.choices import Health, Schedulability, Transport


class Node(models.Model):
    """A machine that runs ranks of training jobs.

    ``health`` is what telemetry and heartbeats say; ``schedulability`` is what operators and
    the drain policy say. A node takes new work only when it is active and usably healthy.
    """

    hostname = models.CharField(max_length=253, unique=True)
    address = models.CharField(max_length=255, help_text="Address other nodes and the control plane reach it on.")
    transport = models.CharField(max_length=8, choices=Transport.choices, default=Transport.AGENT)
    health = models.CharField(max_length=12, choices=Health.choices, default=Health.UNKNOWN, db_index=True)
    schedulability = models.CharField(max_length=12, choices=Schedulability.choices,
                                      default=Schedulability.ACTIVE, db_index=True)
    drain_reason = models.TextField(blank=True)
    labels = models.JSONField(default=dict, blank=True)
    is_spare = models.BooleanField(default=False, help_text="Held back to replace a failed node.")
    # How often this node was blamed for an incident; a lemon is kept out until cleared.
    lemon_count = models.PositiveIntegerField(default=0)
    agent_version = models.CharField(max_length=40, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # Missed by then means unreachable; indexed for the sweeper.
    heartbeat_deadline = models.DateTimeField(null=True, blank=True, db_index=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["hostname"]
        permissions = [("drain_node", "Can drain and undrain nodes")]

    def __str__(self):
        return self.hostname

    @property
    def is_schedulable(self) -> bool:
        return self.schedulability == Schedulability.ACTIVE and self.health in Health.USABLE


class GPU(models.Model):
    """One accelerator of a node, with its latest health reading."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=80, blank=True)
    name = models.CharField(max_length=100, blank=True)
    memory_total_mb = models.PositiveIntegerField(null=True, blank=True)
    health = models.CharField(max_length=12, choices=Health.choices, default=Health.UNKNOWN)
    last_sample = models.JSONField(default=dict, blank=True)
    last_sample_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["node", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_node_index")]

    def __str__(self):
        return f"{self.node.hostname}/gpu{self.index}"

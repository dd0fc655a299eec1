from django.contrib import admin

from nodes.models import (
    GPU,
    AgentEventRecord,
    Node,
    NodeCommand,
    NodePairBandwidth,
    SlurmAllocation,
    SlurmController,
    SlurmNodeMirror,
)


class GPUInline(admin.TabularInline):
    model = GPU
    extra = 0
    readonly_fields = ["last_sample", "last_sample_at"]


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["hostname", "address", "transport", "health", "schedulability", "is_spare", "lemon_count",
                    "last_heartbeat_at"]
    list_filter = ["health", "schedulability", "transport", "is_spare"]
    search_fields = ["hostname", "address"]
    # Health and schedulability change only through nodes.services (audited); not by hand here.
    readonly_fields = ["health", "health_reason", "health_changed_at", "schedulability", "drain_reason",
                       "schedulability_changed_at", "lemon_count", "last_heartbeat_at", "heartbeat_deadline",
                       "running", "registered_at", "last_heartbeat_seq", "spooled", "telemetry_dropped"]
    inlines = [GPUInline]


@admin.register(NodeCommand)
class NodeCommandAdmin(admin.ModelAdmin):
    list_display = ["pk", "node", "kind", "job", "generation", "state", "delivery_count", "created_at", "acked_at"]
    list_filter = ["state", "kind"]
    search_fields = ["node__hostname", "idempotency_key"]
    list_select_related = ["node", "job"]

    def has_change_permission(self, request, obj=None):
        return False  # the queue is the agents' record of what they were told; append-only by hand


@admin.register(AgentEventRecord)
class AgentEventRecordAdmin(admin.ModelAdmin):
    list_display = ["time", "node", "kind", "job", "generation", "key"]
    list_filter = ["kind"]
    search_fields = ["node__hostname", "key", "job_ref"]
    list_select_related = ["node", "job"]

    def has_change_permission(self, request, obj=None):
        return False  # evidence


@admin.register(NodePairBandwidth)
class NodePairBandwidthAdmin(admin.ModelAdmin):
    list_display = ["source", "peer", "mbps", "expected_mbps", "ok", "measured_at"]
    list_filter = ["ok"]
    list_select_related = ["source", "peer"]


@admin.register(SlurmController)
class SlurmControllerAdmin(admin.ModelAdmin):
    list_display = ["cluster", "reachable", "last_contact_at", "failing_since", "consecutive_failures", "retry_after"]
    readonly_fields = ["reachable", "last_error", "last_contact_at", "failing_since", "consecutive_failures",
                       "retry_after"]


@admin.register(SlurmAllocation)
class SlurmAllocationAdmin(admin.ModelAdmin):
    """One generation as one Slurm batch job; written only by the Slurm transport."""

    list_display = ["job", "generation", "state", "slurm_job_id", "slurm_state", "exit_code", "submitted_at",
                    "ended_at"]
    list_filter = ["state", "slurm_state"]
    search_fields = ["job__name", "slurm_job_id"]
    list_select_related = ["job"]

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(SlurmNodeMirror)
class SlurmNodeMirrorAdmin(admin.ModelAdmin):
    list_display = ["node", "slurm_state", "slurm_reason", "slurm_reason_by", "agreed_drained", "seen_at"]
    search_fields = ["node__hostname", "slurm_reason"]
    list_select_related = ["node"]

    def has_change_permission(self, request, obj=None):
        return False  # the mirror is what Slurm said; drains go through nodes.services

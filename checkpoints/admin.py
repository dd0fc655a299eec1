from django.contrib import admin

from checkpoints.models import Checkpoint


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ["job", "step", "state", "permanent", "replica_state", "generation", "created_at", "verified_at"]
    list_filter = ["state", "permanent", "replica_state"]
    search_fields = ["location"]
    raw_id_fields = ["parent", "generation", "job"]
    readonly_fields = ["manifest"]

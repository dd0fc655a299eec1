from django.contrib import admin

from checkpoints.models import Checkpoint


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ["job", "step", "state", "permanent", "generation", "created_at", "verified_at"]
    list_filter = ["state", "permanent"]
    search_fields = ["location"]
    raw_id_fields = ["parent", "generation", "job"]
    readonly_fields = ["manifest"]

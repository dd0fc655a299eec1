from django.contrib import admin

from nodes.models import GPU, Node


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
    inlines = [GPUInline]

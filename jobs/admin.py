from django.contrib import admin

from core.models import Event
from jobs.models import EfficiencyTarget, Generation, Incident, Job, PoolPrice


class GenerationInline(admin.TabularInline):
    model = Generation
    extra = 0
    readonly_fields = ["number", "state", "world_size", "started_at", "first_step_at", "ended_at", "exit_reason"]
    fields = readonly_fields
    can_delete = False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ["name", "state", "generation", "restart_count", "last_step", "created_by", "created_at"]
    list_filter = ["state"]
    search_fields = ["name"]
    # State, generation and restarts change only through jobs.state: never edit them by hand.
    readonly_fields = ["state", "generation", "restart_count", "state_changed_at", "pause_reason", "last_step",
                       "last_step_at", "progress_deadline", "created_by", "created_at"]
    inlines = [GenerationInline]


@admin.register(Incident)
class IncidentAdmin(admin.ModelAdmin):
    list_display = ["kind", "job", "state", "decision", "detected_at", "lost_steps"]
    list_filter = ["kind", "state", "decision"]


@admin.register(Event)
class EventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "kind", "job", "node", "old_state", "new_state", "actor"]
    list_filter = ["kind"]
    search_fields = ["actor", "reason"]

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_add_permission(self, request):
        return False


admin.site.register(EfficiencyTarget)
admin.site.register(PoolPrice)

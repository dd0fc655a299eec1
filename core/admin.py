from django.contrib import admin

from core.models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["name", "scope", "prefix", "user", "node", "created_at", "last_used_at", "revoked_at"]
    list_filter = ["scope"]
    # Only the hash is stored; tokens are issued with `manage.py nightwatch_token`.
    readonly_fields = ["digest", "prefix", "created_at", "last_used_at"]

    def has_add_permission(self, request):
        return False

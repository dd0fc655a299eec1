"""Admin: channels (with a test-send action), the alert log with its deliveries, targets and prices."""

from django import forms
from django.contrib import admin, messages

from alerts import channels, services
from alerts.choices import ChannelKind
from alerts.models import Alert, Channel, Delivery, EfficiencyTarget, PoolPrice


class ChannelForm(forms.ModelForm):
    """The secret is write-only here too: an empty field keeps the stored one."""

    secret = forms.CharField(required=False, widget=forms.PasswordInput(render_value=False),
                             help_text="Webhook signing secret or PagerDuty routing key. Leave empty to keep "
                                       "the current one.")

    class Meta:
        model = Channel
        fields = ["name", "kind", "url", "secret", "emails", "min_severity", "jobs", "enabled"]

    def clean(self):
        data = super().clean()
        if not data.get("secret") and self.instance.pk:
            data["secret"] = self.instance.secret
        kind = data.get("kind")
        if kind in ChannelKind.values:
            for name, problem in channels.validate(kind, data).items():
                self.add_error(name if name in self.fields else None, problem)
        return data


@admin.register(Channel)
class ChannelAdmin(admin.ModelAdmin):
    form = ChannelForm
    list_display = ["name", "kind", "min_severity", "enabled", "created_at"]
    list_filter = ["kind", "min_severity", "enabled"]
    filter_horizontal = ["jobs"]
    actions = ["send_test"]

    @admin.action(description="Send a test alert")
    def send_test(self, request, queryset):
        for channel in queryset:
            delivery = services.test_send(channel, actor=f"user:{request.user.get_username()}")
            if delivery.state == "sent":
                self.message_user(request, f"{channel.name}: delivered (HTTP {delivery.status_code or '-'}).")
            else:
                self.message_user(request, f"{channel.name}: failed — {delivery.errors[-1]}", messages.ERROR)


class DeliveryInline(admin.TabularInline):
    model = Delivery
    extra = 0
    can_delete = False
    fields = readonly_fields = ["channel", "action", "state", "attempts", "status_code", "errors", "created_at",
                                "sent_at"]


@admin.register(Alert)
class AlertAdmin(admin.ModelAdmin):
    list_display = ["created_at", "severity", "rule", "title", "state", "updates", "job"]
    list_filter = ["severity", "rule", "state"]
    search_fields = ["title", "key"]
    readonly_fields = [f.name for f in Alert._meta.fields]
    inlines = [DeliveryInline]

    def has_add_permission(self, request):
        return False


admin.site.register(EfficiencyTarget)
admin.site.register(PoolPrice)

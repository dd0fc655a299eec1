"""Admin: channels (with a test-send action), the alert log with its deliveries. Efficiency targets
and pool prices are registered by the jobs app, which owns them."""

from django import forms
from django.contrib import admin

from alerts import channels, services
from alerts.choices import Action, ChannelKind
from alerts.crypto import SecretUnreadable
from alerts.models import Alert, Channel, Delivery


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
            try:
                data["secret"] = self.instance.secret
            except SecretUnreadable:
                self.add_error("secret", "The stored secret no longer decrypts (NIGHTWATCH_SECRETS_KEY changed): "
                                         "set it again.")
                return data
        kind = data.get("kind")
        if kind in ChannelKind.values:
            for name, problem in channels.validate(kind, data).items():
                self.add_error(name if name in self.fields else None, problem)
        return data

    def save(self, commit=True):
        # ``secret`` is not a model field (the model stores it encrypted): set it through the property.
        if self.cleaned_data.get("secret"):
            self.instance.secret = self.cleaned_data["secret"]
        return super().save(commit)


class TestSendInline(admin.TabularInline):
    """The channel's test-sends and their outcomes (a status code or an error class)."""

    model = Delivery
    verbose_name, verbose_name_plural = "test-send", "test-sends"
    extra = 0
    can_delete = False
    fields = readonly_fields = ["state", "status_code", "errors", "created_at", "sent_at"]

    def get_queryset(self, request):
        return super().get_queryset(request).filter(action=Action.TEST)

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Channel)
class ChannelAdmin(admin.ModelAdmin):
    form = ChannelForm
    inlines = [TestSendInline]
    list_display = ["name", "kind", "min_severity", "enabled", "created_at"]
    list_filter = ["kind", "min_severity", "enabled"]
    filter_horizontal = ["jobs"]
    actions = ["send_test"]

    @admin.action(description="Send a test alert")
    def send_test(self, request, queryset):
        for channel in queryset:
            delivery = services.test_send(channel, actor=f"user:{request.user.get_username()}")
            self.message_user(request, f"{channel.name}: test alert queued (delivery {delivery.pk}); its outcome "
                                       f"appears under the channel's test-sends.")


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


"""Channel, alert, delivery and efficiency representations. Secrets are write-only."""

from __future__ import annotations

import secrets

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from alerts import channels
from alerts.choices import Action, ChannelKind
from alerts.crypto import SecretUnreadable
from alerts.models import Alert, Channel, Delivery
from jobs.models import EfficiencyTarget, Job


class TestSendSerializer(serializers.ModelSerializer):
    """One test-send of a channel: its state (pending, sent, failed), the receiver's status code,
    and per failed attempt the error's class — never what the receiver answered."""

    class Meta:
        model = Delivery
        fields = ["id", "state", "status_code", "errors", "created_at", "sent_at"]


class TestSendQueuedSerializer(serializers.Serializer):
    delivery = serializers.IntegerField(help_text="Read its outcome in the channel's ``test_sends``.")
    state = serializers.CharField()


class ChannelSerializer(serializers.ModelSerializer):
    """``secret`` is accepted, never returned (``has_secret`` says whether one is set). A webhook
    created without one gets a generated secret, shown once in the creation response as
    ``generated_secret``. ``test_sends``: the newest test-sends, newest first."""

    secret = serializers.CharField(write_only=True, required=False, allow_blank=True, max_length=200)
    has_secret = serializers.BooleanField(read_only=True)
    emails = serializers.ListField(child=serializers.CharField(max_length=254), required=False, max_length=50)
    jobs = serializers.PrimaryKeyRelatedField(many=True, queryset=Job.objects.all(), required=False,
                                              help_text="Job ids; empty = every job.")
    test_sends = serializers.SerializerMethodField()

    class Meta:
        model = Channel
        fields = ["id", "name", "kind", "url", "secret", "has_secret", "emails", "min_severity", "jobs", "enabled",
                  "created_by", "created_at", "test_sends"]
        read_only_fields = ["created_by", "created_at"]
        extra_kwargs = {"url": {"required": False, "allow_blank": True}}

    @extend_schema_field(TestSendSerializer(many=True))
    def get_test_sends(self, channel) -> list:
        sends = getattr(channel, "test_sends", None)  # prefetched by the views (``channels_with_test_sends``)
        if sends is None:
            sends = channel.deliveries.filter(action=Action.TEST).order_by("-created_at", "-pk")
        return TestSendSerializer(sends, many=True).data

    def validate(self, data):
        merged = {name: getattr(self.instance, name) for name in ("kind", "url", "emails")} if self.instance else {}
        if data.get("secret"):
            merged["secret"] = data["secret"]
        elif self.instance:
            try:
                merged["secret"] = self.instance.secret
            except SecretUnreadable:
                raise serializers.ValidationError({"secret": [
                    "the stored secret no longer decrypts (NIGHTWATCH_SECRETS_KEY changed): set it again"]}) from None
        merged.update({k: v for k, v in data.items() if k != "secret"})
        kind = merged.get("kind")
        if self.instance and "kind" in data and data["kind"] != self.instance.kind:
            raise serializers.ValidationError({"kind": ["cannot change; create another channel"]})
        if not self.instance and kind == ChannelKind.WEBHOOK and not merged.get("secret"):
            merged["secret"] = data["secret"] = secrets.token_urlsafe(32)
            self.context["generated_secret"] = data["secret"]
        problems = channels.validate(kind, merged)
        if problems:
            raise serializers.ValidationError({name: [problem] for name, problem in problems.items()})
        if "secret" in data and not data["secret"]:
            data.pop("secret")  # blank on update: keep the stored secret
        return data


class DeliverySerializer(serializers.ModelSerializer):
    channel = serializers.CharField(source="channel.name", read_only=True)

    class Meta:
        model = Delivery
        fields = ["id", "channel", "action", "state", "attempts", "status_code", "errors", "created_at", "sent_at",
                  "next_attempt_at"]


class AlertSerializer(serializers.ModelSerializer):
    deliveries = DeliverySerializer(many=True, read_only=True)

    class Meta:
        model = Alert
        fields = ["id", "key", "rule", "severity", "state", "title", "summary", "link", "evidence", "incident",
                  "node", "updates", "suppressed_updates", "created_at", "updated_at", "notified_at", "acknowledged_at",
                  "resolved_at",
                  "deliveries"]


class EfficiencyTargetSerializer(serializers.ModelSerializer):
    expected_mfu = serializers.FloatField(min_value=0.0, max_value=1.0, allow_null=True, required=False)
    mfu_margin = serializers.FloatField(min_value=0.0, max_value=1.0, allow_null=True, required=False)
    flops_per_token = serializers.FloatField(min_value=1.0, max_value=1e18, allow_null=True, required=False)

    class Meta:
        model = EfficiencyTarget
        fields = ["expected_mfu", "mfu_margin", "flops_per_token"]


class CostSerializer(serializers.Serializer):
    currency = serializers.CharField()
    rate_per_hour = serializers.FloatField()
    total = serializers.FloatField()
    productive = serializers.FloatField()
    wasted = serializers.DictField(child=serializers.FloatField())
    wasted_total = serializers.FloatField()


class EfficiencySerializer(serializers.Serializer):
    """``jobs.efficiency.snapshot``: None where a figure is not known yet."""

    generation = serializers.IntegerField(allow_null=True)
    parameters = serializers.IntegerField(allow_null=True)
    flops_per_token = serializers.FloatField(allow_null=True)
    steps_in_window = serializers.IntegerField()
    tokens_per_step = serializers.FloatField(allow_null=True)
    step_s = serializers.FloatField(allow_null=True)
    tokens_per_s = serializers.FloatField(allow_null=True)
    achieved_tflops = serializers.FloatField(allow_null=True)
    peak_tflops = serializers.FloatField(allow_null=True)
    mfu = serializers.FloatField(allow_null=True)
    expected_mfu = serializers.FloatField(allow_null=True)
    mfu_margin = serializers.FloatField()
    gpu_utilization_pct = serializers.FloatField(allow_null=True)
    wall_s = serializers.FloatField()
    productive_s = serializers.FloatField()
    ettr = serializers.FloatField()
    badput_s = serializers.DictField(child=serializers.FloatField())
    downtime_s = serializers.FloatField()
    downtime_ratio = serializers.FloatField()
    cost = CostSerializer()

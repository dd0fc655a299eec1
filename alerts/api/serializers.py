"""Channel, alert, delivery and efficiency representations. Secrets are write-only."""

from __future__ import annotations

import secrets

from rest_framework import serializers

from alerts import channels
from alerts.choices import ChannelKind
from alerts.models import Alert, Channel, Delivery, EfficiencyTarget
from jobs.models import Job


class ChannelSerializer(serializers.ModelSerializer):
    """``secret`` is accepted, never returned (``has_secret`` says whether one is set). A webhook
    created without one gets a generated secret, shown once in the creation response as
    ``generated_secret``."""

    secret = serializers.CharField(write_only=True, required=False, allow_blank=True, max_length=200)
    has_secret = serializers.SerializerMethodField()
    emails = serializers.ListField(child=serializers.CharField(max_length=254), required=False, max_length=50)
    jobs = serializers.PrimaryKeyRelatedField(many=True, queryset=Job.objects.all(), required=False,
                                              help_text="Job ids; empty = every job.")

    class Meta:
        model = Channel
        fields = ["id", "name", "kind", "url", "secret", "has_secret", "emails", "min_severity", "jobs", "enabled",
                  "created_by", "created_at"]
        read_only_fields = ["created_by", "created_at"]
        extra_kwargs = {"url": {"required": False, "allow_blank": True}}

    def get_has_secret(self, channel) -> bool:
        return bool(channel.secret)

    def validate(self, data):
        merged = {name: getattr(self.instance, name) for name in ("kind", "url", "secret", "emails")} \
            if self.instance else {}
        merged.update({k: v for k, v in data.items() if k != "secret" or v})
        kind = merged.get("kind")
        if self.instance and "kind" in data and data["kind"] != self.instance.kind:
            raise serializers.ValidationError({"kind": ["cannot change; create another channel"]})
        if kind == ChannelKind.WEBHOOK and not merged.get("secret"):
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


class TestSendSerializer(serializers.Serializer):
    delivered = serializers.BooleanField()
    status_code = serializers.IntegerField(allow_null=True)
    error = serializers.CharField(allow_blank=True)


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
    """``alerts.efficiency.snapshot``: None where a figure is not known yet."""

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

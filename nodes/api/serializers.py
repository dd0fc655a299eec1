"""Node representations for the dashboard and the CLI (agents speak ``agents.protocol`` instead)."""

from rest_framework import serializers

from nodes.models import GPU, Node, NodeCommand


class GPUSerializer(serializers.ModelSerializer):
    class Meta:
        model = GPU
        fields = ["index", "uuid", "name", "memory_total_mb", "health", "last_sample", "last_sample_at"]
        read_only_fields = fields


class FleetGPUSerializer(GPUSerializer):
    node = serializers.SlugRelatedField(slug_field="hostname", read_only=True)
    node_id = serializers.IntegerField(read_only=True)

    class Meta(GPUSerializer.Meta):
        fields = ["node", "node_id", *GPUSerializer.Meta.fields]
        read_only_fields = fields


class NodeSerializer(serializers.ModelSerializer):
    gpus = GPUSerializer(many=True, read_only=True)

    class Meta:
        model = Node
        fields = ["id", "hostname", "address", "transport", "health", "schedulability", "drain_reason", "labels",
                  "is_spare", "lemon_count", "agent_version", "last_heartbeat_at", "heartbeat_deadline", "gpus",
                  "health_reason", "health_changed_at", "schedulability_changed_at", "registered_at", "running",
                  "gpu_telemetry", "gpu_telemetry_reason", "agent_draining", "spooled", "telemetry_dropped"]
        read_only_fields = fields


class NodeActionSerializer(NodeSerializer):
    """The node after an operator's action, with what the operator should know about it."""

    warning = serializers.CharField(allow_null=True, read_only=True,
                                    help_text="Set when the action did not give the whole effect one might expect, "
                                              "e.g. an undrained lemon that placement still keeps out.")
    lemon_cleared = serializers.IntegerField(allow_null=True, read_only=True,
                                             help_text="clear-lemon: the lemon count the node had.")

    class Meta(NodeSerializer.Meta):
        fields = [*NodeSerializer.Meta.fields, "warning", "lemon_cleared"]
        read_only_fields = fields


class NodeCommandSerializer(serializers.ModelSerializer):
    class Meta:
        model = NodeCommand
        fields = ["id", "kind", "job", "generation", "idempotency_key", "payload", "state", "created_by", "created_at",
                  "delivered_at", "delivery_count", "acked_at", "expires_at", "detail"]
        read_only_fields = fields


class DrainSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=500, help_text="Why; recorded in the audit log and shown to the agent.")


class HealthCheckRequestSerializer(serializers.Serializer):
    peers = serializers.ListField(child=serializers.IntegerField(min_value=1), max_length=64, default=list,
                                  help_text="Node ids to measure bandwidth to (pairwise probe).")
    expected_mbps = serializers.FloatField(min_value=0.001, required=False,
                                           help_text="Expected MB/s per pair; default: the cluster setting.")


class BootstrapTokenRequestSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=500, help_text="Why the node is re-registered (re-imaged, replaced "
                                                             "disk…); recorded in the audit log.")


class BootstrapTokenSerializer(serializers.Serializer):
    """A bootstrap token issued for one node: the raw value is shown here once and never again."""

    token = serializers.CharField(help_text="The raw token: put it in the agent's bootstrap_token_file.")
    name = serializers.CharField()
    hostname = serializers.CharField(help_text="The only host it registers.")
    node = serializers.IntegerField(source="node_id")
    expires_at = serializers.DateTimeField()

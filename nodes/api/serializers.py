from rest_framework import serializers

from nodes.models import GPU, Node


class GPUSerializer(serializers.ModelSerializer):
    class Meta:
        model = GPU
        fields = ["index", "uuid", "name", "memory_total_mb", "health", "last_sample", "last_sample_at"]
        read_only_fields = fields


class NodeSerializer(serializers.ModelSerializer):
    gpus = GPUSerializer(many=True, read_only=True)

    class Meta:
        model = Node
        fields = ["id", "hostname", "address", "transport", "health", "schedulability", "drain_reason", "labels",
                  "is_spare", "lemon_count", "agent_version", "last_heartbeat_at", "heartbeat_deadline", "gpus"]
        read_only_fields = fields

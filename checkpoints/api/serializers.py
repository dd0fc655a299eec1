from rest_framework import serializers

from checkpoints.models import Checkpoint


class CheckpointSerializer(serializers.ModelSerializer):
    generation = serializers.IntegerField(source="generation.number", read_only=True, allow_null=True)

    class Meta:
        model = Checkpoint
        fields = ["id", "job", "generation", "step", "location", "state", "state_reason", "parent", "permanent",
                  "config_hash", "data_cursor", "loss", "size_bytes", "world_size", "created_at", "verified_at"]
        read_only_fields = fields

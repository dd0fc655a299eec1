"""Checkpoint representations: rows, the lineage tree, retention plans and interval recommendations."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from checkpoints.models import Checkpoint


class CheckpointSerializer(serializers.ModelSerializer):
    generation = serializers.IntegerField(source="generation.number", read_only=True, allow_null=True)
    restorable = serializers.BooleanField(read_only=True,
                                          help_text="A verified copy exists (the primary, or else the replica).")

    class Meta:
        model = Checkpoint
        fields = ["id", "job", "generation", "step", "location", "state", "state_reason", "parent", "permanent",
                  "restorable", "config_hash", "data_cursor", "loss", "size_bytes", "world_size", "blocking_s",
                  "total_s", "created_at", "verified_at", "replica_location", "replica_state", "replica_reason",
                  "replica_checked_at"]
        read_only_fields = fields


class CheckpointDetailSerializer(CheckpointSerializer):
    class Meta(CheckpointSerializer.Meta):
        fields = [*CheckpointSerializer.Meta.fields, "manifest"]
        read_only_fields = fields


class TreeNodeSerializer(serializers.Serializer):
    id = serializers.IntegerField(source="checkpoint.pk")
    step = serializers.IntegerField(source="checkpoint.step")
    generation = serializers.SerializerMethodField()
    state = serializers.CharField(source="checkpoint.state")
    state_reason = serializers.CharField(source="checkpoint.state_reason")
    permanent = serializers.BooleanField(source="checkpoint.permanent")
    restorable = serializers.BooleanField(source="checkpoint.restorable")
    replica_state = serializers.CharField(source="checkpoint.replica_state")
    loss = serializers.FloatField(source="checkpoint.loss", allow_null=True)
    data_cursor = serializers.IntegerField(source="checkpoint.data_cursor", allow_null=True)
    created_at = serializers.DateTimeField(source="checkpoint.created_at")
    on_active_branch = serializers.BooleanField(help_text="On the path recovery would restore along.")
    children = serializers.SerializerMethodField(help_text="Child nodes, each of this same shape.")

    def get_generation(self, node) -> int | None:
        return node.checkpoint.generation.number if node.checkpoint.generation else None

    @extend_schema_field(serializers.ListField(child=serializers.DictField()))
    def get_children(self, node):
        return TreeNodeSerializer(node.children, many=True).data


class BranchSerializer(serializers.Serializer):
    leaf = serializers.IntegerField()
    checkpoints = serializers.ListField(child=serializers.IntegerField(), help_text="Ids from the root to the leaf.")
    steps = serializers.ListField(child=serializers.IntegerField())
    generations = serializers.ListField(child=serializers.IntegerField())
    active = serializers.BooleanField(help_text="Contains the active branch's restore point.")


class LineageSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    latest_verified = serializers.IntegerField(allow_null=True,
                                               help_text="Newest restorable checkpoint of the active branch.")
    active_leaf = serializers.IntegerField(allow_null=True)
    branches = BranchSerializer(many=True)
    roots = TreeNodeSerializer(many=True)


class StorageSerializer(serializers.Serializer):
    checkpoints = serializers.IntegerField()
    primary_bytes = serializers.IntegerField()
    replica_bytes = serializers.IntegerField()
    total_bytes = serializers.IntegerField()


class RetentionDecisionSerializer(serializers.Serializer):
    checkpoint = serializers.IntegerField()
    step = serializers.IntegerField()
    generation = serializers.IntegerField(allow_null=True)
    state = serializers.CharField()
    created_at = serializers.DateTimeField()
    size_bytes = serializers.IntegerField()
    keep = serializers.BooleanField()
    reason = serializers.CharField()
    make_permanent = serializers.BooleanField()


class RetentionPlanSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    now = serializers.DateTimeField()
    dry_run = serializers.BooleanField()
    keep_last = serializers.IntegerField()
    permanent_every_hours = serializers.IntegerField()
    storage = StorageSerializer()
    freed_bytes = serializers.IntegerField()
    keep = RetentionDecisionSerializer(many=True)
    delete = RetentionDecisionSerializer(many=True)


class IntervalSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    computed_at = serializers.DateTimeField()
    save_cost_s = serializers.FloatField(allow_null=True, help_text="Median blocking seconds per save.")
    total_save_s = serializers.FloatField(allow_null=True, help_text="Median seconds from save start to commit.")
    cost_samples = serializers.IntegerField()
    mtbf_s = serializers.FloatField()
    mtbf_source = serializers.ChoiceField(choices=["incidents", "assumed"])
    failures = serializers.IntegerField()
    exposure_s = serializers.FloatField()
    gpus = serializers.IntegerField()
    gpu_mtbf_hours = serializers.FloatField()
    interval_s = serializers.FloatField(allow_null=True)
    step_time_s = serializers.FloatField(allow_null=True)
    step_samples = serializers.IntegerField()
    interval_steps = serializers.IntegerField(allow_null=True)
    explanation = serializers.CharField()
    pushed_interval_steps = serializers.IntegerField(allow_null=True,
                                                     help_text="What the hooks are told now (policy 'auto').")


class VerifyRequestSerializer(serializers.Serializer):
    load_test = serializers.BooleanField(default=False, help_text="Only false: the control plane never loads "
                                                                 "checkpoints (see docs/checkpoints.md).")

    def validate_load_test(self, value: bool) -> bool:
        # Loading unpickles what a training process wrote; refused loudly rather than ignored.
        if value:
            raise serializers.ValidationError("the control plane does not load checkpoints; run the load test on a "
                                              "node: python -m agents.hooks.loadtest PATH")
        return value


class CheckpointReasonSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="",
                                   help_text="Why; recorded in the audit log.")

"""A job's checkpoints, ``/jobs/{id}/checkpoints…``: parse → authorise (``required``) → call a
service → render.

Here, above the checkpoints app, because each looks the job up, and the hooks' commit is fenced by
the job's generation (``jobs.checkpointing``); the filters and serializers are the checkpoints
app's. Reading needs ``view``; the hooks' commit needs the generation's job token or the agent
token of a node the generation is placed on.
"""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import generics
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.protocol import hooks as hooks_protocol
from checkpoints import paths
from checkpoints import services as checkpoint_services
from checkpoints.api.serializers import (
    CheckpointSerializer,
    IntervalSerializer,
    LineageSerializer,
    RetentionPlanSerializer,
)
from checkpoints.api.views import CONFLICT, LIST_FILTERS, filter_checkpoints
from checkpoints.models import Checkpoint
from checkpoints.policies import CheckpointPolicy
from core import roles
from core.auth import actor_label
from core.problems import Conflict
from core.schema import protocol_schema
from jobs import checkpoint_interval, checkpointing
from jobs.api.access import hooks_message
from jobs.models import Job
from jobs.state import TransitionError


class JobCheckpoints(generics.ListAPIView):
    """GET: a job's checkpoints, newest step first. POST: the hooks report a commit (the generation's
    job token, or the agent token of a node the generation is placed on)."""

    required = {"GET": roles.VIEW, "POST": roles.HOOKS}
    serializer_class = CheckpointSerializer

    def get_queryset(self):
        job = get_object_or_404(Job, pk=self.kwargs["pk"])
        checkpoints = Checkpoint.objects.filter(job=job).select_related("generation").order_by("-step", "-pk")
        return filter_checkpoints(checkpoints, self.request.query_params, job=job)

    @extend_schema(parameters=LIST_FILTERS)
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    @extend_schema(request=protocol_schema(hooks_protocol.CheckpointCommit),
                   responses={201: CheckpointSerializer, 200: CheckpointSerializer, 409: CONFLICT},
                   description="Body: agents.protocol.hooks.CheckpointCommit. 200 when already recorded; 400 when "
                               "the path is not inside the job's checkpoint directory (under CHECKPOINT_ROOT) or "
                               "is reached through a symlink; 409 when the generation is stale or the path is "
                               "another job's checkpoint.")
    def post(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        commit = hooks_message(request, job, hooks_protocol.CheckpointCommit, "commit")
        if len(commit.path) > _LOCATION_LEN:  # the wire allows 4096: a clear 400, not a database error's 500
            raise ValidationError({"path": [f"{len(commit.path)} characters; the registry stores checkpoint paths "
                                            f"of at most {_LOCATION_LEN}: use a shorter checkpoint directory"]})
        try:
            checkpoint, created = checkpointing.commit_checkpoint(job, commit, actor=actor_label(request))
        except paths.OutsideRoot as exc:
            raise ValidationError({"path": [str(exc)]}) from exc
        except (TransitionError, checkpoint_services.CheckpointError) as exc:
            raise Conflict(str(exc)) from exc
        return Response(CheckpointSerializer(checkpoint).data, status=201 if created else 200)


#: ``Checkpoint.location``'s bound.
_LOCATION_LEN = Checkpoint._meta.get_field("location").max_length or 1000


class JobCheckpointTree(APIView):
    """The job's whole lineage tree, its branches, and the active path (one query for the rows)."""

    required = roles.VIEW

    @extend_schema(responses={200: LineageSerializer})
    def get(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        tree = checkpoint_services.lineage_tree(job)
        return Response(LineageSerializer({"job": job.pk, "latest_verified": tree.latest_verified,
                                           "active_leaf": tree.active_leaf, "branches": tree.branches,
                                           "roots": tree.roots}).data)


class JobCheckpointRetention(APIView):
    """What retention would keep and delete now, and why (a dry run: nothing changes); storage used."""

    required = roles.VIEW

    @extend_schema(responses={200: RetentionPlanSerializer})
    def get(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        plan = checkpoint_services.apply_retention(job, dry_run=True)
        return Response(RetentionPlanSerializer({
            "job": plan.job, "now": plan.now, "dry_run": plan.dry_run, "keep_last": plan.keep_last,
            "permanent_every_hours": plan.permanent_every_hours,
            "storage": {**plan.storage.__dict__, "total_bytes": plan.storage.total_bytes},
            "freed_bytes": plan.freed_bytes, "keep": plan.keep, "delete": plan.delete,
        }).data)


class JobCheckpointInterval(APIView):
    """The Young/Daly checkpoint interval for the job, with every input, and what the hooks are told now."""

    required = roles.VIEW

    @extend_schema(responses={200: IntervalSerializer})
    def get(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        recommendation = checkpoint_interval.recommend_interval(job)
        pushed = job.recommended_interval_steps if CheckpointPolicy.of(job).interval == "auto" else None
        return Response(IntervalSerializer({**recommendation.as_dict(), "pushed_interval_steps": pushed}).data)

"""Checkpoint endpoints: parse → authorise (``required``) → call a service → render.

Reading needs ``view``; verifying, pinning, unpinning and deleting need ``operate``; the hooks'
commit needs an agent token of a node of the job. A verb refused by the checkpoint's state
(a protected delete, pinning a corrupt one) is a 409 problem naming the reason.
"""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.protocol import hooks as hooks_protocol
from checkpoints import paths, services
from checkpoints.api.serializers import (
    CheckpointDetailSerializer,
    CheckpointReasonSerializer,
    CheckpointSerializer,
    IntervalSerializer,
    LineageSerializer,
    RetentionPlanSerializer,
    VerifyRequestSerializer,
)
from checkpoints.choices import CheckpointState
from checkpoints.models import Checkpoint
from checkpoints.policies import CheckpointPolicy
from core import roles
from core.api import int_param, parse_wire
from core.auth import actor_label
from core.problems import Conflict
from core.schema import protocol_schema
from jobs.api.access import require_hooks_caller
from jobs.models import Job
from jobs.state import TransitionError

_FILTERS = [
    OpenApiParameter("state", str, description="Comma-separated states: committed, verified, corrupt, deleted."),
    OpenApiParameter("generation", int, description="Only checkpoints written by this generation."),
    OpenApiParameter("permanent", bool),
    OpenApiParameter("branch", str, enum=["active"], description="'active': only the job's active lineage branch."),
    OpenApiParameter("min_step", int),
    OpenApiParameter("max_step", int),
]
_CONFLICT = OpenApiResponse(description="Problem details: the checkpoint's state forbids it (the reason says why).")


def filter_checkpoints(checkpoints, params, *, job: Job | None = None):
    """The list filters shared by ``/checkpoints`` and ``/jobs/{id}/checkpoints``."""
    if state := params.get("state"):
        states = state.split(",")
        unknown = sorted(set(states) - set(CheckpointState.values))
        if unknown:
            raise ValidationError({"state": [f"Unknown states {unknown}; use {sorted(CheckpointState.values)}."]})
        checkpoints = checkpoints.filter(state__in=states)
    if (generation := int_param(params, "generation")) is not None:
        checkpoints = checkpoints.filter(generation__number=generation)
    if (permanent := params.get("permanent")) is not None:
        if permanent not in ("true", "false"):
            raise ValidationError({"permanent": ["Use true or false."]})
        checkpoints = checkpoints.filter(permanent=permanent == "true")
    if (low := int_param(params, "min_step")) is not None:
        checkpoints = checkpoints.filter(step__gte=low)
    if (high := int_param(params, "max_step")) is not None:
        checkpoints = checkpoints.filter(step__lte=high)
    if (branch := params.get("branch")) is not None:
        if branch != "active" or job is None:
            raise ValidationError({"branch": ["Only 'active' is supported, on a job's checkpoint list."]})
        checkpoints = checkpoints.filter(pk__in=services.active_branch(job).values("pk"))
    return checkpoints


class CheckpointList(generics.ListAPIView):
    """Checkpoints of every job, newest step first; filter with ``?job=`` and the usual filters."""

    required = roles.VIEW
    serializer_class = CheckpointSerializer

    @extend_schema(parameters=[OpenApiParameter("job", int), *(p for p in _FILTERS if p.name != "branch")])
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    def get_queryset(self):
        checkpoints = Checkpoint.objects.select_related("generation").order_by("-step", "-pk")
        if (job := int_param(self.request.query_params, "job")) is not None:
            checkpoints = checkpoints.filter(job_id=job)
        return filter_checkpoints(checkpoints, self.request.query_params)


class JobCheckpoints(generics.ListAPIView):
    """GET: a job's checkpoints, newest step first. POST: the hooks report a commit (the generation's
    job token, or the agent token of a node the generation is placed on)."""

    required = {"GET": roles.VIEW, "POST": roles.HOOKS}
    serializer_class = CheckpointSerializer

    def get_queryset(self):
        job = get_object_or_404(Job, pk=self.kwargs["pk"])
        checkpoints = Checkpoint.objects.filter(job=job).select_related("generation").order_by("-step", "-pk")
        return filter_checkpoints(checkpoints, self.request.query_params, job=job)

    @extend_schema(parameters=_FILTERS)
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    @extend_schema(request=protocol_schema(hooks_protocol.CheckpointCommit),
                   responses={201: CheckpointSerializer, 200: CheckpointSerializer, 409: _CONFLICT},
                   description="Body: agents.protocol.hooks.CheckpointCommit. 200 when already recorded; 400 when "
                               "the path is not inside the job's checkpoint directory (under CHECKPOINT_ROOT) or "
                               "is reached through a symlink; 409 when the generation is stale or the path is "
                               "another job's checkpoint.")
    def post(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        require_hooks_caller(request, job)
        commit = parse_wire(hooks_protocol.CheckpointCommit, request)
        if commit.job != str(job.pk):
            raise ValidationError({"job": [f"the commit is for job {commit.job!r}, the URL for job {job.pk}"]})
        require_hooks_caller(request, job, commit.generation)
        try:
            checkpoint, created = services.record_commit(job, commit, actor=actor_label(request))
        except paths.OutsideRoot as exc:
            raise ValidationError({"path": [str(exc)]}) from exc
        except (TransitionError, services.CheckpointError) as exc:
            raise Conflict(str(exc)) from exc
        return Response(CheckpointSerializer(checkpoint).data, status=201 if created else 200)


class CheckpointDetail(APIView):
    """One checkpoint with its manifest. DELETE removes its files (operator); protected ones are refused."""

    required = {"GET": roles.VIEW, "DELETE": roles.OPERATE}

    @extend_schema(responses={200: CheckpointDetailSerializer})
    def get(self, request, pk):
        checkpoint = get_object_or_404(Checkpoint.objects.select_related("generation"), pk=pk)
        return Response(CheckpointDetailSerializer(checkpoint).data)

    @extend_schema(request=CheckpointReasonSerializer, responses={200: CheckpointDetailSerializer, 409: _CONFLICT},
                   parameters=[OpenApiParameter("reason", str, description="Instead of a body, for clients that "
                                                                          "send none with DELETE.")],
                   description="Deletes the checkpoint's directory (and its replica) and marks the row deleted; the "
                               "row stays in the lineage. Refused (409) for a permanent checkpoint, the latest "
                               "verified one of the active branch, and one a live generation resumed from.")
    def delete(self, request, pk):
        checkpoint = get_object_or_404(Checkpoint.objects.select_related("job", "generation"), pk=pk)
        # Some HTTP clients cannot send a body with DELETE: ?reason= works too.
        body = CheckpointReasonSerializer(data=request.data or {"reason": request.query_params.get("reason", "")})
        body.is_valid(raise_exception=True)
        actor = actor_label(request)
        try:
            checkpoint = services.delete_checkpoint(checkpoint, actor=actor,
                                                    reason=body.validated_data["reason"] or f"deleted by {actor}")
        except services.CheckpointError as exc:
            raise Conflict(str(exc)) from exc
        return Response(CheckpointDetailSerializer(checkpoint).data)


class CheckpointLineage(generics.GenericAPIView):
    """The path from this checkpoint up to the root of its tree, newest first."""

    required = roles.VIEW
    serializer_class = CheckpointSerializer
    pagination_class = None

    @extend_schema(responses={200: CheckpointSerializer(many=True)})
    def get(self, request, pk):
        checkpoint = get_object_or_404(Checkpoint.objects.select_related("generation", "parent"), pk=pk)
        by_id = {c.pk: c for c in Checkpoint.objects.filter(job_id=checkpoint.job_id).select_related("generation")}
        for row in by_id.values():  # walk in memory: one query, however deep the tree
            row.parent = by_id.get(row.parent_id)
        return Response(CheckpointSerializer(services.lineage(by_id[checkpoint.pk]), many=True).data)


class _CheckpointAction(APIView):
    """parse → authorise → call the service → the checkpoint as it is now; state conflicts are 409."""

    required = roles.OPERATE
    body_serializer = CheckpointReasonSerializer

    def post(self, request, pk):
        checkpoint = get_object_or_404(Checkpoint.objects.select_related("job", "generation"), pk=pk)
        body = self.body_serializer(data=request.data or {})
        body.is_valid(raise_exception=True)
        try:
            checkpoint = self.perform(checkpoint, body.validated_data, actor_label(request))
        except services.CheckpointError as exc:
            raise Conflict(str(exc)) from exc
        return Response(CheckpointDetailSerializer(Checkpoint.objects.select_related("generation")
                                                   .get(pk=checkpoint.pk)).data)


class CheckpointVerify(_CheckpointAction):
    """Re-verify now (manifest, hashes, required parts, step); the verdict is recorded."""

    body_serializer = VerifyRequestSerializer

    @extend_schema(request=VerifyRequestSerializer, responses={200: CheckpointDetailSerializer})
    def post(self, request, pk):
        return super().post(request, pk)

    def perform(self, checkpoint, data, actor):
        return services.verify(checkpoint, actor=actor, record_unchanged=True)


class CheckpointPin(_CheckpointAction):
    """Make the checkpoint permanent: retention never deletes it."""

    @extend_schema(request=CheckpointReasonSerializer, responses={200: CheckpointDetailSerializer, 409: _CONFLICT})
    def post(self, request, pk):
        return super().post(request, pk)

    def perform(self, checkpoint, data, actor):
        return services.pin(checkpoint, actor=actor, reason=data["reason"] or f"pinned by {actor}")


class CheckpointUnpin(_CheckpointAction):
    """Make a permanent checkpoint ordinary again; retention decides its fate from the next sweep."""

    @extend_schema(request=CheckpointReasonSerializer, responses={200: CheckpointDetailSerializer})
    def post(self, request, pk):
        return super().post(request, pk)

    def perform(self, checkpoint, data, actor):
        return services.unpin(checkpoint, actor=actor, reason=data["reason"] or f"unpinned by {actor}")


class JobCheckpointTree(APIView):
    """The job's whole lineage tree, its branches, and the active path (one query for the rows)."""

    required = roles.VIEW

    @extend_schema(responses={200: LineageSerializer})
    def get(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        tree = services.lineage_tree(job)
        return Response(LineageSerializer({"job": job.pk, "latest_verified": tree.latest_verified,
                                           "active_leaf": tree.active_leaf, "branches": tree.branches,
                                           "roots": tree.roots}).data)


class JobCheckpointRetention(APIView):
    """What retention would keep and delete now, and why (a dry run: nothing changes); storage used."""

    required = roles.VIEW

    @extend_schema(responses={200: RetentionPlanSerializer})
    def get(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        plan = services.apply_retention(job, dry_run=True)
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
        recommendation = services.recommend_interval(job)
        pushed = job.recommended_interval_steps if CheckpointPolicy.of(job).interval == "auto" else None
        return Response(IntervalSerializer({**recommendation.as_dict(), "pushed_interval_steps": pushed}).data)

"""Checkpoint endpoints: parse → authorise (``required``) → call a service → render.

Reading needs ``view``; verifying, pinning, unpinning and deleting need ``operate``. A verb refused
by the checkpoint's state (a protected delete, pinning a corrupt one) is a 409 problem naming the
reason. A job's checkpoints (``/jobs/{id}/checkpoints``: the list, the hooks' commit, the tree,
retention, the interval) are served by ``jobs.api.checkpoints``, with the filters and serializers
defined here.
"""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from checkpoints import services
from checkpoints.api.serializers import (
    CheckpointDetailSerializer,
    CheckpointReasonSerializer,
    CheckpointSerializer,
    VerifyRequestSerializer,
)
from checkpoints.choices import CheckpointState
from checkpoints.models import Checkpoint
from core import roles
from core.api import int_param
from core.auth import actor_label
from core.problems import Conflict

LIST_FILTERS = [
    OpenApiParameter("state", str, description="Comma-separated states: committed, verified, corrupt, deleted."),
    OpenApiParameter("generation", int, description="Only checkpoints written by this generation."),
    OpenApiParameter("permanent", bool),
    OpenApiParameter("branch", str, enum=["active"], description="'active': only the job's active lineage branch."),
    OpenApiParameter("min_step", int),
    OpenApiParameter("max_step", int),
]
CONFLICT = OpenApiResponse(description="Problem details: the checkpoint's state forbids it (the reason says why).")


def filter_checkpoints(checkpoints, params, *, job=None):
    """The list filters shared by ``/checkpoints`` and ``/jobs/{id}/checkpoints`` (``job``: the
    job of the latter, for ``branch``)."""
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

    @extend_schema(parameters=[OpenApiParameter("job", int), *(p for p in LIST_FILTERS if p.name != "branch")])
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    def get_queryset(self):
        checkpoints = Checkpoint.objects.select_related("generation").order_by("-step", "-pk")
        if (job := int_param(self.request.query_params, "job")) is not None:
            checkpoints = checkpoints.filter(job_id=job)
        return filter_checkpoints(checkpoints, self.request.query_params)


class CheckpointDetail(APIView):
    """One checkpoint with its manifest. DELETE removes its files (operator); protected ones are refused."""

    required = {"GET": roles.VIEW, "DELETE": roles.OPERATE}

    @extend_schema(responses={200: CheckpointDetailSerializer})
    def get(self, request, pk):
        checkpoint = get_object_or_404(Checkpoint.objects.select_related("generation"), pk=pk)
        return Response(CheckpointDetailSerializer(checkpoint).data)

    @extend_schema(request=CheckpointReasonSerializer, responses={200: CheckpointDetailSerializer, 409: CONFLICT},
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

    @extend_schema(request=CheckpointReasonSerializer, responses={200: CheckpointDetailSerializer, 409: CONFLICT})
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

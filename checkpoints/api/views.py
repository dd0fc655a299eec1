from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import generics
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.protocol import hooks as hooks_protocol
from checkpoints import services
from checkpoints.api.serializers import CheckpointSerializer
from checkpoints.models import Checkpoint
from controlplane import roles
from controlplane.api import parse_wire, require_node_of_job
from controlplane.auth import actor_label
from controlplane.problems import Conflict
from jobs.models import Job
from jobs.state import TransitionError


class CheckpointList(generics.ListAPIView):
    """Checkpoints, newest step first; filter with ``?job=`` and ``?state=``."""

    required = roles.VIEW
    serializer_class = CheckpointSerializer

    def get_queryset(self):
        checkpoints = Checkpoint.objects.select_related("generation").order_by("-step", "-pk")
        if job := self.request.query_params.get("job"):
            if not job.isdigit():
                raise ValidationError({"job": ["Must be a job id (an integer)."]})
            checkpoints = checkpoints.filter(job_id=int(job))
        if state := self.request.query_params.get("state"):
            checkpoints = checkpoints.filter(state__in=state.split(","))
        return checkpoints


class CheckpointDetail(generics.RetrieveAPIView):
    required = roles.VIEW
    serializer_class = CheckpointSerializer
    queryset = Checkpoint.objects.select_related("generation")


class JobCheckpointCommit(APIView):
    """The hooks report a committed checkpoint (agent token of a node of the job)."""

    required = roles.AGENT

    @extend_schema(request=None, responses={201: CheckpointSerializer, 200: CheckpointSerializer},
                   description="Body: agents.protocol.hooks.CheckpointCommit. 200 when already recorded.")
    def post(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        require_node_of_job(request, job)
        commit = parse_wire(hooks_protocol.CheckpointCommit, request)
        if commit.job != str(job.pk):
            raise ValidationError({"job": [f"the commit is for job {commit.job!r}, the URL for job {job.pk}"]})
        try:
            checkpoint, created = services.record_commit(job, commit, actor=actor_label(request))
        except TransitionError as exc:
            raise Conflict(str(exc)) from exc
        return Response(CheckpointSerializer(checkpoint).data, status=201 if created else 200)

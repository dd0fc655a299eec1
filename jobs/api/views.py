"""Job endpoints: parse → authorise → call a service → render."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import generics, status
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.protocol import dump
from agents.protocol import hooks as hooks_protocol
from controlplane import roles
from controlplane.api import IDEMPOTENCY_HEADER, idempotent, parse_wire, require_node_of_job
from controlplane.auth import actor_label
from controlplane.problems import Conflict
from jobs import services
from jobs.api.serializers import (
    ApproveSerializer,
    EventSerializer,
    GenerationSerializer,
    GoodputSerializer,
    IncidentSerializer,
    JobSerializer,
    JobSpecSerializer,
    ReasonSerializer,
    RollbackSerializer,
)
from jobs.models import Event, Generation, Incident, Job
from jobs.state import TransitionError


class JobListCreate(generics.ListCreateAPIView):
    """List jobs (filter with ``?state=``), or launch one."""

    required = {"GET": roles.VIEW, "POST": roles.LAUNCH}
    serializer_class = JobSerializer

    def get_queryset(self):
        jobs = Job.objects.all()
        if state := self.request.query_params.get("state"):
            jobs = jobs.filter(state__in=state.split(","))
        if name := self.request.query_params.get("name"):
            jobs = jobs.filter(name=name)
        return jobs

    @extend_schema(
        request=JobSpecSerializer,
        responses={201: JobSerializer},
        parameters=[OpenApiParameter(IDEMPOTENCY_HEADER, str, OpenApiParameter.HEADER,
                                     description="Retries with the same key return the first response.")],
    )
    def post(self, request, *args, **kwargs):
        def perform():
            spec = JobSpecSerializer(data=request.data)
            spec.is_valid(raise_exception=True)
            job = services.launch_job(spec.validated_data, actor=actor_label(request))
            return Response(JobSerializer(job).data, status=status.HTTP_201_CREATED)

        return idempotent(request, perform)


class JobDetail(generics.RetrieveAPIView):
    required = roles.VIEW
    serializer_class = JobSerializer
    queryset = Job.objects.all()


class JobEvents(generics.ListAPIView):
    """The job's audit trail, oldest first."""

    required = roles.VIEW
    serializer_class = EventSerializer

    def get_queryset(self):
        job = get_object_or_404(Job, pk=self.kwargs["pk"])
        return Event.objects.filter(job=job)


class JobCancel(APIView):
    required = roles.OPERATE

    @extend_schema(request=ReasonSerializer, responses={200: JobSerializer})
    def post(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        body = ReasonSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            job = services.cancel_job(job, actor=actor_label(request), reason=body.validated_data["reason"])
        except TransitionError as exc:
            raise Conflict(str(exc)) from exc
        return Response(JobSerializer(job).data)


class JobReports(APIView):
    """Step reports and events from the training hooks (agent token of a node of the job)."""

    required = roles.AGENT

    @extend_schema(request=None, responses={202: None, 409: None},
                   description="Body: agents.protocol.hooks.ReportBatch. 409 when the generation is stale.")
    def post(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        require_node_of_job(request, job)
        batch = parse_wire(hooks_protocol.ReportBatch, request)
        if batch.job != str(job.pk):
            raise ValidationError({"job": [f"the batch is for job {batch.job!r}, the URL for job {job.pk}"]})
        try:
            result = services.record_reports(job, batch, actor=actor_label(request))
        except TransitionError as exc:
            raise Conflict(str(exc)) from exc
        job.refresh_from_db()
        answer = hooks_protocol.ReportsAccepted(accepted=result.accepted, duplicates=result.duplicates,
                                                control=services.control_for(job, batch.generation))
        return Response(dump(answer), status=status.HTTP_202_ACCEPTED)


class JobControl(APIView):
    """What the running generation should do: checkpoint now, pause, a new interval, or stop (stale)."""

    required = roles.AGENT

    @extend_schema(parameters=[OpenApiParameter("generation", int, required=True),
                               OpenApiParameter("rank", int, required=False)],
                   responses={200: None}, description="Answers agents.protocol.hooks.Control.")
    def get(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        require_node_of_job(request, job)
        raw = request.query_params.get("generation", "")
        if not raw.isdigit():
            raise ValidationError({"generation": ["required, a non-negative integer"]})
        return Response(dump(services.control_for(job, int(raw))))


class _Action(APIView):
    """parse → authorise (``required``) → call the service → the job as it is now; conflicts are 409."""

    serializer_class = ReasonSerializer

    def post(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        body = self.serializer_class(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            self.perform(job, body.validated_data, actor_label(request))
        except TransitionError as exc:
            raise Conflict(str(exc)) from exc
        job.refresh_from_db()
        return Response(JobSerializer(job).data)


@extend_schema_view(post=extend_schema(request=ReasonSerializer, responses={200: JobSerializer}))
class JobPause(_Action):
    """Checkpoint and stop the running generation; the job waits, paused, for a resume."""

    required = roles.OPERATE

    def perform(self, job, data, actor):
        services.pause_job(job, actor=actor, reason=data["reason"])


@extend_schema_view(post=extend_schema(request=ApproveSerializer, responses={200: JobSerializer}))
class JobApprove(_Action):
    """On-call approves resuming a paused job (after the circuit breaker or an escalation)."""

    required = roles.APPROVE
    serializer_class = ApproveSerializer

    def perform(self, job, data, actor):
        services.approve_resume(job, actor=actor, reason=data["reason"], force=data["force"])


@extend_schema_view(post=extend_schema(request=RollbackSerializer, responses={200: JobSerializer}))
class JobRollback(_Action):
    """Resume a paused job from an earlier verified checkpoint, on a new lineage branch."""

    required = roles.OPERATE
    serializer_class = RollbackSerializer

    def perform(self, job, data, actor):
        from checkpoints.models import Checkpoint

        checkpoint = Checkpoint.objects.filter(pk=data["checkpoint"], job=job).first()
        if checkpoint is None:
            raise ValidationError({"checkpoint": [f"job {job.pk} has no checkpoint {data['checkpoint']}"]})
        skip = tuple(data["skip_data"]) if data.get("skip_data") else None
        services.rollback_to(job, checkpoint, actor=actor, reason=data["reason"], skip_data=skip,
                             force=data["force"])


class JobIncidents(generics.ListAPIView):
    required = roles.VIEW
    serializer_class = IncidentSerializer

    def get_queryset(self):
        job = get_object_or_404(Job, pk=self.kwargs["pk"])
        return Incident.objects.filter(job=job).select_related("generation").prefetch_related("nodes")


class JobGenerations(generics.ListAPIView):
    required = roles.VIEW
    serializer_class = GenerationSerializer

    def get_queryset(self):
        job = get_object_or_404(Job, pk=self.kwargs["pk"])
        return Generation.objects.filter(job=job).prefetch_related("nodes")


class JobGoodput(APIView):
    """ETTR and where the rest of the wall time went, computed from recorded incidents and steps."""

    required = roles.VIEW

    @extend_schema(responses={200: GoodputSerializer})
    def get(self, request, pk):
        result = services.goodput_of(get_object_or_404(Job, pk=pk))
        return Response(GoodputSerializer({"ettr": result.ettr, "wall_s": result.wall_s,
                                           "productive_s": result.productive_s,
                                           "badput_s": result.badput_s}).data)

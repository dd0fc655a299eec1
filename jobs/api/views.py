"""Job endpoints: parse → authorise → call a service → render."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import generics, status
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.protocol import dump
from agents.protocol import hooks as hooks_protocol
from checkpoints.models import Checkpoint
from core import roles
from core.api import (
    IDEMPOTENCY_HEADER,
    choices_param,
    datetime_param,
    idempotent,
    int_param,
)
from core.auth import actor_label
from core.models import Event
from core.problems import Conflict, Unprocessable
from core.schema import protocol_schema
from jobs import fit, ingest, services
from jobs.api.access import hooks_message, require_hooks_caller
from jobs.api.serializers import (
    ApproveSerializer,
    EventSerializer,
    GenerationSerializer,
    GoodputSerializer,
    IncidentSerializer,
    JobSerializer,
    JobSpecSerializer,
    JobStatusSerializer,
    ReasonSerializer,
    ResizeSerializer,
    RollbackSerializer,
)
from jobs.choices import Decision, IncidentKind, IncidentState, JobState
from jobs.goodput import goodput_of
from jobs.models import Generation, Incident, Job
from jobs.state import TransitionError

_JOB_FILTERS = [
    OpenApiParameter("state", str, description="Comma-separated job states, e.g. running,paused."),
    OpenApiParameter("name", str, description="Exact job name."),
    OpenApiParameter("created_by", str, description="Exact actor label of the launch, e.g. token:ci-main(ci-bot)."),
    OpenApiParameter("since", str, description="Only jobs created at or after this ISO 8601 time."),
]
_INCIDENT_FILTERS = [
    OpenApiParameter("job", int, description="Only this job's incidents."),
    OpenApiParameter("kind", str, description="Comma-separated kinds: " + ", ".join(IncidentKind.values)),
    OpenApiParameter("state", str, description="open or resolved (comma-separated)."),
    OpenApiParameter("decision", str, description="Comma-separated decisions: " + ", ".join(Decision.values)),
    OpenApiParameter("node", str, description="Only incidents that involve this node (hostname)."),
    OpenApiParameter("since", str, description="Only incidents detected at or after this ISO 8601 time."),
]


def filter_incidents(incidents, params):
    if (job := int_param(params, "job", minimum=1)) is not None:
        incidents = incidents.filter(job_id=job)
    for name, allowed in (("kind", IncidentKind.values), ("state", IncidentState.values),
                          ("decision", Decision.values)):
        if (values := choices_param(params, name, allowed)) is not None:
            incidents = incidents.filter(**{f"{name}__in": values})
    if node := params.get("node"):
        incidents = incidents.filter(nodes__hostname=node).distinct()
    if (since := datetime_param(params, "since")) is not None:
        incidents = incidents.filter(detected_at__gte=since)
    return incidents


@extend_schema_view(get=extend_schema(parameters=_JOB_FILTERS))
class JobListCreate(generics.ListCreateAPIView):
    """List jobs, newest first (filters below), or launch one."""

    required = {"GET": roles.VIEW, "POST": roles.LAUNCH}
    serializer_class = JobSerializer

    def get_queryset(self):
        params = self.request.query_params
        jobs = Job.objects.order_by("-created_at", "-pk")
        if (states := choices_param(params, "state", JobState.values)) is not None:
            jobs = jobs.filter(state__in=states)
        for name in ("name", "created_by"):
            if value := params.get(name):
                jobs = jobs.filter(**{name: value})
        if (since := datetime_param(params, "since")) is not None:
            jobs = jobs.filter(created_at__gte=since)
        return jobs

    @extend_schema(
        request=JobSpecSerializer,
        responses={201: JobSerializer,
                   422: OpenApiResponse(description="The Idempotency-Key is empty, longer than 200 characters, "
                                                    "or was used before with a different body; or the registered "
                                                    "fleet can never hold the spec (more nodes than are registered, "
                                                    "more GPUs per node than any node has: the field is named) and "
                                                    "the request did not say \"queue\": true.")},
        parameters=[OpenApiParameter(IDEMPOTENCY_HEADER, str, OpenApiParameter.HEADER,
                                     description="1-200 characters. Retries with the same key (per credential, "
                                                 "for 24 h) return the first response without launching again.")],
    )
    def post(self, request, *args, **kwargs):
        def perform():
            spec = JobSpecSerializer(data=request.data)
            spec.is_valid(raise_exception=True)
            values = dict(spec.validated_data)
            if not values.pop("queue", False) and (never := fit.refusal(values)):
                raise Unprocessable({field: [reason] for field, reason in never.items()})
            job = services.launch_job(values, actor=actor_label(request))
            return Response(JobSerializer(job).data, status=status.HTTP_201_CREATED)

        return idempotent(request, perform)


class JobDetail(generics.RetrieveAPIView):
    required = roles.VIEW
    serializer_class = JobSerializer
    queryset = Job.objects.all()


@extend_schema_view(get=extend_schema(parameters=[
    OpenApiParameter("kind", str, description="Comma-separated event kinds, e.g. job.state,job.launch.")]))
class JobEvents(generics.ListAPIView):
    """The job's audit trail, oldest first."""

    required = roles.VIEW
    serializer_class = EventSerializer

    def get_queryset(self):
        job = get_object_or_404(Job, pk=self.kwargs["pk"])
        events = Event.objects.filter(job=job)
        if kinds := self.request.query_params.get("kind"):
            events = events.filter(kind__in=kinds.split(","))
        return events


class JobStatus(APIView):
    """The job's live status in one small answer: what ``nightwatch launch --wait`` polls."""

    required = roles.VIEW

    @extend_schema(responses={200: JobStatusSerializer})
    def get(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        incidents = Incident.objects.filter(job=job).select_related("generation").order_by("-detected_at", "-pk")
        return Response(JobStatusSerializer({
            "id": job.pk, "name": job.name, "state": job.state, "terminal": job.state in JobState.TERMINAL,
            "needs_human": job.state == JobState.PAUSED, "pause_reason": job.pause_reason,
            "generation": job.generation, "restart_count": job.restart_count, "last_step": job.last_step,
            "last_step_at": job.last_step_at, "state_changed_at": job.state_changed_at,
            "ettr": goodput_of(job).ettr,
            "open_incidents": incidents.filter(state=IncidentState.OPEN).count(),
            # The rows, not their representation: the status serializer renders them (rendering them
            # twice read ``generation.number`` of an int, and every generation came out null).
            "recent_incidents": list(incidents[:5]),
            "waiting": fit.waiting(job),
        }).data)


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
    """Step reports and events from the training hooks: the generation's job token (or the agent
    token of a node the generation is placed on)."""

    required = roles.HOOKS

    @extend_schema(request=protocol_schema(hooks_protocol.ReportBatch),
                   responses={202: protocol_schema(hooks_protocol.ReportsAccepted), 403: None, 409: None, 422: None},
                   description="Body: agents.protocol.hooks.ReportBatch. 403 when the token does not speak for "
                               "that generation; 409 when the generation is stale or the job has ended; 422 "
                               "(nothing stored) when a report is implausible for the job: far past its last "
                               "step, past its max_steps, a data cursor going backwards, another world size.")
    def post(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        batch = hooks_message(request, job, hooks_protocol.ReportBatch, "batch")
        try:
            result = ingest.record_reports(job, batch, actor=actor_label(request))
        except TransitionError as exc:
            raise Conflict(str(exc)) from exc
        except ingest.ReportsRefused as exc:
            raise Unprocessable({f"reports.{r.index}.step": f"{r.reason}: {r.detail}" for r in exc.refusals}) from exc
        job.refresh_from_db()
        answer = hooks_protocol.ReportsAccepted(accepted=result.accepted, duplicates=result.duplicates,
                                                ignored=result.ignored,
                                                control=ingest.control_for(job, batch.generation))
        return Response(dump(answer), status=status.HTTP_202_ACCEPTED)


class JobControl(APIView):
    """What the running generation should do: checkpoint now, pause, a new interval, or stop (stale:
    an older generation, or the job has ended). Same callers as ``JobReports``."""

    required = roles.HOOKS

    @extend_schema(parameters=[OpenApiParameter("generation", int, required=True),
                               OpenApiParameter("rank", int, required=False)],
                   responses={200: protocol_schema(hooks_protocol.Control)},
                   description="Answers agents.protocol.hooks.Control.")
    def get(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        require_hooks_caller(request, job)
        generation = int_param(request.query_params, "generation", required=True)
        require_hooks_caller(request, job, generation)
        return Response(dump(ingest.control_for(job, generation)))


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


@extend_schema_view(post=extend_schema(request=ReasonSerializer, responses={200: JobSerializer}))
class JobCheckpoint(_Action):
    """Ask the running generation for a checkpoint now; the request stands until one is committed."""

    required = roles.OPERATE

    def perform(self, job, data, actor):
        services.request_checkpoint(job, actor=actor, reason=data["reason"])


class JobResize(APIView):
    """Change the world size: a running job pauses at a checkpoint and resumes at once on
    ``nnodes`` × ``nproc_per_node`` (its newest checkpoint that re-verifies, the global sample stream
    continuing exactly); a paused job takes the new size at its next resume."""

    required = roles.OPERATE

    @extend_schema(request=ResizeSerializer,
                   responses={200: JobSerializer,
                              409: OpenApiResponse(description="The job is neither running nor paused, or a "
                                                               "resize is already under way."),
                              422: OpenApiResponse(description="The registered fleet can never hold the new size "
                                                               "(the field is named), as for a launch.")})
    def post(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        body = ResizeSerializer(data=request.data, context={"job": job})
        body.is_valid(raise_exception=True)
        size = {"nnodes": body.validated_data["nnodes"], "nproc_per_node": body.validated_data["nproc_per_node"]}
        if never := fit.refusal({**size, "accelerator": job.accelerator, "recovery_policy": job.recovery_policy}):
            raise Unprocessable({field: [reason] for field, reason in never.items()})
        try:
            job = services.resize_job(job, **size, actor=actor_label(request), reason=body.validated_data["reason"])
        except TransitionError as exc:
            raise Conflict(str(exc)) from exc
        return Response(JobSerializer(job).data)


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
        checkpoint = Checkpoint.objects.filter(pk=data["checkpoint"], job=job).first()
        if checkpoint is None:
            raise ValidationError({"checkpoint": [f"job {job.pk} has no checkpoint {data['checkpoint']}"]})
        skip = tuple(data["skip_data"]) if data.get("skip_data") else None
        services.rollback_to(job, checkpoint, actor=actor, reason=data["reason"], skip_data=skip,
                             force=data["force"])


@extend_schema_view(get=extend_schema(parameters=[p for p in _INCIDENT_FILTERS if p.name != "job"]))
class JobIncidents(generics.ListAPIView):
    """The job's incidents, newest first, with their evidence and timings."""

    required = roles.VIEW
    serializer_class = IncidentSerializer

    def get_queryset(self):
        job = get_object_or_404(Job, pk=self.kwargs["pk"])
        incidents = Incident.objects.filter(job=job).select_related("generation").prefetch_related("nodes")
        return filter_incidents(incidents.order_by("-detected_at", "-pk"), self.request.query_params)


@extend_schema_view(get=extend_schema(parameters=_INCIDENT_FILTERS))
class IncidentList(generics.ListAPIView):
    """Incidents of every job (and of no job, e.g. a node going bad while idle), newest first."""

    required = roles.VIEW
    serializer_class = IncidentSerializer

    def get_queryset(self):
        incidents = Incident.objects.select_related("generation").prefetch_related("nodes")
        return filter_incidents(incidents.order_by("-detected_at", "-pk"), self.request.query_params)


class IncidentDetail(generics.RetrieveAPIView):
    """One incident with its evidence (exit codes, log tails, the rule that matched) and timings."""

    required = roles.VIEW
    serializer_class = IncidentSerializer
    queryset = Incident.objects.select_related("generation").prefetch_related("nodes")


class JobGenerations(generics.ListAPIView):
    """The job's generations (launches), oldest first: nodes, resume point, how each ended."""

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
        result = goodput_of(get_object_or_404(Job, pk=pk))
        return Response(GoodputSerializer({"ettr": result.ettr, "wall_s": result.wall_s,
                                           "productive_s": result.productive_s,
                                           "badput_s": result.badput_s}).data)

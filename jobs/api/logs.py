"""Training output over HTTP (``jobs.logs``): the agents post it, people read it."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import exceptions, serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.protocol import agent as wire
from core import roles
from core.api import int_param, parse_wire
from core.schema import protocol_schema
from jobs import logs
from jobs.models import Job
from nodes.api.views import AgentEndpoint


class AgentLogs(AgentEndpoint):
    """The node's agent ships lines of a generation's torchrun output (its node token; only a
    generation placed on its node)."""

    @extend_schema(request=protocol_schema(wire.LogBatch),
                   responses={202: None, 403: None},
                   description="Body: agents.protocol.agent.LogBatch. 403 (nothing stored) when the generation is "
                               "not placed on this node. Lines already stored (by line number) are skipped; each "
                               "line is sanitised and cut to 2,000 characters; past the per-generation cap "
                               "(NIGHTWATCH_LOG_MAX_BYTES) the oldest lines go.")
    def post(self, request, node_id):
        batch = parse_wire(wire.LogBatch, request)
        try:
            stored = logs.store(request.node, batch)
        except logs.ForeignGeneration as exc:
            raise exceptions.PermissionDenied(str(exc)) from exc
        return Response({"accepted": stored.accepted, "duplicates": stored.duplicates, "dropped": stored.dropped},
                        status=status.HTTP_202_ACCEPTED)


class LogLineSerializer(serializers.Serializer):
    id = serializers.IntegerField(help_text="The follow cursor: pass the last one seen as ?after=.")
    generation = serializers.IntegerField()
    node = serializers.CharField(source="stream.hostname")
    line = serializers.IntegerField(help_text="Line number in the node's output of the generation.")
    rank = serializers.IntegerField(allow_null=True, help_text="The rank, when the line says ([rankN]:).")
    text = serializers.CharField()
    received_at = serializers.DateTimeField()


class LogStreamSerializer(serializers.Serializer):
    generation = serializers.IntegerField()
    node = serializers.CharField(source="hostname")
    lines = serializers.IntegerField(source="next_line", help_text="Lines the node has sent (stored or dropped).")
    bytes = serializers.IntegerField(help_text="Characters still stored.")
    dropped = serializers.IntegerField(help_text="Lines dropped (the agent's buffer, the per-generation cap).")


class JobLogsSerializer(serializers.Serializer):
    lines = LogLineSerializer(many=True)
    cursor = serializers.IntegerField(allow_null=True, help_text="Pass as ?after= to get only newer lines.")
    streams = LogStreamSerializer(many=True)


class JobLogs(APIView):
    """The job's training output (each generation's torchrun output, as the nodes shipped it)."""

    required = roles.VIEW

    @extend_schema(parameters=[
        OpenApiParameter("generation", int, description="Only this generation."),
        OpenApiParameter("rank", int, description="Only lines of this rank (those that carry a [rankN]: prefix)."),
        OpenApiParameter("after", int, description="Follow: only lines after this id (the previous answer's cursor), "
                                                   "oldest first."),
        OpenApiParameter("tail", int, description="Without after: the last this many lines (default 200)."),
        OpenApiParameter("limit", int, description="At most this many lines (default 1000, at most 5000)."),
    ], responses={200: JobLogsSerializer})
    def get(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        params = request.query_params
        generation = int_param(params, "generation", minimum=0)
        rank = int_param(params, "rank", minimum=0)
        after = int_param(params, "after", minimum=0)
        tail = int_param(params, "tail", minimum=1)
        limit = int_param(params, "limit", minimum=1)
        if limit is not None and limit > 5000:
            raise exceptions.ValidationError({"limit": ["Ensure this value is less than or equal to 5000."]})
        for name, value in (("generation", generation), ("rank", rank)):
            if value is not None and value > logs.INT32:
                raise exceptions.ValidationError({name: [f"must be between 0 and {logs.INT32}"]})
        lines = logs.read(job, generation=generation, rank=rank, after=after, tail=tail if tail is not None else 200,
                          limit=limit or 1000)
        cursor = lines[-1].pk if lines else after
        return Response(JobLogsSerializer({"lines": lines, "cursor": cursor,
                                           "streams": logs.streams(job, generation)}).data)

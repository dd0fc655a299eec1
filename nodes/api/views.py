"""Node endpoints: parse → authorise → call a service → render.

Two audiences. People (viewer and up) list nodes and their command queue; operators and on-call
drain and undrain. Node agents call the ``agents.protocol.agent`` endpoints, each body parsed with
the protocol's own classes, each for the token's own node only; a bad message is refused whole
(4xx problem details) before anything is stored.
"""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import JsonResponse
from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import exceptions, generics, permissions, status
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.protocol import ProtocolError, dump
from agents.protocol import agent as wire
from core import admission, roles
from core.api import choices_param, parse_wire
from core.auth import AgentThrottle, RegisterThrottle, actor_label, calling_node
from core.problems import Conflict
from core.schema import protocol_schema
from nodes import services
from nodes.api.serializers import (
    BootstrapTokenRequestSerializer,
    BootstrapTokenSerializer,
    DrainSerializer,
    FleetGPUSerializer,
    HealthCheckRequestSerializer,
    NodeActionSerializer,
    NodeCommandSerializer,
    NodeSerializer,
)
from nodes.choices import CommandState, Health, Schedulability
from nodes.models import GPU, Node, NodeCommand
from nodes.services import wake
from nodes.services.ingest import ForeignGeneration

_HEALTH = OpenApiParameter("health", str, description="Comma-separated: " + ", ".join(Health.values))


@extend_schema_view(get=extend_schema(parameters=[
    _HEALTH,
    OpenApiParameter("schedulability", str, description="Comma-separated: " + ", ".join(Schedulability.values)),
    OpenApiParameter("spare", bool, description="Only spares (true) or only non-spares (false)."),
    OpenApiParameter("hostname", str, description="Exact hostname."),
]))
class NodeList(generics.ListAPIView):
    """Nodes with their GPUs, by hostname (filters below)."""

    required = roles.VIEW
    serializer_class = NodeSerializer

    def get_queryset(self):
        params = self.request.query_params
        nodes = Node.objects.prefetch_related("gpus").order_by("hostname")
        for name, allowed in (("health", Health.values), ("schedulability", Schedulability.values)):
            if (values := choices_param(params, name, allowed)) is not None:
                nodes = nodes.filter(**{f"{name}__in": values})
        if (spare := params.get("spare")) is not None:
            if spare not in ("true", "false"):
                raise exceptions.ValidationError({"spare": ["use true or false"]})
            nodes = nodes.filter(is_spare=spare == "true")
        if hostname := params.get("hostname"):
            nodes = nodes.filter(hostname=hostname)
        return nodes


@extend_schema_view(get=extend_schema(parameters=[_HEALTH, OpenApiParameter("node", str, description="Hostname.")]))
class GPUList(generics.ListAPIView):
    """Every GPU of the fleet with its health and latest sample, by node and index."""

    required = roles.VIEW
    serializer_class = FleetGPUSerializer

    def get_queryset(self):
        params = self.request.query_params
        gpus = GPU.objects.select_related("node").order_by("node__hostname", "index")
        if (values := choices_param(params, "health", Health.values)) is not None:
            gpus = gpus.filter(health__in=values)
        if node := params.get("node"):
            gpus = gpus.filter(node__hostname=node)
        return gpus


class NodeDetail(generics.RetrieveAPIView):
    required = roles.VIEW
    serializer_class = NodeSerializer
    queryset = Node.objects.prefetch_related("gpus")


class _DrainView(APIView):
    required = roles.DRAIN
    #: ``services.drain_node`` or ``services.undrain_node``.
    verb = None

    @extend_schema(request=DrainSerializer, responses={200: NodeActionSerializer})
    def post(self, request, pk):
        node = get_object_or_404(Node, pk=pk)
        body = DrainSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        # Idempotent: draining a drained node changes nothing, records nothing, and answers 200.
        outcome = type(self).verb(node, actor=actor_label(request), reason=body.validated_data["reason"])
        node = Node.objects.prefetch_related("gpus").get(pk=pk)
        return Response(NodeActionSerializer(self.answer(node, outcome)).data)

    def answer(self, node: Node, outcome) -> dict:
        # An undrained (or drained) lemon: placement keeps it out until its count is cleared.
        return {**NodeSerializer(node).data, "warning": services.lemon_warning(node), "lemon_cleared": None}


class NodeDrain(_DrainView):
    """Take the node out of scheduling (its running generation is left to the orchestrator)."""

    verb = services.drain_node


class NodeUndrain(_DrainView):
    """Put the node back into scheduling."""

    verb = services.undrain_node


class NodeClearLemon(_DrainView):
    """Vouch for a node after a repair: its lemon count starts over, so placement may pick it
    again once it is active. Separate from undrain on purpose; audited (``node.lemon_cleared``)."""

    verb = services.clear_lemon

    def answer(self, node: Node, outcome) -> dict:
        return {**NodeSerializer(node).data, "warning": None, "lemon_cleared": outcome}


class NodeHealthCheck(APIView):
    """Run the health checks on the node now (GPUs; with ``peers``, the pairwise bandwidth probe).

    The result arrives as the agent's ``health_check`` event; per-pair bandwidth is stored.
    """

    required = roles.DRAIN

    @extend_schema(request=HealthCheckRequestSerializer, responses={202: NodeCommandSerializer})
    def post(self, request, pk):
        node = get_object_or_404(Node, pk=pk)
        body = HealthCheckRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        peers = list(Node.objects.filter(pk__in=body.validated_data["peers"]).exclude(pk=node.pk))
        missing = set(body.validated_data["peers"]) - {p.pk for p in peers} - {node.pk}
        if missing:
            raise exceptions.ValidationError({"peers": [f"no node with id {sorted(missing)[0]}"]})
        try:
            command = services.request_health_check(node, peers=peers, actor=actor_label(request),
                                                    expected_mbps=body.validated_data.get("expected_mbps"))
        except ValueError as exc:
            raise exceptions.ValidationError({"peers": [str(exc)]}) from exc
        return Response(NodeCommandSerializer(command).data, status=status.HTTP_202_ACCEPTED)


@extend_schema_view(get=extend_schema(parameters=[
    OpenApiParameter("state", str, description="Comma-separated: " + ", ".join(CommandState.values))]))
class NodeCommands(generics.ListAPIView):
    """The node's command queue, newest first; filter with ``?state=pending,delivered``."""

    required = roles.VIEW
    serializer_class = NodeCommandSerializer

    def get_queryset(self):
        node = get_object_or_404(Node, pk=self.kwargs["pk"])
        commands = NodeCommand.objects.filter(node=node).order_by("-created_at", "-pk")
        if value := self.request.query_params.get("state"):
            states = value.split(",")
            unknown = sorted(set(states) - set(CommandState.values))
            if unknown:
                raise exceptions.ValidationError({"state": [f"unknown state {unknown[0]!r}"]})
            commands = commands.filter(state__in=states)
        return commands


class NodeBootstrapToken(APIView):
    """Approve re-registering this node: a single-use bootstrap token that registers only its hostname.

    Whoever registers with it replaces the node's agent (its agent tokens are revoked), so it needs
    the drain capability and is audited; the raw token is in this answer only.
    """

    required = roles.DRAIN

    @extend_schema(request=BootstrapTokenRequestSerializer, responses={201: BootstrapTokenSerializer})
    def post(self, request, pk):
        node = get_object_or_404(Node, pk=pk)
        body = BootstrapTokenRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        name = f"re-register {node.hostname} {timezone.now():%Y%m%dT%H%M%S}"[:100]
        token, raw = services.issue_bootstrap_token(name=name, node=node, actor=actor_label(request),
                                                    reason=body.validated_data["reason"])
        issued = {"token": raw, "name": token.name, "hostname": token.hostname, "node_id": node.pk,
                  "expires_at": token.expires_at}
        return Response(BootstrapTokenSerializer(issued).data, status=status.HTTP_201_CREATED)


# --- what the node agent calls ---------------------------------------------------------------------

class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The request body is too large."
    default_code = "too-large"


def check_body_size(request) -> None:
    """Refuse a body over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` with a clear 413 before anything reads it
    (Django would raise ``RequestDataTooBig`` inside DRF's parser, which surfaces as a 500)."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise exceptions.ParseError("Content-Length is not a number.") from None
    if declared > limit:
        raise PayloadTooLarge(f"The body is {declared} bytes; at most {limit} are accepted. Send smaller batches.")


class WireErrors:
    """A ``ProtocolError`` raised past ``parse_wire`` (event details, numbers too large for a
    column) is a 400 naming the field, like every other malformed message."""

    def handle_exception(self, exc):
        if isinstance(exc, ProtocolError):
            exc = exceptions.ValidationError({exc.field or "body": [exc.reason]})
        return super().handle_exception(exc)


class AgentEndpoint(WireErrors, APIView):
    """Agent capability, the token's own node (``node_id`` in the URL), a bounded body."""

    required = roles.AGENT
    throttle_classes = [AgentThrottle]

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        node = calling_node(request)
        if node is None or node.pk != kwargs["node_id"]:
            acts_for = f"node {node.pk}" if node is not None else "no node"
            raise exceptions.PermissionDenied(f"This token acts for {acts_for}, not node {kwargs['node_id']}.")
        request.node = node
        check_body_size(request)


class AgentRegister(WireErrors, APIView):
    """A new agent trades a one-time bootstrap token (in the body) for its node token."""

    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]
    throttle_classes = [RegisterThrottle]

    def get_authenticate_header(self, request):
        # Without this DRF would answer a refused token with 403; a 401 needs a challenge.
        return 'Bearer realm="agent-registration"'

    @extend_schema(request=protocol_schema(wire.Register),
                   responses={201: protocol_schema(wire.RegisterResponse), 401: None, 403: None},
                   description="Body: agents.protocol.agent.Register; answers RegisterResponse.")
    def post(self, request):
        check_body_size(request)
        message = parse_wire(wire.Register, request)
        try:
            registration = services.register_agent(message)
        except services.RegistrationRefused as exc:
            if exc.status == 401:
                raise exceptions.AuthenticationFailed(str(exc)) from exc
            raise exceptions.PermissionDenied(str(exc)) from exc
        return Response(dump(registration.response), status=status.HTTP_201_CREATED)


class AgentHeartbeat(AgentEndpoint):
    @extend_schema(request=protocol_schema(wire.Heartbeat), responses={200: protocol_schema(wire.HeartbeatResponse)},
                   description="Body: agents.protocol.agent.Heartbeat; answers HeartbeatResponse (open commands).")
    def post(self, request, node_id):
        beat = parse_wire(wire.Heartbeat, request)
        if beat.node_id != str(node_id):
            raise exceptions.ValidationError({"node_id": [f"the heartbeat is for node {beat.node_id!r}, "
                                                          f"the URL for node {node_id}"]})
        return Response(wire.compact(services.record_heartbeat(request.node, beat)))


class AgentTelemetry(AgentEndpoint):
    @extend_schema(request=protocol_schema(wire.TelemetryBatch), responses={202: None},
                   description="Body: agents.protocol.agent.TelemetryBatch; duplicates of (node, gpu, time) "
                               "are skipped.")
    def post(self, request, node_id):
        batch = parse_wire(wire.TelemetryBatch, request)
        expected = str(node_id)
        for i, sample in enumerate(batch.samples):
            if sample.node != expected:
                raise exceptions.ValidationError(
                    {f"samples.{i}.node": [f"the sample is of node {sample.node!r}, the URL is for node {node_id}"]})
        result = services.ingest_telemetry(request.node, batch)
        return Response({"accepted": result.accepted, "duplicates": result.duplicates},
                        status=status.HTTP_202_ACCEPTED)


class AgentEvents(AgentEndpoint):
    @extend_schema(request=protocol_schema(wire.EventBatch), responses={202: None},
                   description="Body: agents.protocol.agent.EventBatch; a key already stored is skipped. 403 "
                               "(nothing recorded) when an event names a generation not placed on this node.")
    def post(self, request, node_id):
        batch = parse_wire(wire.EventBatch, request)
        try:
            result = services.record_agent_events(request.node, wire.parse_event_details(batch))
        except ForeignGeneration as exc:
            raise exceptions.PermissionDenied(str(exc)) from exc
        return Response({"accepted": result.accepted, "duplicates": result.duplicates},
                        status=status.HTTP_202_ACCEPTED)


class AgentCommandAck(AgentEndpoint):
    @extend_schema(request=protocol_schema(wire.CommandAck),
                   responses={200: NodeCommandSerializer, 404: None, 409: None},
                   parameters=[OpenApiParameter("command_id", int, OpenApiParameter.PATH)],
                   description="Body: agents.protocol.agent.CommandAck. 409 when the command's generation is "
                               "no longer the job's, or the acknowledgement contradicts the command.")
    def post(self, request, node_id, command_id):
        ack = parse_wire(wire.CommandAck, request)
        if ack.command_id != str(command_id):
            raise exceptions.ValidationError({"command_id": [f"the acknowledgement is for command "
                                                             f"{ack.command_id!r}, the URL for {command_id}"]})
        try:
            command = services.ack_command(request.node, command_id, ack, actor=actor_label(request))
        except NodeCommand.DoesNotExist:
            raise exceptions.NotFound(f"Node {node_id} has no command {command_id}.") from None
        except (services.StaleCommand, services.AckMismatch) as exc:
            raise Conflict(str(exc)) from exc
        return Response(NodeCommandSerializer(command).data)


class AgentCommandWait(AgentEndpoint):
    """``GET nodes/<id>/commands/wait?timeout=S``: the agent's long poll (``nodes.services.wake``).

    Authorised like every agent call (an agent token of the node in the URL, its throttle); the
    wait itself is ``command_wait``, an async view, so that a waiting agent holds no thread. DRF
    has no async views: ``authorise`` runs this view's checks alone and answers their refusals. Not
    routed, so not in the OpenAPI schema: docs/api.md describes the endpoint."""

    DEFAULT_WAIT_S = 25.0

    @classmethod
    def authorise(cls, request, node_id: int) -> tuple[float | None, Response | None]:
        """(the wait asked for, None) or (None, the rendered refusal)."""
        view = cls()
        view.args, view.kwargs = (), {"node_id": node_id}
        drf_request = view.initialize_request(request, node_id=node_id)
        view.request, view.headers = drf_request, view.default_response_headers
        try:
            if request.method != "GET":
                raise exceptions.MethodNotAllowed(request.method)
            view.initial(drf_request, node_id=node_id)
            return cls._timeout(drf_request.query_params.get("timeout")), None
        except Exception as exc:
            response = view.finalize_response(drf_request, view.handle_exception(exc), node_id=node_id)
            return None, response.render()

    @classmethod
    def _timeout(cls, raw: str | None) -> float:
        if raw is None:
            return cls.DEFAULT_WAIT_S
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not 0 < value <= wake.MAX_WAIT_S:  # NaN fails too
            raise exceptions.ValidationError({"timeout": [f"must be a number of seconds above 0 and at most "
                                                          f"{wake.MAX_WAIT_S:g}, got {raw!r}"]})
        return value


async def command_wait(request, node_id: int):
    timeout_s, refused = await sync_to_async(AgentCommandWait.authorise)(request, node_id)
    if refused is not None:
        return refused
    assert timeout_s is not None
    release = getattr(request, "scope", {}).get(admission.RELEASE)  # ASGI only: see core.admission
    if release is not None:
        release()
    waiting = await wake.WATCH.wait(node_id, timeout_s)
    return JsonResponse(dump(wire.CommandWaitResponse(commands=waiting)))

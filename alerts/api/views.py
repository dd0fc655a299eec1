"""Alert endpoints: parse → authorise → call a service → render.

Channels are configuration that can reach outside (URLs, keys): reading them needs ``operate``
as well as changing them. The alert log and the efficiency figures of a job are ``view``.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Prefetch
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import generics, status
from rest_framework.response import Response
from rest_framework.views import APIView

from alerts import services
from alerts.api.serializers import (
    AlertSerializer,
    ChannelSerializer,
    EfficiencySerializer,
    EfficiencyTargetSerializer,
    TestSendQueuedSerializer,
)
from alerts.choices import Action
from alerts.models import Alert, Channel, Delivery
from core import roles
from core.auth import actor_label
from core.events import EventKind, record_event
from jobs import efficiency
from jobs.models import EfficiencyTarget, Job


def _audit(request, action: str, channel: Channel, **evidence) -> None:
    record_event(EventKind.ALERT_CHANNEL, actor=actor_label(request), new_state=action,
                 reason=f"alert channel {channel.name!r} {action}",
                 evidence={"channel": channel.pk, "name": channel.name, "kind": channel.kind, **evidence})


def channels_with_test_sends():
    """Channels with their jobs and their test-sends (at most ``services.TEST_SENDS_KEPT`` each)."""
    sends = Delivery.objects.filter(action=Action.TEST).order_by("-created_at", "-pk")
    return Channel.objects.prefetch_related("jobs", Prefetch("deliveries", queryset=sends, to_attr="test_sends"))


class ChannelListCreate(generics.ListCreateAPIView):
    """Alert channels. A webhook created without a secret gets one, returned once as ``generated_secret``."""

    required = roles.OPERATE
    serializer_class = ChannelSerializer

    def get_queryset(self):
        return channels_with_test_sends()

    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        with transaction.atomic():
            channel = serializer.save(created_by=actor_label(request))
            _audit(request, "created", channel, min_severity=channel.min_severity)
        body = dict(ChannelSerializer(channel).data)
        if generated := serializer.context.get("generated_secret"):
            body["generated_secret"] = generated
        return Response(body, status=status.HTTP_201_CREATED)


class ChannelDetail(generics.RetrieveUpdateDestroyAPIView):
    required = roles.OPERATE
    serializer_class = ChannelSerializer
    http_method_names = ["get", "patch", "delete", "head", "options"]

    def get_queryset(self):
        return channels_with_test_sends()

    def perform_update(self, serializer):
        with transaction.atomic():
            channel = serializer.save()
            changed = sorted(k if k != "secret" else "secret (not shown)" for k in serializer.validated_data)
            _audit(self.request, "updated", channel, fields=changed)

    def perform_destroy(self, channel):
        with transaction.atomic():
            _audit(self.request, "deleted", channel)
            channel.delete()


class ChannelTest(APIView):
    """Queue a test alert through the channel. The answer is the delivery record only; its outcome
    (a status code or an error class, never the receiver's answer) appears in ``test_sends``."""

    required = roles.OPERATE

    @extend_schema(request=None, responses={202: TestSendQueuedSerializer})
    def post(self, request, pk):
        channel = get_object_or_404(Channel, pk=pk)
        delivery = services.test_send(channel, actor=actor_label(request))
        return Response({"delivery": delivery.pk, "state": delivery.state}, status=status.HTTP_202_ACCEPTED)


class JobAlerts(generics.ListAPIView):
    """The job's alert log, newest first, each with its deliveries (attempts, errors)."""

    required = roles.VIEW
    serializer_class = AlertSerializer

    def get_queryset(self):
        job = get_object_or_404(Job, pk=self.kwargs["pk"])
        return Alert.objects.filter(job=job).prefetch_related("deliveries__channel")


class JobEfficiency(APIView):
    """MFU, GPU utilisation, downtime ratio and cost (so far, and wasted by badput kind)."""

    required = roles.VIEW

    @extend_schema(responses={200: EfficiencySerializer})
    def get(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        return Response(EfficiencySerializer(efficiency.snapshot(job)).data)


class JobEfficiencyTarget(APIView):
    """The job's expected MFU, alert margin and FLOPs-per-token override."""

    required = {"GET": roles.VIEW, "PUT": roles.OPERATE}

    @extend_schema(responses={200: EfficiencyTargetSerializer})
    def get(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        target = EfficiencyTarget.objects.filter(job=job).first() or EfficiencyTarget(job=job)
        return Response(EfficiencyTargetSerializer(target).data)

    @extend_schema(request=EfficiencyTargetSerializer, responses={200: EfficiencyTargetSerializer})
    def put(self, request, pk):
        job = get_object_or_404(Job, pk=pk)
        body = EfficiencyTargetSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        values = {name: body.validated_data.get(name) for name in ("expected_mfu", "mfu_margin", "flops_per_token")}
        with transaction.atomic():
            target, _ = EfficiencyTarget.objects.update_or_create(job=job, defaults=values)
            record_event(EventKind.JOB_EFFICIENCY_TARGET, actor=actor_label(request), job=job,
                         reason="efficiency target set", evidence=values)
        return Response(EfficiencyTargetSerializer(target).data)

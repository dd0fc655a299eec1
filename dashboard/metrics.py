"""Prometheus ``/metrics``: read from the database at scrape time, never kept in process memory.

A custom collector (``prometheus_client``) turns the rows into metric families when Prometheus
scrapes, so every web process answers the same numbers and nothing is lost on a restart.

Label sets are bounded: ``job`` is a job id, limited to jobs that are not finished or finished
within ``METRICS_FINISHED_JOBS_S`` (at most ``METRICS_MAX_JOBS`` of them); ``node`` is a
registered hostname, ``gpu`` an index; every other label is an enum (incident kind, decision,
health, checkpoint state). No request id, no free text (an incident's classification sentence,
a pause reason) ever becomes a label.

Access: a token (or session) holding the ``view`` capability, or a scraper whose address is in
``NIGHTWATCH["METRICS_NETWORKS"]``.
"""

from __future__ import annotations

import ipaddress
import time
from datetime import timedelta

from celery import current_app
from django.conf import settings
from django.db.models import Count, IntegerField, Max, Q, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import Cast
from django.http import HttpResponse, JsonResponse
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from rest_framework.authentication import SessionAuthentication
from rest_framework.exceptions import APIException
from rest_framework.request import Request

from checkpoints.choices import CheckpointState
from checkpoints.models import Checkpoint
from core import admission, degraded, outbox, roles, shared_counts
from core.auth import TokenAuthentication, capabilities, client_address
from core.events import EventKind
from core.models import Event
from core.problems import CONTENT_TYPE, problem
from jobs import efficiency, plausibility
from jobs.choices import Decision, IncidentKind, IncidentState, JobState
from jobs.goodput import goodput_of
from jobs.goodput_math import KINDS
from jobs.models import Incident, Job
from nodes.choices import Health, Schedulability
from nodes.models import GPU, Node
from nodes.services import overload, silence
from nodes.services.sweeper import BATCH_BUCKETS

METRICS_FINISHED_JOBS_S = 24 * 3600
METRICS_MAX_JOBS = 200
#: seconds; fault → detection is usually sub-second to tens of seconds, recovery seconds to minutes
DETECTION_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
RECOVERY_BUCKETS = (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
HISTOGRAM_WINDOW_DAYS = 30


def _histogram(name: str, documentation: str, buckets, values_by_kind: dict[str, list[float]]):
    family = HistogramMetricFamily(name, documentation, labels=["kind"], unit="seconds")
    for kind, values in sorted(values_by_kind.items()):
        cumulative, counts = 0, []
        for bound in buckets:
            cumulative = sum(1 for v in values if v <= bound)
            counts.append((str(float(bound)), cumulative))
        counts.append(("+Inf", len(values)))
        family.add_metric([kind], counts, sum_value=sum(values))
    return family


class NightwatchCollector:
    """One scrape = a handful of queries over jobs, incidents, nodes, GPUs and checkpoints."""

    def collect(self):
        started = time.monotonic()
        now = timezone.now()
        # Goodput is the expensive part of a job's figures: computed once, used by both families.
        jobs = self.reported_jobs(now)
        goodputs = {job.pk: goodput_of(job, now=now) for job in jobs}
        yield from self._jobs(jobs, goodputs)
        yield from self._efficiency(jobs, goodputs)
        yield from self._incidents(now)
        yield from self._refused_reports(jobs)
        yield from self._fleet(now)
        yield from self._checkpoints(now)
        yield from self._queues()
        yield from self._degraded()
        yield from self._overload()
        scrape = GaugeMetricFamily("nightwatch_scrape_duration_seconds", "Time this scrape spent reading the "
                                   "database.")
        scrape.add_metric([], time.monotonic() - started)
        yield scrape

    # --- jobs -------------------------------------------------------------------------------------
    @staticmethod
    def reported_jobs(now):
        recent = now - timedelta(seconds=METRICS_FINISHED_JOBS_S)
        return list(Job.objects.filter(~Q(state__in=JobState.TERMINAL) | Q(state_changed_at__gte=recent))
                    .order_by("-created_at")[:METRICS_MAX_JOBS])

    def _jobs(self, reported, goodputs):
        by_state = dict(Job.objects.values_list("state").annotate(n=Count("pk")))
        jobs = GaugeMetricFamily("nightwatch_jobs", "Jobs by state.", labels=["state"])
        for state in JobState.values:
            jobs.add_metric([state], by_state.get(state, 0))
        yield jobs

        ettr = GaugeMetricFamily("nightwatch_job_ettr_ratio", "Effective training time ratio: productive time / "
                                 "wall time.", labels=["job"])
        wall = GaugeMetricFamily("nightwatch_job_wall_seconds", "Wall time since the first launch.", labels=["job"])
        productive = GaugeMetricFamily("nightwatch_job_productive_seconds", "Productive training time.",
                                       labels=["job"])
        badput = GaugeMetricFamily("nightwatch_job_badput_seconds", "Wall time lost, by kind.",
                                   labels=["job", "kind"])
        restarts = CounterMetricFamily("nightwatch_job_restarts", "Automatic and approved restarts of the job.",
                                       labels=["job"])
        step = GaugeMetricFamily("nightwatch_job_last_step", "The newest step reported by the job.", labels=["job"])
        state = GaugeMetricFamily("nightwatch_job_state", "1 for the job's current state.", labels=["job", "state"])
        for job in reported:
            label = str(job.pk)
            result = goodputs[job.pk]
            ettr.add_metric([label], result.ettr)
            wall.add_metric([label], result.wall_s)
            productive.add_metric([label], result.productive_s)
            for kind in KINDS:
                badput.add_metric([label, kind], result.badput_s.get(kind, 0.0))
            restarts.add_metric([label], job.restart_count)
            if job.last_step is not None:
                step.add_metric([label], job.last_step)
            state.add_metric([label, job.state], 1)
        yield from (ettr, wall, productive, badput, restarts, step, state)

    def _efficiency(self, reported, goodputs):
        """MFU, throughput, downtime and cost of the jobs still running (``jobs.efficiency``): a
        finished job's figures no longer change, and the API keeps them."""
        mfu = GaugeMetricFamily("nightwatch_job_mfu_ratio", "Model FLOPs utilisation: achieved / peak FLOPs of "
                                "the job's accelerators.", labels=["job"])
        tokens = GaugeMetricFamily("nightwatch_job_tokens_per_second", "Training throughput.", labels=["job"])
        downtime = GaugeMetricFamily("nightwatch_job_downtime_ratio", "Detection, restart and paused time / wall "
                                     "time.", labels=["job"])
        cost = GaugeMetricFamily("nightwatch_job_cost", "Cost so far (GPU-hours × the node pool's price, in "
                                 f"{settings.NIGHTWATCH['EFFICIENCY']['CURRENCY']}).", labels=["job"])
        wasted = GaugeMetricFamily("nightwatch_job_cost_wasted", "Cost of the wall time lost, by badput kind.",
                                   labels=["job", "kind"])
        for job in reported:
            if job.state in JobState.TERMINAL:
                continue
            label, figures = str(job.pk), efficiency.snapshot(job, goodputs[job.pk])
            for family, value in ((mfu, figures["mfu"]), (tokens, figures["tokens_per_s"]),
                                  (downtime, figures["downtime_ratio"]), (cost, figures["cost"]["total"])):
                if value is not None:
                    family.add_metric([label], value)
            for kind, value in sorted(figures["cost"]["wasted"].items()):
                wasted.add_metric([label, kind], value)
        yield from (mfu, tokens, downtime, cost, wasted)

    # --- incidents --------------------------------------------------------------------------------
    @staticmethod
    def _refused_reports(reported):
        """Step reports refused as implausible (``jobs.plausibility``), from the job.reports_refused events."""
        rows = (Event.objects.filter(kind=EventKind.JOB_REPORTS_REFUSED, job__in=[j.pk for j in reported])
                .annotate(refused_for=KT("evidence__reason"))
                .values_list("job_id", "refused_for")
                .annotate(n=Sum(Cast(KT("evidence__records"), IntegerField()))))
        counts = {(job_id, reason): n or 0 for job_id, reason, n in rows}
        refused = CounterMetricFamily("nightwatch_job_reports_refused", "Step reports refused as implausible for "
                                      "the job (HTTP 422), by kind of implausibility.", labels=["job", "kind"])
        for job in reported:
            for reason in plausibility.REASONS:
                refused.add_metric([str(job.pk), reason], counts.get((job.pk, reason), 0))
        yield refused

    def _incidents(self, now):
        counts = {(k, d): n for k, d, n in Incident.objects.values_list("kind", "decision").annotate(n=Count("pk"))}
        total = CounterMetricFamily("nightwatch_incidents", "Incidents by kind (classification) and decision.",
                                    labels=["kind", "decision"])
        for kind in IncidentKind.values:
            for decision in [*Decision.values, ""]:  # "" while the decision is still being made
                total.add_metric([kind, decision or "none"], counts.get((kind, decision), 0))
        yield total

        open_by_kind = dict(Incident.objects.filter(state=IncidentState.OPEN).values_list("kind")
                            .annotate(n=Count("pk")))
        open_now = GaugeMetricFamily("nightwatch_incidents_open", "Incidents not yet resolved.", labels=["kind"])
        for kind in IncidentKind.values:
            open_now.add_metric([kind], open_by_kind.get(kind, 0))
        yield open_now

        since = now - timedelta(days=HISTOGRAM_WINDOW_DAYS)
        detection: dict[str, list[float]] = {}
        recovery: dict[str, list[float]] = {}
        rows = Incident.objects.filter(detected_at__gte=since).values_list("kind", "fault_at", "detected_at",
                                                                           "first_step_at")
        for kind, fault_at, detected_at, first_step_at in rows:
            if fault_at is not None and detected_at >= fault_at:
                detection.setdefault(kind, []).append((detected_at - fault_at).total_seconds())
            if first_step_at is not None and first_step_at >= detected_at:
                recovery.setdefault(kind, []).append((first_step_at - detected_at).total_seconds())
        yield _histogram("nightwatch_incident_detection", f"Fault to detection, incidents of the last "
                         f"{HISTOGRAM_WINDOW_DAYS} days.", DETECTION_BUCKETS, detection)
        yield _histogram("nightwatch_incident_recovery", f"Detection to the first step of the resumed generation, "
                         f"incidents of the last {HISTOGRAM_WINDOW_DAYS} days.", RECOVERY_BUCKETS, recovery)

    # --- nodes and GPUs -----------------------------------------------------------------------------
    def _fleet(self, now):
        health = GaugeMetricFamily("nightwatch_node_health", "1 for the node's current health.",
                                   labels=["node", "health"])
        schedulable = GaugeMetricFamily("nightwatch_node_schedulable", "1 if new generations may be placed on "
                                        "the node.", labels=["node"])
        heartbeat = GaugeMetricFamily("nightwatch_node_heartbeat_age_seconds", "Seconds since the agent's last "
                                      "heartbeat.", labels=["node"])
        spooled = GaugeMetricFamily("nightwatch_node_spooled_records", "Records waiting in the agent's disk spool.",
                                    labels=["node"])
        for node in Node.objects.order_by("hostname"):
            for value in Health.values:
                health.add_metric([node.hostname, value], 1 if node.health == value else 0)
            schedulable.add_metric([node.hostname], 1 if node.schedulability == Schedulability.ACTIVE else 0)
            if node.last_heartbeat_at is not None:
                heartbeat.add_metric([node.hostname], max(0.0, (now - node.last_heartbeat_at).total_seconds()))
            spooled.add_metric([node.hostname], node.spooled)
        yield from (health, schedulable, heartbeat, spooled)

        gauges = {
            "temperature_c": GaugeMetricFamily("nightwatch_gpu_temperature_celsius", "GPU temperature.",
                                               labels=["node", "gpu"]),
            "xid_recent": GaugeMetricFamily("nightwatch_gpu_xid_recent", "Xid errors within the agent's window.",
                                            labels=["node", "gpu"]),
            "ecc_uncorrected_recent": GaugeMetricFamily("nightwatch_gpu_ecc_uncorrected_recent", "Uncorrected ECC "
                                                        "errors within the agent's window.", labels=["node", "gpu"]),
            "ecc_corrected_recent": GaugeMetricFamily("nightwatch_gpu_ecc_corrected_recent", "Corrected ECC errors "
                                                      "within the agent's window.", labels=["node", "gpu"]),
            "utilization_pct": GaugeMetricFamily("nightwatch_gpu_utilization_percent", "GPU utilisation.",
                                                 labels=["node", "gpu"]),
        }
        healthy = GaugeMetricFamily("nightwatch_gpu_healthy", "1 if the GPU's health is healthy.",
                                    labels=["node", "gpu"])
        for gpu in GPU.objects.select_related("node").order_by("node__hostname", "index"):
            labels = [gpu.node.hostname, str(gpu.index)]
            healthy.add_metric(labels, 1 if gpu.health == Health.HEALTHY else 0)
            sample = gpu.last_sample or {}
            for key, family in gauges.items():
                value = sample.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    family.add_metric(labels, value)
        yield healthy
        yield from gauges.values()

    # --- checkpoints ------------------------------------------------------------------------------
    def _checkpoints(self, now):
        by_state = dict(Checkpoint.objects.values_list("state").annotate(n=Count("pk")))
        total = GaugeMetricFamily("nightwatch_checkpoints", "Checkpoints by state.", labels=["state"])
        for state in CheckpointState.values:
            total.add_metric([state], by_state.get(state, 0))
        yield total

        jobs = [job.pk for job in self.reported_jobs(now)]
        newest = dict(Checkpoint.objects.filter(job_id__in=jobs, state=CheckpointState.VERIFIED)
                      .values_list("job_id").annotate(at=Max("created_at")))
        corrupt = dict(Checkpoint.objects.filter(job_id__in=jobs, state=CheckpointState.CORRUPT)
                       .values_list("job_id").annotate(n=Count("pk")))
        age = GaugeMetricFamily("nightwatch_checkpoint_age_seconds", "Age of the job's newest verified checkpoint.",
                                labels=["job"])
        failures = CounterMetricFamily("nightwatch_checkpoint_verification_failures", "Checkpoints of the job "
                                       "that failed verification.", labels=["job"])
        for job in jobs:
            if job in newest:
                age.add_metric([str(job)], max(0.0, (now - newest[job]).total_seconds()))
            failures.add_metric([str(job)], corrupt.get(job, 0))
        yield from (age, failures)

    # --- queues -----------------------------------------------------------------------------------
    def _queues(self):
        """Celery queue lengths; only with Redis (the embedded filesystem broker has no cheap count)."""
        if not settings.REDIS_URL:
            return
        # Only a Redis deployment reaches here: the embedded broker's processes never load the client.
        import redis

        depth = GaugeMetricFamily("nightwatch_queue_length", "Messages waiting in the Celery queue.",
                                  labels=["queue"])
        up = GaugeMetricFamily("nightwatch_broker_up", "1 if the broker answered this scrape.")
        try:
            client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
            for queue in _queue_names():
                depth.add_metric([queue], client.llen(queue))
            up.add_metric([], 1)
        except redis.RedisError:
            up.add_metric([], 0)
        yield up
        yield depth

    # --- without Redis ------------------------------------------------------------------------------
    @staticmethod
    def _degraded():
        """What went without Redis (core.degraded: this process's own counts) and what still waits
        for the broker (core.outbox: every process's, in the database)."""
        fallbacks = CounterMetricFamily("nightwatch_redis_fallbacks", "Times this process went without Redis "
                                        "(a rate-limit count kept locally, a Celery message held in the outbox, "
                                        "a push or relay turn deferred), by component.", labels=["component"])
        for component, n in sorted(degraded.counts().items()):
            fallbacks.add_metric([component], n)
        held = GaugeMetricFamily("nightwatch_outbox_messages", "Celery messages held in the database until the "
                                 "broker takes them.")
        held.add_metric([], outbox.held())
        yield from (fallbacks, held)

    # --- overload ---------------------------------------------------------------------------------
    def _overload(self):
        """The sweepers' holds (two indexed queries), and what every web process refused and the
        sweeper expired (``core.shared_counts``: only with Redis)."""
        for name, documentation, holding in (
                ("nightwatch_overloaded", "1 while the control plane is overloaded (fleet.overload events): "
                 "callers it refused are spared one by one.", overload.overloaded()),
                ("nightwatch_overload_hold", "1 while the heartbeat and progress sweeps hold because heartbeats "
                 "were answered late (fleet.overload events).", overload.holding()),
                ("nightwatch_fleet_silence_hold", "1 while the heartbeat and progress sweeps hold because the "
                 "whole fleet went silent at once (fleet.silence events).", silence.held())):
            gauge = GaugeMetricFamily(name, documentation)
            gauge.add_metric([], 1 if holding else 0)
            yield gauge
        counts = shared_counts.totals()
        if counts is None:
            return
        refused = CounterMetricFamily("nightwatch_admission_refused", "Requests admission control answered with "
                                      "503, every web process together, by class (urgent: the agents' events; "
                                      "priority: heartbeats and registration).", labels=["class"])
        for kind in admission.REFUSABLE:
            refused.add_metric([kind], counts.get(f"refused:{kind}", 0))
        abandoned = CounterMetricFamily("nightwatch_admission_abandoned", "Requests of agents and of rank 0's "
                                        "reporters that admission control let in and whose callers gave up before "
                                        "they were answered (their timeouts ran out in the queue), by class.",
                                        labels=["class"])
        for kind in admission.REFUSABLE:
            abandoned.add_metric([kind], counts.get(f"abandoned:{kind}", 0))
        late = CounterMetricFamily("nightwatch_admission_late_heartbeats", "Heartbeats and registrations answered "
                                   "OVERLOAD_HEARTBEAT_LAG_S or more after they arrived.")
        late.add_metric([], counts.get("late:priority", 0))
        spared = CounterMetricFamily("nightwatch_heartbeat_expiry_spared_nodes", "Nodes past their heartbeat "
                                     "deadline that the sweeper spared because admission control had refused "
                                     "their heartbeats (alive, and our fault).")
        spared.add_metric([], counts.get("expiry:spared", 0))
        batches = HistogramMetricFamily("nightwatch_heartbeat_expiry_batch_nodes", "Nodes each heartbeat sweep "
                                        "marked unreachable (sweeps that expired none are not counted).")
        cumulative, buckets = 0, []
        for bound in BATCH_BUCKETS:
            cumulative += counts.get(f"expiry:le:{bound}", 0)
            buckets.append((str(float(bound)), cumulative))
        buckets.append(("+Inf", cumulative + counts.get("expiry:le:+Inf", 0)))
        batches.add_metric([], buckets, sum_value=counts.get("expiry:nodes", 0))
        yield from (refused, abandoned, late, spared, batches)


def _queue_names() -> list[str]:
    # The project's Celery app (controlplane.celery) is the current one; the dashboard sits below
    # controlplane, so it asks Celery rather than importing it.
    conf = current_app.conf
    names = {conf.task_default_queue or "celery"}
    for route in (conf.task_routes or {}).values() if isinstance(conf.task_routes, dict) else []:
        if isinstance(route, dict) and route.get("queue"):
            names.add(route["queue"])
    return sorted(names)


def render() -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NightwatchCollector())
    return generate_latest(registry)


def _network_allowed(request) -> bool:
    networks = settings.NIGHTWATCH.get("METRICS_NETWORKS") or []
    if not networks:
        return False
    try:
        # The client, not the TLS proxy in front: the proxy's own network may well be listed.
        address = ipaddress.ip_address(client_address(request) or "")
    except ValueError:
        return False
    return any(address in ipaddress.ip_network(net, strict=False) for net in networks)


def metrics_view(request):
    """``GET /metrics``: Prometheus text format for a caller holding ``view``, or from an allowed network."""
    if request.method != "GET":
        body = problem(405, "Method Not Allowed", "Use GET.", code="method_not_allowed", instance=request.path)
        return JsonResponse(body, status=405, content_type=CONTENT_TYPE, headers={"Allow": "GET"})
    if not _network_allowed(request):
        drf_request = Request(request, authenticators=[TokenAuthentication(), SessionAuthentication()])
        try:
            held = capabilities(drf_request) if drf_request.user is not None else set()
        except APIException as exc:
            body = problem(exc.status_code, "Unauthorized" if exc.status_code == 401 else "Too Many Requests",
                           str(exc.detail), code=str(exc.default_code), instance=request.path)
            return JsonResponse(body, status=exc.status_code, content_type=CONTENT_TYPE,
                                headers={"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else {})
        if roles.VIEW not in held:
            authenticated = drf_request.auth is not None or drf_request.user.is_authenticated
            status = 403 if authenticated else 401
            detail = ("Scraping needs the 'view' capability, which your credentials do not grant." if authenticated
                      else "Send a bearer token with the view capability, or scrape from an allowed network.")
            body = problem(status, "Forbidden" if authenticated else "Unauthorized", detail,
                           code="permission_denied" if authenticated else "not_authenticated", instance=request.path)
            return JsonResponse(body, status=status, content_type=CONTENT_TYPE,
                                headers={} if authenticated else {"WWW-Authenticate": "Bearer"})
    return HttpResponse(render(), content_type=CONTENT_TYPE_LATEST)

"""The dashboard's pages and its action endpoints.

Pages render every section with the same templates the live updates use (``dashboard.sections``).
Actions parse → authorise by capability (``core.roles``) → call the same service the API
calls → answer JSON; the service writes the audit row (``jobs.models.Event``) and the relay pushes
the result to every open page. Errors are RFC 9457 problem details, like the API's.
"""

from __future__ import annotations

import functools
from http import HTTPStatus

from django.contrib.auth.decorators import login_required
from django.db import transaction
from django.http import HttpResponseForbidden, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_POST

from agents.protocol.hooks import PHASES
from checkpoints.models import Checkpoint
from checkpoints.services import CheckpointError
from core import roles
from core.api import parse_int
from core.auth import actor_label
from core.problems import CONTENT_TYPE, problem
from dashboard import fleet, node_page, queries, sections
from dashboard.relay import RELAY
from jobs import fit
from jobs import services as job_services
from jobs.models import Job
from jobs.state import TransitionError
from nodes import services as node_services
from nodes.choices import Health, Schedulability
from nodes.models import Node

REASON_MAX = 500


class ActionRefused(Exception):
    def __init__(self, status: int, code: str, detail: str):
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


def _problem(request, status: int, code: str, detail: str) -> JsonResponse:
    body = problem(status, HTTPStatus(status).phrase, detail, code=code, instance=request.path)
    return JsonResponse(body, status=status, content_type=CONTENT_TYPE)


# --- pages ----------------------------------------------------------------------------------------

def _page(request, page: str, template: str, on: sections.Subject | None = None, **extra):
    caps = sections.capabilities_of(request.user)
    if roles.VIEW not in caps:
        return HttpResponseForbidden("Your role does not include viewing the dashboard.")
    on = on or sections.Subject()
    html = sections.render(page, None, caps, on)
    return render(request, template, {"html": html, "page": page, "job": on.job, "node": on.node,
                                      "can": sections.can(caps), **extra})


@login_required
def overview(request):
    return _page(request, "overview", "dashboard/overview.html")


@login_required
def job_detail(request, pk: int):
    return _page(request, "job", "dashboard/job.html", sections.Subject(job=get_object_or_404(Job, pk=pk)))


@login_required
def job_node(request, pk: int, node: int):
    """A node of a job's active generation, window by window (opened from the skew view)."""
    caps = sections.capabilities_of(request.user)
    if roles.VIEW not in caps:
        return HttpResponseForbidden("Your role does not include viewing the dashboard.")
    job = get_object_or_404(Job, pk=pk)
    windows = queries.node_windows(job, node)
    return render(request, "dashboard/job_node.html", {"job": job, "node": node, "windows": windows,
                                                        "phases": PHASES, "can": sections.can(caps)})


@login_required
def job_timeline(request, pk: int):
    """Older pages of a job's timeline (the job page shows the newest, live)."""
    caps = sections.capabilities_of(request.user)
    if roles.VIEW not in caps:
        return HttpResponseForbidden("Your role does not include viewing the dashboard.")
    job = get_object_or_404(Job, pk=pk)
    before = parse_int(request.GET.get("before", ""))  # nonsense: the newest page
    return render(request, "dashboard/job_timeline.html", {"job": job, **queries.timeline(job, before)})


@login_required
def nodes(request):
    flt = fleet.NodeFilter.parse(request.GET)
    return _page(request, "nodes", "dashboard/nodes.html", sections.Subject(filter=flt), filter=flt,
                 query=flt.query(), healths=Health.values, schedulabilities=Schedulability.values)


@login_required
def node_detail(request, pk: int):
    node = get_object_or_404(Node, pk=pk)
    range_name = request.GET.get("range", "hour")
    if range_name not in node_page.RANGES:
        range_name = "hour"
    return _page(request, "node", "dashboard/node.html", sections.Subject(node=node), range=range_name,
                 ranges=list(node_page.RANGES), series=node_page.series(node, range_name))


# --- actions --------------------------------------------------------------------------------------

def action(capability: str):
    """POST only, CSRF-checked (Django's middleware), signed in, holding ``capability``, with a
    reason; the view's ``TransitionError`` becomes a 409 and its message the problem's detail."""

    def decorate(view):
        @require_POST
        @functools.wraps(view)
        def wrapper(request, *args, **kwargs):
            if not request.user.is_authenticated:
                return _problem(request, 401, "not_authenticated", "Sign in first.")
            if capability not in sections.capabilities_of(request.user):
                return _problem(request, 403, "permission_denied",
                                f"This action needs the '{capability}' capability, which your role does not grant.")
            reason = (request.POST.get("reason") or "").strip()
            if not reason:
                return _problem(request, 400, "invalid", "reason: say why (it goes into the audit log).")
            if "\x00" in reason:  # PostgreSQL text cannot hold it: a 400 here, not a 500 in the audit row
                return _problem(request, 400, "invalid", "reason: may not contain NUL characters.")
            if len(reason) > REASON_MAX:
                return _problem(request, 400, "invalid", f"reason: at most {REASON_MAX} characters.")
            try:
                message = view(request, *args, reason=reason, actor=actor_label(request), **kwargs)
            except ActionRefused as refused:
                return _problem(request, refused.status, refused.code, refused.detail)
            except (TransitionError, CheckpointError) as exc:
                return _problem(request, exc.http_status, "conflict", str(exc))
            transaction.on_commit(RELAY.poke)  # the services committed: push now, not at the next turn
            return JsonResponse({"ok": True, "message": message})

        return wrapper

    return decorate


@action(roles.APPROVE)
def approve_resume(request, pk: int, *, reason: str, actor: str) -> str:
    job = get_object_or_404(Job, pk=pk)
    generation = job_services.approve_resume(job, actor=actor, reason=reason, force=request.POST.get("force") == "1")
    return f"{job.name}: resume approved, generation {generation.number} launching"


@action(roles.OPERATE)
def pause(request, pk: int, *, reason: str, actor: str) -> str:
    job = job_services.pause_job(get_object_or_404(Job, pk=pk), actor=actor, reason=reason)
    return f"{job.name}: pausing (checkpoint, then stop)"


@action(roles.OPERATE)
def checkpoint_now(request, pk: int, *, reason: str, actor: str) -> str:
    job = job_services.request_checkpoint(get_object_or_404(Job, pk=pk), actor=actor, reason=reason)
    return f"{job.name}: checkpoint requested; the hooks take it at the next step"


#: The bounds of a world size, as the API's (``jobs.api.serializers.ResizeSerializer``).
SIZE_BOUNDS = {"nnodes": 4096, "nproc_per_node": 64}


@action(roles.OPERATE)
def resize(request, pk: int, *, reason: str, actor: str) -> str:
    job = get_object_or_404(Job, pk=pk)
    size = {}
    for name, most in SIZE_BOUNDS.items():
        value = parse_int(request.POST.get(name, ""))
        if value is None or not 1 <= value <= most:
            raise ActionRefused(400, "invalid", f"{name}: a whole number from 1 to {most}.")
        size[name] = value
    if (size["nnodes"], size["nproc_per_node"]) == (job.nnodes, job.nproc_per_node) and not job.resize_to:
        raise ActionRefused(400, "invalid", f"nnodes: job {job.pk} already runs on {job.nnodes} node(s) × "
                                            f"{job.nproc_per_node} process(es).")
    if never := fit.refusal({**size, "accelerator": job.accelerator, "recovery_policy": job.recovery_policy}):
        raise ActionRefused(422, "unprocessable", " ".join(f"{k}: {v}" for k, v in never.items()))
    job = job_services.resize_job(job, **size, actor=actor, reason=reason)
    then = "pausing at a checkpoint, then resuming on it" if job.state != "paused" else "the next resume takes it"
    return f"{job.name}: resize to {size['nnodes']} node(s) × {size['nproc_per_node']} process(es); {then}"


@action(roles.OPERATE)
def rollback(request, pk: int, *, reason: str, actor: str) -> str:
    job = get_object_or_404(Job, pk=pk)
    raw = request.POST.get("checkpoint", "")
    number = parse_int(raw)
    checkpoint = Checkpoint.objects.filter(pk=number, job=job).first() if number is not None and number > 0 else None
    if checkpoint is None:
        raise ActionRefused(400, "invalid", f"checkpoint: job {job.pk} has no checkpoint {raw!r}.")
    generation = job_services.rollback_to(job, checkpoint, actor=actor, reason=reason,
                                          force=request.POST.get("force") == "1")
    return f"{job.name}: rolled back to step {checkpoint.step}; generation {generation.number} starts a new branch"


@action(roles.DRAIN)
def drain(request, pk: int, *, reason: str, actor: str) -> str:
    node = get_object_or_404(Node, pk=pk)
    if not node_services.drain_node(node, actor=actor, reason=reason):
        raise ActionRefused(409, "conflict", f"{node.hostname} is already {node.schedulability}.")
    return f"{node.hostname}: {node.schedulability}"


@action(roles.DRAIN)
def undrain(request, pk: int, *, reason: str, actor: str) -> str:
    node = get_object_or_404(Node, pk=pk)
    if not node_services.undrain_node(node, actor=actor, reason=reason):
        raise ActionRefused(409, "conflict", f"{node.hostname} is not drained.")
    if warning := node_services.lemon_warning(node):
        return f"{node.hostname}: undrained, but {warning}"
    return f"{node.hostname}: back in scheduling"


@action(roles.DRAIN)
def clear_lemon(request, pk: int, *, reason: str, actor: str) -> str:
    node = get_object_or_404(Node, pk=pk)
    if not (cleared := node_services.clear_lemon(node, actor=actor, reason=reason)):
        raise ActionRefused(409, "conflict", f"{node.hostname} has no lemon count to clear.")
    return f"{node.hostname}: lemon count {cleared} cleared" + (
        "; placement may pick it again" if node.schedulability == "active" else f"; it is still {node.schedulability}")

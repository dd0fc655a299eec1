"""Who may speak on the training hooks' endpoints (reports, control, checkpoint commits)."""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import PermissionDenied, ValidationError

from core.api import parse_wire
from core.models import ApiToken, Scope
from jobs.models import Generation, Job


def require_hooks_caller(request, job, generation: int | None = None) -> None:
    """Whether the caller may speak for ``generation`` of ``job`` on the training hooks' endpoints
    (without ``generation``: for some generation of ``job``, checked before the body is read).

    A job token speaks only for its own job and generation; an agent token only for a generation
    placed on its node. Anything else is a 403, before the body is acted on. (A job token of an
    older generation, not yet revoked, meets the fencing rule next: 409 stale.)
    """
    token = request.auth if isinstance(request.auth, ApiToken) else None
    if token is not None and token.scope == Scope.JOB:
        if token.job_id != job.pk:
            raise PermissionDenied(f"This token speaks for job {token.job_id} only, not job {job.pk}.")
        if generation is not None and token.generation != generation:
            raise PermissionDenied(f"This token speaks for generation {token.generation} of job {job.pk} only, "
                                   f"not generation {generation}.")
        return
    node = token.node if token is not None and token.scope == Scope.AGENT else None
    placed = Generation.objects.filter(job=job, nodes=node) if node is not None else Generation.objects.none()
    if generation is not None:
        placed = placed.filter(number=generation)
    if not placed.exists():
        which = "any generation" if generation is None else f"generation {generation}"
        raise PermissionDenied(f"This token speaks neither for {which} of job {job.pk} nor for a node it is "
                               f"placed on.")


def hooks_message(request, job: Job, message_class: type, what: str) -> Any:
    """The body of a hooks' POST about ``job`` (``what``: "batch", "commit"), read only once the
    caller may speak for the job, and kept only if it names that job and a generation the caller
    may speak for."""
    require_hooks_caller(request, job)
    message = parse_wire(message_class, request)
    if message.job != str(job.pk):
        raise ValidationError({"job": [f"the {what} is for job {message.job!r}, the URL for job {job.pk}"]})
    require_hooks_caller(request, job, message.generation)
    return message

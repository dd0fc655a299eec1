"""The three human roles and what each may do.

``viewer`` reads everything; ``operator`` also launches, cancels, pauses, rolls back and drains;
``oncall`` also approves a resume after the circuit breaker opened. Roles are Django groups whose
permissions are kept in sync after every migrate, so a deployment never drifts from this table.
"""

from __future__ import annotations

from django.contrib.auth.models import Group, Permission
from django.db.models import Q

VIEW = "view"
LAUNCH = "launch"
OPERATE = "operate"
DRAIN = "drain"
APPROVE = "approve"
AGENT = "agent"
REGISTER = "register"
#: The training hooks' endpoints (reports, control, checkpoint commits), further bounded per
#: request to the caller's own generation (``jobs.api.access.require_hooks_caller``).
HOOKS = "hooks"

#: capability -> the Django permission a person needs for it
CAPABILITY_PERMISSIONS = {
    VIEW: "jobs.view_job",
    LAUNCH: "jobs.add_job",
    OPERATE: "jobs.operate_job",
    DRAIN: "nodes.drain_node",
    APPROVE: "jobs.approve_resume",
}

_VIEW_PERMS = [
    "jobs.view_job", "jobs.view_generation", "jobs.view_incident", "core.view_event",
    "nodes.view_node", "nodes.view_gpu", "checkpoints.view_checkpoint",
]
ROLE_PERMISSIONS = {
    "viewer": _VIEW_PERMS,
    "operator": [*_VIEW_PERMS, "jobs.add_job", "jobs.operate_job", "nodes.drain_node"],
    "oncall": [*_VIEW_PERMS, "jobs.add_job", "jobs.operate_job", "nodes.drain_node", "jobs.approve_resume"],
}

#: token scope -> the capabilities it can carry (further bounded by the owner's role)
SCOPE_CAPABILITIES = {
    "viewer": {VIEW},
    "ci": {VIEW, LAUNCH},
    "operator": {VIEW, LAUNCH, OPERATE, DRAIN},
    "oncall": {VIEW, LAUNCH, OPERATE, DRAIN, APPROVE},
    "agent": {AGENT, HOOKS},
    "bootstrap": {REGISTER},
    "job": {HOOKS},
}


def ensure_roles(sender=None, **kwargs) -> None:
    """Create or update the role groups (idempotent; runs after every ``migrate``)."""
    for role, perms in ROLE_PERMISSIONS.items():
        query = Q(pk__in=[])
        for perm in perms:
            app_label, codename = perm.split(".")
            query |= Q(content_type__app_label=app_label, codename=codename)
        found = list(Permission.objects.filter(query))
        if len(found) < len(perms):
            return  # not every app is migrated yet; the last post_migrate call completes it
        group, _ = Group.objects.get_or_create(name=role)
        group.permissions.set(found)

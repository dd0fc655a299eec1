"""The dashboard's pages as named sections, rendered by the same templates on the first page load,
in the snapshot of every WebSocket (re)connect, and whenever the relay says a section changed.

A section is rendered for one person: action buttons appear only for the capabilities their
role grants (``core.roles``), so a viewer's page has no buttons at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from django.template.loader import render_to_string

from core import roles
from dashboard import fleet, queries
from jobs.models import Job


@dataclass(frozen=True)
class Section:
    """A template and its context, from the page's job (job pages) or node filter (the nodes page)."""

    template: str
    context: Callable[[Job | None, fleet.NodeFilter], dict]


PAGES: dict[str, dict[str, Section]] = {
    "overview": {
        "jobs": Section("dashboard/sections/jobs.html", lambda job, flt: {"rows": queries.overview_jobs()}),
        "health": Section("dashboard/sections/health.html", lambda job, flt: queries.cluster_health()),
        "feed": Section("dashboard/sections/feed.html", lambda job, flt: {"incidents": queries.incident_feed()}),
    },
    "job": {
        "summary": Section("dashboard/sections/summary.html", lambda job, flt: queries.job_summary(job)),
        "banner": Section("dashboard/sections/banner.html",
                          lambda job, flt: {"job": job, "breaker": queries.breaker(job)}),
        "skew": Section("dashboard/sections/skew.html", lambda job, flt: {"job": job, "skew": queries.rank_skew(job)}),
        "timeline": Section("dashboard/sections/timeline.html", lambda job, flt: {"events": queries.timeline(job)}),
        "incidents": Section("dashboard/sections/incidents.html",
                             lambda job, flt: {"incidents": queries.incident_feed(job)}),
        "lineage": Section("dashboard/sections/lineage.html",
                           lambda job, flt: {"job": job, "tree": queries.lineage(job)}),
    },
    "nodes": {
        "health": Section("dashboard/sections/health.html", lambda job, flt: queries.cluster_health()),
        "heatmap": Section("dashboard/sections/heatmap.html", lambda job, flt: fleet.heatmap(flt)),
        "grid": Section("dashboard/sections/grid.html", lambda job, flt: fleet.nodes_page(flt)),
    },
}

#: Which sections of which page a kind of change touches (the relay's routing table). Job
#: sections are those of the job the change belongs to.
JOB_EVENT_SECTIONS = ["summary", "banner", "timeline", "incidents", "lineage"]
METRICS_SECTIONS = ["summary", "skew"]
CLUSTER_JOB_SECTIONS = ["jobs", "feed"]  # overview sections a job's change touches
CLUSTER_NODE_SECTIONS = ["health", "heatmap", "grid", "jobs"]  # a node's change


def capabilities_of(user) -> frozenset[str]:
    """The capabilities a signed-in person holds (what decides which buttons they see)."""
    if user is None or not user.is_authenticated:
        return frozenset()
    return frozenset(cap for cap, perm in roles.CAPABILITY_PERMISSIONS.items() if user.has_perm(perm))


def can(caps: frozenset[str]) -> dict[str, bool]:
    return {"operate": roles.OPERATE in caps, "approve": roles.APPROVE in caps, "drain": roles.DRAIN in caps}


def render(page: str, names: list[str] | None, caps: frozenset[str], job: Job | None = None,
           flt: fleet.NodeFilter | None = None) -> dict[str, str]:
    """HTML of the named sections of ``page`` (all of them when ``names`` is None); unknown names
    are ignored (another page's section)."""
    flt = flt or fleet.NodeFilter()
    sections = PAGES[page]
    wanted = list(sections) if names is None else [n for n in names if n in sections]
    if job is not None and wanted:
        job.refresh_from_db()
    html = {}
    for name in wanted:
        section = sections[name]
        context = {**section.context(job, flt), "can": can(caps), "section": name}
        html[name] = render_to_string(section.template, context)
    return html

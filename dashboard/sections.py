"""The dashboard's pages as named sections, rendered by the same templates on the first page load,
in the snapshot of every WebSocket (re)connect, and whenever the relay says a section changed.

A section is rendered for one person: action buttons appear only for the capabilities their
role grants (``core.roles``), so a viewer's page has no buttons at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from django.template.loader import render_to_string

from core import roles
from dashboard import fleet, lineage, node_page, queries
from jobs import fit, logs
from jobs.models import Job
from nodes.models import Node


@dataclass(frozen=True)
class Subject:
    """What a page shows: a job (job pages), a node (node pages), a node filter (the nodes page)."""

    job: Job | None = None
    node: Node | None = None
    filter: fleet.NodeFilter = field(default_factory=fleet.NodeFilter)


@dataclass(frozen=True)
class Section:
    """A template and its context, from the page's subject."""

    template: str
    context: Callable[[Subject], dict]


PAGES: dict[str, dict[str, Section]] = {
    "overview": {
        "jobs": Section("dashboard/sections/jobs.html", lambda on: {"rows": queries.overview_jobs()}),
        "health": Section("dashboard/sections/health.html", lambda on: queries.cluster_health()),
        "feed": Section("dashboard/sections/feed.html", lambda on: {"incidents": queries.incident_feed()}),
    },
    "job": {
        "summary": Section("dashboard/sections/summary.html", lambda on: queries.job_summary(on.job)),
        "banner": Section("dashboard/sections/banner.html",
                          lambda on: {"job": on.job, "breaker": queries.breaker(on.job),
                                      "waiting": fit.waiting(on.job)}),
        "skew": Section("dashboard/sections/skew.html", lambda on: {"job": on.job, "skew": queries.rank_skew(on.job)}),
        "timeline": Section("dashboard/sections/timeline.html", lambda on: {"job": on.job, **queries.timeline(on.job)}),
        "incidents": Section("dashboard/sections/incidents.html",
                             lambda on: {"incidents": queries.incident_feed(on.job)}),
        "lineage": Section("dashboard/sections/lineage.html",
                           lambda on: {"job": on.job, "lineage": lineage.rows(on.job)}),
        "logs": Section("dashboard/sections/logs.html",
                        lambda on: {"job": on.job, "lines": logs.read(on.job, tail=LOG_PANEL_LINES)}),
    },
    "nodes": {
        "health": Section("dashboard/sections/health.html", lambda on: queries.cluster_health()),
        "heatmap": Section("dashboard/sections/heatmap.html", lambda on: fleet.heatmap(on.filter)),
        "grid": Section("dashboard/sections/grid.html", lambda on: fleet.nodes_page(on.filter)),
    },
    "node": {
        "node": Section("dashboard/sections/node.html", lambda on: {"node": on.node, "gpus": node_page.gpus(on.node)}),
        "activity": Section("dashboard/sections/node_activity.html",
                            lambda on: {"entries": node_page.activity(on.node)}),
        "history": Section("dashboard/sections/node_history.html", lambda on: node_page.history(on.node)),
    },
}

#: Which sections of which page a kind of change touches (the relay's routing table). Job
#: sections are those of the job the change belongs to.
JOB_EVENT_SECTIONS = ["summary", "banner", "timeline", "incidents", "lineage"]
#: Step metrics arrive while a job trains, and so does its output: the log panel follows them.
METRICS_SECTIONS = ["summary", "skew", "logs"]
#: Lines of training output the job page's panel shows.
LOG_PANEL_LINES = 100
CLUSTER_JOB_SECTIONS = ["jobs", "feed"]  # overview sections a job's change touches
# A node's change. The heat map is not re-rendered: the nodes that changed are sent as blocks of
# their own (``fleet.heatmap_cells``), so an update costs what changed, not the fleet.
CLUSTER_NODE_SECTIONS = ["health", "grid", "jobs", "node", "activity", "history"]


def capabilities_of(user) -> frozenset[str]:
    """The capabilities a signed-in person holds (what decides which buttons they see)."""
    if user is None or not user.is_authenticated:
        return frozenset()
    return frozenset(cap for cap, perm in roles.CAPABILITY_PERMISSIONS.items() if user.has_perm(perm))


def can(caps: frozenset[str]) -> dict[str, bool]:
    return {"operate": roles.OPERATE in caps, "approve": roles.APPROVE in caps, "drain": roles.DRAIN in caps}


def render(page: str, names: list[str] | None, caps: frozenset[str], on: Subject) -> dict[str, str]:
    """HTML of the named sections of ``page`` about ``on`` (all of them when ``names`` is None);
    unknown names are ignored (another page's section)."""
    sections = PAGES[page]
    wanted = list(sections) if names is None else [n for n in names if n in sections]
    if wanted:
        for row in (on.job, on.node):
            if row is not None:
                row.refresh_from_db()
    html = {}
    for name in wanted:
        section = sections[name]
        context = {**section.context(on), "can": can(caps), "section": name}
        html[name] = render_to_string(section.template, context)
    return html

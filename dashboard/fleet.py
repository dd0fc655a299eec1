"""The nodes page at fleet size: a GPU heat map of every node, and a filtered, paged node table.

At 1,024 nodes × 8 GPUs the old page drew a table row per node with a card per GPU: 1.8 MB of
HTML and 1.8 s of rendering, again for every browser at every node's health change. Now:

- the heat map shows every GPU of every node as one small cell coloured by its health (a node's
  cells together, its schedulability as the outline), built from two narrow queries and joined
  as strings, not through the template engine: ~1,024 × 8 cells in tens of milliseconds; a
  click opens the node's page (``dashboard.node_page``);
- the heat map colours by health, or by temperature, utilisation or memory used (five steps of
  one scale, grey where a GPU said nothing), and groups nodes by a label (rack, pool, Slurm
  partition) when asked;
- the table shows ``PAGE_NODES`` nodes at a time: those that want attention first (not healthy,
  not active, a lemon), then by hostname; narrowed by hostname search, health, schedulability,
  lemon, a label ``key=value`` and the job running there. The heat map shows the nodes the filter
  keeps. The filter travels in the query string, of the page and of its WebSocket, so live
  updates render the same page of the same filter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from urllib.parse import urlencode

from django.db.models import Case, F, IntegerField, Q, QuerySet, Value, When
from django.db.models.fields.json import KeyTextTransform
from django.template.defaultfilters import floatformat
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import mark_safe

from nodes.choices import Health, Schedulability
from nodes.models import GPU, Node

PAGE_NODES = 50
#: A GPU reading older than this is drawn as stale.
STALE_AFTER = timedelta(seconds=60)
#: Heat-map colourings other than health: the reading, and the upper bounds of steps 0..3 (4 above).
COLOURINGS = {
    "temperature": (lambda s: s.get("temperature_c"), (50, 65, 75, 85)),
    "utilization": (lambda s: s.get("utilization_pct"), (20, 50, 80, 95)),
    "memory": (lambda s: _fraction(s.get("memory_used"), s.get("memory_free")), (0.2, 0.4, 0.6, 0.8)),
}
#: How many nodes a heat-map group lists before "and N more" (grouping is for seeing racks, not scrolling).
GROUP_LIMIT = 512


def _fraction(used, free) -> float | None:
    return used / (used + free) if isinstance(used, (int, float)) and isinstance(free, (int, float)) and used + free \
        else None


@dataclass(frozen=True)
class NodeFilter:
    """What the operator narrowed the node table to; values that mean nothing are dropped."""

    q: str = ""
    health: str = ""
    schedulability: str = ""
    lemon: bool = False
    label: str = ""  # key=value
    job: int | None = None  # nodes of the job's live generation
    colour: str = "health"  # the heat map's colouring
    group: str = ""  # a label key the heat map groups nodes by
    page: int = 1

    @classmethod
    def parse(cls, params) -> NodeFilter:
        """From a QueryDict or a dict of lists (a WebSocket's parsed query string)."""
        def get(name: str) -> str:
            value = params.get(name, "")
            value = value[-1] if isinstance(value, list) else value
            return str(value).strip()[:253]

        page, job, group = get("page"), get("job"), get("group")
        return cls(q=get("q"), health=get("health") if get("health") in Health.values else "",
                   schedulability=get("schedulability") if get("schedulability") in Schedulability.values else "",
                   lemon=get("lemon") in ("1", "true", "on"), label=get("label") if "=" in get("label") else "",
                   job=int(job) if job.isdigit() and int(job) < 2**31 else None,
                   colour=get("colour") if get("colour") in COLOURINGS else "health",
                   group=group if group and "__" not in group else "",
                   page=int(page) if page.isdigit() and 0 < int(page) < 100_000 else 1)

    def query(self, **changes) -> str:
        """This filter (with ``changes``) as a query string, without defaults."""
        values = replace(self, **changes)
        pairs = {"q": values.q, "health": values.health, "schedulability": values.schedulability,
                 "lemon": "1" if values.lemon else "", "label": values.label,
                 "job": str(values.job) if values.job is not None else "",
                 "colour": values.colour if values.colour != "health" else "", "group": values.group,
                 "page": str(values.page) if values.page > 1 else ""}
        return urlencode({k: v for k, v in pairs.items() if v})

    @property
    def active(self) -> bool:
        return bool(self.q or self.health or self.schedulability or self.lemon or self.label
                    or self.job is not None)

    def apply(self, nodes: QuerySet) -> QuerySet:
        if self.q:
            nodes = nodes.filter(hostname__icontains=self.q)
        if self.health:
            nodes = nodes.filter(health=self.health)
        if self.schedulability:
            nodes = nodes.filter(schedulability=self.schedulability)
        if self.lemon:
            nodes = nodes.filter(lemon_count__gt=0)
        if self.label:
            key, _, value = self.label.partition("=")
            # The key as a literal JSON key: a lookup name ("in", "contains") is just a label here.
            nodes = nodes.alias(label_value=KeyTextTransform(key, "labels")).filter(label_value=value)
        if self.job is not None:
            nodes = nodes.filter(generations__job_id=self.job, generations__ended_at__isnull=True,
                                 generations__job__generation=F("generations__number")).distinct()
        return nodes


def nodes_page(flt: NodeFilter) -> dict:
    """One page of the node table: attention first, then by hostname; three queries."""
    nodes = flt.apply(Node.objects.all())
    total = nodes.count()
    pages = max(1, -(-total // PAGE_NODES))
    page = min(flt.page, pages)
    attention = Case(When(~Q(health=Health.HEALTHY) | ~Q(schedulability=Schedulability.ACTIVE) | Q(lemon_count__gt=0),
                          then=Value(0)), default=Value(1), output_field=IntegerField())
    chosen = (nodes.annotate(attention=attention).order_by("attention", "hostname").prefetch_related("gpus")
              [(page - 1) * PAGE_NODES:page * PAGE_NODES])
    now = timezone.now()
    rows = [{"node": node, "gpus": mark_safe("".join(_gpu_card(gpu, now) for gpu in node.gpus.all())),  # noqa: S308
             "heartbeat_age": now - node.last_heartbeat_at if node.last_heartbeat_at else None}
            for node in chosen]
    return {"rows": rows, "total": total, "page": page, "pages": pages, "filter": flt,
            "previous": flt.query(page=page - 1) if page > 1 else None,
            "next": flt.query(page=page + 1) if page < pages else None}


def _gpu_card(gpu: GPU, now) -> str:
    """A GPU of the node table as HTML built here (escaped): its index, temperature, recent Xids and
    uncorrectable ECC errors, coloured by health. The template engine took 104 of the table's 148 ms
    for a page's 400 cards (``bench.pages``' fleet); built here, the table takes 68 ms."""
    sample = gpu.last_sample or {}
    stale = gpu.last_sample_at is None or now - gpu.last_sample_at > STALE_AFTER
    temperature = sample.get("temperature_c")
    reading = f"{floatformat(temperature, '0u')}°C" if isinstance(temperature, (int, float)) else "–"
    warnings = ""
    if sample.get("xid_recent"):
        codes = ",".join(str(code) for code in sample.get("recent_xid_codes") or [])
        warnings += f'<span class="warn">Xid {escape(codes)}</span>'
    if ecc := sample.get("ecc_uncorrected_recent"):
        warnings += f'<span class="warn">ECC {escape(ecc)}</span>'
    health = escape(gpu.health)
    return (f'<div class="gpu h-{health}{" stale" if stale else ""}" data-gpu="{gpu.index}" '
            f'title="{escape(gpu.name or "GPU")} {gpu.index}: {health}"><b>{gpu.index}</b><span>{reading}</span>'
            f'{warnings}</div>')


def heatmap(flt: NodeFilter) -> dict:
    """Every GPU of the nodes ``flt`` keeps as a cell, as HTML built here (escaped): the template
    engine would spend ~100 µs a cell. A node's cells link to its page. Two queries."""
    base = reverse("dashboard:nodes")
    nodes = flt.apply(Node.objects.all())
    cells = _cells(flt, nodes)
    groups: dict[str, list[str]] = {}
    left_out: dict[str, int] = {}
    rows = nodes.order_by("hostname").values_list("pk", "hostname", "health", "schedulability", "lemon_count", "labels")
    for pk, hostname, health, schedulability, lemon, labels in rows:
        group = str((labels or {}).get(flt.group, "—")) if flt.group else ""
        members = groups.setdefault(group, [])
        if flt.group and len(members) >= GROUP_LIMIT:
            left_out[group] = left_out.get(group, 0) + 1
            continue
        members.append(_block(base, pk, hostname, health, schedulability, lemon, cells.get(pk, [])))
    html = "".join(
        (f'<div class="hm-group" data-group="{escape(name)}"><h4>{escape(flt.group)}={escape(name)} '
         f'<span class="muted">{len(members) + left_out.get(name, 0)}</span></h4>' if flt.group
         else '<div class="hm-group">') + "".join(members)
        + (f'<span class="muted">… and {left_out[name]} more</span>' if name in left_out else "") + "</div>"
        for name, members in sorted(groups.items()))
    return {"heatmap": html, "heatmap_nodes": sum(len(m) for m in groups.values()), "colour": flt.colour,
            "colourings": [(c, flt.query(colour=c, page=1)) for c in ("health", *COLOURINGS)],
            "group_by": flt.group}


def heatmap_cells(flt: NodeFilter, node_ids) -> dict[int, str | None]:
    """The heat-map blocks of the nodes ``node_ids`` that changed, as ``flt`` draws them; None for
    a node the filter no longer keeps. What a live update sends instead of the whole map."""
    base = reverse("dashboard:nodes")
    nodes = flt.apply(Node.objects.filter(pk__in=list(node_ids)))
    cells = _cells(flt, nodes)
    blocks: dict[int, str | None] = dict.fromkeys(node_ids)
    for pk, hostname, health, schedulability, lemon in nodes.values_list(
            "pk", "hostname", "health", "schedulability", "lemon_count"):
        blocks[pk] = _block(base, pk, hostname, health, schedulability, lemon, cells.get(pk, []))
    return blocks


def _cells(flt: NodeFilter, nodes: QuerySet) -> dict[int, list[str]]:
    """Each node's GPU cells (their CSS classes, by GPU index) under ``flt``'s colouring."""
    cells: dict[int, list[str]] = {}
    gpus = GPU.objects.filter(node__in=nodes.values("pk")).order_by("node_id", "index")
    if flt.colour == "health":
        for node_id, health in gpus.values_list("node_id", "health"):
            cells.setdefault(node_id, []).append(f"h-{health}")
    else:
        reading, bounds = COLOURINGS[flt.colour]
        for node_id, sample in gpus.values_list("node_id", "last_sample"):
            cells.setdefault(node_id, []).append(_step(reading(sample or {}), bounds))
    return cells


def _block(base: str, pk: int, hostname: str, health: str, schedulability: str, lemon: int,
           cells: list[str]) -> str:
    name = escape(hostname)
    drawn = "".join(f'<i class="{c}"></i>' for c in cells) or '<i class="h-unknown"></i>'
    title = f"{name}: {health}, {schedulability}" + (f", lemon {lemon}" if lemon else "")
    return (f'<a class="hm-node n-{health} s-{schedulability}" data-node="{name}" data-pk="{pk}" href="{base}{pk}/" '
            f'title="{title}">{drawn}</a>')


def _step(value, bounds: tuple) -> str:
    """The colour step of a reading: c0..c4 along ``bounds``, cx when the GPU said nothing."""
    if not isinstance(value, (int, float)):
        return "cx"
    return f"c{next((i for i, bound in enumerate(bounds) if value < bound), len(bounds))}"

"""What the dashboard pushes to browsers: each payload's shape, defined once.

Two kinds of group message travel on the channel layer (from the relay to the consumers):

One kind of group message travels on the channel layer, from the relay to the consumers:
``dashboard.push`` — new chart points of a job (one point per step) and the names of the page
sections that changed; each consumer re-renders those sections for its own person (buttons
depend on the role) and sends them on.

Two kinds of WebSocket frame reach the browser: ``snapshot`` (every section and the whole chart,
on every (re)connect, so nothing is missed after a network blip) and ``update``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

CLUSTER_GROUP = "cluster"


def job_group(job_id: int) -> str:
    return f"job.{job_id}"


@dataclass(frozen=True)
class Point:
    """One step of a job on the chart: rank 0's loss and the global gradient norm, and the flags
    any rank raised at that step."""

    step: int
    generation: int
    rank: int  # whose loss this is: the lowest rank reported so far (rank 0 once it arrived)
    loss: float | None
    grad_norm: float | None
    spike: bool = False
    skipped: bool = False
    nan: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def points_from_rows(rows) -> list[Point]:
    """Reduce StepMetric rows (any ranks, any order) to one point per (generation, step)."""
    merged: dict[tuple[int, int], dict] = {}
    for row in rows:
        key = (row.generation, row.step)
        point = merged.setdefault(key, {"step": row.step, "generation": row.generation, "loss": None,
                                        "grad_norm": None, "spike": False, "skipped": False, "nan": False,
                                        "rank": None})
        if point["rank"] is None or row.rank < point["rank"]:
            point["rank"] = row.rank
            point["loss"] = row.loss
            point["grad_norm"] = row.grad_norm if row.grad_norm is not None else point["grad_norm"]
        elif point["grad_norm"] is None:
            point["grad_norm"] = row.grad_norm
        point["spike"] |= row.spike
        point["skipped"] |= row.skipped
        point["nan"] |= row.nan
    return [Point(**p) for _, p in sorted(merged.items())]


def push_message(*, message_id: str, job_id: int | None, points: list[Point], sections: list[str],
                 relayed_at: float, nodes: list[int] = ()) -> dict:
    """Group message from the relay: new chart points of ``job_id``, the sections that changed
    (names from ``dashboard.sections``; ``chart`` means the markers changed) and the nodes that
    changed (their heat-map blocks). ``message_id`` lets the consumers of one process render each
    section once per message, not once per browser."""
    return {"type": "dashboard.push", "id": message_id, "job": job_id, "points": [p.as_dict() for p in points],
            "sections": sorted(set(sections)), "nodes": sorted(set(nodes)), "relayed_at": relayed_at}


def snapshot_frame(page: str, html: dict[str, str], chart: dict | None) -> dict:
    """Sent on every (re)connect: every section of the page, and the whole chart."""
    return {"type": "snapshot", "page": page, "html": html, "chart": chart}


def update_frame(*, points: list[dict], html: dict[str, str], chart: dict | None, relayed_at: float,
                 cells: dict[int, str | None] | None = None) -> dict:
    """What changed since the last frame: new points, re-rendered sections, the chart again when
    its markers changed (checkpoints, restarts), and changed nodes' heat-map blocks (None: the
    node left the page's filter)."""
    frame = {"type": "update", "points": points, "html": html, "chart": chart, "relayed_at": relayed_at}
    if cells:
        frame["cells"] = cells
    return frame

"""docs/benchmarks/fleet.md and fleet.png from the fleet benchmark's result (``bench/fleet.py``).

The figure shows how the control plane's cost grows with the fleet (CPU, rows written per hour,
request latency), on log-log axes with the fitted exponent in each legend: 1 is linear. The
Markdown holds a table per fleet size, the faults with their detection times (the ground truth
and what the control plane recorded), and the storm. A hand-written notes section at the end is
kept when the report is regenerated.
"""

from __future__ import annotations

import math
import statistics
from datetime import UTC, datetime
from pathlib import Path

NOTES = "## Notes (written by hand, kept when the report is regenerated)"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def write(result: dict, directory: Path = DOCS) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    plot(result["details"]["sizes"], directory / "fleet.png")
    page = directory / "fleet.md"
    notes = ""
    if page.exists() and NOTES in page.read_text():
        notes = page.read_text()[page.read_text().index(NOTES):]
    page.write_text(markdown(result) + ("\n" + notes if notes else ""))


def series(sizes: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Each cost against the fleet size, for the plot and the fitted exponents."""
    out: dict[str, list[tuple[int, float]]] = {"CPU cores used": [], "rows written per hour": [],
                                              "heartbeat p99 (ms)": [], "step-report p99 (ms)": []}
    for r in sorted(sizes, key=lambda r: r["nodes"]):
        if r.get("cpu_cores") is not None:  # None: a run whose CPU reading was found wrong afterwards
            out["CPU cores used"].append((r["nodes"], r["cpu_cores"]))
        out["rows written per hour"].append((r["nodes"], sum(t["rows_per_hour"] for t in r["tables"].values())))
        for name, endpoint in (("heartbeat p99 (ms)", "heartbeat"), ("step-report p99 (ms)", "reports")):
            p99 = r["http"].get(endpoint, {}).get("p99_ms")
            if p99:
                out[name].append((r["nodes"], p99))
    return out


def exponent(points: list[tuple[float, float]]) -> float | None:
    """The slope of log(cost) against log(nodes): 1 is linear growth."""
    logs = [(math.log(n), math.log(c)) for n, c in points if n > 0 and c > 0]
    if len(logs) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in logs), statistics.fmean(y for _, y in logs)
    den = sum((x - mx) ** 2 for x, _ in logs)
    return round(sum((x - mx) * (y - my) for x, y in logs) / den, 2) if den else None


def plot(sizes: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    data = series(sizes)
    figure, axes = plt.subplots(1, len(data), figsize=(4.2 * len(data), 3.6))
    for axis, (name, points) in zip(axes, data.items()):
        if points:
            slope = exponent(points)
            axis.plot([n for n, _ in points], [v for _, v in points], "o-",
                      label=f"exponent {slope:g}" if slope is not None else "one size")
            axis.legend(loc="upper left", fontsize=8)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("nodes (x 8 GPUs)")
        axis.set_title(name, fontsize=10)
        axis.grid(True, which="both", alpha=0.3)
    figure.suptitle("Control-plane cost against fleet size (2 cores, one PostgreSQL)", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _waits(r: dict) -> str:
    waits = r.get("command_waits")
    if not waits:
        return "—"
    return f"{waits['per_s']}, {waits['wakeups']}, {waits['503']}, {waits['errors']}"


def _page(timings: dict, page: str) -> str:
    size = timings.get(page + "_kb")
    if size is not None and size < 0:  # an early run's record of a refused page: minus the status / 1024
        return "refused (503)"
    return f"{_v(timings.get(page))} ({_v(size)}; {timings.get(page + '_503', '—')})"


def _push(r: dict) -> str:
    push = r.get("live_push")
    if not push:
        return "not measured"
    if push.get("error"):
        return f"sockets did not open ({push['error'][:80]})"
    split = ""
    if push.get("stored_to_relayed"):
        relay = push["stored_to_relayed"]
        split = f"; p95 stored → relayed {_v(relay['p95_ms'])}"
        if relay.get("steps_with_windows") and relay.get("steps_without_windows"):
            split += (f" ({_v(relay['steps_with_windows']['p95_ms'])} for steps sent with the node windows, "
                      f"{_v(relay['steps_without_windows']['p95_ms'])} without)")
        split += f", relayed → browser {_v(push['relayed_to_browser']['p95_ms'])}"
    if push.get("from_commit"):
        split += (f"; from the commit: p50 {_v(push['from_commit']['p50_ms'])}, p95 {_v(push['from_commit']['p95_ms'])}"
                  f" (the commit {_v(push['stored_to_committed']['p95_ms'])} after the ingest began, p95; "
                  f"committed → relayed {_v((push.get('committed_to_relayed') or {}).get('p95_ms'))})")
    return f"{_v(push['p50_ms'])} / {_v(push['p95_ms'])} ({push['clients']}; {push['missing']}{split})"


def _waits_for_cpu(r: dict) -> str:
    waits = r.get("run_queue_wait")
    if not waits:
        return "—"
    return " / ".join(_v((waits.get(role) or {}).get("ms_per_wakeup"))
                      for role in ("ws", "web0", "postgres", "worker", "benchmark (browsers)"))


def _sweep_pauses(r: dict) -> str:
    gaps = r.get("sweep_gaps")
    if not gaps:
        return "—"
    return " / ".join(_v((gaps.get(name) or {}).get("max_gap_s"))
                      for name in ("nodes.tasks.expire_heartbeats", "jobs.tasks.expire_progress"))


def _tasks(counts: dict | None) -> str:
    """``{"celery": {"jobs.tasks.handle_exit": 3}}`` or ``{"jobs.tasks.sweep": 2}``: the three most, by
    short name ("—" where the run predates the figure, "none" where there were none)."""
    if counts is None:
        return "—"
    flat: dict[str, int] = {}
    for key, value in counts.items():
        for name, n in (value.items() if isinstance(value, dict) else [(key, value)]):
            short = name.rsplit(".", 1)[-1]
            flat[short] = flat.get(short, 0) + n
    top = sorted(flat.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{name} {n}" for name, n in top) if top else "none"


def _v(value, unit: str = "") -> str:
    return "—" if value is None else f"{value:g}{unit}"


def markdown(result: dict) -> str:
    details, machine = result["details"], result["machine"]
    sizes = sorted(details["sizes"], key=lambda r: r["nodes"])
    lines = [
        "# Fleet scale",
        "",
        f"Generated by `{result['command']}` on {datetime.now(UTC):%Y-%m-%d} (machine: {machine.get('nproc')} "
        f"cores, {machine.get('memory_gib')} GiB, Python {machine.get('python')}, torch "
        f"{machine.get('torch', '—')}). The control plane — 2 daphne processes (pooled database "
        "connections) for the fleet, one for the browsers' WebSockets and one for the agents' events and acks, "
        "the Celery workers and beat (as `bench/_fleet_services.py` starts them), PostgreSQL and Redis — and "
        "the simulated fleet share these cores: absolute figures are this machine's, the growth with the fleet "
        "is the finding.",
        "",
        "![cost against fleet size](fleet.png)",
        "",
        "## Per fleet size",
        "",
        "| | " + " | ".join(f"{r['nodes']} nodes" for r in sizes) + " |",
        "| --- | " + " | ".join("---" for _ in sizes) + " |",
    ]

    def _launches(figures) -> str:
        if not figures or "delivered_s" not in figures:
            return "—"
        d = figures["delivered_s"]
        waiting = f"{figures['unacknowledged']} of {figures['launches']}"
        return f"{_v(d['p50'])} / {_v(d['p95'])} / {_v(d['max'])} ({waiting})"

    def row(label: str, cell) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(r) for r in sizes) + " |")

    row("ranks (jobs' nodes)", lambda r: f"{r['ranks']} ({', '.join(map(str, r['jobs']))})")
    row("idle spare nodes on top (heartbeating, telemetry)", lambda r: str(r.get("spares", 0)))
    row("set-up: agents registered / refused, nodes healthy, jobs training",
        lambda r: "all" if "setup" not in r else
        f"{r['setup']['agents_registered']} / {r['setup']['registrations_refused']}, {r['setup']['nodes_healthy']}, "
        f"{r['setup']['jobs_running']} of {len(r['jobs'])}")
    row("set-up: first launches delivered, s after queued: p50 / p95 / max (unacknowledged)",
        lambda r: _launches(r.get("setup", {}).get("launch_delivery")))
    row("heartbeat interval the control plane asked for (pacing), s", lambda r: _v(r.get("heartbeat_interval_s")))
    row("requests attempted / s", lambda r: _v(r["attempted_rps"]))
    row("requests accepted (2xx) / s", lambda r: _v(r["accepted_rps"]))
    row("503 (admission control)", lambda r: str(sum(e["503"] for e in r["http"].values())))
    row("other errors (5xx, timeouts, 4xx)", lambda r: str(sum(e["errors"] for e in r["http"].values())))
    row("rank step reports made / stored per s",
        lambda r: f"{_v(r.get('step_reports_made_per_s'))} / {_v(r.get('step_reports_stored_per_s'))}")
    row("control-plane CPU, cores", lambda r: _v(r["cpu_cores"]))
    row("simulator CPU, cores (same machine)", lambda r: _v(r.get("simulator_cores")))
    row("CPU s per node per minute", lambda r: _v(r["cpu_s_per_node_minute"]))
    row("waiting for a CPU, ms per wake-up: ws, web0, PostgreSQL, worker, the browsers' process", _waits_for_cpu)
    row("Celery queue depth, max", lambda r: str(r["queue_depth_max"]))
    row("…its tasks then (the most waiting)", lambda r: _tasks(r.get("queue_at_max")))
    row("sweeps and tasks discarded unrun (expired in the queue)", lambda r: _tasks(r.get("discarded_tasks")))
    row("longest pause between heartbeat / progress sweeps, s", _sweep_pauses)
    row("raw data, GB a day (GPU samples + node windows + step rows; target ≤ 5)",
        lambda r: "—" if "data" not in r else _v(r["data"]["raw_gb_per_day"]))
    row("GPU rollups, GB a day (kept 90 days)",
        lambda r: "—" if "data" not in r else _v(r["data"]["rollup_gb_per_day"]))
    row("nodes falsely unreachable", lambda r: str(r["false_unreachable"]))
    for page in ("overview", "nodes", "biggest_job"):
        row(f"dashboard `{page}` s (KB; 503s first)", lambda r, p=page: _page(r["dashboard_s"], p))
    for page in ("overview", "nodes", "biggest_job"):
        row(f"the same on an ingest process: `{page}` s (KB; 503s first)",
            lambda r, p=page: _page(r.get("dashboard_on_ingest_s") or {}, p))
    row("live push to browsers on the biggest job's page: p50 / p95 ms (clients; steps missed)", _push)
    row("storm: backlog before / peak (records)",
        lambda r: f"{r['storm'].get('backlog_before_records')} / {r['storm']['backlog_peak_records']}")
    row("storm: back to the pre-outage backlog after (s)", lambda r: _v(r["storm"]["flush_s"]))
    row("storm: server errors / incidents / false unreachable",
        lambda r: f"{r['storm']['server_errors']} / {len(r['storm']['incidents'])} / {r['storm']['false_unreachable']}")
    row("command waits (agents' long polls): per s, woke an agent, 503, errors", _waits)
    for endpoint in sorted({e for r in sizes for e in r["http"]}):
        row(f"`{endpoint}` p50 / p99 ms",
            lambda r, e=endpoint: "—" if e not in r["http"] else
            f"{_v(r['http'][e]['p50_ms'])} / {_v(r['http'][e]['p99_ms'])}")

    lines += ["", "## Detection (fault → the incident or node-health row the control plane wrote)", "",
              "| fault | " + " | ".join(f"{r['nodes']} nodes" for r in sizes) + " | target p95 |",
              "| --- | " + " | ".join("---" for _ in sizes) + " | --- |"]
    kinds = sorted({f["kind"] for r in sizes for f in r["faults"]})
    for kind in kinds:
        cells = []
        for r in sizes:
            fault = next((f for f in r["faults"] if f["kind"] == kind), None)
            if fault is None:
                cells.append("—")
            elif kind == "worker_restart":
                cells.append(f"away {fault.get('away_s')} s")
            elif not fault["landed"]:
                cells.append("not injected (job already stopped)")
            else:
                cells.append("**not detected**" if fault["detected_s"] is None else f"{fault['detected_s']} s")
        target = details.get("detection", {}).get(kind, {}).get("target_p95_s")
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {_v(target, ' s')} |")

    lines += ["", "## Rows and bytes written, per table (the busiest; extrapolated from the steady window)", ""]
    for r in sizes:
        lines += [f"**{r['nodes']} nodes**", "", "| table | rows/h | MB/h | GB/day | GB/week |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {t['rows_per_hour']:,} | {t['mb_per_hour']} | {t['gb_per_day']} | {t['gb_per_week']} |"
                  for name, t in r["tables"].items()]
        lines.append("")

    lines += costs(details.get("cost"))
    lines += targets(sizes, details)
    growth = series(sizes)
    lines += ["## Growth", "", "| cost | fitted exponent in nodes (1 = linear) |", "| --- | --- |"]
    lines += [f"| {name} | {_v(exponent(points))} |" for name, points in growth.items()]
    lines += ["", plateau(sizes, details), "", "## What saturates first", "", saturation(sizes), "",
              "## What a deployment needs", "", sizing(sizes), "", "## Not measured here", "",
              "- Straggler detection against its target: the simulated slow rank (`slow_rank`) is judged by the "
              "straggler detector over the node windows (`jobs/stragglers.py`, docs/detection.md), which holds "
              "a ratio for several windows before it raises an incident; a 120 s window may end before it does, "
              "so *not detected* here is not a miss (`python -m bench.detect` measures that detector).",
              "- Decision latency apart from detection: only the incident's `detected_at` (or the node-health "
              "event) is read.", ""]
    return "\n".join(lines)


def costs(cost: dict | None) -> list[str]:
    """The calibration's CPU per request kind (``bench.fleet.cost``)."""
    if not cost:
        return []
    kinds = (("heartbeat", "cpu_ms_per_heartbeat"), ("step-report request (one step)", "cpu_ms_per_report"),
             (f"telemetry request ({cost['telemetry_samples_per_request']} samples)", "cpu_ms_per_telemetry_request"))
    lines = ["## What one request costs", "",
             f"CPU of the web processes and PostgreSQL's backends per request, from {cost['requests']} requests of "
             f"each kind sent 4 at a time on top of a one-job fleet of 8 nodes, its own rate subtracted; median of "
             f"{cost['runs']} bursts (spread).", "", "| request | CPU ms | spread |", "| --- | --- | --- |"]
    lines += [f"| {label} | {cost[key]:g} | {cost[key + '_spread'][0]:g}–{cost[key + '_spread'][1]:g} |"
              for label, key in kinds]
    lines += [f"| one telemetry sample | {cost['cpu_ms_per_telemetry_sample']:g} | |", ""]
    return lines


def targets(sizes: list[dict], details: dict) -> list[str]:
    """The issue's targets at the largest size, each against what this run measured."""
    r = max(sizes, key=lambda r: r["nodes"])
    detection = details.get("detection", {})
    errors = sum(e["errors"] for e in r["http"].values())
    refused = sum(e["503"] for e in r["http"].values())
    pages = {p: r["dashboard_s"].get(p) for p in ("overview", "nodes", "biggest_job")}
    push = (r.get("live_push") or {}).get("p95_ms")
    committed = (r.get("live_push") or {}).get("from_commit")
    from_commit = f" ({_v(committed['p95_ms'], ' ms')} from its commit)" if committed else ""
    exponent_cpu = details.get("exponents", {}).get("CPU cores used")
    raw = (r.get("data") or {}).get("raw_gb_per_day")
    storm = r["storm"]

    def verdict(ok: bool | None) -> str:
        return "—" if ok is None else "met" if ok else "**missed**"

    rows = [("0 failed requests (5xx other than 503, timeouts, 4xx)",
             f"{errors} failed; {refused} refused with 503 + Retry-After and resent from the spools", errors == 0)]
    for kind in ("rank_exit", "xid", "node_death", "hang"):
        d = detection.get(kind, {})
        target = d.get("target_p95_s")
        seen = d.get("p95_s")
        measured = "not measured" if seen is None else f"{seen:g} s ({d.get('n')} faults, {d.get('missed', 0)} missed)"
        rows.append((f"{kind} detected, p95 ≤ {_v(target, ' s')}", measured,
                     None if seen is None or target is None else seen <= target and not d.get("missed")))
    rows += [("raw data ≤ 5 GB a day", f"{_v(raw)} GB", None if raw is None else raw <= 5),
             ("CPU grows at most linearly in nodes", f"exponent {_v(exponent_cpu)}",
              None if exponent_cpu is None else exponent_cpu <= 1.0),
             ("accepted ≥ 90 % of capacity at the largest size", f"{_v(details.get('plateau'))} of "
              f"{_v(details.get('capacity_rps'))} requests/s", details.get("plateau", 0) >= 0.9),
             ("0 nodes falsely unreachable (steady window and storm)",
              f"{r['false_unreachable']} and {storm['false_unreachable']}",
              r["false_unreachable"] == 0 and storm["false_unreachable"] == 0),
             ("dashboard ≤ 1 s a page", ", ".join(f"{p} {_v(v, ' s')}" for p, v in pages.items()),
              all(v is not None and v <= 1.0 for v in pages.values())),
             ("live push p95 ≤ 250 ms (from the step's ingest)", f"{_v(push, ' ms')}{from_commit}",
              None if push is None else push <= 250),
             ("reconnect storm absorbed: spools back, 0 server errors, no incident",
              f"{_v(storm['flush_s'], ' s')}, {storm['server_errors']} errors, {len(storm['incidents'])} incidents",
              storm["flush_s"] is not None and storm["server_errors"] == 0 and not storm["incidents"])]
    title = f"## Against the targets ({r['nodes']} nodes, {r['ranks']} ranks, a {r['window_s']:g} s steady window)"
    lines = [title, "", "| target | measured | |", "| --- | --- | --- |"]
    lines += [f"| {target} | {measured} | {verdict(ok)} |" for target, measured, ok in rows]
    return lines + [""]


def saturation(sizes: list[dict]) -> str:
    """Which limit the run hit first, read from the figures (not written by hand)."""
    for r in sizes:
        refused = sum(e["503"] for e in r["http"].values())
        if (r["cpu_cores"] or 0) >= 1.6 or not _kept_up(r):
            slowest = max(r["http"].items(), key=lambda item: item[1]["p50_ms"] or 0)
            return (f"At {r['nodes']} nodes admission control refused {refused} requests with 503 + Retry-After "
                    f"while the control plane used {r['cpu_cores']} cores (the simulator {r.get('simulator_cores')}; "
                    f"the rest of the machine's 2 went to whatever else ran on it) and `{slowest[0]}` answered in "
                    f"{slowest[1]['p50_ms']} ms at the median: with the CPU it got, the web processes' requests took "
                    "long enough to fill admission control's in-flight bound, the first limit reached.")
    return "No size in this run used the cores up or was refused by admission control."


def _kept_up(r: dict) -> bool:
    """Took what it was offered: 99 % of the requests attempted accepted (a burst's few 503s, 2 of
    3,000 at 64 nodes in run U, do not make a size saturated)."""
    return r["accepted_rps"] >= 0.99 * r["attempted_rps"]


def sizing(sizes: list[dict]) -> str:
    """Cores and database growth for 1,024 and 10,000 nodes, scaled linearly from the largest size
    that kept up (a saturated size's cost per node is capped by the cores it had, not what it needed)."""
    base = max((r for r in sizes if _kept_up(r)), key=lambda r: r["nodes"], default=None)
    if base is None:
        return "No size kept up (each had more than 1 % of its requests refused): nothing to scale from."
    per_node_cores = base["cpu_s_per_node_minute"] / 60
    # Tables that only grow by rows inserted; the others (nodes_gpu, nodes_node, jobs_job) grew by
    # updates in place during the window, space that vacuum gives back: not a daily growth.
    inserted = {name: t for name, t in base["tables"].items() if t["rows_per_hour"] > 0}
    gb_day = sum(t["gb_per_day"] for t in inserted.values()) / base["nodes"]
    rows_day = sum(t["rows_per_hour"] for t in inserted.values()) * 24 / base["nodes"]
    lines = [f"Scaled linearly from {base['nodes']} nodes, the largest size that kept up (99 % accepted): "
             f"{base['cpu_s_per_node_minute']:g} CPU s per node per minute for daphne, Celery and PostgreSQL "
             f"together, {rows_day:,.0f} rows and {gb_day * 1024:.1f} MB per node per day in the tables that grow "
             "by inserts (before retention drops raw telemetry and node windows after 48 h).", "",
             "| fleet | CPU cores (web + workers + database) | rows per day | database growth per day |",
             "| --- | --- | --- | --- |"]
    for nodes in (1024, 10_000):
        lines.append(f"| {nodes:,} nodes | {per_node_cores * nodes:.1f} | {rows_day * nodes / 1e6:,.1f} M | "
                     f"{gb_day * nodes:,.1f} GB |")
    return "\n".join(lines)


def plateau(sizes: list[dict], details: dict) -> str:
    saturated = [r for r in sizes if not _kept_up(r)]
    if not saturated:
        return ("Every size kept up (99 % of what was attempted accepted): the capacity was not reached, "
                f"the most accepted was {_v(details.get('capacity_rps'))} requests/s.")
    return (f"Capacity (most requests accepted per second at any size): {_v(details.get('capacity_rps'))}. "
            + "; ".join(f"at {r['nodes']} nodes {r['attempted_rps']:g} were attempted a second (retries after "
                        f"503 included) and {r['accepted_rps']:g} accepted" for r in saturated)
            + f": the largest size accepted {_v(details.get('plateau'))} of the capacity (target ≥ 0.9: a plateau, "
              "not a cliff).")

"""What the fleet benchmark reads from outside the control plane: PostgreSQL, /proc and Redis.

Nothing here asks the control plane how it is doing: rows and bytes come from PostgreSQL's own
statistics (rows inserted per table, ``pg_total_relation_size`` with indexes and TOAST), CPU from
``/proc/<pid>/stat`` of the server processes and of the database's backends, queue depth from
Redis ``LLEN``, and detection times from the rows the control plane wrote (an incident's
``detected_at``, a node's ``node.health`` event), so a slow poll never adds to a latency.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

_TICKS = os.sysconf("SC_CLK_TCK")


def _is_process(pid: int) -> bool:
    """Whether ``pid`` names a process now, not a thread of one: ``/proc/<tid>`` answers for any
    thread too, with its whole process's figures. This machine's pids wrap at 32,768, and a
    database backend's pid that came back as a thread of a web process counted that process's
    every CPU second from 0: 12.5 cores of PostgreSQL on a 2-core machine in one run, 3.06 cores
    in all in another."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return any(line.split()[1:2] == [str(pid)] for line in status.splitlines() if line.startswith("Tgid:"))


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """user + system CPU seconds of each process that still exists."""
    found = {}
    for pid in pids:
        if not _is_process(pid):
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[pid] = (int(fields[11]) + int(fields[12])) / _TICKS
    return found


def schedstat(pids: list[int]) -> dict[tuple[int, int], tuple[int, int, int]]:
    """Per thread of each process (``/proc/<pid>/task/<tid>/schedstat``): nanoseconds on a CPU,
    nanoseconds runnable but waiting for one, and how many times it was given one."""
    found = {}
    for pid in pids:
        if not _is_process(pid):
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                ran, waited, slices = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:3]
            except (OSError, ValueError):
                continue
            found[(pid, int(tid))] = (int(ran), int(waited), int(slices))
    return found


def run_queue_wait(before: dict, after: dict, roles: dict[int, str], window: float) -> dict[str, dict[str, float]]:
    """How long each role's threads waited for a CPU while runnable, from two ``schedstat`` reads:
    milliseconds per time they were given one (the delay a wake-up meets on a busy machine) and
    seconds waited per second of the window. A thread that ended between the reads is left out."""
    sums: dict[str, list[int]] = {}
    for key, (_, waited, slices) in after.items():
        _, waited0, slices0 = before.get(key, (0, 0, 0))
        total = sums.setdefault(roles.get(key[0], "postgres"), [0, 0])
        total[0] += waited - waited0
        total[1] += slices - slices0
    return {role: {"ms_per_wakeup": round(waited / 1e6 / slices, 2) if slices else None,
                   "waited_s_per_s": round(waited / 1e9 / window, 3)}
            for role, (waited, slices) in sorted(sums.items())}


def backend_pids(conn, database: str) -> list[int]:
    """PostgreSQL backends serving ``database`` (the web processes' pools, the workers)."""
    return [row[0] for row in conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> "
                                           "pg_backend_pid()", (database,))]


def tables(conn) -> dict[str, dict[str, int]]:
    """Rows inserted so far and bytes on disk (with indexes and TOAST), per table."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = conn.execute("SELECT relname, n_tup_ins, pg_total_relation_size(relid) FROM pg_stat_user_tables").fetchall()
    return {name: {"rows": inserted, "bytes": size} for name, inserted, size in rows}


def growth(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], seconds: float,
           top: int = 12) -> dict[str, dict[str, float]]:
    """Rows and bytes per hour per table between two ``tables`` readings, the busiest first, with
    the day and week they extrapolate to."""
    per_table = {}
    for name, now in after.items():
        then = before.get(name, {"rows": 0, "bytes": 0})
        rows, size = now["rows"] - then["rows"], now["bytes"] - then["bytes"]
        if rows <= 0 and size <= 0:
            continue
        hour = 3600.0 / seconds
        per_table[name] = {"rows_per_hour": round(rows * hour), "mb_per_hour": round(size * hour / 2**20, 2),
                           "gb_per_day": round(size * hour * 24 / 2**30, 3),
                           "gb_per_week": round(size * hour * 24 * 7 / 2**30, 2)}
    busiest = sorted(per_table.items(), key=lambda item: -item[1]["mb_per_hour"])[:top]
    return dict(busiest)


#: Tables (and their partitions) of raw telemetry and step data: inserted, kept for the raw
#: retention (48 h by default), dropped a partition at a time. Issue 18's "≤ 5 GB a day of raw data".
RAW_TABLES = ("nodes_nodegpusample", "jobs_nodewindow", "jobs_stepmetric")
#: The 1-minute GPU rollups, kept for months.
ROLLUP_TABLES = ("nodes_nodegpuminute",)


def data_per_day(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]],
                 seconds: float) -> dict[str, Any]:
    """GB a day extrapolated from the window: raw data (``RAW_TABLES``), rollups, and the tables
    updated in place (rows changed, none inserted: ``nodes_node`` at every heartbeat), whose growth
    over a short window is dead row versions that vacuum reuses, so bounded rather than per day."""
    day = 24 * 3600.0 / seconds

    def gb(prefixes: tuple[str, ...]) -> dict[str, float]:
        found = {}
        for name, now in after.items():
            if name.startswith(prefixes):
                grown = now["bytes"] - before.get(name, {"bytes": 0})["bytes"]
                if grown > 0:
                    found[name] = round(grown * day / 2**30, 3)
        return found

    raw, rollups = gb(RAW_TABLES), gb(ROLLUP_TABLES)
    in_place = {name: round((now["bytes"] - before[name]["bytes"]) * day / 2**30, 3) for name, now in after.items()
                if name in before and now["rows"] == before[name]["rows"] and now["bytes"] > before[name]["bytes"]}
    return {"raw_gb_per_day": round(sum(raw.values()), 3), "raw_by_table": raw,
            "rollup_gb_per_day": round(sum(rollups.values()), 3), "in_place_churn_gb_per_day": in_place}


def detection(conn, fault: dict[str, Any]) -> float | None:
    """Seconds from the fault landing to the control plane's record of it; None if never seen."""
    at = datetime.fromtimestamp(fault["at"]).astimezone()
    kind = fault["kind"]
    if kind in ("node_death", "xid"):
        states = ("unreachable",) if kind == "node_death" else ("unhealthy", "degraded")
        row = conn.execute(
            "SELECT min(e.created_at) FROM jobs_event e JOIN nodes_node n ON n.id = e.node_id WHERE n.hostname = %s "
            "AND e.kind = 'node.health' AND e.new_state = ANY(%s) AND e.created_at >= %s",
            (fault["hostname"], list(states), at)).fetchone()
    else:
        incident = {"rank_exit": "crash", "hang": "hang", "slow_rank": "straggler"}[kind]
        row = conn.execute("SELECT min(detected_at) FROM jobs_incident WHERE job_id = %s AND kind = %s "
                           "AND detected_at >= %s", (int(fault["job"]), incident, at)).fetchone()
    return None if row[0] is None else (row[0] - at).total_seconds()


def unreachable_events(conn, since: float, until: float, killed: set[str]) -> int:
    """Nodes declared unreachable in [since, until] that were alive (not killed by the benchmark)."""
    rows = conn.execute(
        "SELECT n.hostname FROM jobs_event e JOIN nodes_node n ON n.id = e.node_id WHERE e.kind = 'node.health' "
        "AND e.new_state = 'unreachable' AND e.created_at BETWEEN %s AND %s",
        (datetime.fromtimestamp(since).astimezone(), datetime.fromtimestamp(until).astimezone())).fetchall()
    return sum(1 for (hostname,) in rows if hostname not in killed)


def incidents_between(conn, since: float, until: float) -> list[str]:
    rows = conn.execute("SELECT kind FROM jobs_incident WHERE detected_at BETWEEN %s AND %s",
                        (datetime.fromtimestamp(since).astimezone(), datetime.fromtimestamp(until).astimezone()))
    return [kind for (kind,) in rows.fetchall()]


#: How far before a hang's verdict its job's rank 0's requests are read (``hangs``).
HANG_LOOKBACK_S = 120


def hangs(conn, fates: dict[str, list[list[Any]]]) -> list[dict[str, Any]]:
    """Every hang incident of the run (an injected hang's, and any other: a false one), with what
    became of its job's rank 0's requests before the verdict (``fates_before``)."""
    return [{"job": job, "generation": generation, "detected_at": round(detected_at.timestamp(), 1),
             **fates_before(detected_at.timestamp(), fates.get(str(job), []))}
            for job, generation, detected_at in conn.execute(
                "SELECT i.job_id, g.number, i.detected_at FROM jobs_incident i "
                "LEFT JOIN jobs_generation g ON g.id = i.generation_id WHERE i.kind = 'hang' ORDER BY i.detected_at")]


def fates_before(verdict: float, fates: list[list[Any]]) -> dict[str, Any]:
    """What became of a job's rank 0's requests (``bench._fleet_sim.Sim.fates``: [sent at, endpoint,
    outcome, seconds], oldest first) sent in the ``HANG_LOOKBACK_S`` before ``verdict``: how many ended
    each way (an HTTP status, ``timeout`` or ``error``), how long before the verdict the last 2xx
    answer came, and the last to a step report (None: none did), and the last 20 as [seconds before
    the verdict, endpoint, outcome, seconds it took]."""
    mine = [f for f in fates if verdict - HANG_LOOKBACK_S <= f[0] <= verdict]
    answered = [(sent + took, endpoint) for sent, endpoint, outcome, took in mine
                if isinstance(outcome, int) and 200 <= outcome < 300 and sent + took <= verdict]
    reports = [at for at, endpoint in answered if endpoint == "reports"]
    return {"requests": dict(Counter(str(f[2]) for f in mine)),
            "last_answered_s_before": round(verdict - max(answered)[0], 1) if answered else None,
            "last_report_s_before": round(verdict - max(reports), 1) if reports else None,
            "last_requests": [[round(verdict - sent, 1), endpoint, outcome, took]
                              for sent, endpoint, outcome, took in mine[-20:]]}


def launch_delivery(conn, jobs: list[int]) -> dict[str, Any]:
    """How the first generation's launch commands of ``jobs`` reached their nodes, as the control
    plane recorded them: how many, how many were still not acknowledged, and seconds from queued to
    delivered (a heartbeat of the node took it) and to acknowledged, p50/p95/max of those that were."""
    rows = conn.execute(
        "SELECT extract(epoch FROM delivered_at - created_at), extract(epoch FROM acked_at - created_at) "
        "FROM nodes_nodecommand WHERE kind = 'launch' AND generation = 1 AND job_id = ANY(%s)", (jobs,)).fetchall()
    figures: dict[str, Any] = {"launches": len(rows), "unacknowledged": sum(1 for _, acked in rows if acked is None)}
    for name, column in (("delivered", 0), ("acknowledged", 1)):
        values = [float(row[column]) for row in rows if row[column] is not None]
        if values:
            figures[f"{name}_s"] = {"p50": _quantile(values, 0.5), "p95": _quantile(values, 0.95),
                                    "max": round(max(values), 1)}
    return figures


#: The queues whose depth the benchmark follows (the sweeps' own queue apart: beat sends a few a
#: second, and those that wait too long expire unrun, which ``discarded_tasks`` counts).
QUEUES = ("celery", "checkpoints", "background")


def queue_depth(redis_client) -> int:
    return sum(int(redis_client.llen(queue)) for queue in QUEUES)


def queue_census(redis_client, queues: tuple[str, ...] = QUEUES) -> dict[str, dict[str, int]]:
    """What waits in each queue, counted by task name (Celery's Redis messages are JSON whose
    ``headers.task`` names the task): read when the depth reaches a new maximum, to say what a
    backlog is made of."""
    census: dict[str, dict[str, int]] = {}
    for queue in queues:
        names: Counter[str] = Counter()
        for raw in redis_client.lrange(queue, 0, -1):
            try:
                names[json.loads(raw)["headers"]["task"]] += 1
            except (ValueError, KeyError, TypeError):
                names["(unreadable)"] += 1
        if names:
            census[queue] = dict(names.most_common())
    return census


def live_push(conn, job: int, arrivals: list[dict[int, float]], window: tuple[float, float],
              relayed: list[dict[int, float]] | None = None) -> dict[str, Any]:
    """How soon each step of ``job`` reported during ``window`` reached each browser: the wall time a
    client got the step (``arrivals``, one dict per client) minus the moment the control plane stored
    it (the step row's ``received_at``, taken as the ingest transaction starts: the figure includes
    the rest of that request, which under overload is most of it). Steps a client never got count as
    missing. With ``relayed`` (when the relay sent each step, from the frames) the figure is split:
    ``stored_to_relayed`` (the ingest request's rest, the relay's read, coalescing; given apart for
    the steps whose request also carried the job's node windows) and ``relayed_to_browser`` (the
    channel layer, the consumer, the socket, the client).

    Where PostgreSQL records commit times (``track_commit_timestamp = on``, a server setting that
    takes a restart), the figure is also given from the step row's commit, the moment it exists for
    any other process (``from_commit``), with the commit's own delay after ``received_at``
    (``stored_to_committed``): the ingest transaction's part apart from the push's."""
    rows = conn.execute("SELECT step, extract(epoch FROM received_at), "
                        "CASE WHEN current_setting('track_commit_timestamp') = 'on' "
                        "THEN extract(epoch FROM pg_xact_commit_timestamp(xmin)) END "
                        "FROM jobs_stepmetric WHERE job_id = %s AND rank = 0 "
                        "AND received_at BETWEEN to_timestamp(%s) AND to_timestamp(%s)",
                        (job, window[0], window[1] - 2.0)).fetchall()  # the last 2 s: still on their way
    stored = {int(step): float(at) for step, at, _ in rows}
    committed = {int(step): float(at) for step, _, at in rows if at is not None}
    # The steps at which rank 0 also reported the job's node windows (in the same request, as the
    # hooks batch them): their split is given apart, to tell the windows' cost from the rest.
    exchange_steps = {int(step) for (step,) in conn.execute(
        "SELECT DISTINCT last_step FROM jobs_nodewindow WHERE job_id = %s", (job,)).fetchall()}
    latencies, missing = [], 0
    to_relay: list[float] = []
    to_relay_exchange: list[float] = []
    to_browser: list[float] = []
    for i, client in enumerate(arrivals):
        sent = relayed[i] if relayed else {}
        for step, at in stored.items():
            if step in client:
                latencies.append(max(0.0, client[step] - at) * 1000)
                if step in sent:
                    (to_relay_exchange if step in exchange_steps else to_relay).append(max(0.0, sent[step] - at) * 1000)
                    to_browser.append(max(0.0, client[step] - sent[step]) * 1000)
            else:
                missing += 1
    if not latencies:
        return {"clients": len(arrivals), "steps": len(stored), "p50_ms": None, "p95_ms": None, "missing": missing}
    figures = {"clients": len(arrivals), "steps": len(stored), "samples": len(latencies),
               "p50_ms": _quantile(latencies, 0.5), "p95_ms": _quantile(latencies, 0.95), "missing": missing}
    from_commit = [max(0.0, client[step] - at) * 1000 for client in arrivals
                   for step, at in committed.items() if step in client]
    if from_commit:
        to_commit = [max(0.0, committed[step] - stored[step]) * 1000 for step in committed]
        figures["from_commit"] = {"samples": len(from_commit), "p50_ms": _quantile(from_commit, 0.5),
                                  "p95_ms": _quantile(from_commit, 0.95)}
        figures["stored_to_committed"] = {"p50_ms": _quantile(to_commit, 0.5), "p95_ms": _quantile(to_commit, 0.95)}
        if relayed:
            to_relayed = [max(0.0, sent[step] - at) * 1000 for sent in relayed
                          for step, at in committed.items() if step in sent]
            if to_relayed:
                figures["committed_to_relayed"] = {"p50_ms": _quantile(to_relayed, 0.5),
                                                   "p95_ms": _quantile(to_relayed, 0.95)}
    if to_relay or to_relay_exchange:
        every = to_relay + to_relay_exchange
        figures["stored_to_relayed"] = {"p50_ms": _quantile(every, 0.5), "p95_ms": _quantile(every, 0.95)}
        for name, values in (("steps_without_windows", to_relay), ("steps_with_windows", to_relay_exchange)):
            if values:
                figures["stored_to_relayed"][name] = {"samples": len(values), "p50_ms": _quantile(values, 0.5),
                                                      "p95_ms": _quantile(values, 0.95)}
        figures["relayed_to_browser"] = {"p50_ms": _quantile(to_browser, 0.5),
                                         "p95_ms": _quantile(to_browser, 0.95)}
    return figures


def _gained(logs: dict[Path, int]) -> list[str]:
    """The lines each log gained after its offset (a log that does not exist gained none)."""
    lines = []
    for log, offset in logs.items():
        try:
            with log.open("rb") as f:
                f.seek(offset)
                lines += f.read().decode(errors="replace").splitlines()
        except OSError:
            continue
    return lines


def discarded_tasks(logs: dict[Path, int]) -> dict[str, int]:
    """Tasks the workers discarded unrun (expired before a process took them), by name, from what
    their logs gained after the offsets given: Celery logs "Discarding revoked task: <name>[<id>]"."""
    return dict(Counter(re.findall(r"Discarding revoked task: ([\w.]+)\[", "\n".join(_gained(logs)))).most_common())


#: The sweeps whose pace bounds a detection: node death (heartbeat expiry) and hangs (progress
#: deadlines). Both are in ``settings.SWEEP_TASKS`` (tests/bench/test_fleet_measure.py checks).
DETECTING_SWEEPS = ("nodes.tasks.expire_heartbeats", "jobs.tasks.expire_progress")


def sweep_gaps(logs: dict[Path, int], names: tuple[str, ...] = DETECTING_SWEEPS) -> dict[str, dict[str, Any]]:
    """How regularly each sweep ran, in whichever worker, from the "Task <name>[<id>] succeeded" lines
    the workers' logs gained after the offsets given (their JSON lines carry the time): runs, and the
    longest time between two (the first and last lines logged count as runs), with when it ended. A
    sweep that expired in the queue is redundant, the next one does its work; a long gap is what
    delays a detection."""
    runs: dict[str, list[datetime]] = {name: [] for name in names}
    stamps = []
    for line in _gained(logs):
        try:
            record = json.loads(line)
            at = datetime.fromisoformat(record["time"])
        except (ValueError, KeyError, TypeError):
            continue
        stamps.append(at)
        name = record.get("task")
        if name in runs and " succeeded in " in str(record.get("message", "")):
            runs[name].append(at)
    if not stamps:
        return {}
    first, last = min(stamps), max(stamps)
    gaps = {}
    for name, times in runs.items():
        marks = [first, *sorted(times), last]
        widest = max(zip(marks, marks[1:]), key=lambda pair: pair[1] - pair[0], default=None)
        gaps[name] = {"runs": len(times),
                      "max_gap_s": round((widest[1] - widest[0]).total_seconds(), 2) if widest else None,
                      "max_gap_ended": widest[1].isoformat() if widest else None}
    return gaps


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank), rounded to a tenth of their unit."""
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 1)

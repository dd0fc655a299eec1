"""``nightwatch`` (or ``python -m agents.cli``): launch, watch and steer jobs from CI and terminals.

Exit codes, so that a pipeline can act on the outcome of ``launch --wait``:

====  =====================================================================
0     the job completed (or the command did what was asked)
1     the job failed
2     usage error, or the job spec was refused (each problem with its line)
3     the job is paused and needs a human (approve, roll back or cancel it)
4     the job was cancelled
5     error: the control plane refused the request or could not be reached
6     ``--timeout`` passed while waiting
====  =====================================================================
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from agents.cli import spec as specs
from agents.cli.client import ApiError, Client

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PAUSED, EXIT_CANCELLED, EXIT_ERROR, EXIT_TIMEOUT = 0, 1, 2, 3, 4, 5, 6
OUTCOME = {"completed": EXIT_OK, "failed": EXIT_FAILED, "cancelled": EXIT_CANCELLED, "paused": EXIT_PAUSED}
#: CI systems' run identifiers: a retried pipeline step reuses the launch instead of starting another
CI_RUN_VARIABLES = ("NIGHTWATCH_RUN_ID", "GITHUB_RUN_ID", "CI_PIPELINE_ID", "BUILD_ID", "BUILDKITE_BUILD_ID")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    token = args.token or os.environ.get("NIGHTWATCH_TOKEN")
    token_file = args.token_file or os.environ.get("NIGHTWATCH_TOKEN_FILE")
    if not token and token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            return _fail(f"cannot read the token file {token_file}: {exc.strerror}", EXIT_USAGE)
    if not token:
        return _fail("no token: set NIGHTWATCH_TOKEN (or NIGHTWATCH_TOKEN_FILE, --token, --token-file)", EXIT_USAGE)
    client = Client(args.url, token, timeout=args.http_timeout)
    try:
        return args.handler(client, args)
    except ApiError as exc:
        return _fail(_describe(exc), EXIT_ERROR)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_ERROR)
    except BrokenPipeError:
        return _reader_gone(args)


def _reader_gone(args) -> int:
    """Whoever read our output went away (``nightwatch status | head -1``): stop quietly.

    Standard output is pointed at /dev/null, so that the interpreter's last flush of what is still
    buffered does not fail again and print a traceback. What was asked is done as far as anyone
    reads it (exit 0), except a ``launch --wait``, whose outcome was not seen (exit 5).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (a test's capture): nothing will flush to a pipe
        pass
    return EXIT_ERROR if getattr(args, "command", None) == "launch" and getattr(args, "wait", False) else EXIT_OK


# --- commands -------------------------------------------------------------------------------------

def launch(client: Client, args) -> int:
    try:
        spec = specs.load(args.spec)
    except specs.SpecError as exc:
        return _fail(f"the job spec is invalid:\n{exc}", EXIT_USAGE)
    key = args.idempotency_key or _ci_key(spec)
    headers = {"Idempotency-Key": key} if key else {}
    try:
        job = client.post("/jobs", spec.body, headers=headers)
    except ApiError as exc:
        if exc.status in (400, 422) and exc.errors:  # 422: a spec the fleet can never hold
            problems = [specs.Problem(spec.locate(e.get("field", "")), e.get("field", ""), e.get("reason", ""))
                        for e in exc.errors]
            return _fail(f"the control plane refused the job spec:\n{specs.SpecError(spec.path, problems)}",
                         EXIT_USAGE)
        raise
    _say(args, f"launched job {job['id']} ({job['name']})", job)
    if not args.wait:
        return EXIT_OK
    return wait(client, job["id"], args)


def wait(client: Client, job_id: int, args) -> int:
    """Poll the job's status, print each change (state, generation, step, incidents), and turn the
    end into an exit code. A paused job ends the wait: it needs a person, not more patience."""
    deadline = time.monotonic() + args.timeout if args.timeout else None
    shown_line, seen_incidents = None, set()
    while True:
        status = client.get(f"/jobs/{job_id}/status")
        for incident in reversed(status["recent_incidents"]):
            key = (incident["id"], incident["state"], incident["decision"])
            if key not in seen_incidents:
                seen_incidents.add(key)
                print(f"  incident {incident['id']}: {incident['kind']} ({incident['classification'] or '-'}) "
                      f"→ {incident['decision'] or 'deciding'}, {incident['state']}", flush=True)
        line = _progress(status)
        if line != shown_line:
            print(line, flush=True)
            shown_line = line
        if status["state"] in OUTCOME:
            if status["state"] == "paused":
                print(f"job {job_id} is paused and needs a human: {status['pause_reason'] or 'no reason given'}\n"
                      f"  resume with `nightwatch approve {job_id} --reason …`, roll back with "
                      f"`nightwatch rollback {job_id} --to CKPT --reason …`", flush=True)
            return OUTCOME[status["state"]]
        if deadline is not None and time.monotonic() > deadline:
            return _fail(f"job {job_id} is still {status['state']} after {args.timeout:g} s", EXIT_TIMEOUT)
        time.sleep(args.poll)


def _progress(status: dict) -> str:
    step = status["last_step"] if status["last_step"] is not None else "-"
    return (f"[{time.strftime('%H:%M:%S')}] job {status['id']} {status['state']} · generation {status['generation']}"
            f" · step {step} · restarts {status['restart_count']} · open incidents {status['open_incidents']}"
            f" · ettr {status['ettr']:.2f}"
            + (f"\n  waiting: {status['waiting']['reason']}" if status.get("waiting") else ""))


def status(client: Client, args) -> int:
    if args.job is None:
        jobs = client.list("/jobs", limit=args.limit, state=args.state)
        if args.json:
            print(json.dumps(jobs, indent=2))
            return EXIT_OK
        _table(["ID", "NAME", "STATE", "GEN", "STEP", "RESTARTS", "CREATED"],
               [[j["id"], j["name"], j["state"], j["generation"], _dash(j["last_step"]), j["restart_count"],
                 j["created_at"][:19]] for j in jobs])
        return EXIT_OK
    current = client.get(f"/jobs/{args.job}/status")
    if args.json:
        print(json.dumps(current, indent=2))
    else:
        print(_progress(current))
        if current["pause_reason"]:
            print(f"  paused: {current['pause_reason']}")
        for incident in current["recent_incidents"]:
            print(f"  incident {incident['id']} gen {_dash(incident['generation'])}: {incident['kind']} → "
                  f"{incident['decision'] or 'deciding'} ({incident['state']}, "
                  f"detected {incident['detected_at'][:19]})")
    return EXIT_OK


def logs(client: Client, args) -> int:
    """The job's training output (each generation's torchrun output, shipped by the nodes): the last
    ``--tail`` lines, then with ``--follow`` what arrives, until the job has ended and nothing more came."""
    filters = {"generation": args.generation, "rank": args.rank}
    page = client.get(f"/jobs/{args.job}/logs", tail=args.tail, **filters)
    shown: list = [None]
    _print_lines(page["lines"], shown, args)
    cursor = page["cursor"]
    if not args.follow:
        if not page["lines"] and not args.json:
            print(f"job {args.job}: no training output yet", file=sys.stderr)
        return EXIT_OK
    quiet_after_end = 0
    while quiet_after_end < 2:  # the last lines of an ended job may still be on their way: two quiet polls
        time.sleep(args.poll)
        page = client.get(f"/jobs/{args.job}/logs", after=cursor or 0, limit=5000, **filters)
        _print_lines(page["lines"], shown, args)
        cursor = page["cursor"] if page["cursor"] is not None else cursor
        if page["lines"]:
            quiet_after_end = 0
        elif client.get(f"/jobs/{args.job}/status")["terminal"]:
            quiet_after_end += 1
    return EXIT_OK


def _print_lines(lines: list[dict], shown: list, args) -> None:
    """Each line as the node printed it, under a header whenever the generation or node changes."""
    for line in lines:
        if args.json:
            print(json.dumps(line), flush=True)
            continue
        source = (line["generation"], line["node"])
        if source != shown[0]:
            print(f"=== generation {line['generation']} on {line['node']} ===", flush=True)
            shown[0] = source
        print(line["text"], flush=True)


def incidents(client: Client, args) -> int:
    """Incident evidence (exit codes, the error line, log tails) for the job, oldest first."""
    incidents = client.list(f"/jobs/{args.job}/incidents", limit=args.limit)
    if args.incident is not None:
        incidents = [i for i in incidents if i["id"] == args.incident]
        if not incidents:
            return _fail(f"job {args.job} has no incident {args.incident}", EXIT_ERROR)
    if args.json:
        print(json.dumps(incidents, indent=2))
        return EXIT_OK
    if not incidents:
        print(f"job {args.job}: no incidents")
    for incident in reversed(incidents):
        print(f"=== incident {incident['id']} · generation {_dash(incident['generation'])} · {incident['kind']} · "
              f"{incident['decision'] or 'deciding'} · {incident['state']}")
        print(f"    {incident['classification'] or ''}")
        for stamp in ("fault_at", "detected_at", "quiesced_at", "relaunched_at", "first_step_at", "resolved_at"):
            if incident.get(stamp):
                print(f"    {stamp:<14} {incident[stamp]}")
        if incident["nodes"]:
            print(f"    nodes          {', '.join(incident['nodes'])}")
        _evidence(incident.get("evidence") or {}, args.tail)
    return EXIT_OK


def nodes(client: Client, args) -> int:
    """One line per node: health, drain state, GPUs (healthy of all), the generations it runs."""
    rows = client.list("/nodes", limit=args.limit, health=args.health)
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    _table(["ID", "HOSTNAME", "HEALTH", "SCHEDULING", "GPUS", "JOB", "HEARTBEAT", "REASON"],
           [[n["id"], n["hostname"], n["health"], n["schedulability"] + (" (spare)" if n["is_spare"] else ""),
             _gpus(n["gpus"]), _running(n["running"]), (n["last_heartbeat_at"] or "-")[:19],
             n["drain_reason"] or n["health_reason"] or ""] for n in rows])
    return EXIT_OK


def _gpus(gpus: list[dict]) -> str:
    if not gpus:
        return "-"
    healthy = sum(1 for g in gpus if g.get("health") == "healthy")
    names = sorted({g.get("name") or "?" for g in gpus})
    return f"{healthy}/{len(gpus)} {','.join(names)}"


def _running(running) -> str:
    """``job 7 gen 2`` for each generation the node's agent said it runs; "-" when idle."""
    if not isinstance(running, list) or not running:
        return "-"
    return ", ".join(f"job {r.get('job')} gen {r.get('generation')}" for r in running if isinstance(r, dict)) or "-"


def _evidence(evidence: dict, tail: int, indent: str = "    ") -> None:
    for name, value in evidence.items():
        if name == "log_tail" and isinstance(value, list):
            print(f"{indent}log tail (last {min(tail, len(value))} lines):")
            for line in value[-tail:]:
                print(f"{indent}  | {line}")
        elif isinstance(value, dict) and name in ("detail", "evidence"):
            _evidence(value, tail, indent)
        elif value not in (None, "", [], {}):
            print(f"{indent}{name:<14} {json.dumps(value) if isinstance(value, (dict, list)) else value}")


def drain(client: Client, args) -> int:
    """drain, undrain, clear-lemon: each its own audited action (an undrain never clears a lemon)."""
    node = _node(client, args.node)
    verb = args.command if args.command in ("undrain", "clear-lemon") else "drain"
    answer = client.post(f"/nodes/{node['id']}/{verb}", {"reason": args.reason})
    text = f"node {answer['hostname']}: {answer['schedulability']} (health {answer['health']})"
    if answer.get("lemon_cleared") is not None:
        text += f"; lemon count {answer['lemon_cleared']} cleared"
    if answer.get("warning"):
        text += f"\nwarning: {answer['warning']}"
    _say(args, text, answer)
    return EXIT_OK


def job_action(client: Client, args) -> int:
    body: dict = {"reason": args.reason}
    if args.command in ("approve", "rollback"):
        body["force"] = args.force
    if args.command == "rollback":
        body["checkpoint"] = args.to
        if args.skip_data:
            body["skip_data"] = list(args.skip_data)
    job = client.post(f"/jobs/{args.job}/{args.command}", body)
    _say(args, f"job {job['id']} ({job['name']}): {job['state']}", job)
    return EXIT_OK


def resize(client: Client, args) -> int:
    """A new world size: a running job pauses at a checkpoint and resumes on it; a paused job takes
    it at its next resume. A size left out stays what it is."""
    if args.nnodes is None and args.nproc_per_node is None:
        return _fail("give --nnodes, --nproc-per-node or both", EXIT_USAGE)
    current = client.get(f"/jobs/{args.job}")
    body = {"nnodes": args.nnodes if args.nnodes is not None else current["nnodes"],
            "nproc_per_node": args.nproc_per_node if args.nproc_per_node is not None else current["nproc_per_node"],
            "reason": args.reason}
    job = client.post(f"/jobs/{args.job}/resize", body)
    then = ("pausing at a checkpoint, then resuming on it" if job["state"] != "paused"
            else "paused: the next resume (approve, rollback) takes it")
    _say(args, f"job {job['id']} ({job['name']}): resize to {body['nnodes']} node(s) × {body['nproc_per_node']} "
               f"process(es); {then}", job)
    return EXIT_OK


def checkpoints(client: Client, args) -> int:
    rows = client.list(f"/jobs/{args.job}/checkpoints", limit=args.limit, state=args.state)
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    _table(["ID", "STEP", "GEN", "STATE", "PERMANENT", "PARENT", "SIZE", "CREATED", "LOCATION"],
           [[c["id"], c["step"], _dash(c["generation"]), c["state"], "yes" if c["permanent"] else "",
             _dash(c["parent"]), _size(c["size_bytes"]), c["created_at"][:19], c["location"]] for c in rows])
    return EXIT_OK


# --- helpers --------------------------------------------------------------------------------------

def _ci_key(spec) -> str | None:
    """With a CI run id in the environment: the same run + the same spec = the same launch."""
    for name in CI_RUN_VARIABLES:
        if os.environ.get(name):
            digest = hashlib.sha256(json.dumps(spec.body, sort_keys=True).encode()).hexdigest()[:16]
            return f"{name}:{os.environ[name]}:{digest}"[:200]
    return None


def _node(client: Client, ref: str) -> dict:
    if ref.isdigit():
        return client.get(f"/nodes/{ref}")
    found = client.list("/nodes", hostname=ref)
    if not found:
        raise ApiError(404, "Not Found", f"no node with hostname {ref!r}")
    return found[0]


def _skip_range(text: str) -> tuple[int, int]:
    start, sep, end = text.partition(":")
    if not sep or not start.isdigit() or not end.isdigit() or int(start) >= int(end):
        raise argparse.ArgumentTypeError("expected START:END sample indices with START < END, e.g. 1000:2000")
    return int(start), int(end)


def _describe(exc: ApiError) -> str:
    lines = [str(exc)]
    for error in exc.errors:
        reason = error.get("reason")
        if reason and reason not in exc.detail:
            lines.append(f"  {error.get('field') or 'body'}: {reason}")
    return "\n".join(lines)


def _say(args, text: str, payload) -> None:
    print(json.dumps(payload, indent=2) if args.json else text, flush=True)


def _fail(message: str, code: int) -> int:
    print(f"nightwatch: {message}", file=sys.stderr, flush=True)
    return code


def _dash(value) -> str:
    return "-" if value is None else str(value)


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024:
            return f"{count:.0f} {unit}"
        count /= 1024
    return f"{count:.1f} TB"


def _table(header: list[str], rows: list[list]) -> None:
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nightwatch", description="Launch, watch and steer Nightwatch jobs.",
                                     allow_abbrev=False,
                                     epilog="Exit codes: 0 completed, 1 failed, 2 usage or invalid spec, 3 paused "
                                            "(needs a human), 4 cancelled, 5 error, 6 timeout.")
    parser.add_argument("--url", default=os.environ.get("NIGHTWATCH_URL", "http://127.0.0.1:8000"),
                        help="control plane URL (env NIGHTWATCH_URL)")
    parser.add_argument("--token", help="API token (env NIGHTWATCH_TOKEN); prefer the environment or a file")
    parser.add_argument("--token-file", help="file holding the API token (env NIGHTWATCH_TOKEN_FILE)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--http-timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("launch", help="launch a job from a YAML spec")
    p.add_argument("spec", help="job spec file (YAML)")
    p.add_argument("--wait", action="store_true", help="wait for the outcome, showing progress")
    p.add_argument("--timeout", type=float, default=0, help="with --wait: give up after this many seconds")
    p.add_argument("--poll", type=float, default=2.0, help="with --wait: seconds between status polls")
    p.add_argument("--idempotency-key", help="retries with the same key never launch twice "
                                             "(default: derived from the CI run id, when there is one)")
    p.set_defaults(handler=launch)

    p = sub.add_parser("status", help="list jobs, or show one job's live status")
    p.add_argument("job", nargs="?", type=int)
    p.add_argument("--state", help="with no JOB: comma-separated states to list")
    p.add_argument("--limit", type=int, default=50)
    p.set_defaults(handler=status)

    p = sub.add_parser("logs", help="a job's training output (each generation's torchrun output)")
    p.add_argument("job", type=int)
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
    p.add_argument("--rank", type=int, help="only lines of this rank (those torch marks [rankN]:)")
    p.add_argument("--generation", type=int, help="only this generation")
    p.add_argument("--tail", type=int, default=200, help="lines to show first (default 200)")
    p.add_argument("--poll", type=float, default=1.0, help="with --follow: seconds between polls")
    p.set_defaults(handler=logs)

    p = sub.add_parser("incidents", help="incident evidence (exit codes, error lines, log tails) of a job")
    p.add_argument("job", type=int)
    p.add_argument("--incident", type=int, help="only this incident")
    p.add_argument("--tail", type=int, default=40, help="log lines per incident")
    p.add_argument("--limit", type=int, default=100, help="newest incidents to show")
    p.set_defaults(handler=incidents)

    p = sub.add_parser("nodes", help="the fleet: health, drain state, GPUs, the job each node runs")
    p.add_argument("--health", help="comma-separated: healthy, degraded, unhealthy, unreachable…")
    p.add_argument("--limit", type=int, default=500)
    p.set_defaults(handler=nodes)

    for verb, text in (("drain", "take a node out of scheduling"), ("undrain", "put a node back into scheduling"),
                       ("clear-lemon", "clear a repaired node's lemon count, so that placement may pick it again")):
        p = sub.add_parser(verb, help=text)
        p.add_argument("node", help="hostname or id")
        p.add_argument("--reason", required=True, help="recorded in the audit log")
        p.set_defaults(handler=drain)

    for verb, text in (("approve", "approve resuming a paused job (on-call)"),
                       ("pause", "checkpoint and pause a job"), ("checkpoint", "checkpoint a running job now"),
                       ("cancel", "cancel a job"),
                       ("rollback", "resume a paused job from an earlier verified checkpoint")):
        p = sub.add_parser(verb, help=text)
        p.add_argument("job", type=int)
        p.add_argument("--reason", required=True, help="recorded in the audit log")
        if verb in ("approve", "rollback"):
            p.add_argument("--force", action="store_true",
                           help="resume although a node of the old generation never confirmed its ranks stopped")
        if verb == "rollback":
            p.add_argument("--to", type=int, required=True, metavar="CKPT", help="checkpoint id")
            p.add_argument("--skip-data", type=_skip_range, metavar="A:B", help="global sample range to skip")
        p.set_defaults(handler=job_action)

    p = sub.add_parser("resize", help="change a job's world size (pause at a checkpoint, resume on the new size)")
    p.add_argument("job", type=int)
    p.add_argument("--nnodes", type=int, help="nodes (default: as now)")
    p.add_argument("--nproc-per-node", type=int, help="processes per node (default: as now)")
    p.add_argument("--reason", default="resized with nightwatch resize", help="recorded in the audit log")
    p.set_defaults(handler=resize)

    p = sub.add_parser("checkpoints", help="a job's checkpoints, newest first")
    p.add_argument("job", type=int)
    p.add_argument("--state", help="comma-separated: committed, verified, corrupt, deleted")
    p.add_argument("--limit", type=int, default=50)
    p.set_defaults(handler=checkpoints)
    for command in sub.choices.values():  # --json after the command works too
        command.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    return parser


if __name__ == "__main__":
    sys.exit(main())

"""A node lost under a 2-node job, the job moved onto a spare: Nightwatch vs plain torchrun's restart.

Issue 20's target: fault -> first step on the spare within 1.0 x plain ``torchrun --max-restarts``
restarting a crashed rank on the same node (torchrun has no spare to go to: a lost node ends its run).

- **Nightwatch**: the whole stack on this machine (daphne, a Celery worker with beat, PostgreSQL,
  Redis) and three node agents, each with node memory of its own (the agent's ``snapshot_dir``):
  ``lost-N`` (a fresh one per run), ``survivor`` and ``spare`` (``is_spare``). The example job
  (``examples/train.py``, 2 ranks on CPU/gloo, one per node, steps padded to 0.1 s, a disk checkpoint
  every 10 steps, an in-memory snapshot every step copied to the other node) runs on ``lost-N`` and
  ``survivor``. ``lost-N``'s scripted GPU then raises Xid 79 ("fallen off the bus") at a set time:
  the node is out for good. The control plane drains it and relaunches the job on ``survivor`` and
  ``spare`` (c10d's rendezvous numbers them as they join). The survivor restores its new rank's
  snapshot from whichever copy it holds (its own, or the partner copy it kept for the lost node),
  and sends the other rank's to the spare: no disk, at most a step lost.
- **plain torchrun**: ``bench.recovery``'s crash run (``--standalone --max-restarts=3``, rank 1
  SIGKILLed once step 15 was trained and a checkpoint verified), in the same invocation, interleaved.

Measured from the fault: for Nightwatch the Xid's own time (the incident's fault time, by the lost
node's clock, which is this machine's); for torchrun the SIGKILL. Recovery is the first line of the
per-rank ``--log-samples`` files written after the relaunch (torchrun: with ``attempt`` >= 1), seen by a
20 ms poll. Each Nightwatch run also reports the incident's timeline, the nodes of the next
generation, what each rank restored (a snapshot on the node, ``rankR:STEP`` when received from the
partner, or a checkpoint directory) and the steps lost.

    python -m bench.node_loss [--quick] [--runs N] [--warm-workers] [--keep-logs]

``--quick`` (3 runs) takes about 4 minutes on 2 cores. Needs PostgreSQL and Redis, as
``bench.recovery`` (the same database and Redis database, emptied).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import urllib.parse
from pathlib import Path

from bench._common import arguments, emit, median, spread
from bench.recovery import (
    CKPT_EVERY,
    DEFAULT_URL,
    FAULT_STEP,
    REDIS_DB,
    Tail,
    bootstrap_token,
    describe,
    figure,
    first_sample,
    kill,
    lost_steps,
    operator_token,
    plain_run,
    prepare,
    process_start,
    reached,
    setup_django,
    spawned,
    train_args,
)
from tests.e2e.cluster import wait_for

#: Issue 20: a node lost onto a spare recovers within torchrun's own restart on the same node.
TARGET_RATIO = 1.0
#: When the lost node's scripted GPU fails, after its agent starts: the job must have trained step
#: ``FAULT_STEP``, verified a checkpoint and settled by then (a run where it did not is an error).
XID_AT_S = 40.0
XID_CODE = 79
SURVIVOR, SPARE = "survivor", "spare"


def start_node(cluster, hostname: str, *, warm: bool, xid_at: float | None = None) -> float:
    """Start ``hostname``'s agent (node memory of its own); returns when its GPU will fail, or 0."""
    from nodes.models import Node

    events = [{"at": f"{xid_at}s", "gpu": 0, "xid": XID_CODE}] if xid_at is not None else []
    started = time.time()
    cluster.start_agent(hostname, bootstrap_token=bootstrap_token(), scenario={"gpus": 1, "events": events},
                        extra=["--snapshot-dir", str(cluster.tmp / "memory" / hostname),
                               *(["--warm-workers", "true"] if warm else [])])
    wait_for(lambda: Node.objects.filter(hostname=hostname, health="healthy").exists(), timeout=60,
             what=f"{hostname}'s agent to register")
    return started + xid_at if xid_at is not None else 0.0


def nightwatch_run(cluster, token: str, run: int, opts: argparse.Namespace) -> dict:
    from checkpoints.models import Checkpoint
    from jobs.choices import JobState
    from jobs.models import Generation, Incident, Job, StepMetric
    from tests.e2e.cluster import api, rank_pids
    from tests.ports import free_port

    lost = f"lost-{run + 1}"
    work = Path(tempfile.mkdtemp(prefix="nw-node-", dir=cluster.tmp))
    xid_by = start_node(cluster, lost, warm=opts.warm_workers, xid_at=XID_AT_S)
    body = {"name": f"bench-node-loss-{run + 1}", "entrypoint": "examples/train.py", "nnodes": 2,
            "nproc_per_node": 1, "accelerator": "cpu", "rdzv_port": free_port(), "args": train_args(work),
            "checkpoint_policy": {"dir": str(work / "ckpt"), "interval_steps": CKPT_EVERY,
                                  "snapshot_every": opts.snapshot_every}}
    status, job = api(cluster, token, "POST", "/api/v1/jobs", body)
    if status != 201:
        raise RuntimeError(f"launch refused ({status}): {job}")
    job_id = job["id"]
    tail = Tail(work, ("samples/rank*.jsonl",))
    try:
        first_nodes = wait_for(lambda: set(Generation.objects.filter(job_id=job_id, number=1)
                                           .values_list("nodes__hostname", flat=True)) - {None}, timeout=30,
                               what="generation 1's placement")
        if first_nodes != {lost, SURVIVOR}:
            raise RuntimeError(f"generation 1 was placed on {sorted(first_nodes)}, not on {lost} and {SURVIVOR}")
        wait_for(lambda: reached(tail, FAULT_STEP), timeout=XID_AT_S, what=f"job {job_id} to train step {FAULT_STEP}")
        checkpoint = wait_for(lambda: Checkpoint.objects.filter(job_id=job_id, state="verified", step__gte=CKPT_EVERY)
                              .order_by("-step").first(), timeout=XID_AT_S, what="a verified checkpoint")
        if time.time() > xid_by - 2:
            raise RuntimeError(f"job {job_id} was not settled 2 s before {lost}'s Xid: raise XID_AT_S")

        generation = wait_for(lambda: Generation.objects.filter(job_id=job_id, number=2, first_step_at__isnull=False)
                              .first(), timeout=XID_AT_S + 120, what=f"job {job_id}'s generation on the spare")
        incidents = list(Incident.objects.filter(job_id=job_id).order_by("detected_at"))
        incident = next(i for i in incidents if i.relaunched_at is not None)
        fault_at = incident.fault_at.timestamp()
        relaunched = incident.relaunched_at.timestamp()

        def first_line(rank: int) -> tuple[float, dict] | None:
            return first_sample(tail, lambda seen, r: seen > relaunched and r["rank"] == rank)

        resumed = [wait_for(lambda rank=rank: first_line(rank), timeout=30,
                            what=f"rank {rank}'s first sample line after the relaunch") for rank in (0, 1)]
        first = min(resumed, key=lambda item: item[0])
        restarted = spawned(list(rank_pids(job_id, 2, cluster.tmp).values()))
        reported = (StepMetric.objects.filter(job_id=job_id, generation=2).order_by("reported_at")
                    .values_list("reported_at", flat=True).first())
        at = {name: getattr(incident, f"{name}_at").timestamp() - fault_at
              for name in ("detected", "quiesced", "relaunched")}
        restored = {record["rank"]: record.get("restored") for _, record in resumed}
        return {
            "system": "nightwatch", "fault": "node_loss", "lost_node": lost,
            "incident": incident.kind, "decision": incident.decision,
            "incidents": [f"{i.kind}:{i.decision}" for i in incidents],
            "xid_scheduled_at_s": round(xid_by - fault_at, 3),  # the agent's clock started a little after ours
            "next_nodes": list(generation.nodes.order_by("hostname").values_list("hostname", flat=True)),
            "checkpoint_step": checkpoint.step, "detection_s": round(at["detected"], 3),
            "quiesced_s": round(at["quiesced"], 3), "relaunched_s": round(at["relaunched"], 3),
            "workers_spawned_s": round(restarted["workers"] - fault_at, 3) if restarted else None,
            "spawn_to_first_step_s": round(first[0] - restarted["workers"], 3) if restarted else None,
            "recovery_s": round(first[0] - fault_at, 3),
            "first_step_reported_s": round(reported.timestamp() - fault_at, 3) if reported else None,
            "resumed_from_step": first[1]["step"] - 1, "restored": restored,
            "from_snapshots": all(isinstance(r, str) and "/ckpt/" not in r for r in restored.values()),
            # c10d's rendezvous numbers the nodes as they join (torchrun ignores --node-rank with it):
            # whichever rank the spare got, it holds nothing and receives its snapshot.
            "received_from_partner": sorted(rank for rank, path in restored.items()
                                            if isinstance(path, str) and path.startswith("rank")),
            # The lost node's ranks train on until they are stopped (the GPU's failure is scripted):
            # what counts is what the old generation trained that the new one trains again.
            "lost_steps": lost_steps(tail, relaunched, first[1]["step"]),
        }
    finally:
        tail.close()
        job_row = Job.objects.filter(pk=job_id).first()
        if job_row is not None and job_row.state not in JobState.TERMINAL:
            api(cluster, token, "POST", f"/api/v1/jobs/{job_id}/cancel", {"reason": "benchmark cleanup"})
        ranks = {pid for g in range(1, 4) for pid in rank_pids(job_id, g, cluster.tmp).values()}
        parents = {start[1] for start in map(process_start, ranks) if start}
        try:
            wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in ranks | parents), timeout=30,
                     what="the job's processes to exit")
        except AssertionError:
            for pid in ranks | parents:
                kill(pid)
        cluster.procs[f"agent-{lost}"].stop()
        if not opts.keep_logs:
            shutil.rmtree(work, ignore_errors=True)


def summarise(nightwatch: list[dict], torchrun: list[dict], opts: argparse.Namespace, runs: int,
              elapsed: float) -> None:
    def col(rows: list[dict], key: str) -> list:
        return [r[key] for r in rows if r.get(key) is not None]

    ratios = [round(n["recovery_s"] / t["recovery_s"], 3) for n, t in zip(nightwatch, torchrun)]
    print()
    print(f"{'system':28} {'detection s: median [min-max]':32} {'recovery s: median [min-max]':32}")
    print(f"{'Nightwatch, node onto spare':28} {describe(col(nightwatch, 'detection_s')):32} "
          f"{describe(col(nightwatch, 'recovery_s')):32}")
    print(f"{'torchrun, crash on the node':28} {describe(col(torchrun, 'detection_s')):32} "
          f"{describe(col(torchrun, 'recovery_s')):32}")
    snapshots = sum(bool(r["from_snapshots"]) for r in nightwatch)
    received = sum(len(r["received_from_partner"]) == 1 for r in nightwatch)
    print(f"node loss onto a spare / torchrun's restart: median {median(ratios):.2f} (runs {ratios}; target <= "
          f"{TARGET_RATIO}); lost steps Nightwatch {col(nightwatch, 'lost_steps')}, torchrun "
          f"{col(torchrun, 'lost_steps')}; resumed from snapshots in {snapshots} of {len(nightwatch)} runs, the "
          f"spare's rank from its partner's copy in {received}; {elapsed:.0f} s in all", flush=True)
    keys = ("detection_s", "quiesced_s", "relaunched_s", "workers_spawned_s", "spawn_to_first_step_s", "recovery_s",
            "first_step_reported_s")
    details = {
        "node_loss": {
            "nightwatch": {"detection_s": figure(col(nightwatch, "detection_s")),
                           "recovery_s": figure(col(nightwatch, "recovery_s")),
                           "lost_steps": col(nightwatch, "lost_steps"),
                           "resumed_from_snapshots": f"{snapshots} of {len(nightwatch)} runs",
                           "spare_received_from_partner": f"{received} of {len(nightwatch)} runs",
                           "timeline_median_s": {k: round(median(col(nightwatch, k)), 3) for k in keys
                                                 if col(nightwatch, k)}},
            "torchrun": {"detection_s": figure(col(torchrun, "detection_s")),
                         "recovery_s": figure(col(torchrun, "recovery_s")),
                         "lost_steps": col(torchrun, "lost_steps")},
            "ratio": {"median": round(median(ratios), 3), "spread": [round(v, 3) for v in spread(ratios)],
                      "runs": ratios, "target": TARGET_RATIO, "better": "lower"},
        },
        "runs": {"nightwatch": nightwatch, "torchrun": torchrun},
        "setup": {"job": f"examples/train.py, 2 ranks (gloo, CPU), steps padded to 0.1 s, a checkpoint every "
                         f"{CKPT_EVERY} steps, a snapshot every {opts.snapshot_every} step(s)",
                  "nightwatch": "daphne + celery worker -B + 3 agents on this machine (the lost node, the survivor, "
                                f"the spare; heartbeat {opts.heartbeat_s} s), one rank per node; the lost node's "
                                f"scripted GPU raises Xid {XID_CODE} {XID_AT_S:g} s after its agent started; warm "
                                f"workers: {opts.warm_workers}",
                  "torchrun": "bench.recovery's crash run: --nproc-per-node=2 --standalone --max-restarts=3, rank 1 "
                              "SIGKILLed once step 15 was trained and a checkpoint verified",
                  "elapsed_s": round(elapsed)},
    }
    emit("node_loss", metric="node_loss_over_torchrun_restart", value=round(median(ratios), 3), target=TARGET_RATIO,
         better="lower", unit="ratio", runs=runs, spread=[round(v, 3) for v in spread(ratios)], details=details)


def main(argv: list[str] | None = None) -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--warm-workers", action="store_true", help="the agents fork ranks from a zygote")
    own.add_argument("--snapshot-every", type=int, default=1, help="the job's checkpoint_policy.snapshot_every (1)")
    own.add_argument("--heartbeat-s", type=int, default=1, help="control plane's agent heartbeat interval")
    own.add_argument("--keep-logs", action="store_true", help="keep the temporary directory (logs) and say where")
    opts, rest = own.parse_known_args(argv)
    args = arguments(__doc__.splitlines()[0], rest)
    url = os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL)
    name = urllib.parse.urlsplit(url).path.lstrip("/")

    import torch  # noqa: F401 - recorded in the machine description

    started = time.monotonic()
    prepare(url)
    setup_django(url)
    from nodes.models import Node
    from tests.e2e.cluster import Cluster

    base = Path(tempfile.mkdtemp(prefix="nightwatch-bench-node-loss-"))
    nightwatch: list[dict] = []
    torchrun: list[dict] = []
    cluster = None
    try:
        cluster = Cluster(base / "cluster", database_name=name, redis_db=REDIS_DB,
                          settings={"DATABASE_URL": url, "NIGHTWATCH_HEARTBEAT_INTERVAL_S": str(opts.heartbeat_s),
                                    "NIGHTWATCH_SWEEP_INTERVAL_S": "0.5", "DEBUG": "0",
                                    "NIGHTWATCH_CHECKPOINT_ROOT": str(base / "cluster")})
        cluster.start_web()
        cluster.start_worker(checkpoint_worker=True)
        token = operator_token()
        for host in (SURVIVOR, SPARE):
            start_node(cluster, host, warm=opts.warm_workers)
        Node.objects.filter(hostname=SPARE).update(is_spare=True)
        for run in range(args.runs):
            order = ("nightwatch", "torchrun") if run % 2 == 0 else ("torchrun", "nightwatch")
            for system in order:
                if system == "nightwatch":
                    result = nightwatch_run(cluster, token, run, opts)
                    nightwatch.append(result)
                else:
                    result = plain_run("crash", base, 30.0, keep=opts.keep_logs)
                    torchrun.append(result)
                shown = {k: v for k, v in result.items() if k not in ("system", "fault")}
                print(f"run {run + 1}/{args.runs} {system:10} {json.dumps(shown)}", flush=True)
    except Exception:
        traceback.print_exc()
        if cluster is not None:
            print(cluster.dump_logs(), file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if cluster is not None:
            cluster.close()
        from django.db import connections

        connections.close_all()
        if opts.keep_logs:
            print(f"logs kept in {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    summarise(nightwatch, torchrun, opts, args.runs, time.monotonic() - started)


if __name__ == "__main__":
    main()

"""docs/benchmarks/chaos.md and chaos.png from the chaos benchmark's result (``bench/chaos.py``).

The figure shows training progress (rank 0's step) against wall time for every side, one panel
each, with the injected faults drawn where they landed; the Markdown holds the table the issue
asks for, the fault schedule (the ground truth) and each fault's fate, so a reader can check
every figure against what happened.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench import _faults as F

LABELS = {"nightwatch": "Nightwatch", "torchrun": "plain torchrun"}
COLOURS = {F.RANK_KILL: "tab:red", F.RANK_HANG: "tab:purple", F.AGENT_DEATH: "tab:brown", F.XID: "tab:orange",
           F.NAN: "tab:olive", F.CORRUPT_CHECKPOINT: "tab:pink", F.CONTROL_PLANE_OUTAGE: "tab:cyan"}


NOTES = "## Notes (written by hand, kept when the report is regenerated)"


def write(result: dict, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    plot(result, directory / "chaos.png")
    page = directory / "chaos.md"
    notes = ""
    if page.exists() and NOTES in page.read_text():
        notes = page.read_text()[page.read_text().index(NOTES):]
    page.write_text(markdown(result) + ("\n" + notes if notes else ""))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    runs = result["details"]["runs"]
    sides = list(runs)
    figure, axes = plt.subplots(len(sides), 1, figsize=(11, 3.4 * len(sides)), sharex=True, squeeze=False)
    for ax, side in zip(axes[:, 0], sides, strict=True):
        run = runs[side][-1]
        for i, piece in enumerate(pieces(run["timeline"])):
            t, step = zip(*piece, strict=True)
            ax.plot(t, step, lw=1.4, color="black", marker="." if len(piece) == 1 else None,
                    label="rank 0 step" if i == 0 else None)
        shown = set()
        for fault in run["faults"]:
            at = fault.get("effective_at_s", fault["at_s"])
            style = "-" if fault.get("applied") else ":"
            ax.axvline(at, color=COLOURS[fault["kind"]], ls=style, lw=1.4,
                       label=None if fault["kind"] in shown else fault["kind"].replace("_", " "))
            shown.add(fault["kind"])
        for item in run.get("human_interventions", []):
            ax.axvline(item["approved_at_s"], color="grey", ls="--", lw=1)
        ax.set_title(f"{LABELS.get(side, side)}: ETTR {run['ettr']:.1%}, lost steps {run['lost_steps']}, "
                     f"human interventions {run['human_interventions_count']}  ({_newest(runs[side])})", fontsize=10)
        ax.set_ylabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    axes[-1, 0].set_xlabel("wall time since the side's start, s (dotted: fault not applicable; grey dashed: on-call)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def pieces(timeline: list[list[float]], gap_s: float = 2.0) -> list[list[list[float]]]:
    """The timeline cut where training stood still or went back, so no line bridges an outage."""
    out: list[list[list[float]]] = []
    for point in timeline:
        if not out or point[0] - out[-1][-1][0] > gap_s or point[1] < out[-1][-1][1]:
            out.append([])
        out[-1].append(point)
    return out


def _fate(fault: dict) -> str:
    words = [fault.get("note") or "", f"node {fault['node']}" if fault.get("node") else ""]
    if fault.get("detected_as"):
        words.append(f"noticed as {fault['detected_as']}")
    later = fault.get("resumed_after_later_faults")
    if later:
        words.append(f"next resume at {later['at_s']:.1f} s, after " + ", ".join(later["kinds"]))
    return "; ".join(w for w in words if w)


def _newest(rows: list) -> str:
    return "the run" if len(rows) == 1 else f"run {len(rows)}, the newest"


def _p(figure: dict | None) -> str:
    return f"{figure['p50']:.1f} / {figure['max']:.1f}" if figure else "—"


def _median(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:g}"
    return f"{statistics.median(values):g} [{min(values):g}–{max(values):g}]"


def markdown(result: dict) -> str:
    details = result["details"]
    setup, runs = details["setup"], details["runs"]
    run_info = details.get("run_info", [])
    newest = _newest(next(iter(runs.values())))
    machine = result["machine"]
    quick = setup["quick"]
    lines = [
        "# Goodput under failure: Nightwatch vs plain `torchrun --max-restarts`",
        "",
        "`bench/chaos.py` (issue 11): the same seeded fault schedule against the example job, once under "
        "Nightwatch and once under plain `torchrun`, "
        + ("both at the same time (sharing the machine's load)" if setup.get("together") else "one after the other")
        + ". Generated by the benchmark itself.",
        "",
    ]
    if quick:
        lines += ["> **Quick run on a shared machine**: short runs (not the 30-minute, three-run "
                  "report the issue asks for). Other sessions' tests and benchmarks were running at the same "
                  "time, so the absolute times are noisy.", ""]
    lines += [
        f"- **Command**: `{result['command']}` ({setup['elapsed_s']} s in all); the runs reported, each with "
        "its commit and command, are listed under *Runs* below",
        f"- **Machine**: {machine.get('nproc')} CPUs, {machine.get('memory_gib')} GiB, Python {machine.get('python')}, "
        f"torch {machine.get('torch')}",
        f"- **Run**: {setup['duration_s']:g} s of wall time per side, faults with a mean time between failures of "
        f"{setup['mtbf_s']:g} s (seed {setup['seed']}), {result['runs']} run(s) of each side",
        f"- **Job**: `examples/train.py`, {setup['world_size']} ranks (gloo, CPU), {setup['step_s']} s steps, "
        f"{setup['batch_size']} samples a rank a step",
        f"- **Nightwatch**: daphne + Celery worker with beat + two agents (node-b a spare); "
        f"`checkpoint_policy.interval: auto` starting at {setup['ckpt_every']} steps (the Young/Daly push runs every "
        f"5 min; `NIGHTWATCH_GPU_MTBF_HOURS={setup['gpu_mtbf_hours']}` before the job has failure history); "
        f"`progress_timeout_s` {setup['progress_timeout_s']}, a start-up deadline of 3 × the job's slowest start "
        f"but at least {setup.get('startup_floor_s', 60)} s, restart backoff 0 s, a budget of "
        f"{setup['plain_max_restarts']} restarts an hour; on-call answers a pause after "
        f"{setup['human_response_s']:g} s by approving; a killed agent is restarted after "
        f"{setup['agent_restart_s']:g} s; an outage lasts {setup['outage_s']:g} s; agents heartbeat every second "
        f"and a node is unreachable after {setup.get('heartbeat_misses', 3)} missed",
        f"- **plain torchrun**: `--max-restarts={setup['plain_max_restarts']}`, a checkpoint every "
        f"{setup['ckpt_every']} steps, resume from the newest checkpoint in the directory that passes the hooks' "
        "manifest check (see *corrupt checkpoints* below)",
        "",
        "## Results",
        "",
        "| | " + " | ".join(LABELS.get(s, s) for s in runs) + " |",
        "| --- | " + " | ".join("---" for _ in runs) + " |",
    ]
    rows = [("ETTR (productive / wall)", "ettr"), ("first step after, s (cold start)", "first_step_s"),
            ("ETTR after the first step", "ettr_after_first_step"), ("steps in the final model", "steps_surviving"),
            ("lost steps (trained, then thrown away)", "lost_steps"), ("samples trained twice", "trained_twice"),
            ("samples skipped", "skipped"), ("corrupt checkpoints loaded", "corrupt_checkpoints_loaded"),
            ("resumes where the newest directory was corrupt", "newest_dir_was_corrupt_at_resume"),
            ("human interventions", "human_interventions_count")]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(_median(runs[s], key) for s in runs) + " |")
    if run_info:
        lines += ["", "### Runs", "", "The spread above is over these runs: every run made with exactly these settings "
                  "(`bench/results/chaos-runs/`), the newest "
                  f"{len(run_info)}, whichever invocation made them.", "",
                  "| run | finished (UTC) | commit | command | wall time, s | "
                  + " | ".join(f"{LABELS.get(s, s)} ETTR" for s in runs) + " |",
                  "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in runs) + " |"]
        for number, info in enumerate(run_info, 1):
            lines.append(f"| {number} | {info['finished_at'].replace('+00:00', '')} | `{info['commit']}` | "
                         f"`{info['command']}` | {info['elapsed_s']} | "
                         + " | ".join(f"{info['ettr'][s]:.4f}" if s in info["ettr"] else "—" for s in runs) + " |")
    lines += ["", f"Detection / recovery per fault kind, seconds, p50 / max over the faults of {newest} "
              "(detected and recovered counts of applied faults):", "",
              "| fault | " + " | ".join(f"{LABELS.get(s, s)} detection | recovery" for s in runs) + " |",
              "| --- | " + " | ".join("--- | ---" for _ in runs) + " |"]
    for kind in F.KINDS:
        cells = []
        for side in runs:
            info = runs[side][-1]["by_kind"].get(kind)
            if not info:
                cells.append("— | —")
            elif not info["injected"]:
                cells.append("not applicable | —")
            else:
                cells.append(f"{_p(info['detection_s'])} ({info['detected']}/{info['injected']}) | "
                             f"{_p(info['recovery_s'])} ({info['recovered']}/{info['injected']})")
        lines.append(f"| {kind.replace('_', ' ')} | " + " | ".join(cells) + " |")
    lines += ["", "![steps vs wall time, faults marked](chaos.png)", "", "## Fault schedule (ground truth)", "",
              "| at, s | kind | target |", "| --- | --- | --- |"]
    lines += [f"| {f['at']:.1f} | {f['kind']} | {f['target']} |" for f in details["schedule"]]
    for side in runs:
        run = runs[side][-1]
        lines += ["", f"### What happened: {LABELS.get(side, side)} ({newest})", "",
                  "| at, s | kind | applied | detection, s | recovery, s | resumed from step | note |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for fault in run["faults"]:
            lines.append(f"| {fault.get('effective_at_s', fault['at_s']):.1f} | {fault['kind']} | "
                         f"{'yes' if fault.get('applied') else 'no'} | {fault.get('detection_s') or '—'} | "
                         f"{fault.get('recovery_s') or '—'} | {fault.get('resumed_step') or '—'} | "
                         f"{_fate(fault)} |")
        if run.get("incidents"):
            lines += ["", "Incidents: " + ", ".join(f"{i['at_s']:.1f} s {i['kind']} → {i['decision']}"
                                                    for i in run["incidents"])]
        for item in run.get("human_interventions", []):
            lines.append(f"- on-call: paused at {item['paused_at_s']} s, approved at {item['approved_at_s']} s "
                         f"(HTTP {item['status']}): {item['pause_reason']}")
        if run.get("exited_at_s"):
            lines.append(f"- torchrun exited at {run['exited_at_s']} s (exit code {run['returncode']}); the rest "
                         "of the run trained nothing")
    lines += ["", "## How the figures are read", "",
              "- From the per-rank `--log-samples` lines only (the time is when the harness first saw a line, "
              "polled every 20 ms). A step survives if no later resume went back before it; ETTR is the time of "
              "the surviving steps over the side's wall time (start-up counts as not productive).",
              "- Detection: Nightwatch's incident `detected_at`; torchrun's first log line about a failed worker. "
              "Recovery: the first step of the next resumed segment after the fault.",
              "- *Corrupt checkpoints loaded*: a resume whose first step follows a checkpoint that the harness "
              "had corrupted. *Resumes where the newest directory was corrupt*: what a naive \"load the newest "
              "checkpoint directory\" resume would have loaded; both sides here run the Nightwatch hooks, "
              "which check the manifest's sha256 of every shard and skip such a directory.",
              "- Samples twice/skipped: the data set is larger than the run, so each sample id has one "
              "position in the stream; the surviving steps' ids are compared with the stream up to the "
              "furthest position trained.", ""]
    return "\n".join(lines)

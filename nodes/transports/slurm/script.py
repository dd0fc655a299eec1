"""A generation as a Slurm batch job: the ``sbatch`` options and the script body. Pure: no I/O.

The body is generated from a launch payload the wire protocol has already validated (the same
``LaunchPayload`` an agent would run), and every value in it is quoted with ``shlex.quote``; no
user-provided text is ever interpreted by the shell. What the script does on the allocation:

1. export the job's NCCL profile and the hooks' variables exactly as the agent's supervisor sets
   them (``agents.supervisor.Supervisor._environment``), including
   ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see PLATFORM-NOTES: restarts dial a dead peer without it);
2. take the rendezvous host from the first node of the allocation
   (``scontrol show hostnames "$SLURM_JOB_NODELIST"``);
3. check that the script (or every file of the module, ``agents.protocol.agent.module_files``) is
   in the work directory, as the agent's supervisor does, and exit 2 otherwise: an installed or
   standard-library module must never run in place of the job's own;
4. ``srun`` one ``torchrun`` per node with ``--max-restarts=0`` — Nightwatch decides restarts,
   from the latest verified checkpoint — and ``--kill-on-bad-exit`` so that a failed node ends
   the step everywhere; the script (or ``--module`` and the module) comes after every torchrun
   option, the job's arguments after it, each quoted as one word.

NCCL's file variables (``NCCL_DEBUG_FILE``…) are bare names in the profile, placed next to the
generation's output as ``generation-<n>-<name>``.

The hooks' token is not in the script (Slurm keeps scripts where more people can read them than
should hold a token): it comes through ``sbatch --export`` from ``sbatch``'s own environment.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath

from agents.protocol.agent import (
    LaunchPayload,
    module_files,
    nccl_environment,
    snapshot_environment,
    validate_launch,
)

#: Variables passed from sbatch's environment into the job; nothing else of the control plane's
#: environment (database URLs, secrets) leaves it.
EXPORTED = ("PATH", "LANG", "SLURM_CONF", "NIGHTWATCH_TOKEN")


@dataclass(frozen=True)
class BatchJob:
    """What ``sbatch`` is given: its options (an argument list) and the script on standard input."""

    options: list[str]
    script: str


def _hooks_environment(job: str, generation: int, p: LaunchPayload, spool_dir: str) -> dict[str, str]:
    """The hooks' variables (``agents.hooks.settings``), as the agent's supervisor sets them."""
    hooks = {"NIGHTWATCH_URL": p.hooks_url, "NIGHTWATCH_JOB": job, "NIGHTWATCH_GENERATION": str(generation),
             "NIGHTWATCH_CKPT_DIR": p.ckpt_dir, "NIGHTWATCH_RESUME_FROM": p.resume_from,
             "NIGHTWATCH_SPOOL_DIR": spool_dir,
             "NIGHTWATCH_SKIP_DATA": ",".join(f"{a}-{b}" for a, b in p.skip_data) or None,
             **snapshot_environment(p)}
    return {k: v for k, v in hooks.items() if v is not None}


def render(*, job: str, generation: int, payload: LaunchPayload, hostnames: list[str], excluded: list[str],
           python: str, workdir: str, output_path: str, spool_dir: str, partition: str | None = None,
           extra_options: list[str] | None = None) -> BatchJob:
    """The batch job that runs ``payload`` on exactly ``hostnames`` (placement chose them)."""
    validate_launch(payload)
    nccl_env = nccl_environment(payload.nccl_env, str(PurePosixPath(output_path).parent),
                                prefix=f"generation-{generation}-")
    for name in [*hostnames, *excluded]:
        if not name or any(c in name for c in " \t\n,=[]'\"$`\\") or name.startswith("-"):
            raise ValueError(f"not a single Slurm node name: {name!r}")
    port = payload.rdzv_endpoint.rsplit(":", 1)[-1]
    if not port.isdigit():
        raise ValueError(f"rdzv_endpoint {payload.rdzv_endpoint!r} has no port")
    options = [
        f"--job-name=nw-{job}-g{generation}",
        f"--nodes={len(hostnames)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(hostnames)}",
        "--exclusive",
        # Slurm's requeue would start the script again from the beginning; Nightwatch resubmits
        # a new generation from the latest verified checkpoint instead.
        "--no-requeue",
        f"--output={output_path}",
        f"--chdir={workdir}",
        f"--export={','.join(EXPORTED)}",
    ]
    if excluded:
        options.append(f"--exclude={','.join(excluded)}")
    if partition:
        options.append(f"--partition={partition}")
    options.extend(extra_options or [])
    environment = {**nccl_env, **_hooks_environment(job, generation, payload, spool_dir),
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
    torchrun = [python, "-m", "torch.distributed.run", f"--nnodes={len(hostnames)}",
                f"--nproc-per-node={payload.nproc_per_node}", "--rdzv-backend=c10d",
                f"--rdzv-id={payload.rdzv_id}", "--max-restarts=0"]
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# Nightwatch job {q(job)} generation {generation}: generated by the control plane; do not edit.",
        "set -euo pipefail",
        *(f"export {name}={q(value)}" for name, value in sorted(environment.items())),
        'rdzv_host="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        'echo "nightwatch: generation ' + str(generation) + ' on $SLURM_JOB_NODELIST, rendezvous at $rdzv_host"',
        # --export=ALL: srun would otherwise read sbatch's --export list (SLURM_EXPORT_ENV) and
        # drop every variable exported above.
        _target_check(payload),
        "srun --export=ALL --nodes=\"$SLURM_JOB_NUM_NODES\" --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        "  " + " ".join(q(a) for a in torchrun) + f' --rdzv-endpoint="$rdzv_host":{port} \\',
        "  " + " ".join(q(a) for a in [*_target(payload), *payload.args]),
        "",
    ]
    return BatchJob(options=options, script="\n".join(lines))


def _target(payload: LaunchPayload) -> list[str]:
    """torchrun's positional part before the job's arguments (``validate_launch`` checked it)."""
    return ["--module", payload.module] if payload.module is not None else [str(payload.script)]


def _target_check(payload: LaunchPayload) -> str:
    """A shell line that exits 2 unless the target's files are in the work directory."""
    alternatives = module_files(payload.module) if payload.module is not None else [(str(payload.script),)]
    test = " || ".join("{ " + " && ".join(f"[ -f {shlex.quote(f)} ]" for f in files) + "; }" for files in alternatives)
    what = f"module {payload.module}" if payload.module is not None else f"script {payload.script}"
    message = shlex.quote(f"nightwatch: the {what} is not in the work directory")
    return f'if ! {{ {test}; }}; then echo {message} "$PWD" >&2; exit 2; fi'


"""The one place Slurm commands run: argument lists, a timeout, parsed output, typed errors.

Every Slurm client command goes through ``run``; nothing else in Nightwatch starts ``sbatch``,
``scancel``, ``squeue``, ``sinfo`` or ``scontrol``. Arguments are always a list (never a shell
string); output is parsed from ``--json`` (``squeue``, ``sinfo``: Slurm 22.05's OpenAPI v0.0.38
shapes) or ``--parsable`` (``sbatch``).

Errors, so that callers can tell "Slurm is down" (degrade and back off) from "Slurm said no"
(a bad request; do not retry blindly):

- ``SlurmUnavailable``: the command is missing, timed out, or could not reach the controller;
- ``SlurmRefused``: the controller answered and refused (bad option, unknown node, no permission).

Slurm 22.05 ``squeue --json``/``sinfo --json`` exit 0 even when the controller is down and put
the failure in an ``errors`` list; that is checked too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

#: What Slurm prints when it cannot reach its controller (or the controller its daemons).
_UNREACHABLE_HINTS = ("unable to contact slurm controller", "connect failure", "connection refused",
                      "socket timed out", "communication connection failure", "zero bytes were transmitted",
                      "slurm_load_jobs", "slurm_load_node", "could not establish a configuration source",
                      "unable to establish")


class SlurmError(Exception):
    """A Slurm command failed; ``command`` is its argument list, ``detail`` what Slurm said."""

    def __init__(self, message: str, *, command: Sequence[str] = (), detail: str = ""):
        super().__init__(message)
        self.command = list(command)
        self.detail = detail


class SlurmUnavailable(SlurmError):
    """Slurm cannot be asked right now: not installed, timed out, or its controller is down."""


class SlurmRefused(SlurmError):
    """The controller answered and said no."""


@dataclass(frozen=True)
class SlurmJob:
    """One Slurm job as ``squeue --json`` shows it."""

    job_id: int
    name: str
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, …
    reason: str
    nodes: str
    exit_status: int | None  # the batch script's exit code
    exit_signal: int | None  # the signal that ended it, if one did

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES


#: Job states after which nothing of the job runs any more (COMPLETING is not one: epilogs run).
ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                          "PREEMPTED", "BOOT_FAIL", "DEADLINE"})


@dataclass(frozen=True)
class SlurmNode:
    """One node as ``sinfo --json`` shows it."""

    name: str
    address: str
    state: str  # base state, lower case: idle, allocated, mixed, down, unknown, …
    flags: tuple[str, ...] = field(default=())  # DRAIN, NOT_RESPONDING, COMPLETING, …
    reason: str = ""
    reason_by: str = ""
    partitions: tuple[str, ...] = field(default=())

    @property
    def drained(self) -> bool:
        """Drained or draining: Slurm will not give it new jobs."""
        return "DRAIN" in self.flags or self.state in ("drain", "drained", "draining")

    @property
    def busy(self) -> bool:
        return self.state in ("allocated", "mixed", "completing") or "COMPLETING" in self.flags

    @property
    def unreachable(self) -> bool:
        """Slurm gave up on it: down (slurmd silent past SlurmdTimeout, or set down) or failed. Not
        ``unknown``: a restarted slurmctld shows every node so until its slurmd registers again, and
        that must not look like the loss of every node."""
        return self.state in ("down", "future", "fail") or "FAIL" in self.flags

    @property
    def uncertain(self) -> bool:
        """Missed a ping (``idle*``, also briefly after every ``state=resume``) or not yet known."""
        return "NOT_RESPONDING" in self.flags or self.state == "unknown"


class Slurm:
    """Runs Slurm's client commands with ``timeout_s`` each. ``bin_dir``: where they are
    installed (default: found on PATH); ``env``: extra environment (e.g. ``SLURM_CONF``)."""

    def __init__(self, *, timeout_s: float = 30.0, bin_dir: str | None = None, env: Mapping[str, str] | None = None):
        self.timeout_s = timeout_s
        self.bin_dir = bin_dir
        self.env = dict(env or {})

    @classmethod
    def from_settings(cls) -> Slurm:
        conf = settings.NIGHTWATCH["SLURM"]
        return cls(timeout_s=conf["COMMAND_TIMEOUT_S"], bin_dir=conf["BIN_DIR"] or None)

    # --- the one runner -----------------------------------------------------------------------
    def run(self, tool: str, args: Sequence[str], *, input_text: str | None = None,
            env: Mapping[str, str] | None = None) -> str:
        """Run Slurm's ``tool`` with ``args``; its standard output, or a typed ``SlurmError``."""
        executable = str(Path(self.bin_dir) / tool) if self.bin_dir else shutil.which(tool)
        command = [executable or tool, *args]
        if executable is None or not os.access(executable, os.X_OK):
            raise SlurmUnavailable(f"{tool}: Slurm's client commands are not installed here", command=command)
        try:
            done = subprocess.run(command, input=input_text, capture_output=True, text=True,  # noqa: S603 - a list
                                  timeout=self.timeout_s, env={**os.environ, **self.env, **(env or {})}, check=False)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"{tool} did not answer within {self.timeout_s:g} s", command=command) from None
        except OSError as exc:
            raise SlurmUnavailable(f"{tool} could not be started: {exc}", command=command) from exc
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()
            kind = SlurmUnavailable if _unreachable(said) else SlurmRefused
            raise kind(f"{tool} failed (exit {done.returncode}): {said[:500] or 'no message'}", command=command,
                       detail=said)
        return done.stdout

    def _json(self, tool: str, args: Sequence[str]) -> dict:
        out = self.run(tool, [*args, "--json"])
        try:
            data = json.loads(out)
        except ValueError as exc:
            raise SlurmRefused(f"{tool} --json printed something that is not JSON: {out[:200]!r}",
                               command=[tool, *args]) from exc
        errors = [e for e in data.get("errors") or [] if e]
        if errors:
            said = "; ".join(": ".join(str(e[k]) for k in ("source", "description", "error") if e.get(k))
                             for e in errors)
            # 22.05 reports a controller it cannot reach this way, with exit status 0.
            raise SlurmUnavailable(f"{tool}: the Slurm controller did not answer ({said})", command=[tool, *args],
                                   detail=said)
        return data

    # --- jobs ---------------------------------------------------------------------------------
    def submit(self, script: str, options: Sequence[str], *, env: Mapping[str, str]) -> int:
        """``sbatch --parsable OPTIONS`` with the script on standard input; the new job's id."""
        out = self.run("sbatch", ["--parsable", *options], input_text=script, env=env).strip()
        job_id = out.split(";", 1)[0]  # "<id>" or "<id>;<cluster>"
        if not job_id.isdigit():
            raise SlurmRefused(f"sbatch printed no job id: {out[:200]!r}", command=["sbatch", *options])
        return int(job_id)

    def cancel(self, job_id: int) -> None:
        """``scancel``: SIGTERM to every step, SIGKILL after the cluster's KillWait. A job that has
        already ended is no error."""
        self.run("scancel", [str(int(job_id))])

    def jobs(self) -> dict[int, SlurmJob]:
        """Every job the controller still remembers (ended ones for ``MinJobAge``), by id.

        ``squeue --json`` of 22.05 ignores filters, so the caller picks its own."""
        data = self._json("squeue", ["--states=all"])
        return {job.job_id: job for job in map(_parse_job, data.get("jobs") or [])}

    def job_ids_named(self, name: str) -> list[int]:
        return sorted(j.job_id for j in self.jobs().values() if j.name == name)

    # --- nodes --------------------------------------------------------------------------------
    def nodes(self, partition: str | None = None) -> list[SlurmNode]:
        data = self._json("sinfo", [])
        found = [_parse_node(n) for n in data.get("nodes") or []]
        return [n for n in found if partition is None or partition in n.partitions]

    def drain(self, node: str, reason: str) -> None:
        self.run("scontrol", ["update", f"nodename={_node_name(node)}", "state=drain", f"reason={_reason(reason)}"])

    def resume(self, node: str) -> None:
        self.run("scontrol", ["update", f"nodename={_node_name(node)}", "state=resume"])


def _unreachable(said: str) -> bool:
    lowered = said.lower()
    return any(hint in lowered for hint in _UNREACHABLE_HINTS)


def _node_name(name: str) -> str:
    """A node name as ``scontrol`` takes it: one name, no list or expression."""
    if not name or any(c in name for c in " \t\n,=[]") or name.startswith("-"):
        raise ValueError(f"not a single Slurm node name: {name!r}")
    return name


def _reason(text: str) -> str:
    """Slurm keeps reasons on one line; a newline or a very long reason is cut, not refused."""
    flat = " ".join(text.split())
    return flat[:250] or "no reason given"


def _parse_job(raw: dict) -> SlurmJob:
    status = raw.get("exit_code")
    exit_status = exit_signal = None
    if isinstance(status, int):  # a wait(2) status: code in the high byte, signal in the low bits
        exit_signal = status & 0x7F or None
        exit_status = None if exit_signal else (status >> 8) & 0xFF
    state = raw.get("job_state") or ""
    return SlurmJob(job_id=int(raw["job_id"]), name=raw.get("name") or "", state=str(state).upper(),
                    reason=raw.get("state_reason") or "", nodes=raw.get("nodes") or "",
                    exit_status=exit_status, exit_signal=exit_signal)


def _parse_node(raw: dict) -> SlurmNode:
    return SlurmNode(name=raw["name"], address=raw.get("address") or raw["name"],
                     state=str(raw.get("state") or "unknown").lower(),
                     flags=tuple(str(f).upper() for f in raw.get("state_flags") or ()),
                     reason=raw.get("reason") or "", reason_by=raw.get("reason_set_by_user") or "",
                     partitions=tuple(raw.get("partitions") or ()))

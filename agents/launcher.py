"""A warm ``torchrun``: an interpreter that has already imported torch and waits for its launch.

A cold ``python -m torch.distributed.run`` spends about a second starting Python and importing
torch before it does anything; plain ``torchrun --max-restarts`` pays that once per job, because
it restarts workers inside the process it already has. Nightwatch starts a new torchrun for every
generation (restarts are its decision, not torchrun's), so the supervisor keeps one of these
waiting per node and hands it the next generation's command line instead.

Protocol, over the standard input the supervisor gave it (never anything else):

- one JSON line ``{"args": [...], "env": {...}, "cwd": "...", "output": "/path/torchrun.log"}``;
  the process then *becomes* ``python -m torch.distributed.run ARGS`` with exactly that
  environment and directory, its standard output and error appended to ``output`` (the
  generation's log, which the supervisor tails: never a pipe to the agent, which would break if
  the agent died), running the module as ``__main__`` so its behaviour, output and exit status
  are a cold start's;
- end of input instead (the supervisor went away or does not need it): exit 0.

With ``--workers`` it also imports what a rank needs (``agents.supervisor.zygote.PRELOAD``), and
a request with ``"zygote": "/private/dir/sock"`` first forks the generation's zygote, listening
there, which forks each rank for torchrun's ``warm_client.py`` (warm workers; see that module).

It is started in its own session, so its process group is the generation's, as for a cold start.
Variables that torch reads at import time come from the agent's environment, as they would for a
torchrun the agent started itself; the job's NCCL profile is read by the workers, which torchrun
starts after the environment was set.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import torch.distributed.run  # noqa: F401  (the point: pay for the import before a launch needs it)


def _become(request: dict) -> None:
    missing = [key for key in ("args", "env", "cwd", "output") if key not in request]
    if missing:
        raise ValueError(f"launch request without {', '.join(missing)}")
    # Output first: whatever goes wrong from here on is written to the generation's log.
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.chdir(request["cwd"])
    os.environ.clear()  # os.environ writes through to the C environment that workers inherit
    os.environ.update(request["env"])
    # The workers must not inherit the request pipe: nothing reads a rank's standard input.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if request.get("zygote"):
        # Only a warm-workers launch needs the zygote; every other launch starts without importing it.
        from agents.supervisor import zygote

        worker = zygote.start(zygote.listen(request["zygote"]))
        if worker is not None:  # this is a rank the zygote forked: run it, and exit as it does
            zygote.run_and_exit(worker)
    sys.argv = ["torchrun", *request["args"]]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


def main() -> int:
    if "--workers" in sys.argv[1:]:
        # Only a warm-workers launcher needs the zygote; every other launcher starts without importing it.
        from agents.supervisor import zygote

        zygote.preload()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    _become(json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Runs ``torchrun`` for one generation of a job on this node, reports how it ended, and stops it
completely.

- One generation per job at a time, and the generation is the fencing token: a launch or stop
  for a generation older than the newest one seen here raises ``StaleGeneration`` (persisted, so
  an agent restart does not forget it).
- torchrun runs in its own session and process group with ``--max-restarts=0`` (Nightwatch
  decides restarts), the job's validated NCCL profile and the hooks' variables.
- Its output goes straight to a log file in the generation's directory, never to a pipe to the
  agent: a pipe would break (EPIPE) when the agent dies or is upgraded, and take training down
  with it. The supervisor tails the file (rotating it by copy-and-truncate, since torchrun keeps
  it open); a tail is kept in memory for the exit report, and the whole stream is scanned for
  torchrun's failure table (per-rank exit codes, first rank to fail), exception lines and
  failure signatures.
- A running generation is recorded on disk (job, generation, torchrun's pid and process start
  time, log path), so an agent that restarts *adopts* it: it is reported as running again, its
  end is detected by polling /proc (it is no longer our child, so its exit status is unknown and
  derived from the log), and it can be stopped. A record whose torchrun is gone is reported as
  exited once; a pid reused by another process is never taken for torchrun (start times differ).
- ``stop`` sends SIGTERM to the process group, SIGKILL after the grace period, and confirms in
  /proc that every process of the generation is gone, children that left the group included.
- Once torchrun says it is closing the worker group (a worker failed), a rank that is still there
  after ``WORKER_CLOSE_GRACE_S`` is SIGCONT'ed and SIGKILLed: torchrun would wait 30 s for a rank
  that cannot act on SIGTERM (a stopped one, say), and the generation is lost anyway.
- Restarts are fast because nothing waits that need not: a warm launcher (``agents.launcher``,
  torch already imported) is handed each new generation instead of a cold interpreter, and a
  generation counts as ended as soon as torchrun has printed its failure table — by then its
  workers are stopped and its rendezvous closed, and what is left is a torchrun tearing its
  interpreter down (≈ 0.4 s), which the supervisor cuts short.

The package, along its seams: ``output`` reads torchrun's output and classifies the exit,
``procs`` reads and signals the process tree in /proc, ``generation`` holds a generation and its
on-disk record, ``launch`` what a launch runs, and ``_core`` the ``Supervisor`` itself.
"""

from agents.supervisor._core import STOPPED_WORKER_KILL_S, WARM_RESPAWN_DELAY_S, StaleGeneration, Supervisor
from agents.supervisor.launch import DEFAULT_TORCHRUN
from agents.supervisor.output import OutputScan, attach_xids, classify_exit

__all__ = [
    "STOPPED_WORKER_KILL_S",
    "DEFAULT_TORCHRUN",
    "WARM_RESPAWN_DELAY_S",
    "OutputScan",
    "StaleGeneration",
    "Supervisor",
    "attach_xids",
    "classify_exit",
]

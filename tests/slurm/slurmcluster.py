"""A real single-node Slurm cluster on this machine, for the Slurm transport's tests.

munged (as the munge user, with a fresh 0400 key), slurmctld and slurmd (as root, in the
foreground, each in its own session) on free ports, with a configuration generated under a
temporary directory (the one PLATFORM-NOTES describes: linuxproc, task/none, cons_tres, no
accounting, ``NodeName=localhost NodeAddr=127.0.0.1 CPUs=2``). ``stop()`` kills the daemons and
whatever they started, and waits for them to exit.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.ports import free_port
from tests.waiting import wait_for

NODE = "localhost"
PARTITION = "nw"
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")

CONFIG = """\
ClusterName=nwtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=10
SlurmdTimeout=10
MessageTimeout=3
KillWait=2
MinJobAge=300
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "the Slurm tests run slurmd and slurmctld as root"
    absent = [d for d in DAEMONS if not os.access(d, os.X_OK)] + [t for t in ("sbatch", "sinfo") if not shutil.which(t)]
    if absent:
        return f"slurm-wlm and munge are not installed ({', '.join(absent)}): see scripts/install-system-deps.sh"
    return None


class SlurmCluster:
    def __init__(self):
        # Not under pytest's tmp_path: that is private to root (0700), and munged, which runs as
        # the munge user, must reach its own directory below it.
        self.root = root = Path(tempfile.mkdtemp(prefix="nightwatch-slurm-"))
        root.chmod(0o755)
        for sub in ("state", "spool", "log", "munge"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.conf.write_text(CONFIG.format(root=root, ctld_port=free_port(), slurmd_port=free_port(),
                                           munge_socket=self.munge_socket, node=NODE, partition=PARTITION))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen] = {}

    # --- daemons ------------------------------------------------------------------------------
    def start(self) -> None:
        self._start_munge()
        self.start_controller()
        self._spawn("slurmd", ["/usr/sbin/slurmd", "-D", "-f", str(self.conf), "-N", NODE])
        wait_for(lambda: self.node_state() == "idle", timeout=30, what="the Slurm node to be idle")

    def _start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        key_dir = self.root / "munge"
        key = key_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for path in (key_dir, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        key_dir.chmod(0o755)  # munged insists that everyone may reach its socket
        self._spawn("munged", ["/usr/sbin/munged", "-F", f"--key-file={key}", f"--socket={self.munge_socket}",
                               f"--pid-file={key_dir / 'munged.pid'}", f"--seed-file={key_dir / 'munged.seed'}",
                               f"--log-file={key_dir / 'munged.log'}"], user=munge.pw_uid, group=munge.pw_gid)
        wait_for(self.munge_socket.exists, timeout=10, what="munged's socket")

    def start_controller(self) -> None:
        self._spawn("slurmctld", ["/usr/sbin/slurmctld", "-D", "-f", str(self.conf)])
        wait_for(lambda: self._answers(), timeout=30, what="slurmctld to answer")

    def stop_controller(self) -> None:
        self._stop("slurmctld")

    def _spawn(self, name: str, argv: list[str], **kwargs) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the child holds it
        self.procs[name] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)
        log.close()

    def _stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld", "munged"):
            self._stop(name)
        self._kill_leftovers()
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """slurmstepd and the job's processes outlive slurmd; they carry our SLURM_CONF."""
        marker = f"SLURM_CONF={self.conf}".encode()
        for _ in range(3):
            found = []
            for pid_dir in Path("/proc").glob("[0-9]*"):
                try:
                    if int(pid_dir.name) != os.getpid() and marker in (pid_dir / "environ").read_bytes():
                        found.append(int(pid_dir.name))
                except (OSError, ValueError):
                    continue
            if not found:
                return
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    # --- asking Slurm directly (the tests' independent view) ----------------------------------
    def command(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=30, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"{argv}: {done.stderr or done.stdout}")
        return done.stdout

    def _answers(self) -> bool:
        return subprocess.run(["scontrol", "ping"], env=self.env, capture_output=True, timeout=10,
                              check=False).returncode == 0

    def node_line(self) -> tuple[str, str]:
        """(state, reason) of the node as ``sinfo`` prints them."""
        out = self.command("sinfo", "-h", "-N", "-n", NODE, "-o", "%T|%E").strip()
        state, _, reason = out.partition("|")
        return state, reason

    def node_state(self) -> str:
        try:
            return self.node_line()[0]
        except (AssertionError, subprocess.TimeoutExpired):
            return ""

    def job_state(self, job_id: int) -> str:
        out = self.command("scontrol", "show", "job", str(job_id))
        return next(part.split("=", 1)[1] for part in out.split() if part.startswith("JobState="))

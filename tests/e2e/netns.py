"""Network namespaces as test hosts: a bridge in the root namespace and one namespace per node.

    root namespace                          namespace nwt-a            namespace nwt-b
    nwtbr (10.213.0.1) ── nwtv-a ═══ veth ═══ eth0 (10.213.0.2)
                       └─ nwtv-b ═══ veth ════════════════════════════ eth0 (10.213.0.3)

The control plane listens on the bridge address; each node's agent runs under ``ip netns exec``
with a host name of its own (a UTS namespace) that resolves to its address in every namespace
(``/etc/netns/<ns>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``), as on real
machines: torchrun publishes the rendezvous winner's host name as the workers' MASTER_ADDR, and
the machine's own name resolves to 127.0.0.1 — in the other namespace, nobody is listening there.
``cut(host)`` takes the root-side end of the host's veth down: that host can reach neither the
control plane nor the other hosts until ``restore(host)``.

Safety (PLATFORM-NOTES, "Network namespaces as test hosts"): before any address exists, an
``unreachable`` route for the whole test subnet goes into the root namespace, with a metric above
the bridge's connected route. While the bridge is up its connected route wins; without it, a
packet to a test address hits the unreachable route instead of the default route, so nothing
addressed to a namespace can ever leave this machine. The namespaces get no default route at
all. ``close()`` kills every process left in the namespaces, then removes namespaces, links and
the route — it is idempotent and also cleans up what a crashed earlier run left behind.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

#: A private subnet that nothing on this machine routes; the bridge takes .1, hosts .2 onwards.
SUBNET = "10.213.0.0/24"
#: Higher than the connected route's metric (0), so the unreachable route only catches traffic
#: when the bridge's route is gone.
UNREACHABLE_METRIC = 4000
PREFIX = "nwt"
#: Inside every namespace the interface has the same name, so one Gloo/NCCL profile fits all.
IFNAME = "eth0"
LOCK = Path("/run/nightwatch-e2e-netns.lock")
#: ``ip netns exec NS`` bind-mounts the files of ``/etc/netns/NS/`` over those of ``/etc``.
ETC_NETNS = Path("/etc/netns")


class NetnsUnavailable(RuntimeError):
    """Not root, or no ``ip`` (iproute2)."""


def ip(*args: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


@dataclass(frozen=True)
class Host:
    name: str  # a short name: "a", "b"
    netns: str
    root_veth: str
    address: str
    hostname: str

    def exec_prefix(self) -> list[str]:
        """Prepend to an argv to run it inside this host's namespace, under its host name. Every
        step execs, so the process started keeps the pid of the one spawned."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.hostname]


class Network:
    """A bridge in the root namespace and hosts in namespaces, all under ``PREFIX``."""

    def __init__(self, subnet: str = SUBNET, prefix: str = PREFIX):
        self.net = ipaddress.ip_network(subnet)
        self.prefix = prefix
        self.bridge = f"{prefix}br"
        addresses = self.net.hosts()
        self.gateway = str(next(addresses))
        self._addresses = addresses
        self.hosts: dict[str, Host] = {}
        self._lock_fd: int | None = None

    # --- setup ------------------------------------------------------------------------------------
    def up(self) -> Network:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise NetnsUnavailable("network namespaces need root and iproute2 (`ip`)")
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # one namespace test at a time on this machine
        self._teardown()  # leftovers of a run that died before its finalizer
        # Safety first: no address of the subnet exists yet, and from now on none can be routed out.
        ip("route", "add", "unreachable", str(self.net), "metric", str(UNREACHABLE_METRIC))
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/{self.net.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        return self

    def add_host(self, name: str, hostname: str | None = None) -> Host:
        host = Host(name=name, netns=f"{self.prefix}-{name}", root_veth=f"{self.prefix}v-{name}",
                    address=str(next(self._addresses)), hostname=hostname or name)
        self.hosts[name] = host
        self._write_hosts_files()
        ip("netns", "add", host.netns)
        peer = f"{self.prefix}p-{name}"
        ip("link", "add", host.root_veth, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", host.netns)
        ip("link", "set", peer, "name", IFNAME, netns=host.netns)
        ip("addr", "add", f"{host.address}/{self.net.prefixlen}", "dev", IFNAME, netns=host.netns)
        ip("link", "set", IFNAME, "up", netns=host.netns)
        ip("link", "set", "lo", "up", netns=host.netns)
        ip("link", "set", host.root_veth, "master", self.bridge)
        ip("link", "set", host.root_veth, "up")
        return host

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1 localhost", *(f"{h.address} {h.hostname}" for h in self.hosts.values())]
        for host in self.hosts.values():
            etc = ETC_NETNS / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")

    # --- faults -----------------------------------------------------------------------------------
    def cut(self, name: str) -> None:
        """The host loses its link: to the control plane and to every other host."""
        ip("link", "set", self.hosts[name].root_veth, "down")

    def restore(self, name: str) -> None:
        ip("link", "set", self.hosts[name].root_veth, "up")

    def pids(self, name: str) -> set[int]:
        """The processes running in the host's namespace now."""
        return {int(p) for p in ip("netns", "pids", self.hosts[name].netns, check=False).stdout.split()}

    # --- teardown ---------------------------------------------------------------------------------
    def close(self) -> None:
        try:
            self._teardown()
        finally:
            self.hosts.clear()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the lock
                self._lock_fd = None

    def _teardown(self) -> None:
        namespaces = [line.split()[0] for line in ip("netns", "list", check=False).stdout.splitlines() if line]
        ours = [ns for ns in namespaces if ns.startswith(f"{self.prefix}-")]
        for netns in ours:
            self._kill_all_in(netns)
        for netns in ours:
            ip("netns", "delete", netns, check=False)  # takes its veth ends, and so their peers, with it
        for etc in ETC_NETNS.glob(f"{self.prefix}-*"):
            shutil.rmtree(etc, ignore_errors=True)
        if ETC_NETNS.is_dir() and not any(ETC_NETNS.iterdir()):
            ETC_NETNS.rmdir()
        links = [line.split(":")[1].strip().split("@")[0]
                 for line in ip("-o", "link", "show", check=False).stdout.splitlines() if ":" in line]
        for link in links:
            if link == self.bridge or link.startswith(f"{self.prefix}v-"):
                ip("link", "delete", link, check=False)
        # The safety route goes last, once no address of the subnet is left anywhere.
        while ip("route", "del", "unreachable", str(self.net), "metric", str(UNREACHABLE_METRIC),
                 check=False).returncode == 0:
            pass

    @staticmethod
    def _kill_all_in(netns: str) -> None:
        """SIGKILL every process in ``netns`` (a cut-off rank may ignore SIGTERM) and wait for them."""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            pids = [int(p) for p in ip("netns", "pids", netns, check=False).stdout.split()]
            pids = [p for p in pids if p != os.getpid()]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

"""Ports for the servers a test starts, chosen where no outgoing connection can take them first.

A port the kernel hands out for ``bind(0)`` lies in the ephemeral range
(``net.ipv4.ip_local_port_range``, 32768-60999 by default): the same range every outgoing
connection takes its source port from. Between choosing such a port and the server binding it
(torchrun's rendezvous store binds seconds later, after Slurm or an agent has started it), any of
the hundreds of connections the control plane, its worker and the test open meanwhile may take
it, and the server fails to start. (CI saw a Slurm job's first generation FAILED before its first
step and its successor, on the same rendezvous port, train: what this race would do; its output
was not kept, so the cause is inferred.) Ports below the ephemeral range are never taken that
way: ``free_port`` draws one at random there, skips those this process handed out before, and
checks that nothing is bound to it now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Below this nothing is drawn: the well-known services' neighbourhood.
LOWEST = 10000
_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for source ports (Linux's default where it cannot be read)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port nobody holds, outside the ephemeral range, not handed out before."""
    low, high = ephemeral_range()
    candidates = [*range(LOWEST, low), *range(high + 1, 65536)]
    for _ in range(1000):
        port = random.choice(candidates)  # noqa: S311 - not a secret
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port outside the ephemeral range {low}-{high} after 1000 draws")

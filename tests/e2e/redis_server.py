"""A Redis server of a test's own: its own free port and directory, killed and restarted at will."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.ports import free_port
from tests.waiting import wait_for


class RedisServer:
    def __init__(self, directory: Path):
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # No persistence: the test kills it and wants a clean restart on the same port.
        self._log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir)], stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        wait_for(self.answers, timeout=10, what=f"redis-server on port {self.port}")

    def answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None
            self._log.close()

"""docker-compose.yml supervises workers with their liveness file, and beat runs on its own."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.project.test_settings import ROOT


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.fail("docker-compose is missing: run `make system-deps`")
    tmp = tmp_path_factory.mktemp("compose")
    shutil.copy(ROOT / "docker-compose.yml", tmp / "docker-compose.yml")
    shutil.copy(ROOT / ".env.example", tmp / ".env")
    result = subprocess.run([compose, "config"], cwd=tmp, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def test_a_stale_worker_is_killed_by_its_healthcheck_and_restarted_by_the_policy(services):
    workers = {name: s for name, s in services.items()
               if "celery -A controlplane worker" in " ".join(s.get("command") or [])}
    assert set(workers) == {"worker", "sweeper", "checkpoint-worker", "background-worker"}
    for name, service in workers.items():
        command = " ".join(service["command"])
        pidfile = command.split("--pidfile=")[1].split()[0]
        alive = service["environment"]["NIGHTWATCH_WORKER_LIVENESS_FILE"]
        check = service["healthcheck"]["test"]
        assert check[:4] == ["CMD", "python", "-m", "core.liveness"], name
        assert check[4] == alive and check[check.index("--kill-pidfile") + 1] == pidfile, name
        # The kill must end the container (the worker is not PID 1) and the policy must restart it.
        assert service["init"] is True and service["restart"] == "unless-stopped", name
        assert service["command"][2].startswith(f"rm -f {pidfile} {alive} &&"), name  # a restarted container keeps /tmp
        assert service["environment"]["DATABASE_URL"] == services["web"]["environment"]["DATABASE_URL"]


def test_beat_is_a_process_of_its_own(services):
    commands = {name: " ".join(s.get("command") or []) for name, s in services.items()}
    assert "celery -A controlplane beat" in commands["beat"]
    assert not any(" -B" in c or "--beat" in c for n, c in commands.items() if n != "beat"), commands

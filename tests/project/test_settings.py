"""Settings from the environment, production refusals, and the compose file."""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def manage(*args, env_overrides: dict, tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DEBUG", "SECRET_KEY")}
    env.update({"NIGHTWATCH_VAR_DIR": str(tmp_path), **env_overrides})
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_production_without_secret_key_or_with_debug_is_refused(tmp_path):
    result = manage("check", env_overrides={"NIGHTWATCH_ENV": "production", "DEBUG": "1", "ALLOWED_HOSTS": "h"},
                    tmp_path=tmp_path)
    assert result.returncode != 0
    assert "nightwatch.E001" in result.stderr and "nightwatch.E002" in result.stderr


def test_production_asgi_app_refuses_to_load_when_unsafe(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG")}
    env.update({"NIGHTWATCH_ENV": "production", "ALLOWED_HOSTS": "h", "NIGHTWATCH_VAR_DIR": str(tmp_path)})
    result = subprocess.run([sys.executable, "-c", "import controlplane.asgi"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "refusing to start in production" in result.stderr and "nightwatch.E001" in result.stderr


def _secrets_key() -> str:
    """A key for the alert channels' secrets: production warns without one (nightwatch.alerts.W001)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()


def test_check_deploy_passes_with_production_settings(tmp_path):
    result = manage("check", "--deploy", "--fail-level", "WARNING", tmp_path=tmp_path, env_overrides={
        "NIGHTWATCH_ENV": "production", "SECRET_KEY": secrets.token_urlsafe(60), "ALLOWED_HOSTS": "nw.example.com",
        "NIGHTWATCH_SECRETS_KEY": _secrets_key(),
    })
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout


def test_bad_environment_value_names_the_variable(tmp_path):
    result = manage("check", env_overrides={"DEBUG": "maybe"}, tmp_path=tmp_path)
    assert result.returncode != 0
    assert "DEBUG='maybe' is not a boolean" in result.stderr


def test_secret_key_can_come_from_a_file(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(secrets.token_urlsafe(60))
    result = manage("check", "--deploy", "--fail-level", "WARNING", tmp_path=tmp_path, env_overrides={
        "NIGHTWATCH_ENV": "production", "SECRET_KEY_FILE": str(key_file), "ALLOWED_HOSTS": "nw.example.com",
        "NIGHTWATCH_SECRETS_KEY": _secrets_key(),
    })
    assert result.returncode == 0, result.stderr


def test_docker_compose_file_is_valid(tmp_path):
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.fail("docker-compose is missing: run `make system-deps`")
    shutil.copy(ROOT / "docker-compose.yml", tmp_path / "docker-compose.yml")
    shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    result = subprocess.run([compose, "config"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    import yaml

    services = yaml.safe_load(result.stdout)["services"]
    assert set(services) == {"postgres", "redis", "web", "ws", "urgent", "worker", "sweeper", "checkpoint-worker",
                             "background-worker", "beat"}
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
    assert services["web"]["environment"]["NIGHTWATCH_ENV"] == "production"
    # The operators' and the agents' urgent web processes run the same application as web, each on
    # its own port.
    ports = {"web": "8000", "ws": "8001", "urgent": "8002"}
    for name in ("ws", "urgent"):
        assert services[name]["image"] == services["web"]["image"]
        command = " ".join(services[name]["command"])
        assert "controlplane.asgi:application" in command and f"-p {ports[name]}" in command
        assert services[name]["environment"] == services["web"]["environment"]
    assert [str(p["target"]) for name in ports for p in services[name]["ports"]] == list(ports.values())


def test_a_connection_pool_is_configured_for_postgresql_and_refused_for_anything_else(tmp_path):
    show = "from django.conf import settings; d = settings.DATABASES['default']; print(d['CONN_MAX_AGE'], d['OPTIONS'])"
    pooled = manage("shell", "-c", show, tmp_path=tmp_path, env_overrides={
        "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/nightwatch", "DB_POOL_MAX_SIZE": "8",
        "DB_CONN_MAX_AGE": "60"})
    assert pooled.returncode == 0, pooled.stderr
    assert pooled.stdout.strip().splitlines()[-1] == "0 {'pool': {'min_size': 1, 'max_size': 8, 'timeout': 10.0}}"

    sqlite = manage("check", tmp_path=tmp_path, env_overrides={
        "DATABASE_URL": f"sqlite:///{tmp_path}/db.sqlite3", "DB_POOL_MAX_SIZE": "8"})
    assert sqlite.returncode != 0 and "a connection pool needs PostgreSQL" in sqlite.stderr

"""The production deployment files: the compose file parses, and the Dockerfile copies what exists."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


SECRETS = {"POSTGRES_PASSWORD": "pg-test-secret", "REDIS_PASSWORD": "redis-test-secret",
           "LOCOJAX_DASHBOARD_SECRET": "dashboard-test-secret"}


def _compose_config(env: dict[str, str]) -> subprocess.CompletedProcess:
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed (.ci/run installs Debian's package)")
    base = {key: value for key, value in os.environ.items() if key not in SECRETS}
    return subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, env={**base, **env})


def test_docker_compose_accepts_the_compose_file_with_its_secrets_set():
    result = _compose_config(SECRETS)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for worker in ("host0", "host1"):
        environment = services[worker]["environment"]
        assert "LOCOJAX_DATABASE_URL" not in environment
        assert "pg-test-secret" not in json.dumps(services[worker])
    assert services["redis"]["command"][-2:] == ["--requirepass", "redis-test-secret"]


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_a_missing_secret_stops_compose_naming_it(missing):
    result = _compose_config({key: value for key, value in SECRETS.items() if key != missing})
    assert result.returncode != 0
    assert f"set {missing}" in result.stderr


def _services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_compose_has_the_production_roles_and_no_flower():
    services = _services()
    assert {"postgres", "redis", "migrate", "api", "host0", "host1"} <= set(services)
    for worker in ("host0", "host1"):
        command = services[worker]["command"]
        assert command[:2] == ["locojax", "worker"] and command[command.index("--name") + 1] == worker
    assert "flower" not in services  # it would show the broker's traffic without authentication


def test_secrets_in_the_compose_file_have_no_defaults_and_workers_no_database():
    text = (ROOT / "docker-compose.yml").read_text()
    references = re.findall(r"\$\{([A-Z_]+)(:?[-?])?([^}]*)\}", text)
    secret_refs = [(name, sep) for name, sep, _ in references if name in SECRETS]
    assert {name for name, _ in secret_refs} == set(SECRETS)
    assert all(sep == ":?" for _, sep in secret_refs), secret_refs  # `${X:-default}` would be a public password
    services = _services()
    for worker in ("host0", "host1"):
        assert not [key for key in services[worker]["environment"] if "DATABASE" in key or "POSTGRES" in key]
    assert "--requirepass" in services["redis"]["command"]


def test_dockerfile_copies_only_paths_that_exist():
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        parts = line.split()
        if not parts or parts[0] != "COPY" or parts[1].startswith("--from"):
            continue
        for source in parts[1:-1]:
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"

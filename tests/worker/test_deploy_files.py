"""The production deployment files: the compose file parses, and the Dockerfile copies what exists."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_docker_compose_accepts_the_compose_file():
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed (.ci/run installs Debian's package)")
    result = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr


def test_compose_has_the_production_roles():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert {"postgres", "redis", "migrate", "api", "host0", "host1", "flower"} <= set(services)
    for worker in ("host0", "host1"):
        command = services[worker]["command"]
        assert command[:2] == ["locojax", "worker"] and command[command.index("--name") + 1] == worker
    assert services["flower"].get("profiles") == ["monitoring"]  # optional


def test_dockerfile_copies_only_paths_that_exist():
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        parts = line.split()
        if not parts or parts[0] != "COPY" or parts[1].startswith("--from"):
            continue
        for source in parts[1:-1]:
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"

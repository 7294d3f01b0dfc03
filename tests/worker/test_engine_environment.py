"""What an engine process is given by its worker: an explicit, minimal environment and the operator's
reward allowlist on its command line (issue #18). The live check of a running engine process's
environment is in test_control_plane_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from worker.supervisor import engine_environment

ROOT = Path(__file__).resolve().parents[2]

WORKER_ENV = {
    "PATH": "/opt/venv/bin:/usr/bin", "HOME": "/home/locojax", "PYTHONPATH": "/srv/locojax",
    "JAX_COMPILATION_CACHE_DIR": "/var/cache/jax", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
    "TPU_WORKER_ID": "3", "LOCOJAX_TOKEN": "lcj_worker_secret", "LOCOJAX_DATABASE_URL": "postgresql://u:pw@db/x",
    "LOCOJAX_BROKER_URL": "redis://:pw@redis:6379/0", "LOCOJAX_DASHBOARD_SECRET": "s3cret",
    "POSTGRES_PASSWORD": "pw", "REDIS_PASSWORD": "pw", "AWS_SECRET_ACCESS_KEY": "k", "SSH_AUTH_SOCK": "/tmp/agent",
}


def test_the_engine_environment_keeps_runtime_variables_and_nothing_else():
    env = engine_environment(WORKER_ENV)
    assert env == {"PATH": "/opt/venv/bin:/usr/bin", "HOME": "/home/locojax", "PYTHONPATH": "/srv/locojax",
                   "JAX_COMPILATION_CACHE_DIR": "/var/cache/jax", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
                   "TPU_WORKER_ID": "3", "PYTHONUNBUFFERED": "1"}


def test_no_pythonpath_unless_the_operator_set_one():
    env = engine_environment({"PATH": "/usr/bin", "HOME": "/root"})
    assert "PYTHONPATH" not in env and env["PATH"] == "/usr/bin"


def test_a_host_refuses_a_reward_outside_its_allowlist_before_starting(tmp_path: Path):
    # What a forged start message would reach: the spec names an import path the operator did not allow.
    spec = {"name": "forged", "task": {"name": "arith", "reward": ["gsm8k", "builtins:print"]}, "steps": 1,
            "output_dir": str(tmp_path / "out")}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    command = [sys.executable, "-m", "locojax.cli", "host", str(path), "--reward-modules", "tests.locojax"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=engine_environment(os.environ))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "task.reward.1: reward module 'builtins' is not allowed by the operator" in done.stderr
    assert "allowed module prefixes: tests.locojax" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written


def test_the_engine_command_carries_the_operators_allowlist_and_ray_cluster(tmp_path: Path):
    from locojax.spec import RunSpec
    from worker.supervisor import HostSupervisor, WorkerContext

    context = WorkerContext(host_name="h0", api=None, reward_modules=("mycompany.rewards", "tests.locojax"),
                            ray_address="10.0.0.5:6379")
    spec_path = tmp_path / "spec.yaml"

    def command(role: str, mode: str) -> list[str]:
        supervisor = HostSupervisor(context, run_id=1, attempt=0, process_index=0, num_processes=1, role=role,
                                    resume=False, output_dir=str(tmp_path))
        placement = {"mode": mode, "hosts": 2 if mode == "da" else 1}
        return supervisor.command(RunSpec.model_validate({"placement": placement}), spec_path, None)

    da = command("controller", "da")
    assert da[da.index("--reward-modules") + 1] == "mycompany.rewards,tests.locojax"
    assert da[da.index("--ray-address") + 1] == "10.0.0.5:6379"
    co = command("co", "co")
    assert "--ray-address" not in co and co[co.index("--reward-modules") + 1] == "mycompany.rewards,tests.locojax"

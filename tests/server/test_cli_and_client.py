"""The operator CLI (`locojax token ...`) and the REST client CLI (`locojax submit`, `locojax runs ...`)
against a real uvicorn server on loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import httpx
import pytest
import typer
import uvicorn
import yaml
from typer.testing import CliRunner

from locojax import client as client_module
from locojax.client import ApiClient, ApiClientError
from locojax.contract import EXIT_UNREACHABLE
from server import cli as server_cli
from server.app import create_app
from server.services import tokens as token_service
from server.settings import Settings, get_settings


def _app() -> typer.Typer:
    app = typer.Typer()
    client_module.register(app)
    server_cli.register(app)
    return app


def test_commands_join_through_the_entry_point():
    registered = {entry.name: entry.value for entry in entry_points(group="locojax.commands")}
    assert registered.get("server") == "server.cli:register"


def test_token_create_prints_the_secret_once_and_ls_never_does(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCOJAX_HOME", str(tmp_path / ".locojax"))
    get_settings.cache_clear()
    runner = CliRunner()
    try:
        created = runner.invoke(_app(), ["token", "create", "--scope", "submit", "--name", "ci"])
        assert created.exit_code == 0, created.output
        secret = created.stdout.strip().splitlines()[-1]
        assert secret.startswith("lcj_")
        listed = runner.invoke(_app(), ["token", "ls"])
        assert "ci" in listed.stdout and secret not in listed.stdout and secret[:8] in listed.stdout
        assert runner.invoke(_app(), ["token", "revoke", "1"]).exit_code == 0
        assert "revoked" in runner.invoke(_app(), ["token", "ls"]).stdout
        bad = runner.invoke(_app(), ["token", "create", "--scope", "root"])
        assert bad.exit_code != 0
        # Worker tokens are bound to a host name or prefix (issue 17); an unbound one is refused.
        unbound = runner.invoke(_app(), ["token", "create", "--scope", "worker"])
        assert unbound.exit_code != 0 and "--hosts" in unbound.output
        bound = runner.invoke(_app(), ["token", "create", "--scope", "worker", "--hosts", "tpu-vm-*"])
        assert bound.exit_code == 0 and "hosts: tpu-vm-*" in bound.output
    finally:
        get_settings.cache_clear()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    home = tmp_path_factory.mktemp("live")
    settings = Settings(home=home / ".locojax", broker_url="memory://", data_roots=[home], runs_root=home / "runs",
                        sse_poll_s=0.02)
    app = create_app(settings, plugins=False)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    with app.state.db.write_session() as session:
        secrets = {scope: token_service.create(session, name=scope, scopes=[scope],
                                               hosts="h*" if scope == "worker" else None)[1]
                   for scope in ("submit", "worker", "admin")}
    try:
        yield f"http://127.0.0.1:{port}", secrets
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _spec_file(tmp_path: Path, **spec) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "cli-run", "steps": 5, **spec}))
    return str(path)


def test_submit_and_runs_commands(live_server, tmp_path):
    url, secrets = live_server
    runner = CliRunner()
    env = {"LOCOJAX_URL": url, "LOCOJAX_TOKEN": secrets["submit"]}
    submitted = runner.invoke(_app(), ["submit", _spec_file(tmp_path), "--json", "--idempotency-key", "cli-1"], env=env)
    assert submitted.exit_code == 0, submitted.output
    run_id = int(yaml.safe_load(submitted.stdout)["id"])
    again = runner.invoke(_app(), ["submit", _spec_file(tmp_path), "--json", "--idempotency-key", "cli-1"], env=env)
    assert int(yaml.safe_load(again.stdout)["id"]) == run_id

    listed = runner.invoke(_app(), ["runs", "ls", "--all", "--status", "queued"], env=env)
    assert listed.exit_code == 0 and "cli-run" in listed.stdout and "QUEUED" in listed.stdout
    got = runner.invoke(_app(), ["runs", "get", str(run_id)], env=env)
    assert got.exit_code == 0 and f"{run_id}" in got.stdout

    with ApiClient(url, secrets["admin"]) as operator:  # moves the run by hand (no scheduler here)
        operator.report_transition(run_id, "STARTING")
        operator.report_transition(run_id, "RUNNING")
        operator.post_metrics(run_id, [{"step": s, "values": {"reward/mean": s / 10}} for s in range(50)], attempt=0)
        operator.post_events(run_id, [{"message": "hello from host 0"}], attempt=0)
    metrics = runner.invoke(_app(), ["runs", "metrics", str(run_id)], env=env)
    assert "reward/mean" in metrics.stdout and "step 49" in metrics.stdout
    history = runner.invoke(_app(), ["runs", "metrics", str(run_id), "-k", "reward/mean", "--max-points", "5"], env=env)
    assert history.exit_code == 0 and "step(s) per point" in history.stdout
    assert history.stdout.splitlines()[-1].split()[0] == "49"  # the newest step is always shown

    cancelled = runner.invoke(_app(), ["runs", "cancel", str(run_id)], env=env)
    assert cancelled.exit_code == 0 and "CANCELLING" in cancelled.stdout
    with ApiClient(url, secrets["admin"]) as operator:
        operator.report_transition(run_id, "CANCELLED", reason="stopped at step 50")
    events = runner.invoke(_app(), ["runs", "events", str(run_id), "--follow"], env=env)
    assert events.exit_code == 0 and "hello from host 0" in events.stdout and "CANCELLING -> CANCELLED" in events.stdout
    resumed = runner.invoke(_app(), ["runs", "resume", str(run_id)], env=env)
    assert resumed.exit_code == 0 and "QUEUED" in resumed.stdout


def test_client_errors_and_exit_codes(live_server, tmp_path):
    url, secrets = live_server
    runner = CliRunner()
    env = {"LOCOJAX_URL": url, "LOCOJAX_TOKEN": secrets["submit"]}
    bad_spec = runner.invoke(_app(), ["submit", _spec_file(tmp_path, rollout={"group_size": 0})], env=env)
    assert bad_spec.exit_code == 2 and "rollout.group_size" in bad_spec.output
    missing = runner.invoke(_app(), ["runs", "get", "987654"], env=env)
    assert missing.exit_code == 1 and "RUN_NOT_FOUND" in missing.output
    wrong_scope = runner.invoke(_app(), ["runs", "cancel", "1"], env={**env, "LOCOJAX_TOKEN": secrets["worker"]})
    assert wrong_scope.exit_code == 1 and "AUTH_FORBIDDEN" in wrong_scope.output
    no_token = runner.invoke(_app(), ["runs", "ls"], env={"LOCOJAX_URL": url, "LOCOJAX_TOKEN": ""})
    assert no_token.exit_code == 2
    unreachable = runner.invoke(_app(), ["runs", "ls", "--url", f"http://127.0.0.1:{_free_port()}"], env=env)
    assert unreachable.exit_code == EXIT_UNREACHABLE == 4  # not EXIT_CANCELLED's 3
    with ApiClient(url, "lcj_wrong") as client, pytest.raises(ApiClientError) as raised:
        client.get_run(1)
    assert (raised.value.status, raised.value.code) == (401, "AUTH_INVALID")


def test_serve_writes_the_bootstrap_token_to_an_owner_only_file_never_to_its_log(tmp_path):
    import os
    import stat
    import subprocess
    import sys

    home, port = tmp_path / "home", _free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("LOCOJAX_")}
    env.update(LOCOJAX_HOME=str(home), LOCOJAX_BROKER_URL="memory://", LOCOJAX_SCHEDULER_ENABLED="false",
               LOCOJAX_DATA_ROOTS=str(tmp_path), LOCOJAX_RUNS_ROOT=str(tmp_path / "runs"))
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "locojax.cli", "serve", "--port", str(port)], env=env,
                                   stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve did not start"
            time.sleep(0.2)
        token_file = home / "bootstrap-admin-token"
        secret = token_file.read_text().strip()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        output = log_path.read_text()
        assert secret not in output and str(token_file) in output
        response = httpx.get(f"{url}/api/v1/tokens", headers={"Authorization": f"Bearer {secret}"}, timeout=5)
        assert response.status_code == 200  # the file holds a working admin token
    finally:
        process.terminate()
        process.wait(timeout=20)

"""`locojax up`: the whole control plane on one machine, with no server to install.

Starts the API (SQLite under LOCOJAX_HOME, migrated at start; the scheduler runs inside it) and N host
workers as separate processes, each worker a simulated host pinned to its share of the cores, all
talking through kombu's SQLAlchemy broker on SQLite. Prints the dashboard URL and a fresh admin token;
Ctrl-C (or SIGTERM) stops the workers and then the API. Processes' logs go to `<home>/logs/`.

`--demo` then submits the newcomer's demo through the REST API, as a user would: an SFT warm-start
run, and when it succeeded, the GRPO run that starts from its checkpoint.

A run that is still going when `up` stops keeps its state in the database: its hosts stop
heartbeating, and the next `locojax up` recovers it from its last checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx

from locojax import contract as c
from locojax.client import TERMINAL, ApiClient
from server.settings import Settings

TOKEN_TTL_S = 7 * 86400
LOCAL_HOST_PREFIX = "local"  # the workers of `locojax up` are local0, local1, ...; their token is bound to local*


@dataclass
class ControlPlane:
    """The processes of an embedded control plane and how to reach it."""

    settings: Settings
    url: str
    admin_token: str
    worker_token: str
    host_names: list[str]
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def client(self) -> ApiClient:
        return ApiClient(self.url, self.admin_token)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Workers first (cold shutdown: a worker does not wait for its run to finish; the engine process
        dies with it), then the API."""
        workers = [p for name, p in self.processes.items() if name != "api"]
        for process in workers:
            _signal(process, signal.SIGQUIT)
        _wait_all(workers, timeout_s)
        api = self.processes.get("api")
        if api is not None:
            _signal(api, signal.SIGTERM)
            _wait_all([api], timeout_s)


def _signal(process: subprocess.Popen[bytes], signum: int) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass


def _wait_all(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(process, signal.SIGKILL)
            process.wait(timeout=5)


def _spawn(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        # Own process group: Ctrl-C in the terminal reaches `up` only, which stops the children in order.
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(what: str, check: Any, timeout_s: float, processes: dict[str, subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, process in processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {process.returncode} while waiting for {what}")
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")


def start(settings: Settings, *, hosts: int, port: int, devices_per_host: int = 1,
          extra_env: dict[str, str] | None = None, startup_timeout_s: float = 120.0, api_host: str = "127.0.0.1",
          worker_prefixes: Sequence[Sequence[str]] = (), worker_addresses: Sequence[str] = ()) -> ControlPlane:
    """Start the API (listening on `api_host`) and `hosts` workers; return once every worker has
    registered. Worker i's command may be run through `worker_prefixes[i]` (e.g. `ip netns exec NS`,
    a host in a network namespace of its own) and advertise `worker_addresses[i]` to its peers."""
    from locojax.launch import cores_for_host
    from server.db import Database, upgrade_to_head
    from server.services import tokens

    upgrade_to_head(settings.database_url)
    db = Database(settings)
    try:
        with db.write_session() as session:
            tokens.ensure_admin(session)  # so `serve` does not print a second bootstrap token
            _, admin = tokens.create(session, name="locojax-up", scopes=["admin"], expires_in_s=TOKEN_TTL_S)
            _, worker = tokens.create(session, name="locojax-up-workers", scopes=["worker"], expires_in_s=TOKEN_TTL_S,
                                      hosts=f"{LOCAL_HOST_PREFIX}*")
    finally:
        db.dispose()

    url = f"http://{api_host}:{port}"
    # The children see exactly these settings (tests pass short timeouts and other databases this way).
    env = settings.as_environment(LOCOJAX_URL=url, PYTHONUNBUFFERED="1", **(extra_env or {}))
    logs = Path(settings.home) / "logs"
    names = [f"{LOCAL_HOST_PREFIX}{i}" for i in range(hosts)]
    plane = ControlPlane(settings, url, admin, worker, names)
    cli = [sys.executable, "-m", "locojax.cli"]
    try:
        plane.processes["api"] = _spawn(cli + ["serve", "--host", api_host, "--port", str(port)], env,
                                        logs / "api.log")
        with plane.client() as client:
            _wait_for("the API", lambda: client._http.get("/readyz").status_code == 200, startup_timeout_s,
                      plane.processes)
            worker_env = {**env, "LOCOJAX_TOKEN": worker}
            for index, name in enumerate(names):
                cores = ",".join(map(str, cores_for_host(index, hosts)))
                prefix = list(worker_prefixes[index]) if worker_prefixes else []
                address = ["--address", worker_addresses[index]] if worker_addresses else []
                plane.processes[name] = _spawn(
                    # Simulated hosts: CPU devices by construction, so no JAX probe at their start.
                    prefix + cli + ["worker", "--name", name, "--cores", cores, "--devices", str(devices_per_host),
                                    "--device-kind", "local-cpu"]
                    + address, worker_env, logs / f"worker-{name}.log")

            def registered() -> bool:
                online = {h["name"] for h in client.request("GET", "/api/v1/hosts")["data"] if h["status"] == "ONLINE"}
                return set(names) <= online

            _wait_for(f"{hosts} worker(s) to register", registered, startup_timeout_s, plane.processes)
    except BaseException:
        plane.stop(timeout_s=5)
        raise
    return plane


def wait_for_run(client: ApiClient, run_id: int, *, on_progress: Any = None, poll_s: float = 2.0,
                 stop: threading.Event | None = None) -> dict[str, Any]:
    """Poll a run until it is final; `on_progress(run, summary)` is called on every new step."""
    last_step = None
    while True:
        run = client.get_run(run_id)
        if on_progress is not None:
            summary = client.metric_summary(run_id)
            if summary.get("last_step") is not None and summary["last_step"] != last_step:
                last_step = summary["last_step"]
                on_progress(run, summary)
        if run["status"] in TERMINAL or (stop is not None and stop.is_set()):
            return run
        time.sleep(poll_s)


def run_demo(plane: ControlPlane, stop: threading.Event, *, echo: Any = print, out: Path | None = None) -> None:
    """Submit the demo through the REST API and follow it: SFT warm start, then GRPO from its checkpoint.

    The server gives each run its own directory (runs_root/<id>-<name>), so a second `make demo` never
    finds (and relays, or resumes from) the first one's metrics and checkpoints; the GRPO run starts
    from the model the SFT run exported into its directory. The reward plot goes to `out`.
    """
    from locojax.demo import demo_specs, eval_summary, reward_summary

    out = out or Path(plane.settings.runs_root) / time.strftime("demo-%Y%m%d-%H%M%S")
    sft_spec, grpo_spec = demo_specs(out)
    run_dir = Path(plane.settings.runs_root)
    with plane.client() as client:
        for spec in (sft_spec, grpo_spec):
            body = spec.model_dump(mode="json")
            body["output_dir"] = None  # the server chooses run directories
            if spec is grpo_spec:
                sft_dir = run_dir / c.run_dir_name(final["id"], sft_spec.name)
                body["model"]["checkpoint"] = str(sft_dir / c.EXPORT_DIR)
            run = client.submit(body)
            echo(f"submitted run {run['id']} ({spec.name}, {spec.kind}, {spec.steps} steps): "
                 f"{plane.url}/runs/{run['id']}")
            started = time.monotonic()

            def progress(run: dict[str, Any], summary: dict[str, Any]) -> None:
                values = {key: item["value"] for key, item in summary["values"].items()}
                shown = "  ".join(f"{key} {values[key]:.3f}" for key in (c.LOSS_SFT, c.REWARD_MEAN, c.TIME_STEP)
                                  if key in values)
                # The newest step a step time was recorded for: the final evaluation's record is at step = steps.
                step = summary["values"].get(c.TIME_STEP, {}).get("step", summary["last_step"])
                echo(f"  run {run['id']} step {step + 1}/{spec.steps}  {shown}  "
                     f"[{time.monotonic() - started:.0f} s]")

            final = wait_for_run(client, run["id"], on_progress=progress, stop=stop)
            if final["status"] != c.RunStatus.SUCCEEDED.value:
                echo(f"run {run['id']} ended {final['status']}: {final.get('status_reason')}")
                return
        keys = [c.REWARD_MEAN, c.EVAL_ACCURACY, c.EVAL_PASS_AT_K]
        history = {series["key"]: series for series in
                   client.metric_history(final["id"], keys, max_points=10_000)["series"]}
        rewards = history[c.REWARD_MEAN]["last"] if c.REWARD_MEAN in history else []
        metrics_file = run_dir / c.run_dir_name(final["id"], grpo_spec.name) / c.METRICS_FILE
        echo(reward_summary(rewards, out / "reward.png", metrics_file))
        accuracy, pass_at_k = history.get(c.EVAL_ACCURACY), history.get(c.EVAL_PASS_AT_K)
        if accuracy and pass_at_k:
            echo(eval_summary(accuracy["steps"], accuracy["last"], pass_at_k["last"], grpo_spec.eval.k))
        else:
            echo(eval_summary([], [], [], grpo_spec.eval.k))

"""The machinery the reliability scenarios break things with: a private Redis and a private PostgreSQL
(never the shared servers on 6379/5432, which other tests and people use), and a control plane on
them whose API and workers can be killed and started again the way systemd or compose would.

`Stack.start()` brings everything up; `Stack.close()` takes everything down again, whatever state a
scenario left it in.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from locojax.client import ApiClient
from locojax.launch import cores_for_host, free_port
from server.embedded import ControlPlane, start
from server.settings import Settings
from tests.e2e.helpers import alive, wait_until

# Tables whose row counts the bad-input and security scenarios compare before and after.
TABLES = ("runs", "run_events", "run_hosts", "step_metrics", "hosts", "placement_decisions", "api_tokens")
WORKERS = 3
REPO_ROOT = Path(__file__).resolve().parents[2]


class Unavailable(Exception):
    """A server binary this suite needs is not installed here (the tests skip)."""


def _as_postgres_user() -> list[str]:
    """initdb and postgres refuse to run as root; run them as the `postgres` account then."""
    if os.geteuid() != 0:
        return []
    if shutil.which("runuser"):
        return ["runuser", "-u", "postgres", "--"]
    return ["su", "postgres", "-s", "/bin/sh", "-c"]  # pragma: no cover - Debian/Ubuntu have runuser


def _postgres_bin() -> Path:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if candidates:
        return Path(candidates[-1]).parent
    initdb = shutil.which("initdb")
    if initdb is None:
        raise Unavailable("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    return Path(initdb).parent


class PrivatePostgres:
    """A throwaway PostgreSQL cluster in a temporary directory, on a free loopback port."""

    def __init__(self) -> None:
        self.bin = _postgres_bin()
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="locojax-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        self.data = self.root / "data"
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                   "--no-sync"])

    def _run(self, command: list[str]) -> None:
        result = subprocess.run(_as_postgres_user() + command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {result.stdout}{result.stderr}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        # Durability of a throwaway cluster is worth nothing; without fsync it is several times faster.
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.root / "server.log"),
                   "-w", "-t", "60", "start"])

    def stop(self, mode: str = "fast") -> None:
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"])

    def running(self) -> bool:
        return subprocess.run(_as_postgres_user() + [str(self.bin / "pg_ctl"), "-D", str(self.data), "status"],
                              capture_output=True).returncode == 0

    def create_database(self, name: str) -> str:
        admin = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as connection:
                connection.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            admin.dispose()
        return self.url(name)

    def close(self) -> None:
        try:
            if self.running():
                self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class PrivateRedis:
    """A redis-server child process without persistence (like the compose file's broker)."""

    def __init__(self) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise Unavailable("redis-server is not installed")
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_until(answers, 30, "the private Redis to answer", poll_s=0.1)
        client.close()

    def kill(self) -> None:
        """SIGKILL: everything in it (queued start messages included) is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def close(self) -> None:
        self.kill()


DASHBOARD_SECRET = "e2e-" + secrets.token_hex(16)


def engine_environment(work: Path) -> dict[str, str]:
    """What the workers pass on to their engine processes: one persistent JAX compilation cache, so every
    run and restart after the first skips compiling the tiny model again (seconds each on a shared
    machine): the test run's (tests/conftest.py), which every other test's engines fill with the same
    programs, or else one under `work` (bench/reliability.py). The control plane under test is the same
    with or without it."""
    in_test_run = "LOCOJAX_TEST_SESSION" in os.environ  # tests/conftest.py: SESSION_VARIABLE
    cache = os.environ["JAX_COMPILATION_CACHE_DIR"] if in_test_run else str(work / "jax-cache")
    return {"JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            # so that engine processes can import the test reward functions (tests.locojax.rewards_for_tests,
            # allowed by the stack's reward_modules) and this checkout's code
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))}


@dataclass
class Stack:
    """A private PostgreSQL and Redis, and a control plane (API + `WORKERS` workers) on them."""

    work: Path
    postgres: PrivatePostgres
    redis: PrivateRedis
    plane: ControlPlane
    database_url: str
    port: int

    # --- building ----------------------------------------------------------------------------------

    @classmethod
    def start(cls, work: Path, **overrides: Any) -> "Stack":
        postgres = PrivatePostgres()
        redis_server = PrivateRedis()
        try:
            postgres.start()
            redis_server.start()
            database_url = postgres.create_database("locojax")
            (work / "data").mkdir(parents=True, exist_ok=True)
            values: dict[str, Any] = dict(
                home=work / "home", database_url=database_url, broker_url=redis_server.url, migrate_on_start=False,
                runs_root=work / "runs", data_roots=[work / "data"], scheduler_interval_s=0.3, host_stale_s=4.0,
                host_lost_s=10.0, start_timeout_s=120.0, kill_timeout_s=20.0, dispatch_resend_s=5.0,
                log_level="info", max_body_bytes=1024 * 1024, metrics_batch_max_values=5_000,
                # The operator allows the test rewards' module (tests/e2e/faults.py holds steps with one).
                reward_modules=["tests.locojax.rewards_for_tests"],
                # As an operator would set them (tests/e2e/attacks.py tries the dashboard with both).
                dashboard_secret=DASHBOARD_SECRET, trusted_hosts=["127.0.0.1", "localhost"],
            )
            values.update(overrides)
            port = free_port()
            plane = start(Settings(**values), hosts=WORKERS, port=port, extra_env=engine_environment(work))
        except BaseException:
            redis_server.close()
            postgres.close()
            raise
        return cls(work, postgres, redis_server, plane, database_url, port)

    def close(self) -> None:
        try:
            self.plane.stop(timeout_s=15)
        finally:
            self.redis.close()
            self.postgres.close()

    # --- reaching it -------------------------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        return self.plane.settings

    @property
    def url(self) -> str:
        return self.plane.url

    def client(self, token: str | None = None, timeout: float = 60.0) -> ApiClient:
        return ApiClient(self.url, token or self.plane.admin_token, timeout=timeout)

    def http(self, timeout: float = 60.0) -> httpx.Client:
        """A raw client without credentials, for requests the typed client would not send."""
        return httpx.Client(base_url=self.url, timeout=timeout)

    def ready(self) -> int:
        try:
            with self.http(timeout=10) as http:
                return http.get("/readyz").status_code
        except httpx.TransportError:
            return 0

    def counts(self, run_id: int | None = None) -> dict[str, int]:
        """Rows per table (of one run where the table has a run_id), read straight from PostgreSQL."""
        engine = create_engine(self.database_url)
        try:
            with engine.connect() as connection:
                result = {}
                for table in TABLES:
                    where = f" WHERE run_id = {int(run_id)}" if run_id is not None and table.startswith(("run_", "step_")) else ""
                    result[table] = connection.execute(text(f"SELECT count(*) FROM {table}{where}")).scalar_one()
                return result
        finally:
            engine.dispose()

    def sql(self, statement: str, **params: Any) -> list[Any]:
        engine = create_engine(self.database_url)
        try:
            with engine.begin() as connection:
                result = connection.execute(text(statement), params)
                return list(result) if result.returns_rows else []
        finally:
            engine.dispose()

    def logs(self) -> str:
        return "\n".join(path.read_text(errors="replace") for path in sorted((self.work / "home" / "logs").glob("*.log")))

    # --- breaking it -------------------------------------------------------------------------------

    def _environment(self) -> dict[str, str]:
        return self.settings.as_environment(LOCOJAX_URL=self.url, PYTHONUNBUFFERED="1",
                                            **engine_environment(self.work))

    def _spawn(self, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = self.work / "home" / "logs" / (f"{name}.log" if name == "api" else f"worker-{name}.log")
        with log.open("ab") as handle:
            process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self.plane.processes[name] = process
        return process

    def kill(self, name: str) -> None:
        """SIGKILL one process of the plane ("api" or a worker name): no cleanup of any kind runs. Only
        the process itself: a worker's engine processes die by their parent-death signal."""
        process = self.plane.processes[name]
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)

    def start_api(self) -> None:
        """Start the API again on the same port with the same settings (as a service manager would)."""
        self._spawn("api", [sys.executable, "-m", "locojax.cli", "serve", "--host", "127.0.0.1", "--port",
                            str(self.port)], self._environment())

        def up() -> bool:
            if self.plane.processes["api"].poll() is not None:
                raise AssertionError(f"the API exited with code {self.plane.processes['api'].returncode}")
            return self.ready() == 200

        wait_until(up, 120, "the restarted API to be ready", poll_s=0.2)

    def start_worker(self, name: str) -> None:
        """Start a worker of this name again (same queue, same cores)."""
        index = self.plane.host_names.index(name)
        cores = ",".join(map(str, cores_for_host(index, len(self.plane.host_names))))
        env = {**self._environment(), "LOCOJAX_TOKEN": self.plane.worker_token}
        self._spawn(name, [sys.executable, "-m", "locojax.cli", "worker", "--name", name, "--cores", cores,
                           "--devices", "1"], env)

    def hosts_online(self) -> set[str]:
        with self.client() as api:
            return {h["name"] for h in api.request("GET", "/api/v1/hosts")["data"] if h["status"] == "ONLINE"}

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Every service up, the API ready, every worker process alive and its host ONLINE."""
        for name, process in self.plane.processes.items():
            if process.poll() is not None:
                raise AssertionError(f"{name} is not running (exit code {process.returncode})")
        wait_until(lambda: self.ready() == 200, timeout_s, "the API to be ready")
        wait_until(lambda: set(self.plane.host_names) <= self.hosts_online(), timeout_s, "every host ONLINE")

    def engine_processes(self, marker: str | None = None) -> list[int]:
        """Live `locojax host`/`train` processes (of one run when `marker`, e.g. its output dir, is given)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [part.decode(errors="replace") for part in argv if part]
            if "locojax.cli" not in words or not {"host", "train"} & set(words):
                continue
            if str(self.work) not in " ".join(words):
                continue  # another suite's engine (tests run in parallel on shared machines)
            if marker is not None and marker not in " ".join(words):
                continue
            if alive(int(entry.name)):
                found.append(int(entry.name))
        return found


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive after `timeout_s` (empty when every one is gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]

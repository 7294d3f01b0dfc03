"""Fixtures shared by every test package: a fresh database on the local PostgreSQL per test session, and
a way to find the processes this test session started (and no one else's)."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

DEFAULT_PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"

# Every process a test starts inherits this variable, and so do their children (JAX hosts, Ray's raylet
# and workers). Checks for leftover processes look only at those carrying it: other suites, benchmarks
# or people on the same machine must neither fail these checks nor be picked as a process to kill.
SESSION_VARIABLE = "LOCOJAX_TEST_SESSION"
os.environ[SESSION_VARIABLE] = secrets.token_hex(8)
# An engine started by a worker gets a minimal environment (worker/supervisor.py: engine_environment),
# without LOCOJAX_* variables, so the marker above stops at the worker. TMPDIR is one the engine keeps,
# and so do Ray's processes (whose session directory goes under it): a directory of this session's own
# marks them as well.
SESSION_TMPDIR = Path("/tmp") / f"locojax-test-{os.environ[SESSION_VARIABLE]}"
SESSION_TMPDIR.mkdir(mode=0o711)  # others may pass through (a private PostgreSQL runs as `postgres`), not list it
os.environ["TMPDIR"] = str(SESSION_TMPDIR)
# The engine's processes share compiled programs in a persistent cache (`locojax train --compilation-cache`,
# default under the home directory); a test run keeps its own, removed with its folder, so nothing a
# previous run compiled can make this one faster or different. Under pytest-xdist the controller's
# folder is the run's: its workers inherit the variable set here (xdist names each worker in
# PYTEST_XDIST_WORKER before this file is imported), so every process of one run compiles a program once.
if "PYTEST_XDIST_WORKER" not in os.environ or "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(SESSION_TMPDIR / "compilation-cache")
# Every program, however quickly it compiled (JAX's default caches only those over 1 s): the engine's
# hosts already do (`configure_jax`), and so now do this process and the processes that take JAX's
# settings from the environment alone (Ray's actors, the probe's workers), where a test builds again
# a program an earlier test compiled.
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# Two xdist workers share 2 cores: a DA driver once gave up on its Ray GCS after Ray's 60 s while the
# other worker's tests held the cores (the GCS starved, not broken). Runs started from the tests may
# wait 180 s; an engine a worker starts keeps Ray's default (RAY_* does not pass the worker's filter).
os.environ.setdefault("RAY_gcs_server_request_timeout_seconds", "180")
# The tests' programs are tiny and run a few steps: XLA:CPU spends far longer compiling them than running
# them, much of that in LLVM optimising the machine code XLA:CPU generates. At LLVM's level 0 a cold
# two-host tiny run took 14-16 s instead of 23.7 end to end (a warm one: 8.2). The programs are the same
# XLA programs (fast-math off either way) in less optimised machine code, whose float32 rounding can
# differ in the last bits (a chunked entropy: 3.8e-6 from the whole-vocabulary one instead of 9.5e-7);
# every test passes with it, the exact-equality ones included. Benchmarks and real runs keep XLA's default.
# Engines a worker starts keep it too (worker/supervisor.py passes XLA_* through).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()


def session_processes(fragment: str) -> list[int]:
    """Live processes of this test session whose command line contains `fragment`."""
    markers = {f"{SESSION_VARIABLE}={os.environ[SESSION_VARIABLE]}".encode(), f"TMPDIR={SESSION_TMPDIR}".encode()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if markers.isdisjoint((entry / "environ").read_bytes().split(b"\0")):
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # exited while we looked
        if fragment in command and state != "Z":  # a zombie holds nothing; its parent reaps it
            found.append(int(entry.name))
    return found


# `make test` shares the suite between two pytest-xdist workers (`-n 2`) in units of work: a module is
# one, so whatever its module-scoped fixtures start (a control plane, a trained start) is started once,
# on one worker; tests/e2e is one, as its whole package shares one stack. Units whose tests start
# processes of their own are handed out first, the most such tests first, so that the longest ones are
# not left running alone at the end while the other worker idles. (xdist's own `--dist loadgroup` marks
# cannot do this here: they rename test ids through an attribute pytest 9 no longer reads.)
HEAVY_MARKERS = ("e2e", "multiprocess", "slow")


def work_unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "tests/e2e" if path.startswith("tests/e2e/") else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        """xdist's scheduling by scope, with this suite's units as the scopes, in the workers' order."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # the order is the one pytest_collection_modifyitems sets
    return WorkUnitScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:  # a plain run keeps the file order
        return
    units = [work_unit(item.nodeid) for item in items]
    heavy: dict[str, int] = {}
    for unit, item in zip(units, items):
        heavy[unit] = heavy.get(unit, 0) + any(item.get_closest_marker(name) for name in HEAVY_MARKERS)
    order = {unit: position for position, unit in enumerate(dict.fromkeys(units))}
    ranked = sorted(zip(units, items), key=lambda pair: (-heavy[pair[0]], order[pair[0]]))
    items[:] = [item for _, item in ranked]


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(SESSION_TMPDIR, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--postgres-url", default=DEFAULT_PG_ADMIN_URL,
                     help="a PostgreSQL database URL whose server may create and drop test databases")


def create_postgres_database(admin_url: str, prefix: str = "locojax_test") -> tuple[str, Callable[[], None]]:
    """A new, migrated database on the server at `admin_url` and a function that drops it; skips the
    requesting tests when no server answers."""
    from server.db import upgrade_to_head

    admin = make_url(admin_url).set(drivername="postgresql+psycopg")
    name = f"{prefix}_{secrets.token_hex(4)}"
    engine = create_engine(admin, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
            # Durability of a throwaway database is worth nothing; skipping the fsync per commit makes
            # the PostgreSQL tests several times faster.
            connection.execute(text(f'ALTER DATABASE "{name}" SET synchronous_commit = off'))
    except Exception as exc:  # no server here: the SQLite tests still run
        engine.dispose()
        pytest.skip(f"PostgreSQL not reachable at {admin.render_as_string(hide_password=True)}: {exc}")

    def drop() -> None:
        with engine.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        engine.dispose()

    url = admin.set(database=name).render_as_string(hide_password=False)
    try:
        upgrade_to_head(url)
    except BaseException:
        drop()
        raise
    return url, drop


@pytest.fixture(scope="session")
def postgres_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A new, migrated database (dropped afterwards); skips when no server answers."""
    url, drop = create_postgres_database(request.config.getoption("--postgres-url"))
    try:
        yield url
    finally:
        drop()

"""`locojax up` as a newcomer runs it: the embedded control plane (SQLite, kombu's SQLAlchemy broker, no
server to install), a real run submitted over REST and watched in the dashboard in chromium until it
succeeds, then Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from locojax.client import ApiClient
from locojax.launch import free_port
from tests.worker.test_control_plane_e2e import tiny_spec, wait_final, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.browser]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def processes_with_home(home: Path) -> list[int]:
    """Every process started for this control plane: they all carry its LOCOJAX_HOME."""
    marker = f"LOCOJAX_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


class Up:
    def __init__(self, process: subprocess.Popen[str], url: str, token: str, home: Path):
        self.process, self.url, self.token, self.home = process, url, token, home


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("up")
    home = tmp / ".locojax"
    port = free_port()
    env = {**os.environ, "LOCOJAX_HOME": str(home), "LOCOJAX_RUNS_ROOT": str(tmp / "runs"),
           "LOCOJAX_DATA_ROOTS": str(tmp)}
    for name in ("LOCOJAX_DATABASE_URL", "LOCOJAX_BROKER_URL"):
        env.pop(name, None)  # the embedded defaults: SQLite and the SQLite broker under LOCOJAX_HOME
    process = subprocess.Popen([sys.executable, "-m", "locojax.cli", "up", "--hosts", "1", "--port", str(port)],
                               cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    token = None
    deadline = time.monotonic() + 180
    while token is None and time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if match := re.search(r"^\s+token\s+(\S+)", line):
            token = match.group(1)
    assert token, "".join(lines)
    assert f"http://127.0.0.1:{port}/" in "".join(lines)  # the dashboard URL is printed
    yield Up(process, f"http://127.0.0.1:{port}", token, home)
    if process.poll() is None:
        process.kill()


def test_up_runs_a_submitted_run_and_the_dashboard_follows_it(up: Up):
    if not shutil.which("chromium"):
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with ApiClient(up.url, up.token) as api:
        run = api.submit(tiny_spec("up-live", hosts=1, steps=12, every=4))
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            page.goto(f"{up.url}/login?next=/runs/{run['id']}")
            page.fill("#input-token", up.token)
            page.click("button[type=submit]")
            page.wait_for_url(f"{up.url}/runs/{run['id']}")
            page.evaluate("window.__no_reload = true")
            sync_api.expect(page.locator("#run-status")).to_have_text("SUCCEEDED", timeout=240_000)
            assert page.evaluate("window.__no_reload === true"), "the page was reloaded"
            # A locator assertion, not page.wait_for_function: that one polls by evaluating its string
            # inside the page, which the dashboard's CSP (no 'unsafe-eval') refuses whenever the chart
            # was not drawn yet at the first look (a fresh-clone CI run failed so).
            reward_chart = page.locator("figure[data-chart=reward]")
            sync_api.expect(reward_chart).to_have_attribute("data-drawn-points", "12", timeout=120_000)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "run-page-real-run.png"), full_page=True)
            browser.close()
        final = wait_final(api, run["id"], timeout_s=30)
        assert final["status"] == "SUCCEEDED" and final["last_checkpoint_step"] == 12
        history = api.metric_history(run["id"], ["reward/mean"], max_points=100)["series"][0]
        assert history["steps"] == list(range(12))


def test_ctrl_c_stops_everything(up: Up):
    assert processes_with_home(up.home), "the control plane's processes should be running"
    up.process.send_signal(signal.SIGINT)
    assert up.process.wait(timeout=60) == 0
    wait_until(lambda: not processes_with_home(up.home), 15, "every process of the control plane to exit")

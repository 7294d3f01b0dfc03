"""The dashboard in a real browser: Debian's chromium driven by Playwright, against a live uvicorn server
on loopback with PostgreSQL behind it.

A run's lifecycle, metrics and events are reported through the worker REST API (what workers do), and
the pages must follow without a reload. Screenshots land in test-artifacts/ (the run page's is kept as
the dashboard's picture).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from server.models import HostProcessStatus, HostRole, RunHost
from tests.web.conftest import ARTIFACTS, LiveServer

pytestmark = [pytest.mark.browser, pytest.mark.postgres, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
WAIT_MS = 20_000  # generous: the CI machine is shared and slow; nothing here asserts on speed

sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect


@pytest.fixture(scope="module")
def browser(live_server: LiveServer) -> Iterator[object]:
    if not shutil.which("chromium"):
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    from web.templating import STATIC_DIR, VENDOR_FILES

    missing = [name for name in VENDOR_FILES if not (STATIC_DIR / "vendor" / name).is_file()]
    assert not missing, f"{missing} not in web/static/vendor: run `make install` (npm step)"
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, live_server: LiveServer):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    # The dashboard's own Content-Security-Policy is enforced here (no bypass): a script or style it
    # blocks shows up as a console error, and fails the test.
    page.on("console", lambda message: errors.append(message.text)
            if message.type == "error" and "Content Security Policy" in message.text else None)
    page.on("dialog", lambda dialog: dialog.accept())  # the cancel button asks first
    # Logging in is part of every visit: the unauthenticated page sends the browser to /login.
    page.goto(live_server.url + "/runs")
    expect(page).to_have_url(live_server.url + "/login?next=%2Fruns")
    page.fill("#input-token", live_server.tokens["submit"])
    page.click("button[type=submit]")
    expect(page).to_have_url(live_server.url + "/runs")
    yield page
    context.close()
    assert not errors, f"JavaScript errors: {errors}"


def _submit_run(server: LiveServer, name: str, **spec) -> int:
    response = server.submitter.post("/api/v1/runs", json={"spec": {"name": name, "steps": 40, **spec}})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _transition(server: LiveServer, run_id: int, to: str) -> None:
    response = server.worker.post(f"/api/v1/runs/{run_id}/transitions", json={"to": to})
    assert response.status_code == 200, response.text


def _metrics(server: LiveServer, run_id: int, steps: range) -> None:
    rows = [{"step": step, "values": {
        "reward/mean": step / 40 + 0.1 * (step % 3), "loss/total": 1 / (step + 1), "loss/policy": 0.5 / (step + 1),
        "loss/kl": 0.01 * step,
        "completion/len_mean": 10 + step % 5, "throughput/rollout_tokens_per_s": 900.0 + step,
        "throughput/train_tokens_per_s": 1500.0 - step, "time/step": 0.5, "time/device": 0.3, "time/host": 0.15,
        "time/network": 0.05}} for step in steps]
    response = server.worker.post(f"/api/v1/runs/{run_id}/metrics", json={"rows": rows, "attempt": 0})
    assert response.status_code == 200, response.text


def _event(server: LiveServer, run_id: int, message: str) -> None:
    response = server.worker.post(f"/api/v1/runs/{run_id}/events", json={"events": [{"message": message}], "attempt": 0})
    assert response.status_code == 200, response.text


def _drawn_points(page, chart: str) -> int:
    return int(page.get_attribute(f"figure[data-chart={chart}]", "data-drawn-points") or 0)


def test_run_page_follows_a_run_to_succeeded_without_a_reload(page, live_server: LiveServer):
    decision = live_server.submitter.post("/api/v1/placement/recommend", json={
        "model": "tiny", "hardware": "local-cpu", "chips": 1, "workload": "arith"})
    assert decision.status_code == 201, decision.text
    run_id = _submit_run(live_server, "browser-live", steps=400,
                         placement={"mode": decision.json()["mode"], "decision_id": decision.json()["id"]})
    _transition(live_server, run_id, "STARTING")
    _transition(live_server, run_id, "RUNNING")
    with live_server.app.state.db.write_session() as session:  # placed, as the scheduler would
        session.add(RunHost(run_id=run_id, attempt=0, process_index=0, host_name="browser-host", role=HostRole.CO,
                            status=HostProcessStatus.STARTING))
        session.commit()
    response = live_server.worker.put(f"/api/v1/runs/{run_id}/hosts/0", json={
        "host_name": "browser-host", "role": "co", "status": "RUNNING", "pid": 4242, "attempt": 0})
    assert response.status_code == 200, response.text
    _metrics(live_server, run_id, range(0, 10))

    page.goto(f"{live_server.url}/runs/{run_id}")
    page.evaluate("window.__no_reload = true")
    expect(page.locator("#run-status")).to_have_text("RUNNING")
    expect(page.locator("figure[data-chart=reward]")).to_have_attribute("data-drawn-points", "10")
    assert page.locator("figure[data-chart=reward] canvas").count() >= 1
    assert _drawn_points(page, "split") == 10  # the stacked device/host/network chart
    expect(page.locator("#run-hosts")).to_contain_text("browser-host")

    # New steps and events arrive while the page is open. 400 steps are more than a chart's 300 points:
    # the server downsamples to 2 steps per point, and each line gains its min/max band.
    _metrics(live_server, run_id, range(10, 400))
    _event(live_server, run_id, "step 399 done: reward 9.975")
    expect(page.locator("figure[data-chart=reward]")).to_have_attribute("data-drawn-points", "200")
    assert page.locator("figure[data-chart=reward] .u-legend .u-series").count() == 4  # step, value, min, max
    expect(page.locator("#run-events")).to_contain_text("step 399 done: reward 9.975")
    expect(page.locator("#run-latest")).to_contain_text("9.975")
    expect(page.locator("#run-progress")).to_contain_text("step 400 of 400")

    _transition(live_server, run_id, "SUCCEEDED")
    expect(page.locator("#run-status")).to_have_text("SUCCEEDED")
    expect(page.locator("#run-events")).to_contain_text("RUNNING -> SUCCEEDED")
    assert page.evaluate("window.__no_reload === true"), "the page was reloaded"
    # Terminal: the header no longer polls, and the decision shows the run's median step time.
    assert page.get_attribute("#run-header", "hx-trigger") is None
    page.reload()
    expect(page.locator("#measured-step")).to_have_text("500 ms")
    expect(page.locator("figure[data-chart=reward]")).to_have_attribute("data-drawn-points", "200")
    page.screenshot(path=str(ARTIFACTS / "run-page.png"), full_page=True)


def test_runs_list_badge_updates_itself(page, live_server: LiveServer):
    run_id = _submit_run(live_server, "browser-badge")
    page.goto(f"{live_server.url}/runs")
    badge = page.locator(f"#run-{run_id}-status")
    expect(badge).to_have_text("QUEUED")
    _transition(live_server, run_id, "STARTING")
    _transition(live_server, run_id, "RUNNING")
    expect(badge).to_have_text("RUNNING")
    _transition(live_server, run_id, "FAILED")
    expect(badge).to_have_text("FAILED")
    assert badge.get_attribute("hx-trigger") is None  # stopped polling
    page.screenshot(path=str(ARTIFACTS / "runs-list.png"), full_page=True)


def test_new_run_form_shows_errors_inline_then_submits(page, live_server: LiveServer):
    page.goto(f"{live_server.url}/runs/new")
    page.fill("#input-name", "browser-form")
    page.fill("#input-group_size", "0")
    page.fill("#input-spec_yaml", "rollout:\n  top_p: 1.5\n")
    page.click("#submit-run")
    expect(page.locator("#field-group_size .error")).to_contain_text("greater than or equal to 1")
    expect(page.locator("#field-spec_yaml .error")).to_contain_text("rollout.top_p")
    expect(page).to_have_url(f"{live_server.url}/runs/new")
    page.screenshot(path=str(ARTIFACTS / "new-run-errors.png"), full_page=True)

    page.fill("#input-group_size", "4")
    page.fill("#input-spec_yaml", "rollout:\n  top_p: 0.9\n")
    page.click("#submit-run")
    page.wait_for_url(f"{live_server.url}/runs/*")
    expect(page.locator("#run-status")).to_have_text("QUEUED")
    run = live_server.submitter.get(page.url.replace(live_server.url, "/api/v1")).json()
    rollout = run["spec"]["rollout"]
    assert (run["name"], rollout["group_size"], rollout["top_p"]) == ("browser-form", 4, 0.9)


def test_placement_explorer_ranks_options_and_prefills_the_form(page, live_server: LiveServer):
    page.goto(f"{live_server.url}/placement")
    page.select_option("#input-model", "qwen3-0.6b")
    page.select_option("#input-hardware", "tpu-v5e")
    page.fill("#input-chips", "16")
    page.select_option("#input-workload", "gsm8k")
    page.click("#rank-placements")
    options = page.locator("#placement-options tr.option")
    expect(options.first).to_be_visible()
    assert options.count() > 3
    expect(page.locator("#placement-reason")).not_to_be_empty()
    assert page.locator("#placement-options .split-bar").count() == options.count()
    page.screenshot(path=str(ARTIFACTS / "placement-explorer.png"), full_page=True)

    chosen = page.locator("#placement-options tr.chosen")
    chosen.get_by_role("link", name="submit with this placement").click()
    page.wait_for_url("**/runs/new?**")
    assert page.input_value("#input-decision_id") != ""
    assert page.input_value("#input-preset") == "qwen3-0.6b"


def test_ask_the_recommender_fills_the_placement(page, live_server: LiveServer):
    page.goto(f"{live_server.url}/runs/new")
    page.click("#placement-fields summary")
    page.select_option("#input-hardware", "tpu-v5e")
    page.fill("#input-chips", "8")
    page.click("#ask-recommender")
    expect(page.locator("#recommendation")).to_contain_text("fastest")
    assert page.input_value("#input-decision_id") != ""


def test_cancel_from_the_run_page(page, live_server: LiveServer):
    run_id = _submit_run(live_server, "browser-cancel")
    _transition(live_server, run_id, "STARTING")
    _transition(live_server, run_id, "RUNNING")
    page.goto(f"{live_server.url}/runs/{run_id}")
    page.click("#cancel-run")
    expect(page.locator("#run-status")).to_have_text("CANCELLING")
    assert live_server.submitter.get(f"/api/v1/runs/{run_id}").json()["cancel_requested"] is True
    _transition(live_server, run_id, "CANCELLED")  # the host process stopped at its step boundary
    expect(page.locator("#run-status")).to_have_text("CANCELLED")
    expect(page.locator("#resume-run")).to_be_visible()


def test_runs_list_filters_as_you_type(page, live_server: LiveServer):
    wanted = _submit_run(live_server, "browser-filter-needle")
    other = _submit_run(live_server, "browser-filter-hay")
    page.goto(f"{live_server.url}/runs")
    page.evaluate("window.__no_reload = true")
    page.fill("input[name=name]", "needle")
    expect(page.locator(f"#run-{other}-status")).to_have_count(0)
    expect(page.locator(f"#run-{wanted}-status")).to_be_visible()
    assert page.evaluate("window.__no_reload === true")
    expect(page).to_have_url(f"{live_server.url}/runs?status=&name=needle")


def test_compare_overlays_runs(page, live_server: LiveServer):
    first, second = _submit_run(live_server, "browser-cmp-a"), _submit_run(live_server, "browser-cmp-b")
    for run_id, steps in ((first, range(0, 8)), (second, range(4, 12))):
        _transition(live_server, run_id, "STARTING")
        _transition(live_server, run_id, "RUNNING")
        _metrics(live_server, run_id, steps)
    page.goto(f"{live_server.url}/compare?run={first}&run={second}&key=reward/mean")
    expect(page.locator("figure[data-chart=compare]")).to_have_attribute("data-drawn-points", "12")
    legend = page.locator("figure[data-chart=compare] .u-legend")
    expect(legend).to_contain_text("browser-cmp-a")
    expect(legend).to_contain_text("browser-cmp-b")
    page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)


def test_pages_read_without_javascript(browser, live_server: LiveServer):
    run_id = _submit_run(live_server, "browser-no-js")
    _transition(live_server, run_id, "STARTING")
    _transition(live_server, run_id, "RUNNING")
    _metrics(live_server, run_id, range(0, 5))
    context = browser.new_context(java_script_enabled=False)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    try:
        page.goto(f"{live_server.url}/runs/{run_id}")
        page.fill("#input-token", live_server.tokens["worker"])  # plain form post, then the redirect back
        page.click("button[type=submit]")
        expect(page.locator("#run-status")).to_have_text("RUNNING")
        summary = page.locator("figure[data-chart=reward] .chart-summary")
        expect(summary).to_be_visible()  # the numbers stand in for the chart
        expect(summary).to_contain_text("at step 4")
        assert page.locator("figure[data-chart=reward] canvas").count() == 0
        expect(page.locator("#run-latest")).to_contain_text("reward/mean")
        page.goto(f"{live_server.url}/runs")
        expect(page.locator(f"#run-{run_id}-status")).to_have_text("RUNNING")
    finally:
        context.close()

"""The placement page's prediction-error chart in a real browser (Debian's chromium through Playwright):
run directories imported over REST become observations, and the page draws each one's error on a time
axis, one series per hardware, under the dashboard's own Content-Security-Policy."""

from __future__ import annotations

import pytest

from locojax.placement.calibration import observation_payload
from tests.placement_runs import SMALL_RUNS, write_run_dir
from tests.web.conftest import ARTIFACTS, LiveServer
from tests.web.test_browser import browser, expect, page  # noqa: F401  (the browser and a logged-in page)

pytestmark = [pytest.mark.browser, pytest.mark.postgres, pytest.mark.slow]


def test_the_placement_page_charts_each_hardwares_prediction_error_over_time(page, live_server: LiveServer,  # noqa: F811
                                                                            tmp_path):
    for spec in SMALL_RUNS[:4]:
        payload = observation_payload(write_run_dir(tmp_path / spec["name"], spec))
        response = live_server.worker.post("/api/v1/calibration/observations", json=payload)  # an admin token
        assert response.status_code == 201, response.text
    page.goto(live_server.url + "/placement")
    figure = page.locator("#chart-prediction-error")
    expect(figure.locator("canvas")).to_have_count(1)
    expect(figure).to_have_attribute("data-drawn-points", "4")
    expect(figure.locator(".u-legend")).to_contain_text("tpu-v5e")
    expect(figure.locator(".u-legend")).to_contain_text("time")
    # The observations are listed with their errors; a submit token sees no admin buttons.
    expect(page.locator("#observations tbody tr")).to_have_count(4)
    expect(page.locator("#placement-learning button")).to_have_count(0)
    page.screenshot(path=str(ARTIFACTS / "placement_learning.png"), full_page=True)

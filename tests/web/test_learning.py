"""The dashboard's view of the placement model's learning: a run page shows what the model predicted for
the run on its hosts' hardware beside what it measured, and where its TensorBoard files are; the
placement page charts each hardware's prediction error per run over time, and an admin (only) excludes
an observation or returns to an earlier calibration version from it."""

from __future__ import annotations

import json
import re

import pytest
from sqlalchemy import text

from locojax.placement.calibration import observation_payload
from server.models import Host, HostRecordStatus, Run, RunStatus, utcnow
from server.services import runs as run_service
from server.services import scheduling
from tests.placement_runs import SMALL_RUNS, spec_dict, write_run_dir
from tests.server.helpers import insert_run
from tests.web.conftest import Browsing, login

CHART_DATA = re.compile(r'<script type="application/json" class="chart-data">(.*?)</script>', re.S)


@pytest.fixture(autouse=True)
def no_calibrations(site):
    with site.db.engine.begin() as connection:
        for table in ("calibration_observations", "calibrations"):
            connection.execute(text(f"DELETE FROM {table}"))


@pytest.fixture
def admin(site) -> Browsing:
    client = site.client()
    return Browsing(client, login(client, site.tokens["admin"]), site)


def _import(site, tmp_path, specs):
    client = site.client()
    for spec in specs:
        payload = observation_payload(write_run_dir(tmp_path / spec["name"], spec))
        response = client.post("/api/v1/calibration/observations", json=payload, headers=site.bearer("admin"))
        assert response.status_code == 201, response.text


def test_a_run_page_shows_predicted_beside_measured_and_its_tensorboard_files(site, submitter):
    with site.db.write_session() as session:
        session.add(Host(name="browser-0", device_kind="tpu-v5e", device_count=1, status=HostRecordStatus.ONLINE,
                         last_heartbeat=utcnow(), info={}))
        session.commit()
    run_id = insert_run(site.db, spec=spec_dict("priced", "small", 8, 8, 64, 64, steps=10), name="priced")
    with site.db.write_session() as session:
        scheduling.tick(session, site.app.state.settings)
    page = submitter.client.get(f"/runs/{run_id}").text
    assert 'id="run-hardware">tpu-v5e<' in page and "the catalog's constants" in page
    assert 'data-phase="rollout"' in page and f"{run_id}-priced/tensorboard" in page
    with site.db.write_session() as session:
        from server.models import AGGREGATE_HOST, StepMetric

        session.add_all(StepMetric(run_id=run_id, key=key, host=AGGREGATE_HOST, step=step, value=value)
                        for step in range(4) for key, value in (("time/step", 0.25), ("time/rollout", 0.125),
                                                                ("time/train", 0.1), ("time/reward", 0.01)))
        run = session.get(Run, run_id)
        run_service.transition(session, run, RunStatus.RUNNING)
        run_service.transition(session, run, RunStatus.SUCCEEDED)
        session.commit()
    partial = submitter.client.get(f"/runs/{run_id}/prediction").text
    assert "median of 3 steady step(s)" in partial and "250 ms" in partial and "125 ms" in partial
    assert "It teaches the model: observation #" in partial


def test_the_placement_page_charts_errors_and_only_admins_change_the_calibration(site, submitter, admin, tmp_path):
    _import(site, tmp_path, SMALL_RUNS[:3])
    page = submitter.client.get("/placement").text
    chart = json.loads(CHART_DATA.findall(page)[-1])
    assert chart["time"] and chart["points"] == 3 and [s["label"] for s in chart["series"]] == ["tpu-v5e"]
    # The first import was priced with the catalog's constants; the ones after it with the fit so far.
    errors = chart["series"][0]["last"]
    assert abs(errors[-1]) < abs(errors[0])
    assert 'id="observations"' in page and "Exclude" not in page and "Return to v" not in page  # not an admin
    observation = re.search(r'id="observation-(\d+)"', page).group(1)
    refused = submitter.post(f"/placement/observations/{observation}/exclude")
    assert refused.status_code == 403

    admin_page = admin.client.get("/placement").text
    assert f'/placement/observations/{observation}/exclude' in admin_page and "Return to v1" in admin_page
    swapped = admin.post(f"/placement/observations/{observation}/exclude", headers={"HX-Request": "true"})
    assert swapped.status_code == 200 and swapped.text.lstrip().startswith('<section id="placement-learning">')
    assert f'id="observation-{observation}" class="excluded"' in swapped.text
    assert admin.client.post(f"/placement/observations/{observation}/include").status_code == 403  # no CSRF token
    version = re.search(r'id="calibration-version-(\d+)"(?! class="active")', admin_page).group(1)
    done = admin.post(f"/placement/calibrations/{version}/activate")
    assert done.status_code == 303 and done.headers["location"].startswith("/placement")
    assert f'id="calibration-version-{version}" class="active"' in admin.client.get("/placement").text

"""The dashboard over HTTP (TestClient, both backends): sessions and CSRF, scopes, the new-run form's
errors, partials that poll only while a run is live, chart data, the events stream, the explorer."""

from __future__ import annotations

import json
import re
import time
from html import unescape

import pytest
from sqlalchemy import func, select

from server.models import ApiToken, PlacementDecision, Run, RunStatus
from server.schemas import EventCreate, MetricsBatch
from server.services import events as event_service
from server.services import metrics as metric_service
from server.services import tokens as token_service
from tests.server.helpers import insert_run
from tests.web.conftest import Browsing, Site, csrf_from, login
from web import auth
from web.charts import RUN_CHART_KEYS

S = RunStatus


def _run_count(site: Site) -> int:
    with site.db.read_session() as session:
        return session.scalar(select(func.count()).select_from(Run))


def _ingest(site: Site, run_id: int, steps: range, keys=("reward/mean", "time/step"), rows=None) -> None:
    """Metrics stored as ingest stores them (test setup: the runs here have no host processes to report)."""
    rows = rows or [{"step": step, "values": {key: float(step % 7) for key in keys}} for step in steps]
    with site.db.write_session() as session:
        metric_service.ingest(session, run_id, MetricsBatch(rows=rows, attempt=0), max_values=100_000)


def _events(site: Site, run_id: int, messages: list[str]) -> None:
    with site.db.write_session() as session:
        event_service.append(session, run_id, [EventCreate(message=m) for m in messages], source="host0")


def _owned(site: Site, status: RunStatus, scope: str = "submit", **fields) -> int:
    """A run submitted by the site's `scope` token: the one its sessions may cancel and resume."""
    with site.db.read_session() as session:
        token_id = session.scalar(select(ApiToken.id).where(ApiToken.name == f"web-{scope}"))
    return insert_run(site.db, status, owner_token_id=token_id, **fields)


def _error_near(html: str, field: str) -> list[str]:
    """The inline errors rendered inside the field's wrapper."""
    block = re.search(rf'<div class="field[^"]*" id="field-{re.escape(field)}">(.*?)</div>', html, re.S)
    assert block, f"no field {field}"
    return re.findall(r'<span class="error" role="alert">(.*?)</span>', block.group(1), re.S)


# --- sessions ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/runs", "/runs/1", "/runs/new", "/placement", "/compare", "/hosts"])
def test_pages_redirect_to_login_without_a_session(site: Site, path: str):
    response = site.client().get(path)
    assert response.status_code == 303
    assert response.headers["location"].startswith("/login?next=")


def test_htmx_fragments_ask_the_browser_to_log_in(site: Site):
    run_id = insert_run(site.db, S.RUNNING)
    response = site.client().get(f"/runs/{run_id}/status", headers={
        "HX-Request": "true", "HX-Current-URL": "http://testserver/runs?status=RUNNING"})
    assert response.status_code == 401
    # Back to the page the badge sits on after logging in, not to the badge.
    assert response.headers["HX-Redirect"] == "/login?next=%2Fruns%3Fstatus%3DRUNNING"


def test_login_sets_a_signed_httponly_lax_cookie_and_returns_to_next(site: Site):
    client = site.client()
    page = client.get("/login?next=/hosts")
    response = client.post("/login", data={"token": site.tokens["submit"], "csrf_token": csrf_from(page.text),
                                           "next": "/hosts"})
    assert (response.status_code, response.headers["location"]) == (303, "/hosts")
    cookie = response.headers["set-cookie"]
    assert cookie.startswith(f"{auth.COOKIE_NAME}=")
    assert "HttpOnly" in cookie and "SameSite=lax" in cookie and "Path=/" in cookie
    assert site.tokens["submit"] not in cookie  # the token id travels, never the secret
    assert client.get("/hosts").status_code == 200


def test_login_changes_the_csrf_token(site: Site):
    client = site.client()
    before = csrf_from(client.get("/login").text)
    after = login(client, site.tokens["submit"])
    assert before != after


@pytest.mark.parametrize("token", ["lcj_not-a-token", ""])
def test_a_bad_token_is_refused_on_the_login_page(site: Site, token: str):
    client = site.client()
    page = client.get("/login")
    response = client.post("/login", data={"token": token, "csrf_token": csrf_from(page.text)})
    assert response.status_code == 401
    assert "not valid" in response.text
    assert client.get("/runs").status_code == 303


@pytest.mark.parametrize("target", ["https://evil.example/", "//evil.example/x", "/\\evil.example", "javascript:x"])
def test_login_never_redirects_off_site(site: Site, target: str):
    client = site.client()
    page = client.get("/login")
    response = client.post("/login", data={"token": site.tokens["submit"], "csrf_token": csrf_from(page.text),
                                           "next": target})
    assert response.headers["location"] == "/runs"


def test_a_revoked_token_ends_its_sessions(site: Site):
    with site.db.write_session() as session:
        row, secret = token_service.create(session, name="short-lived", scopes=["submit"])
    client = site.client()
    login(client, secret)
    assert client.get("/runs").status_code == 200
    with site.db.write_session() as session:
        token_service.revoke(session, row.id)
    assert client.get("/runs").status_code == 303


def test_a_tampered_or_expired_cookie_is_no_session(site: Site):
    key = site.app.state.dashboard_key
    with site.db.read_session() as session:
        token_id = token_service.list_all(session)[0].id
    good = auth.encode_session(key, auth.WebSession(csrf="c", token_id=token_id, expires_at=time.time() + 60))
    assert auth.decode_session(key, good) is not None
    payload, signature = good.split(".")
    forged = auth.encode_session(b"another key", auth.WebSession(csrf="c", token_id=token_id + 1,
                                                                  expires_at=time.time() + 60)).split(".")[0]
    assert auth.decode_session(key, f"{forged}.{signature}") is None
    assert auth.decode_session(key, good, now=time.time() + 120) is None
    assert auth.decode_session(key, "garbage") is None
    client = site.client()
    client.cookies.set(auth.COOKIE_NAME, f"{forged}.{signature}")
    assert client.get("/runs").status_code == 303


def test_logout_ends_the_session(submitter: Browsing):
    response = submitter.post("/logout")
    assert (response.status_code, response.headers["location"]) == (303, "/login")
    assert submitter.client.get("/runs").status_code == 303


# --- CSRF and scopes --------------------------------------------------------------------------------

@pytest.mark.parametrize("sent", [None, "", "wrong-token"])
def test_posts_without_the_sessions_csrf_token_are_403(submitter: Browsing, sent: str | None):
    run_id = insert_run(submitter.site.db, S.QUEUED)
    data = {} if sent is None else {"csrf_token": sent}
    for url, body in [(f"/runs/{run_id}/cancel", data), ("/runs/new", {**data, "name": "x"}),
                      ("/placement", {**data, "model": "tiny", "hardware": "local-cpu", "chips": "1",
                                      "workload": "arith"}),
                      ("/logout", data)]:
        response = submitter.client.post(url, data=body)
        assert response.status_code == 403, url
        assert "security token" in response.text
    with submitter.site.db.read_session() as session:
        assert session.get(Run, run_id).status == S.QUEUED
        assert session.scalar(select(func.count()).select_from(PlacementDecision)) == 0
    assert _run_count(submitter.site) == 1


def test_the_login_form_is_csrf_protected_too(site: Site):
    client = site.client()
    client.get("/login")
    assert client.post("/login", data={"token": site.tokens["submit"]}).status_code == 403
    assert site.client().post("/login", data={"token": site.tokens["submit"], "csrf_token": "x"}).status_code == 403


def test_another_sessions_csrf_token_is_refused(site: Site):
    first, second = site.client(), site.client()
    login(first, site.tokens["submit"])
    other_csrf = login(second, site.tokens["submit"])
    run_id = insert_run(site.db, S.QUEUED)
    assert first.post(f"/runs/{run_id}/cancel", data={"csrf_token": other_csrf}).status_code == 403


def test_htmx_requests_carry_the_csrf_token_in_a_header(submitter: Browsing):
    run_id = _owned(submitter.site, S.QUEUED)
    response = submitter.client.post(f"/runs/{run_id}/cancel",
                                     headers={"HX-Request": "true", "X-CSRF-Token": submitter.csrf})
    assert response.status_code == 200
    assert 'data-status="CANCELLED"' in response.text


def test_a_read_only_token_can_read_but_not_change(reader: Browsing):
    run_id = insert_run(reader.site.db, S.RUNNING)
    page = reader.client.get(f"/runs/{run_id}")
    assert page.status_code == 200
    assert 'id="cancel-run"' not in page.text  # no buttons it could not use
    response = reader.post(f"/runs/{run_id}/cancel")
    assert response.status_code == 403
    assert "submit" in response.text
    with reader.site.db.read_session() as session:
        assert session.get(Run, run_id).status == S.RUNNING



def test_a_read_only_token_is_offered_nothing_the_server_would_refuse(submitter: Browsing, reader: Browsing):
    """Issue 17: a worker-scope token that logged in sees no New run, Submit, Recommend, Rank placements
    or "submit with this placement"; the server still refuses the posts (403)."""
    ranked = submitter.post("/placement", {"model": "qwen3-0.6b", "hardware": "tpu-v5e", "chips": "8",
                                           "workload": "gsm8k"})
    explorer = ranked.headers["location"]
    offered = {"/runs": ['href="/runs/new"'], "/runs/new": ['id="submit-run"', 'id="ask-recommender"'],
               explorer: ['id="rank-placements"', "submit with this placement"]}
    for path, controls in offered.items():
        as_submitter, as_reader = submitter.client.get(path).text, reader.client.get(path).text
        for control in controls:
            assert control in as_submitter, (path, control)  # the markers are real: a submitter gets them
            assert control not in as_reader, (path, control)
    assert 'id="submit-needs-scope"' in reader.client.get("/runs/new").text
    assert 'id="rank-needs-scope"' in reader.client.get(explorer).text
    for path, form in [("/runs/new", {"name": "sneaky"}), ("/runs/new/recommend", {"preset": "tiny"}),
                       ("/placement", {"model": "qwen3-0.6b", "hardware": "tpu-v5e", "chips": "8"})]:
        assert reader.post(path, form).status_code == 403, path
    assert _run_count(reader.site) == 0


# --- new-run form -----------------------------------------------------------------------------------

def test_the_form_shows_the_spec_defaults_and_takes_query_prefills(submitter: Browsing):
    html = submitter.client.get("/runs/new?mode=da&hosts=4&decision_id=7").text
    assert re.search(r'name="group_size" value="8"', html)
    assert re.search(r'<option value="da" selected>', html)
    assert re.search(r'name="hosts" value="4"', html) and re.search(r'name="decision_id" value="7"', html)


@pytest.mark.parametrize(("fields", "where", "message"), [
    ({"group_size": "0"}, "group_size", "greater than or equal to 1"),
    ({"group_size": "many"}, "group_size", "valid integer"),
    ({"name": "has space"}, "name", "pattern"),
    ({"lr": "-1"}, "lr", "greater than 0"),
    ({"preset": "gpt-17"}, "preset", "unknown model preset"),
    ({"mode": "da", "hosts": "1"}, "group:placement", "at least 2 in DA mode"),
    ({"task": "gsm8k"}, "group:model", "task.path is required"),
    ({"spec_yaml": "rollout: [1, 2"}, "spec_yaml", "not valid YAML"),
    ({"spec_yaml": "- a list"}, "spec_yaml", "expected a mapping"),
    ({"spec_yaml": "rollout:\n  group_size: 0"}, "spec_yaml", "rollout.group_size"),
    ({"spec_yaml": "optim:\n  lr_typo: 1"}, "spec_yaml", "optim.lr_typo"),
    ({"spec_yaml": "# " + "x" * 65_536}, "spec_yaml", "at most 64 KiB"),
    ({"prompts_per_step": "3", "hosts": "2"}, "form", "divisible"),
])
def test_invalid_values_are_shown_next_to_their_field_and_nothing_is_written(submitter: Browsing, fields, where,
                                                                             message):
    response = submitter.post("/runs/new", {"name": "form-run", **fields})
    assert response.status_code == 422
    html = response.text
    if where.startswith("group:"):
        assert message in re.search(rf'id="errors-{where[6:]}">(.*?)</div>', html, re.S).group(1)
    elif where == "form":
        assert message in re.search(r'id="form-errors">(.*?)</div>', html, re.S).group(1)
    else:
        assert any(message in error for error in _error_near(html, where)), _error_near(html, where)
    assert _run_count(submitter.site) == 0
    # What was typed is kept, so it can be corrected.
    for name, value in fields.items():
        if name != "spec_yaml" and name not in ("mode", "preset", "task"):
            assert f'name="{name}" value="{value}"' in html


def test_a_path_outside_the_allowed_roots_is_shown_at_the_path_field(submitter: Browsing):
    response = submitter.post("/runs/new", {"name": "paths", "task": "gsm8k", "task_path": "/etc/passwd"})
    assert response.status_code == 422
    assert any("outside the allowed roots" in error for error in _error_near(response.text, "task_path"))
    assert _run_count(submitter.site) == 0


def test_htmx_gets_the_form_fragment_back_with_errors(submitter: Browsing):
    response = submitter.post("/runs/new", {"group_size": "0"}, headers={"HX-Request": "true"})
    assert response.status_code == 422
    assert response.text.lstrip().startswith("<form id=\"new-run-form\"")


def test_a_valid_form_submits_the_run_with_the_yaml_merged_over_the_fields(submitter: Browsing):
    response = submitter.post("/runs/new", {"name": "merged", "group_size": "4", "steps": "30", "preset": "tiny",
                                            "spec_yaml": "rollout:\n  group_size: 2\n  top_p: 0.9\n"})
    assert response.status_code == 303
    run_id = int(response.headers["location"].rsplit("/", 1)[1])
    with submitter.site.db.read_session() as session:
        run = session.get(Run, run_id)
        assert (run.name, run.status, run.created_by) == ("merged", S.QUEUED, "web-submit")
        assert (run.spec["rollout"]["group_size"], run.spec["rollout"]["top_p"], run.spec["steps"]) == (2, 0.9, 30)
    htmx = submitter.post("/runs/new", {"name": "via-htmx"}, headers={"HX-Request": "true"})
    assert htmx.headers["HX-Redirect"].startswith("/runs/")


def test_ask_the_recommender_fills_the_placement_fields(submitter: Browsing):
    response = submitter.post("/runs/new/recommend", {"preset": "tiny", "hardware": "local-cpu", "chips": "2",
                                                      "task": "arith", "workload": "arith"},
                              headers={"HX-Request": "true"})
    assert response.status_code == 200
    html = response.text
    assert html.lstrip().startswith('<fieldset id="placement-fields">')
    with submitter.site.db.read_session() as session:
        decision = session.scalars(select(PlacementDecision)).one()
    assert f'name="decision_id" value="{decision.id}"' in html
    assert f'name="hosts" value="{decision.choice["hosts"]}"' in html
    assert decision.reason in " ".join(unescape(html).split())
    bad = submitter.post("/runs/new/recommend", {"preset": "tiny", "hardware": "no-such-chip", "chips": "2",
                                                 "workload": "arith"})
    assert bad.status_code == 422
    assert any("unknown hardware" in error for error in _error_near(bad.text, "hardware"))


# --- partials poll while live, stop at terminal -----------------------------------------------------

POLLING_PARTIALS = ["status", "header", "latest", "processes", "decision"]


@pytest.mark.parametrize("status", [S.QUEUED, S.STARTING, S.RUNNING, S.CANCELLING, S.RECOVERING])
def test_partials_of_a_live_run_poll_themselves(submitter: Browsing, status: RunStatus):
    run_id = insert_run(submitter.site.db, status)
    for partial in POLLING_PARTIALS:
        html = submitter.client.get(f"/runs/{run_id}/{partial}").text
        assert f'hx-get="/runs/{run_id}/{partial}"' in html and "hx-trigger=\"every " in html, partial


@pytest.mark.parametrize("status", [S.SUCCEEDED, S.FAILED, S.CANCELLED])
def test_partials_of_a_finished_run_stop_polling(submitter: Browsing, status: RunStatus):
    run_id = insert_run(submitter.site.db, status)
    for partial in POLLING_PARTIALS:
        html = submitter.client.get(f"/runs/{run_id}/{partial}").text
        assert "hx-trigger" not in html, partial
    page = submitter.client.get(f"/runs/{run_id}").text
    assert 'data-live="false"' in page and 'data-live="true"' not in page
    assert f'hx-get="/runs/{run_id}/status"' not in submitter.client.get("/runs").text


def test_the_badge_follows_the_run_to_its_final_state(submitter: Browsing):
    run_id = submitter.site.client().post("/api/v1/runs", json={"spec": {"name": "badge"}},
                                          headers=submitter.site.bearer("submit")).json()["id"]
    worker = submitter.site.client()
    seen = []
    for to in ("STARTING", "RUNNING", "SUCCEEDED"):
        badge = submitter.client.get(f"/runs/{run_id}/status").text
        seen.append(("hx-trigger" in badge, re.search(r'data-status="(\w+)"', badge).group(1)))
        worker.post(f"/api/v1/runs/{run_id}/transitions", json={"to": to}, headers=submitter.site.bearer("admin"))
    badge = submitter.client.get(f"/runs/{run_id}/status").text
    seen.append(("hx-trigger" in badge, re.search(r'data-status="(\w+)"', badge).group(1)))
    assert seen == [(True, "QUEUED"), (True, "STARTING"), (True, "RUNNING"), (False, "SUCCEEDED")]


# --- run page data ----------------------------------------------------------------------------------

def test_chart_data_is_downsampled_with_min_max_bands(submitter: Browsing):
    site = submitter.site
    run_id = insert_run(site.db, S.RUNNING)
    _ingest(site, run_id, range(0, 1000), keys=RUN_CHART_KEYS)
    payload = submitter.client.get(f"/runs/{run_id}/charts.json").json()
    assert (payload["status"], payload["terminal"]) == ("RUNNING", False)
    charts = {chart["id"]: chart for chart in payload["charts"]}
    assert set(charts) == {"reward", "eval", "loss", "kl", "completion", "throughput", "step_time", "split"}
    reward = charts["reward"]
    assert 2 <= reward["points"] <= 300 < 1000  # dashboard_chart_points
    assert reward["bucket_steps"] > 1 and reward["x"][-1] == 999  # the last step is always there
    series = reward["series"][0]
    assert len(series["last"]) == len(series["min"]) == len(series["max"]) == len(reward["x"])
    assert all(low <= last <= high for low, last, high in zip(series["min"], series["last"], series["max"]))
    assert min(series["min"]) == 0.0 and max(series["max"]) == 6.0
    assert charts["split"]["stacked"] and [s["label"] for s in charts["split"]["series"]] == [
        "time/device", "time/host", "time/network"]


def test_run_page_charts_held_out_evaluation_at_its_own_steps(submitter: Browsing):
    """Eval records come every eval.every steps (and at step = steps, after the last): the eval chart has
    just those points, its two series aligned on them."""
    site = submitter.site
    run_id = insert_run(site.db, S.SUCCEEDED, spec={"name": "test-run", "steps": 10})
    _ingest(site, run_id, range(0, 10))
    rows = [{"step": step, "values": {"eval/accuracy": accuracy, "eval/pass@k": passed}}
            for step, accuracy, passed in ((0, 0.25, 0.5), (5, 0.375, 0.625), (10, 0.5, 0.75))]
    _ingest(site, run_id, range(0), rows=rows)
    payload = submitter.client.get(f"/runs/{run_id}/charts.json").json()
    chart = next(chart for chart in payload["charts"] if chart["id"] == "eval")
    assert chart["x"] == [0, 5, 10]
    assert [s["label"] for s in chart["series"]] == ["eval/accuracy", "eval/pass@k"]
    assert chart["series"][0]["last"] == [0.25, 0.375, 0.5] and chart["series"][1]["last"] == [0.5, 0.625, 0.75]
    page = submitter.client.get(f"/runs/{run_id}").text
    assert "Held-out evaluation" in page
    # The header counts trained steps: the evaluation after the last step (step 10) is not an 11th step.
    assert re.search(r"step 10\s+of 10", page) and not re.search(r"step 11\s+of", page)


def test_raw_chart_points_carry_no_band(submitter: Browsing):
    run_id = insert_run(submitter.site.db, S.SUCCEEDED)
    _ingest(submitter.site, run_id, range(0, 5))
    payload = submitter.client.get(f"/runs/{run_id}/charts.json").json()
    reward = next(chart for chart in payload["charts"] if chart["id"] == "reward")
    assert payload["terminal"] is True
    assert reward["x"] == [0, 1, 2, 3, 4] and set(reward["series"][0]) == {"label", "last"}


def test_the_run_page_reads_without_javascript(submitter: Browsing):
    site = submitter.site
    run_id = insert_run(site.db, S.RUNNING, name="readable", spec={"name": "readable", "steps": 200})
    _ingest(site, run_id, range(0, 12))
    _events(site, run_id, ["hello <b>world</b>"])
    html = submitter.client.get(f"/runs/{run_id}").text
    assert "readable" in html and 'id="run-status"' in html and ">RUNNING<" in html
    assert "last 4 at step 11" in html  # the chart's numbers, for readers without the script
    assert "step 12 of 200" in html
    assert "hello &lt;b&gt;world&lt;/b&gt;" in html  # events are escaped
    assert submitter.client.get("/runs/999999").status_code == 404


def test_the_events_stream_sends_rendered_rows_then_ends_for_a_finished_run(submitter: Browsing):
    site = submitter.site
    run_id = insert_run(site.db, S.SUCCEEDED)
    _events(site, run_id, [f"line {i}" for i in range(3)])
    with submitter.client.stream("GET", f"/runs/{run_id}/events/stream") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        body = "".join(response.iter_text())
    assert body.count("event: log") == 3 and "<tr class=\"event level-info\"" in body
    assert body.rstrip().endswith("data: SUCCEEDED")
    first_id = int(re.search(r"^id: (\d+)", body, re.M).group(1))
    resumed_from = {"Last-Event-ID": str(first_id)}
    with submitter.client.stream("GET", f"/runs/{run_id}/events/stream", headers=resumed_from) as again:
        assert "".join(again.iter_text()).count("event: log") == 2


def test_cancel_and_resume_buttons_follow_the_state(submitter: Browsing):
    run_id = _owned(submitter.site, S.RUNNING)
    assert 'id="cancel-run"' in submitter.client.get(f"/runs/{run_id}").text
    response = submitter.post(f"/runs/{run_id}/cancel")
    assert (response.status_code, response.headers["location"]) == (303, f"/runs/{run_id}")
    page = submitter.client.get(f"/runs/{run_id}").text
    assert ">CANCELLING<" in page and 'id="cancel-run"' not in page
    failed = _owned(submitter.site, S.FAILED)
    assert 'id="resume-run"' in submitter.client.get(f"/runs/{failed}").text
    resumed = submitter.post(f"/runs/{failed}/resume", headers={"HX-Request": "true"})
    assert 'data-status="QUEUED"' in resumed.text
    # A refused action (resuming a finished run) is said in the header, not swallowed.
    done = _owned(submitter.site, S.SUCCEEDED)
    refused = submitter.post(f"/runs/{done}/resume", headers={"HX-Request": "true"})
    assert refused.status_code == 200 and "cannot go from SUCCEEDED" in refused.text
    assert submitter.post(f"/runs/{done}/resume").status_code == 409


def test_buttons_are_hidden_on_another_tokens_run_and_the_server_refuses_anyway(submitter: Browsing):
    """Issue 17: a submitter reads every run but acts only on its own; an admin acts on any."""
    others = _owned(submitter.site, S.RUNNING, scope="admin")
    page = submitter.client.get(f"/runs/{others}").text
    assert ">RUNNING<" in page and 'id="cancel-run"' not in page
    refused = submitter.post(f"/runs/{others}/cancel", headers={"HX-Request": "true"})
    assert refused.status_code == 200 and "submitted by another token" in refused.text
    assert submitter.post(f"/runs/{others}/cancel").status_code == 403
    failed = _owned(submitter.site, S.FAILED, scope="admin")
    assert 'id="resume-run"' not in submitter.client.get(f"/runs/{failed}").text
    assert submitter.post(f"/runs/{failed}/resume").status_code == 403
    with submitter.site.db.read_session() as session:
        assert (session.get(Run, others).status, session.get(Run, failed).status) == (S.RUNNING, S.FAILED)



def test_a_run_submitted_through_the_form_is_its_submitters_to_cancel(submitter: Browsing):
    """Issue 17: the form stores the run with its submitter as the owner (it was stored with none, and
    only an admin could cancel it); another submit token reads it but may not cancel it."""
    site = submitter.site
    response = submitter.post("/runs/new", {"name": "from-the-form", "steps": "3"})
    assert response.status_code == 303
    run_id = int(response.headers["location"].rsplit("/", 1)[1])
    with site.db.write_session() as session:
        owner = session.scalar(select(ApiToken.id).where(ApiToken.name == "web-submit"))
        _, other_secret = token_service.create(session, name=f"web-other-{run_id}", scopes=["submit"])
    with site.db.read_session() as session:
        assert session.get(Run, run_id).owner_token_id == owner
    other_client = site.client()
    other = Browsing(other_client, login(other_client, other_secret), site)
    page = other.client.get(f"/runs/{run_id}").text
    assert ">QUEUED<" in page and 'id="cancel-run"' not in page
    assert other.post(f"/runs/{run_id}/cancel").status_code == 403
    # One rule (services.authorization): the dashboard says what the API says, code and message.
    api = other.client.post(f"/api/v1/runs/{run_id}/cancel", headers={"Authorization": f"Bearer {other_secret}"})
    assert (api.status_code, api.json()["error"]["code"]) == (403, "RUN_NOT_OWNED")
    refused = other.post(f"/runs/{run_id}/cancel", headers={"HX-Request": "true"})
    assert api.json()["error"]["message"] in unescape(refused.text)
    assert 'id="cancel-run"' in submitter.client.get(f"/runs/{run_id}").text
    cancelled = submitter.post(f"/runs/{run_id}/cancel")
    assert (cancelled.status_code, cancelled.headers["location"]) == (303, f"/runs/{run_id}")
    with site.db.read_session() as session:
        assert session.get(Run, run_id).status == S.CANCELLED


# --- runs list, explorer, compare, hosts ------------------------------------------------------------

def test_runs_list_filters_and_pages(submitter: Browsing):
    site = submitter.site
    ids = [insert_run(site.db, S.RUNNING if i % 2 else S.FAILED, name=f"list-{i}") for i in range(9)]
    first = submitter.client.get("/runs").text
    shown = [int(i) for i in re.findall(r'<td><a href="/runs/(\d+)">#', first)]
    assert shown == ids[::-1][:3]  # newest first, page_size_default = 3
    older = re.search(r'href="(/runs\?cursor=[^"]+)" rel="next"', first).group(1)
    older_page = submitter.client.get(older.replace("&amp;", "&")).text
    second = [int(i) for i in re.findall(r'<td><a href="/runs/(\d+)">#', older_page)]
    assert second == ids[::-1][3:6]
    running = submitter.client.get("/runs?status=RUNNING&name=list-").text
    assert [int(i) for i in re.findall(r'<td><a href="/runs/(\d+)">#', running)] == ids[1::2][::-1][:3]
    assert 'rel="next"' in running and "status=RUNNING" in running  # the filters travel with the cursor
    fragment = submitter.client.get("/runs?name=list-6", headers={"HX-Request": "true"}).text
    assert fragment.lstrip().startswith('<div id="runs-table">') and "list-6" in fragment
    assert "No runs match" in submitter.client.get("/runs?name=nothing-like-this").text
    assert submitter.client.get("/runs?status=").status_code == 200  # "any"


def test_placement_explorer_ranks_options_and_links_them_to_the_form(submitter: Browsing):
    form = {"model": "qwen3-0.6b", "hardware": "tpu-v5e", "chips": "16", "workload": "gsm8k"}
    response = submitter.post("/placement", form)
    assert response.status_code == 303
    page = submitter.client.get(response.headers["location"]).text
    with submitter.site.db.read_session() as session:
        decision = session.scalars(select(PlacementDecision)).one()
    assert page.count('<tr class="option') == len(decision.options) > 1
    assert page.count('class="split-bar"') == len(decision.options)
    links = re.findall(r'href="(/runs/new\?[^"]+)">submit with this placement', page)
    assert len(links) == len(decision.options)
    assert sum(f"decision_id={decision.id}" in link for link in links) == 1  # only the recommended one follows it
    prefilled = submitter.client.get(links[0].replace("&amp;", "&")).text
    assert f'name="decision_id" value="{decision.id}"' in prefilled


@pytest.mark.parametrize(("fields", "where", "message"), [
    ({"chips": "0"}, "chips", "greater than or equal to 1"),
    ({"hardware": "abacus"}, "hardware", "unknown hardware"),
    ({"chips": "6", "chips_per_host": "4"}, "form", "divisible"),
])
def test_placement_explorer_shows_errors_next_to_the_inputs(submitter: Browsing, fields, where, message):
    form = {"model": "qwen3-0.6b", "hardware": "tpu-v5e", "chips": "8", "workload": "gsm8k", **fields}
    response = submitter.post("/placement", form)
    assert response.status_code == 422
    if where == "form":
        assert message in response.text
    else:
        assert any(message in error for error in _error_near(response.text, where))


def test_compare_overlays_one_metric_for_at_most_ten_runs(submitter: Browsing):
    site = submitter.site
    ids = [insert_run(site.db, S.SUCCEEDED, name=f"cmp-{i}") for i in range(12)]
    for offset, run_id in enumerate(ids[:3]):
        _ingest(site, run_id, range(offset, offset + 5))
    query = "&".join(f"run={run_id}" for run_id in ids) + "&key=reward/mean"
    html = submitter.client.get(f"/compare?{query}").text
    assert "showing the first 10 of the 12 runs" in html
    chart = re.search(r'<script type="application/json" class="chart-data">(.*?)</script>', html, re.S).group(1)
    data = json.loads(chart)
    assert len(data["series"]) == 10 and data["x"] == list(range(0, 7))  # the union of the runs' steps
    assert data["series"][1]["last"][0] is None and data["series"][1]["last"][1] == 1.0


def test_hosts_page_shows_liveness(submitter: Browsing):
    site = submitter.site
    site.client().post("/api/v1/hosts", json={"name": "browser-tpu-0", "device_kind": "tpu", "device_count": 4},
                       headers=site.bearer("worker"))
    html = submitter.client.get("/hosts").text
    assert "browser-tpu-0" in html and ">ONLINE<" in html and "4 × tpu" in html


def test_chart_metric_names_are_the_engines():
    metrics = pytest.importorskip("locojax.metrics")  # imports JAX; the dashboard itself does not
    assert set(RUN_CHART_KEYS) <= set(metrics.METRICS)


def test_dashboard_routes_stay_out_of_the_openapi_document(site: Site):
    paths = site.client().get("/openapi.json").json()["paths"]
    assert all(path.startswith(("/api/", "/healthz", "/readyz", "/metrics")) for path in paths), sorted(paths)


def test_a_polling_partial_of_a_deleted_run_stops_polling(submitter: Browsing):
    response = submitter.client.get("/runs/424242/status", headers={"HX-Request": "true"})
    assert response.status_code == 286  # htmx: stop polling
    assert "not found" in response.text


@pytest.mark.parametrize("path", ["/runs/99999999999", "/runs/0/header", "/compare?run=abc"])
def test_out_of_range_ids_are_an_html_422(submitter: Browsing, path: str):
    response = submitter.client.get(path)
    assert response.status_code == 422
    assert response.headers["content-type"].startswith("text/html")

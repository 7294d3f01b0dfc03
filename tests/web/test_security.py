"""The dashboard's browser-facing protections (issue #18): logout revokes the session server-side,
security headers, failed-login rate limiting, the Host allowlist and Secure cookies behind TLS."""

from __future__ import annotations

import asyncio
import time

from fastapi.testclient import TestClient

from server.app import create_app
from server.services import tokens as token_service
from tests.web.conftest import Browsing, Site, csrf_from, login
from web import auth


def _app_with(site: Site, **settings):
    return create_app(site.app.state.settings.model_copy(update=settings))


def test_logout_revokes_the_session_so_a_copied_cookie_stops_working(site: Site):
    client = site.client()
    csrf = login(client, site.tokens["submit"])
    stolen = client.cookies.get(auth.COOKIE_NAME)
    other = site.client()
    other.cookies.set(auth.COOKIE_NAME, stolen)
    assert other.get("/runs").status_code == 200  # the copy works while the session lives
    assert client.post("/logout", data={"csrf_token": csrf}).status_code == 303
    # The signature and expiry of the copy are still good; the server-side row is revoked.
    assert auth.decode_session(site.app.state.dashboard_key, stolen) is not None
    assert other.get("/runs").status_code == 303


def test_a_signed_cookie_without_a_session_row_is_no_login(site: Site):
    # What a leaked signing key alone could forge: the token's id, but no stored session.
    with site.db.read_session() as session:
        token_id = token_service.list_all(session)[0].id
    forged = auth.encode_session(site.app.state.dashboard_key, auth.WebSession(
        csrf="c", token_id=token_id, expires_at=time.time() + 600, session_id="made-up"))
    client = site.client()
    client.cookies.set(auth.COOKIE_NAME, forged)
    assert client.get("/runs").status_code == 303


def test_pages_and_api_answers_carry_the_security_headers(submitter: Browsing):
    for response in (submitter.client.get("/runs"), submitter.client.get("/login"),
                     submitter.client.get("/api/v1/runs", headers=submitter.site.bearer("submit"))):
        headers = response.headers
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert "script-src 'self'" in headers["content-security-policy"]
        assert headers["x-frame-options"] == "DENY"
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["referrer-policy"] == "same-origin"


def test_failed_logins_are_limited_per_client_with_retry_after(site: Site):
    app = _app_with(site, login_failures_per_minute=10)
    with TestClient(app, follow_redirects=False) as client:
        csrf = csrf_from(client.get("/login").text)
        codes = [client.post("/login", data={"token": f"lcj_wrong{i}", "csrf_token": csrf}).status_code
                 for i in range(10)]
        assert codes == [401] * 10
        refused = client.post("/login", data={"token": site.tokens["submit"], "csrf_token": csrf})
        assert refused.status_code == 429  # even a good token, from this client, for now
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert "set-cookie" not in refused.headers  # no session was made


def test_the_login_limiter_counts_per_client_in_a_sliding_window():
    limiter = auth.LoginLimiter(max_failures=3, window_s=60.0)
    for second in (0.0, 10.0, 20.0):
        limiter.failed("10.0.0.1", now=second)
    assert limiter.retry_after("10.0.0.1", now=21.0) == 39  # the first failure ages out at 60 s
    assert limiter.retry_after("10.0.0.2", now=21.0) is None  # another client is not affected
    assert limiter.retry_after("10.0.0.1", now=60.5) is None


def test_the_trusted_hosts_setting_refuses_other_host_headers(site: Site):
    app = _app_with(site, trusted_hosts=["dash.example.com"])
    with TestClient(app, base_url="http://dash.example.com") as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/healthz", headers={"Host": "attacker.example"}).status_code == 400


def test_the_cookie_is_secure_over_tls_or_behind_a_proxy_that_says_so(site: Site):
    with TestClient(_app_with(site, trust_forwarded_proto=True), follow_redirects=False) as client:
        assert "Secure" in client.get("/login", headers={"X-Forwarded-Proto": "https"}).headers["set-cookie"]
    with TestClient(_app_with(site), follow_redirects=False) as client:
        # Without the operator's word, a client-sent header proves nothing.
        assert "Secure" not in client.get("/login", headers={"X-Forwarded-Proto": "https"}).headers["set-cookie"]
    with TestClient(_app_with(site), base_url="https://testserver", follow_redirects=False) as client:
        assert "Secure" in client.get("/login").headers["set-cookie"]



def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def test_dashboard_posts_do_their_database_and_yaml_work_off_the_event_loop(submitter: Browsing, monkeypatch):
    # Called from an async route directly, these would find a running event loop in their thread.
    from server.services import placement as placement_service
    from server.services import runs as run_service
    from web import forms

    on_loop: dict[str, bool] = {}

    def spy(name, real):
        def wrapped(*args, **kwargs):
            on_loop[name] = _on_event_loop()
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(run_service, "create", spy("create", run_service.create))
    monkeypatch.setattr(placement_service, "recommend", spy("recommend", placement_service.recommend))
    monkeypatch.setattr(forms.yaml, "safe_load", spy("yaml", forms.yaml.safe_load))
    monkeypatch.setattr(token_service, "authenticate", spy("login", token_service.authenticate))
    assert submitter.post("/runs/new", {"name": "off-loop", "spec_yaml": "steps: 3"}).status_code == 303
    assert submitter.post("/placement", {"model": "qwen3-0.6b", "hardware": "tpu-v5e", "chips": "8",
                                         "workload": "gsm8k"}).status_code == 303
    login(submitter.site.client(), submitter.site.tokens["submit"])
    assert on_loop == {"create": False, "recommend": False, "yaml": False, "login": False}, on_loop


def test_dashboard_event_streams_count_against_the_tokens_stream_cap(submitter: Browsing, monkeypatch):
    from server.api.deps import StreamSlots
    from server.models import RunStatus
    from tests.server.helpers import insert_run

    slots = StreamSlots(per_token=1)
    monkeypatch.setattr(submitter.site.app.state, "stream_slots", slots)
    run_id = insert_run(submitter.site.db, RunStatus.SUCCEEDED)
    with submitter.site.db.read_session() as session:
        token_id = next(t.id for t in token_service.list_all(session) if t.scope_set == {"submit"})
    slots.acquire(token_id)  # a stream this token already holds (through the API, say)
    assert submitter.client.get(f"/runs/{run_id}/events/stream").status_code == 429
    slots.release(token_id)
    assert submitter.client.get(f"/runs/{run_id}/events/stream").status_code == 200
    assert slots.open_for(token_id) == 0  # given back when the stream ended


def test_a_login_clears_expired_session_rows(site: Site):
    from datetime import datetime, timedelta, timezone

    from sqlalchemy import select

    from server.models import WebSession as WebSessionRow

    with site.db.write_session() as session:
        token_id = token_service.list_all(session)[0].id
        session.add(WebSessionRow(id_hash="e" * 64, token_id=token_id,
                                  expires_at=datetime.now(timezone.utc) - timedelta(seconds=1)))
        session.commit()
    login(site.client(), site.tokens["submit"])
    with site.db.read_session() as session:
        hashes = set(session.scalars(select(WebSessionRow.id_hash)))
    assert "e" * 64 not in hashes and hashes  # the expired row is gone, the new login's row is there

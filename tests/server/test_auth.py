"""Authentication and authorization: every route, every way a token can be wrong."""

from __future__ import annotations

import logging

import pytest

from tests.server.helpers import assert_error

RUN = "/api/v1/runs/1"
VALID_BODIES = {
    ("POST", "/api/v1/runs"): {"spec": {"name": "auth"}},
    ("POST", "/api/v1/runs/{run_id}/transitions"): {"to": "STARTING"},
    ("POST", "/api/v1/runs/{run_id}/checkpoints"): {"step": 1, "attempt": 0},
    ("PUT", "/api/v1/runs/{run_id}/hosts/{process_index}"): {"host_name": "h0", "role": "co", "status": "RUNNING",
                                                             "attempt": 0},
    ("POST", "/api/v1/runs/{run_id}/metrics"): {"rows": [{"step": 0, "values": {"a": 1.0}}], "attempt": 0},
    ("POST", "/api/v1/runs/{run_id}/events"): {"events": [{"message": "hi"}], "attempt": 0},
    ("POST", "/api/v1/hosts"): {"name": "h0"},
    ("POST", "/api/v1/hosts/{name}/heartbeat"): None,
    ("POST", "/api/v1/placement/recommend"): {"model": "tiny", "hardware": "x", "chips": 1, "workload": "y"},
    ("POST", "/api/v1/tokens"): {"name": "t", "scopes": ["submit"]},
}

# The scope each mutating route needs. test_every_mutating_route_is_in_the_matrix keeps this complete.
MUTATING = {
    ("POST", "/api/v1/runs"): "submit",
    ("POST", "/api/v1/runs/{run_id}/cancel"): "submit",
    ("POST", "/api/v1/runs/{run_id}/resume"): "submit",
    ("DELETE", "/api/v1/runs/{run_id}"): "submit",
    ("POST", "/api/v1/placement/recommend"): "submit",
    ("POST", "/api/v1/runs/{run_id}/transitions"): "admin",  # by hand only: the server derives run states
    ("POST", "/api/v1/runs/{run_id}/checkpoints"): "worker",
    ("PUT", "/api/v1/runs/{run_id}/hosts/{process_index}"): "worker",
    ("POST", "/api/v1/runs/{run_id}/metrics"): "worker",
    ("POST", "/api/v1/runs/{run_id}/events"): "worker",
    ("POST", "/api/v1/hosts"): "worker",
    ("POST", "/api/v1/hosts/{name}/heartbeat"): "worker",
    ("DELETE", "/api/v1/hosts/{name}"): "worker",
    ("POST", "/api/v1/tokens"): "admin",
    ("DELETE", "/api/v1/tokens/{token_id}"): "admin",
    # A calibration is every user's: only an admin feeds or steers it (server/api/calibration.py).
    ("POST", "/api/v1/calibration/observations"): "admin",
    ("POST", "/api/v1/calibration/observations/{observation_id}/exclude"): "admin",
    ("POST", "/api/v1/calibration/observations/{observation_id}/include"): "admin",
    ("POST", "/api/v1/calibration/versions/{calibration_id}/activate"): "admin",
}
ADMIN_READS = {("GET", "/api/v1/tokens")}
PUBLIC = {("GET", "/healthz"), ("GET", "/readyz")}
WRONG_SCOPES = {"submit": ["worker"], "worker": ["submit"], "admin": ["submit", "worker"]}


def _url(template: str) -> str:
    return (template.replace("{run_id}", "1").replace("{process_index}", "0").replace("{name}", "h0")
            .replace("{token_id}", "99999").replace("{decision_id}", "1").replace("{observation_id}", "1")
            .replace("{calibration_id}", "1"))


def _call(client, method: str, template: str, headers: dict[str, str]):
    body = VALID_BODIES.get((method, template))
    return client.request(method, _url(template), json=body, headers=headers)


def _routes(client) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, operations in client.app.openapi()["paths"].items() for method in operations}


def test_every_mutating_route_is_in_the_matrix(client):
    routes = _routes(client)
    assert {route for route in routes if route[0] != "GET"} == set(MUTATING)
    assert set(MUTATING) <= routes


BAD_CREDENTIALS = {
    "missing": {},
    "empty": {"Authorization": "Bearer "},
    "not-bearer": {"Authorization": "Basic dXNlcjpwYXNz"},
    "invalid": {"Authorization": "Bearer lcj_not-a-real-token"},
}


@pytest.mark.parametrize("route", sorted(MUTATING), ids=lambda r: f"{r[0]} {r[1]}")
@pytest.mark.parametrize("credential", [*BAD_CREDENTIALS, "revoked", "expired"])
def test_mutating_routes_reject_bad_tokens_with_401(client, tokens, route, credential):
    headers = BAD_CREDENTIALS.get(credential) if credential in BAD_CREDENTIALS else tokens.headers(credential)
    response = _call(client, *route, headers)
    error = assert_error(response, 401)
    assert error["code"] == ("AUTH_REQUIRED" if credential in ("missing", "empty", "not-bearer") else "AUTH_INVALID")
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("route", sorted(MUTATING), ids=lambda r: f"{r[0]} {r[1]}")
def test_mutating_routes_reject_the_wrong_scope_with_403(client, tokens, route):
    for scope in WRONG_SCOPES[MUTATING[route]]:
        error = assert_error(_call(client, *route, tokens.headers(scope)), 403, "AUTH_FORBIDDEN")
        assert error["details"]["required_scope"] == MUTATING[route]


@pytest.mark.parametrize("route", sorted(MUTATING), ids=lambda r: f"{r[0]} {r[1]}")
def test_admin_passes_every_scope_check(client, tokens, route):
    response = _call(client, *route, tokens.headers("admin"))
    # Past the scope check the route must answer (404 for run 1 is fine), not crash.
    assert response.status_code not in (401, 403) and response.status_code < 500, response.text


def test_read_routes_need_a_token_of_any_scope(client, tokens):
    reads = sorted(route for route in _routes(client) if route[0] == "GET" and route not in PUBLIC)
    assert len(reads) >= 20
    for route in reads:
        for credential in ("missing", "invalid"):
            assert_error(_call(client, *route, BAD_CREDENTIALS[credential]), 401)
        assert_error(_call(client, *route, tokens.headers("expired")), 401, "AUTH_INVALID")
        for scope in ("submit", "worker"):
            response = _call(client, *route, tokens.headers(scope))
            if route in ADMIN_READS:
                assert_error(response, 403, "AUTH_FORBIDDEN")
            else:
                assert response.status_code not in (401, 403) and response.status_code < 500, (route, response.text)


def test_health_and_docs_need_no_token(client):
    for path in ("/healthz", "/readyz", "/openapi.json", "/docs"):
        assert client.get(path).status_code == 200, path


def test_token_lifecycle_over_the_api(client, admin):
    created = client.post("/api/v1/tokens", json={"name": "ci", "scopes": ["submit", "worker"], "expires_in_s": 3600,
                                                   "hosts": "ci-*"}, headers=admin)
    assert created.status_code == 201
    secret = created.json()["token"]
    assert secret.startswith("lcj_") and created.json()["scopes"] == ["submit", "worker"]
    mine = {"Authorization": f"Bearer {secret}"}
    assert client.get("/api/v1/whoami", headers=mine).json()["name"] == "ci"
    listing = client.get("/api/v1/tokens", headers=admin).text
    assert secret not in listing and secret[8:] not in listing  # only the short prefix is ever shown
    token_id = created.json()["id"]
    assert client.delete(f"/api/v1/tokens/{token_id}", headers=admin).status_code == 204
    assert_error(client.get("/api/v1/whoami", headers=mine), 401, "AUTH_INVALID")
    assert_error(client.delete("/api/v1/tokens/99999", headers=admin), 404, "TOKEN_NOT_FOUND")


@pytest.mark.parametrize("body", [{"name": "x", "scopes": []}, {"name": "x", "scopes": ["root"]},
                                  {"name": "", "scopes": ["submit"]}, {"name": "x", "scopes": ["submit"], "expires_in_s": 0}])
def test_bad_token_requests_are_422(client, admin, body):
    assert_error(client.post("/api/v1/tokens", json=body, headers=admin), 422, "VALIDATION_ERROR")


def test_tokens_never_reach_the_logs(client, tokens, caplog):
    caplog.set_level(logging.DEBUG)
    for scope in ("admin", "submit", "worker"):
        client.get("/api/v1/runs", headers=tokens.headers(scope))
        client.post("/api/v1/runs", json={"spec": {"name": "x"}}, headers=tokens.headers(scope))
    client.get("/api/v1/runs", headers={"Authorization": "Bearer lcj_guessed-secret"})
    text = caplog.text
    assert all(getattr(tokens, name) not in text for name in ("admin", "submit", "worker", "revoked", "expired"))
    assert "lcj_guessed-secret" not in text


def test_error_bodies_never_echo_the_token(client):
    response = client.get("/api/v1/runs", headers={"Authorization": "Bearer lcj_guessed-secret"})
    assert "lcj_guessed-secret" not in response.text

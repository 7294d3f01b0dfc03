"""Security scenarios against the live API and dashboard over HTTP (the real `locojax serve` process):

  auth_matrix          every operation in the served OpenAPI, with no, malformed, unknown, expired and
                       revoked credentials (401) and with each wrong scope (403); reads pass any scope
  worker_token_limits  a worker token cannot submit, cancel, resume or delete runs, nor mint tokens
  secrets_stay_secret  token secrets appear in no log file of the plane, no response after creation, no
                       database column
  csrf                 every dashboard form refuses a missing, wrong or another session's CSRF token
  injection            SQL-injection and path-traversal strings in every string path and query parameter
                       and in every string field of a run spec: no 5xx, and nothing changes

The scope of each mutating route comes from tests/server/test_auth.py (`MUTATING`), which that module
keeps complete against the routes; here the routes themselves come from the running server's OpenAPI.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any
from urllib.parse import quote

import httpx

from tests.e2e.bad_input import _spec
from tests.e2e.helpers import tiny_spec, wait_final, wait_until
from tests.e2e.infra import Stack
from tests.e2e.outcome import outcome
from tests.server.test_auth import ADMIN_READS, MUTATING, PUBLIC, VALID_BODIES, WRONG_SCOPES

# Ids that exist nowhere: a request that got past authentication could not touch anything real.
ABSENT = {"run_id": "2147483000", "process_index": "0", "name": "no-such-host", "token_id": "2147483000",
          "decision_id": "2147483000", "observation_id": "2147483000", "calibration_id": "2147483000"}
CSRF_INPUT = re.compile(r'name="csrf_token" value="([^"]+)"')
INJECTIONS = [
    "' OR '1'='1", "1' OR 1=1 --", "1; DROP TABLE runs; --", "\" OR \"\"=\"", "') OR ('a'='a",
    "' UNION SELECT token_hash FROM api_tokens --", "1 AND SLEEP(5)", "%27%20OR%201%3D1--",
    "../../../../etc/passwd", "..%2F..%2F..%2Fetc%2Fpasswd", "....//....//etc/passwd", "/etc/passwd",
    "..\\..\\windows\\win.ini", "$(id)", "{{7*7}}", "*", "%", "_",
]


def _operations(http: httpx.Client) -> list[tuple[str, str, dict[str, Any]]]:
    document = http.get("/openapi.json").json()
    return [(method.upper(), path, operation) for path, item in document["paths"].items()
            for method, operation in item.items()]


def _url(template: str, values: dict[str, str] = ABSENT) -> str:
    for name, value in values.items():
        template = template.replace("{" + name + "}", value)
    return template


def _tokens(stack: Stack, http: httpx.Client, label: str) -> dict[str, str]:
    """submit, worker and admin tokens, plus one revoked and one expired, made over the API."""
    admin = {"Authorization": f"Bearer {stack.plane.admin_token}"}

    def create(scopes: list[str], **extra: Any) -> dict[str, Any]:
        response = http.post("/api/v1/tokens", json={"name": f"{label}-{'-'.join(scopes)}", "scopes": scopes, **extra},
                             headers=admin)
        response.raise_for_status()
        return response.json()

    made = {scope: create([scope], **({"hosts": f"{label}-host"} if scope == "worker" else {}))["token"]
            for scope in ("submit", "worker", "admin")}
    revoked = create(["admin"])
    http.delete(f"/api/v1/tokens/{revoked['id']}", headers=admin).raise_for_status()
    made["revoked"] = revoked["token"]
    expired = create(["admin"], expires_in_s=1)
    made["expired"] = expired["token"]
    # Until the server refuses it: expiry is the server's clock, not a sleep of ours.
    wait_until(lambda: http.get("/api/v1/whoami", headers={"Authorization": f"Bearer {made['expired']}"})
               .status_code == 401, 10.0, "the server to refuse a token created with expires_in_s=1", poll_s=0.1)
    return made


def auth_matrix(stack: Stack) -> dict[str, Any]:
    failures: list[str] = []
    checked = 0
    with stack.http() as http:
        tokens = _tokens(stack, http, f"matrix-{secrets.token_hex(2)}")
        bad = {
            "missing": {},
            "not bearer": {"Authorization": "Basic dXNlcjpwYXNz"},
            "bearer without a token": {"Authorization": "Bearer"},
            "unknown": {"Authorization": "Bearer lcj_" + secrets.token_urlsafe(24)},
            "garbage": {"Authorization": "Bearer ' OR 1=1 --"},
            "expired": {"Authorization": f"Bearer {tokens['expired']}"},
            "revoked": {"Authorization": f"Bearer {tokens['revoked']}"},
        }
        operations = _operations(http)
        routes = {(method, path) for method, path, _ in operations}
        unlisted = sorted(f"{m} {p}" for m, p in routes if m != "GET" and (m, p) not in MUTATING)
        before = stack.counts()
        for method, path, _ in operations:
            if (method, path) in PUBLIC:
                continue
            body = VALID_BODIES.get((method, path))

            def call(headers: dict[str, str]) -> httpx.Response:
                return http.request(method, _url(path), json=body, headers=headers)

            for name, headers in bad.items():
                response = call(headers)
                checked += 1
                credential = headers.get("Authorization", "").partition(" ")[2]
                if response.status_code != 401 or response.headers.get("www-authenticate") != "Bearer":
                    failures.append(f"{method} {path} with {name} credentials: {response.status_code}")
                elif len(credential) > 8 and credential in response.text:
                    failures.append(f"{method} {path} echoed the {name} credential")
            needed = MUTATING.get((method, path), "admin" if (method, path) in ADMIN_READS else None)
            for scope in ("submit", "worker"):
                if needed is not None and scope not in WRONG_SCOPES[needed]:
                    continue  # the right scope would really do it (start a run on the plane); not here
                response = call({"Authorization": f"Bearer {tokens[scope]}"})
                checked += 1
                if needed is not None and response.status_code != 403:
                    failures.append(f"{method} {path} with a {scope} token: {response.status_code}, not 403")
                elif needed is None and response.status_code in (401, 403):
                    failures.append(f"{method} {path} refused a {scope} token for a read: {response.status_code}")
        after = stack.counts()
        public = {f"{m} {p}": http.get(p).status_code for m, p in sorted(PUBLIC)}
    return outcome({
        "every refusal was a 401 or 403 as due": not failures,
        "every mutating route has a known scope": not unlisted,
        "public routes answer without a token": all(code == 200 for code in public.values()),
        "nothing changed": {k: v for k, v in before.items() if k != "api_tokens"}
                           == {k: v for k, v in after.items() if k != "api_tokens"},
    }, operations=len(operations), requests=checked, failures=failures[:20], unlisted_routes=unlisted,
        public=public)


def worker_token_limits(stack: Stack) -> dict[str, Any]:
    with stack.client() as api, stack.http() as http:
        run = api.submit(tiny_spec(f"victim-{secrets.token_hex(2)}", hosts=4, steps=1))  # never placed: 3 hosts
        worker = {"Authorization": f"Bearer {stack.plane.worker_token}"}
        before = stack.counts()
        attempts = {
            "submit": http.post("/api/v1/runs", json={"spec": tiny_spec("by-worker", hosts=1, steps=1)},
                                headers=worker),
            "cancel": http.post(f"/api/v1/runs/{run['id']}/cancel", headers=worker),
            "resume": http.post(f"/api/v1/runs/{run['id']}/resume", headers=worker),
            "delete": http.delete(f"/api/v1/runs/{run['id']}", headers=worker),
            "recommend": http.post("/api/v1/placement/recommend", headers=worker,
                                   json=VALID_BODIES[("POST", "/api/v1/placement/recommend")]),
            "create a token": http.post("/api/v1/tokens", json={"name": "escalate", "scopes": ["admin"]},
                                        headers=worker),
            "list tokens": http.get("/api/v1/tokens", headers=worker),
        }
        after = stack.counts()
        status_after = api.get_run(run["id"])["status"]
        api.cancel_run(run["id"])
        wait_final(api, run["id"], 30)
    codes = {name: response.status_code for name, response in attempts.items()}
    return outcome({
        "every attempt refused with 403": all(code == 403 for code in codes.values()),
        "the run was left QUEUED": status_after == "QUEUED",
        "nothing written": before == after,
    }, codes=codes)


def _secrets_found(text: str, secrets_by_name: dict[str, str]) -> list[str]:
    """Names of secrets whose full value, or the part after the short public prefix, occurs in `text`."""
    return sorted(name for name, secret in secrets_by_name.items() if secret in text or secret[8:] in text)


def secrets_stay_secret(stack: Stack) -> dict[str, Any]:
    with stack.http() as http:
        made = _tokens(stack, http, f"leak-{secrets.token_hex(2)}")
        known = {"plane admin": stack.plane.admin_token, "plane worker": stack.plane.worker_token, **made,
                 "guessed": "lcj_" + secrets.token_urlsafe(24)}
        # Use every one of them, in good and bad requests, so the logs had their chance.
        for name, secret in known.items():
            headers = {"Authorization": f"Bearer {secret}"}
            http.get("/api/v1/whoami", headers=headers)
            http.get("/api/v1/runs", headers=headers)
            http.post("/api/v1/runs", json={"spec": {"name": "bad name!"}}, headers=headers)
            http.post("/login", data={"token": secret, "csrf_token": "x"})
        admin = {"Authorization": f"Bearer {stack.plane.admin_token}"}
        responses = [http.get("/api/v1/tokens", headers=admin).text,
                     http.get("/api/v1/whoami", headers={"Authorization": f"Bearer {made['submit']}"}).text,
                     http.get("/api/v1/runs", headers={"Authorization": "Bearer " + known["guessed"]}).text,
                     http.get("/metrics", headers=admin).text]
        # The API logs each request as it answers it: this last one's line means every earlier line is in.
        marker = f"/api/v1/whoami?log-marker={secrets.token_hex(4)}"
        http.get(marker)
    wait_until(lambda: marker in stack.logs(), 10.0, f"the API to log its request for {marker}", poll_s=0.1)
    logs = stack.logs()
    stored = json.dumps([list(map(str, row)) for row in stack.sql("SELECT * FROM api_tokens")])
    in_logs = _secrets_found(logs, known)
    in_responses = _secrets_found("\n".join(responses), known)
    in_database = _secrets_found(stored, known)
    return outcome({
        "no secret in any log file": not in_logs,
        "no secret in a response after creation": not in_responses,
        "the database holds hashes only": not in_database,
        "the logs were read": len(logs) > 1000,
    }, secrets_checked=len(known), log_bytes=len(logs), found_in_logs=in_logs, found_in_responses=in_responses,
        found_in_database=in_database)


def _csrf(page: httpx.Response) -> str:
    match = CSRF_INPUT.search(page.text)
    assert match, f"no CSRF field on {page.request.url}"
    return match.group(1)


def _login(stack: Stack, token: str) -> tuple[httpx.Client, str]:
    client = httpx.Client(base_url=stack.url, timeout=60)
    response = client.post("/login", data={"token": token, "csrf_token": _csrf(client.get("/login"))})
    assert response.status_code == 303, response.text[:300]
    return client, _csrf(client.get("/runs/new"))


def csrf(stack: Stack) -> dict[str, Any]:
    failures: list[str] = []
    with stack.client() as api:
        run = api.submit(tiny_spec(f"csrf-{secrets.token_hex(2)}", hosts=4, steps=1))  # never placed
        forms = {
            "/runs/new": {"name": "csrf-made", "preset": "tiny", "task": "arith", "steps": "1", "hosts": "1"},
            "/runs/new/recommend": {"preset": "tiny", "hardware": "local-cpu", "chips": "1", "task": "arith"},
            "/placement": {"model": "tiny", "hardware": "local-cpu", "chips": "1", "workload": "arith"},
            f"/runs/{run['id']}/cancel": {},
            f"/runs/{run['id']}/resume": {},
            "/logout": {},
        }
        first, first_csrf = _login(stack, stack.plane.admin_token)
        second, second_csrf = _login(stack, stack.plane.admin_token)
        before = stack.counts()
        try:
            anonymous = httpx.Client(base_url=stack.url, timeout=60)
            with anonymous:
                login_csrf = _csrf(anonymous.get("/login"))
                for sent in ({}, {"csrf_token": "x"}):  # the login form itself
                    code = anonymous.post("/login", data={"token": stack.plane.admin_token, **sent}).status_code
                    if code != 403:
                        failures.append(f"/login with {sent or 'no token'}: {code}")
                cross_site = httpx.post(f"{stack.url}/login", timeout=60, headers={"Origin": "https://evil.example"},
                                        data={"token": stack.plane.admin_token, "csrf_token": login_csrf})
                if cross_site.status_code != 403:  # the token without its session cookie is worthless
                    failures.append(f"/login from another site without the cookie: {cross_site.status_code}")
            for url, data in forms.items():
                for label, sent in (("no", {}), ("a wrong", {"csrf_token": "wrong"}),
                                    ("another session's", {"csrf_token": second_csrf}),
                                    ("a header with another session's", None)):
                    if sent is None:
                        response = first.post(url, data=data, headers={"HX-Request": "true", "X-CSRF-Token": second_csrf})
                    else:
                        response = first.post(url, data={**data, **sent},
                                              headers={"Origin": "https://evil.example"} if label == "no" else {})
                    if response.status_code != 403:
                        failures.append(f"{url} with {label} CSRF token: {response.status_code}")
            after = stack.counts()
            status_after = api.get_run(run["id"])["status"]
            # The control: the same form with this session's own token goes through.
            accepted = first.post(f"/runs/{run['id']}/cancel", data={"csrf_token": first_csrf})
        finally:
            first.close()
            second.close()
        final = wait_final(api, run["id"], 30)
    return outcome({
        "every form refused a missing, wrong or foreign CSRF token": not failures,
        "nothing written": before == after and status_after == "QUEUED",
        "the right token is accepted (control)": accepted.status_code < 400 and final["status"] == "CANCELLED",
    }, forms=len(forms) + 1, failures=failures)


def _string_parameters(operation: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    for parameter in operation.get("parameters", []):
        schema = parameter.get("schema", {})
        kinds = {schema.get("type")} | {item.get("type") for item in schema.get("anyOf", [])}
        if schema.get("type") == "array":
            kinds |= {schema.get("items", {}).get("type")}
        if "string" in kinds and parameter["in"] in ("path", "query"):
            found.append((parameter["in"], parameter["name"]))
    return found


SPEC_STRINGS = ["name", "model.preset", "model.checkpoint", "model.tokenizer", "task.name", "task.path",
                "output_dir", "checkpoint.dir"]


def injection(stack: Stack) -> dict[str, Any]:
    server_errors: list[str] = []
    leaks: list[str] = []
    requests = 0
    admin = {"Authorization": f"Bearer {stack.plane.admin_token}"}
    with stack.http() as http:
        before = stack.counts()
        for method, path, operation in _operations(http):
            for where, name in _string_parameters(operation):
                for payload in INJECTIONS:
                    if where == "path":
                        url, params = _url(path, {**ABSENT, name: quote(payload, safe="")}), None
                    else:
                        url, params = _url(path), {name: payload}
                    body = VALID_BODIES.get((method, path))
                    response = http.request(method, url, params=params, json=body, headers=admin)
                    requests += 1
                    if response.status_code >= 500:
                        server_errors.append(f"{method} {path} {name}={payload!r}: {response.status_code}")
                    elif (method, path, name) == ("GET", "/api/v1/runs", "name") and response.status_code == 200 \
                            and response.json()["data"]:
                        leaks.append(f"runs?name={payload!r} listed {len(response.json()['data'])} run(s)")
        spec_refusals = 0
        for field in SPEC_STRINGS:
            for payload in INJECTIONS:
                value: Any = [payload] if field == "task.reward" else payload
                response = http.post("/api/v1/runs", json={"spec": _spec({field: value})}, headers=admin)
                requests += 1
                if response.status_code >= 500:
                    server_errors.append(f"spec.{field}={payload!r}: {response.status_code}")
                elif 400 <= response.status_code < 500:
                    spec_refusals += 1
        after = stack.counts()
        still_works = http.get("/api/v1/whoami", headers=admin).status_code == 200
    spec_attempts = len(SPEC_STRINGS) * len(INJECTIONS)
    return outcome({
        "no 5xx": not server_errors,
        "no filter matched more than it should": not leaks,
        "every injected spec string refused": spec_refusals == spec_attempts,
        "nothing changed": {k: v for k, v in before.items() if k != "api_tokens"}
                           == {k: v for k, v in after.items() if k != "api_tokens"},
        "the API still answers": still_works,
    }, requests=requests, payloads=len(INJECTIONS), spec_fields=SPEC_STRINGS, server_errors=server_errors[:20],
        leaks=leaks, spec_refused=f"{spec_refusals}/{spec_attempts}")


SECURITY = {
    "auth_matrix": auth_matrix,
    "worker_token_limits": worker_token_limits,
    "secrets_stay_secret": secrets_stay_secret,
    "csrf": csrf,
    "injection": injection,
}

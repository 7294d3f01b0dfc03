"""Attacks (issue #18) against the live stack: what a holder of a `submit` (or `worker`) token, or a
browser visitor, might try, each sent for real to the running API, dashboard, workers and engines.

Each attack records what was sent, what came back and whether it was blocked; the scenario passes when
every attack was blocked and nothing changed that should not have. Groups:
  rewards       `module:function` rewards outside the operator's allowlist, and a spec forged in the
                database behind the API's back (the host re-checks before importing)
  endpoints     a spec naming a Ray cluster or any other address
  engine env    what a running engine process can see of its worker's credentials
  ray network   connecting, from the machine's own network, to the ports of a DA run's private Ray
  browser       a cookie signed with the public placeholder a masked secret used to become, a cookie kept
                after logout, framing, a foreign Host header, login brute force (from its own loopback
                address, 127.0.0.2, so the other scenarios' logins are not limited)
  bounded       oversized host info, too many metric keys, too many event streams, RunSpec limits, the
                dashboard's YAML box, non-UTF-8 JSON
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.bad_input import _spec
from tests.e2e.helpers import last_step, tiny_spec, wait_final, wait_until
from tests.e2e.infra import Stack
from tests.e2e.outcome import outcome
from tests.e2e.security import _csrf, _login

COOKIE = "locojax_session"


class Attacks:
    """The log of attacks tried: name, what was sent, what came back, blocked or not."""

    def __init__(self) -> None:
        self.tried: list[dict[str, Any]] = []

    def record(self, name: str, sent: str, response: httpx.Response | str, blocked: bool) -> bool:
        if isinstance(response, httpx.Response):
            try:
                error = response.json().get("error") or {}
            except (ValueError, AttributeError):
                error = {}
            got = f"{response.status_code} {error.get('code', '')}".strip()
            if error.get("details") and isinstance(error["details"], list) and isinstance(error["details"][0], dict):
                got += f" field={error['details'][0].get('field')}"
        else:
            got = response
        self.tried.append({"attack": name, "sent": sent[:300], "got": got[:300], "blocked": bool(blocked)})
        return blocked


def _error_field(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["details"][0]["field"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def _submit(http: httpx.Client, headers: dict[str, str], spec: dict[str, Any]) -> httpx.Response:
    return http.post("/api/v1/runs", json={"spec": spec}, headers=headers)


def _reward_attacks(stack: Stack, http: httpx.Client, submit: dict[str, str], log: Attacks) -> None:
    for reward in ("builtins:print", "shutil:rmtree", "pty:spawn", "os:system", "subprocess:run",
                   "tests.locojaxx.evil:run", "tests:conftest"):
        spec = _spec({"task.reward": ["gsm8k", reward]})
        response = _submit(http, submit, spec)
        log.record(f"reward {reward}", f"POST /api/v1/runs task.reward=['gsm8k', {reward!r}]", response,
                   response.status_code == 422 and _error_field(response) == "spec.task.reward.1")


def _forged_spec_attack(stack: Stack, http: httpx.Client, submit: dict[str, str], log: Attacks) -> None:
    """A spec changed in the database after the API accepted it (what a forged start message carries):
    the engine process refuses the reward before importing anything and the run fails saying so."""
    response = _submit(http, submit, tiny_spec(f"forged-{secrets.token_hex(2)}", hosts=4, steps=1))  # unplaceable
    response.raise_for_status()
    run_id = response.json()["id"]
    forged = {**tiny_spec("forged", hosts=1, steps=1), "max_restarts": 0}
    forged["task"] = {**forged["task"], "reward": ["gsm8k", "builtins:exec"]}
    stack.sql("UPDATE runs SET spec = CAST(:spec AS JSONB), hosts_needed = 1, max_restarts = 0 WHERE id = :id",
              spec=json.dumps(forged), id=run_id)
    with stack.client() as api:
        final = wait_final(api, run_id, timeout_s=120)
        events = api.events(run_id)["data"]
    reason = final.get("status_reason") or ""
    said = "not allowed by the operator" in reason or any("not allowed by the operator" in e["message"] for e in events)
    log.record("forged spec in the database (builtins:exec)", f"UPDATE runs SET spec.task.reward=[..., 'builtins:exec'] "
               f"for run {run_id}", f"{final['status']}: {reason[:200]}", final["status"] == "FAILED" and said)


def _endpoint_attacks(http: httpx.Client, submit: dict[str, str], log: Attacks) -> None:
    for name, changes, field in [
        ("DA run on an attacker's Ray cluster", {"placement": {"mode": "da", "hosts": 2, "ray_address": "203.0.113.9:6379"}},
         "spec.placement.ray_address"),
        ("a coordinator address in the spec", {"placement": {"mode": "co", "hosts": 1, "coordinator": "203.0.113.9:1"}},
         "spec.placement.coordinator"),
        ("a metrics endpoint in the spec", {"metrics_url": "http://203.0.113.9/collect"}, "spec.metrics_url"),
    ]:
        spec = {**tiny_spec("endpoint", hosts=1, steps=1), **changes}
        response = _submit(http, submit, spec)
        log.record(name, f"POST /api/v1/runs {json.dumps(changes)}", response,
                   response.status_code == 422 and _error_field(response) == field)


@contextmanager
def _training_run(stack: Stack, http: httpx.Client, submit: dict[str, str], spec: dict[str, Any]) -> Iterator[
        tuple[Any, int, int]]:
    """A run that keeps training (a reward the operator allowed sleeps each step) while a probe looks at
    its engine process: yields (API client, run id, the first engine process's PID); cancelled after."""
    spec["task"]["reward"] = ["gsm8k", "tests.locojax.rewards_for_tests:sleep_100ms_per_tiny_step"]
    response = _submit(http, submit, spec)
    response.raise_for_status()
    run_id = response.json()["id"]
    with stack.client() as api:
        try:
            pids = wait_until(lambda: [row["pid"] for row in api.list_run_hosts(run_id) if row["pid"]], 120,
                              "the engine process")
            yield api, run_id, pids[0]
        finally:
            api.cancel_run(run_id)
            wait_final(api, run_id, timeout_s=120)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _engine_env_attack(stack: Stack, http: httpx.Client, submit: dict[str, str], log: Attacks) -> None:
    """A reward running in the engine (the operator allowed its module) reads its environment: nothing
    of the worker's credentials is there. Read from /proc while the run trains."""
    spec = tiny_spec(f"env-{secrets.token_hex(2)}", hosts=1, steps=400)
    with _training_run(stack, http, submit, spec) as (_, run_id, engine):
        env = _environ(engine)
        leaked = sorted(name for name in env if name.startswith("LOCOJAX_") or any(
            word in name for word in ("PASSWORD", "TOKEN", "SECRET")))
        values = " ".join(env.values())
        secret_values = [stack.plane.worker_token, stack.plane.admin_token, stack.database_url,
                         stack.settings.broker_url]
        found = [value[:12] for value in secret_values if value and value in values]
        log.record("engine process reads its environment for credentials", f"/proc/{engine}/environ of run {run_id}",
                   f"{len(env)} variables: {sorted(env)[:12]}; credential names {leaked}, values {found}",
                   not leaked and not found)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except OSError:
            continue  # exited while we looked
    return found


def _listeners(pid: int | str) -> dict[int, int]:
    """TCP port -> socket inode of what listens in the network namespace of process `pid` (its own
    view, /proc/PID/net)."""
    found = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                found[int(fields[1].rsplit(":", 1)[1], 16)] = int(fields[9])
    return found


def _descendants(pid: int) -> list[int]:
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in _children(parent)]
        found += frontier
    return found


def _socket_inodes(pids: list[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
        except OSError:
            continue  # exited while we looked
    return inodes


def _host_addresses() -> list[str]:
    """Every IPv4 address of this machine's interfaces (`ip -4 -o addr`: one line per address)."""
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    return sorted({"127.0.0.1"} | {line.split()[3].split("/")[0] for line in shown.splitlines()})


def _ray_network_attack(stack: Stack, http: httpx.Client, submit: dict[str, str], log: Attacks) -> None:
    """A DA run under the control plane is one Ray cluster over its reserved hosts (issue 19): its
    processes must be reachable at the address its hosts advertise, and there every RPC needs the
    attempt's secret as Ray's token (tests/locojax/test_da_cluster.py refuses clients without it). What
    must not happen is Ray answering at any *other* address of the machine. While one trains, read the
    ports its GCS listens on (/proc/PID/net) and try each at every address of the host."""
    spec = tiny_spec(f"ray-{secrets.token_hex(2)}", hosts=2, steps=400)
    spec["placement"] = {"mode": "da", "hosts": 2, "devices_per_host": 1, "rollout_fraction": 0.5}
    with _training_run(stack, http, submit, spec) as (api, run_id, engine):
        gcs = wait_until(lambda: [pid for pid in _children(engine)
                                  if b"gcs_server" in Path(f"/proc/{pid}/cmdline").read_bytes()], 120,
                         "the run's Ray GCS")[0]
        wait_until(lambda: last_step(api, run_id) >= 1, 240, "a DA step (every Ray server up)")
        ports = sorted(_listeners(gcs))
        addresses = _host_addresses()
        # Another Ray on this machine (a test, a benchmark) may hold the same default port in the
        # host's namespace: a port that answers counts against this run only if the socket is its own.
        run_sockets = _socket_inodes(_descendants(engine))
        host_listeners = _listeners("self")
        reached, answered_by_others = [], []
        for address in addresses:
            for port in ports:
                try:
                    socket.create_connection((address, port), timeout=2).close()
                except OSError:
                    continue
                (reached if host_listeners.get(port) in run_sockets else answered_by_others).append(
                    f"{address}:{port}")
        advertised = {host["info"]["address"] for host in api.request("GET", "/api/v1/hosts")["data"]}
        elsewhere = [where for where in reached if where.rsplit(":", 1)[0] not in advertised]
        log.record("connect to a DA run's Ray at an address its hosts do not advertise",
                   f"TCP connect to the {len(ports)} ports Ray of run {run_id} listens on, at {addresses} "
                   f"(the hosts advertise {sorted(advertised)})",
                   f"reached the run's Ray at {reached or 'none'}, of which at other addresses: "
                   f"{elsewhere or 'none'} (other processes' ports: {answered_by_others or 'none'})",
                   not elsewhere and len(ports) > 1)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _browser_attacks(stack: Stack, log: Attacks) -> None:
    with stack.http() as http:
        token_id = http.get("/api/v1/whoami", headers={"Authorization": f"Bearer {stack.plane.admin_token}"}).json()["id"]
    # The old bug: a SecretStr passed to a child process as "**********" made the cookie key public.
    payload = _b64(json.dumps({"csrf": "c", "tid": token_id, "sid": None, "exp": int(time.time()) + 3600},
                              separators=(",", ":")).encode())
    key = hashlib.sha256(b"**********").digest()
    forged = f"{payload}.{_b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())}"
    with httpx.Client(base_url=stack.url, timeout=30, cookies={COOKIE: forged}) as client:
        response = client.get("/runs")
        log.record("cookie signed with the masked-secret placeholder", "GET /runs with a cookie signed by "
                   "sha256('**********')", response, response.status_code == 303)

    client, csrf = _login(stack, stack.plane.admin_token)
    try:
        kept = client.cookies.get(COOKIE)
        client.post("/logout", data={"csrf_token": csrf})
    finally:
        client.close()
    with httpx.Client(base_url=stack.url, timeout=30, cookies={COOKIE: kept}) as replay:
        response = replay.get("/runs")
        log.record("session cookie replayed after logout", "GET /runs with the cookie from before POST /logout",
                   response, response.status_code == 303)

    with stack.http() as http:
        page = http.get("/login")
        headers = page.headers
        framed = ("frame-ancestors 'none'" in headers.get("content-security-policy", "")
                  and headers.get("x-frame-options") == "DENY" and headers.get("x-content-type-options") == "nosniff"
                  and bool(headers.get("referrer-policy")))
        log.record("framing the dashboard (clickjacking)", "GET /login, headers checked",
                   f"CSP={headers.get('content-security-policy', '')[:80]!r} XFO={headers.get('x-frame-options')}",
                   framed)
        response = http.get("/healthz", headers={"Host": "attacker.example"})
        log.record("a foreign Host header (DNS rebinding)", "GET /healthz Host: attacker.example", response,
                   response.status_code == 400)

        client, csrf = _login(stack, stack.plane.admin_token)
        try:
            response = client.post("/runs/new", data={"csrf_token": csrf, "name": "yaml-bomb",
                                                       "spec_yaml": "# " + "x" * (70 * 1024)})
        finally:
            client.close()
        log.record("a 70 KiB YAML box on the new-run form", "POST /runs/new spec_yaml=70 KiB", f"{response.status_code}",
                   response.status_code == 422 and "at most 64 KiB" in response.text)

    # Last: from its own loopback address, so no other scenario's logins are limited.
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(base_url=stack.url, timeout=30, transport=transport) as brute:
        csrf = _csrf(brute.get("/login"))
        codes = [brute.post("/login", data={"token": f"lcj_{secrets.token_urlsafe(24)}", "csrf_token": csrf}).status_code
                 for _ in range(12)]
        response = brute.post("/login", data={"token": stack.plane.admin_token, "csrf_token": csrf})
        retry_after = response.headers.get("retry-after")
        log.record("login brute force (12 wrong tokens, then the right one)", "POST /login x13 from 127.0.0.2",
                   f"codes {codes} then {response.status_code} Retry-After={retry_after}",
                   codes[:10] == [401] * 10 and codes[10:] == [429, 429] and response.status_code == 429
                   and bool(retry_after))


def _bounded_attacks(stack: Stack, http: httpx.Client, submit: dict[str, str], log: Attacks) -> None:
    worker = {"Authorization": f"Bearer {stack.plane.worker_token}"}
    admin = {"Authorization": f"Bearer {stack.plane.admin_token}"}
    host = stack.plane.host_names[0]
    before = stack.sql("SELECT info FROM hosts WHERE name = :name", name=host)
    response = http.post("/api/v1/hosts", json={"name": host, "info": {"junk": "x" * (17 * 1024)}}, headers=worker)
    after = stack.sql("SELECT info FROM hosts WHERE name = :name", name=host)
    log.record("17 KiB of host info", f"POST /api/v1/hosts name={host} info=17 KiB", response,
               response.status_code == 422 and before == after)

    run = _submit(http, submit, tiny_spec(f"keys-{secrets.token_hex(2)}", hosts=4, steps=1))  # never placed
    run.raise_for_status()
    run_id = run.json()["id"]
    rows = [{"step": step, "host": -1, "values": {f"junk/{step}/{i}": 1.0 for i in range(500)}} for step in range(2)]
    first = http.post(f"/api/v1/runs/{run_id}/metrics", json={"rows": rows, "attempt": 0}, headers=admin)
    more = http.post(f"/api/v1/runs/{run_id}/metrics",
                     json={"rows": [{"step": 2, "host": -1, "values": {"junk/extra": 1.0}}], "attempt": 0},
                     headers=admin)
    keys = stack.sql("SELECT COUNT(DISTINCT key) FROM step_metrics WHERE run_id = :id", id=run_id)[0][0]
    log.record("1,001 distinct metric keys in one run", f"POST metrics: 1,000 keys ({first.status_code}), then one more",
               more, first.status_code == 200 and more.status_code == 422 and keys == 1000)

    url = f"/api/v1/runs/{run_id}/events/stream"
    limit = stack.settings.sse_streams_per_token
    with ExitStack() as streams:
        opened = [streams.enter_context(httpx.stream("GET", stack.url + url, headers=submit, timeout=30))
                  for _ in range(limit)]
        extra = http.get(url, headers=submit)
        log.record(f"{limit + 1} event streams with one token", f"GET {url} x{limit + 1} held open",
                   f"first {limit}: {sorted({s.status_code for s in opened})}; then {extra.status_code}",
                   all(s.status_code == 200 for s in opened) and extra.status_code == 429)
    with stack.client() as api:
        api.cancel_run(run_id)

    for name, changes, field in [
        ("max_new_tokens 1,000,000", {"rollout.max_new_tokens": 1_000_000}, "spec.rollout.max_new_tokens"),
        ("checkpoint.keep 100,000", {"checkpoint.keep": 100_000}, "spec.checkpoint.keep"),
        ("max_restarts 1,000", {"max_restarts": 1000}, "spec.max_restarts"),
    ]:
        response = _submit(http, submit, _spec(changes))
        log.record(name, f"POST /api/v1/runs {changes}", response,
                   response.status_code == 422 and _error_field(response) == field)

    for encoding in ("utf-16", "utf-32"):
        body = json.dumps({"spec": tiny_spec("wide", hosts=1, steps=1)}).encode(encoding)
        response = http.post("/api/v1/runs", content=body, headers={**submit, "Content-Type": "application/json"})
        log.record(f"a {encoding.upper()} JSON body", f"POST /api/v1/runs, {len(body)} bytes of {encoding}", response,
                   400 <= response.status_code < 500)


def attacks(stack: Stack) -> dict[str, Any]:
    log = Attacks()
    with stack.http() as http:
        admin = {"Authorization": f"Bearer {stack.plane.admin_token}"}
        made = http.post("/api/v1/tokens", json={"name": f"attacker-{secrets.token_hex(2)}", "scopes": ["submit"]},
                         headers=admin)
        made.raise_for_status()
        submit = {"Authorization": f"Bearer {made.json()['token']}"}
        runs_before = stack.sql("SELECT COUNT(*) FROM runs")[0][0]
        _reward_attacks(stack, http, submit, log)
        _endpoint_attacks(http, submit, log)
        _bounded_attacks(stack, http, submit, log)
        refused_nothing_stored = stack.sql("SELECT COUNT(*) FROM runs")[0][0] == runs_before + 1  # the keys run only
        _forged_spec_attack(stack, http, submit, log)
        _engine_env_attack(stack, http, submit, log)
        _ray_network_attack(stack, http, submit, log)
    _browser_attacks(stack, log)
    blocked = sum(item["blocked"] for item in log.tried)
    return outcome({
        "every attack was blocked": blocked == len(log.tried),
        "refused specs stored nothing": refused_nothing_stored,
        "at least 20 attacks tried": len(log.tried) >= 20,
    }, attacks_tried=len(log.tried), attacks_blocked=blocked, attacks=log.tried)

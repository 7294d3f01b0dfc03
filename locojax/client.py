"""REST client of the control plane, for scripts, CI and the workers: `ApiClient`, and the CLI commands

  locojax submit spec.yaml [--idempotency-key K] [--wait]
  locojax runs ls [--status S] [--name N] [--limit L] [--all]
  locojax runs get|cancel|resume|delete RUN_ID
  locojax runs metrics RUN_ID [--key K ...] [--host H] [--max-points N]
  locojax runs events RUN_ID [--follow]

The server URL and token come from `--url`/`--token` or `LOCOJAX_URL`/`LOCOJAX_TOKEN` (read by typer,
not by this module). Imports only httpx, typer and locojax.spec: the engine never depends on the server.
httpx is imported where a request is made, not with the module: the `locojax` command line registers these
commands in every process it starts, engine hosts included (with server/cli.py's settings imported lazily too,
`locojax --help` went from 0.49 to 0.42 s, median of 9).
Exit codes (locojax.contract): 0 success (EXIT_OK), 1 the API refused, its error code and message go to
stderr, or a waited-for run did not succeed (EXIT_FAILED), 2 bad local input (EXIT_SPEC_ERROR), 4 the
server could not be reached (EXIT_UNREACHABLE; 3 is a cancelled engine run's).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer

from locojax.contract import EXIT_FAILED, EXIT_SPEC_ERROR, EXIT_UNREACHABLE, TERMINAL_STATES, RunStatus
from locojax.spec import SpecError, load_spec

DEFAULT_URL = "http://127.0.0.1:8000"
TERMINAL = frozenset(status.value for status in TERMINAL_STATES)

if TYPE_CHECKING:
    import httpx


class ApiClientError(Exception):
    """The API answered with an error (`status`, `code`, `message`, `details` from its error body)."""

    def __init__(self, status: int, code: str, message: str, details: Any = None):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details


class ApiClient:
    """A thin typed wrapper over the REST API. Safe to share between threads (httpx.Client is)."""

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, *, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None):
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ApiClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise _error_from(response)
        if response.status_code == 204 or not response.content:
            return None
        return response.json()

    # runs
    def submit(self, spec: dict[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self.request("POST", "/api/v1/runs", json={"spec": spec}, headers=headers)

    def list_runs(self, *, status: list[str] | None = None, name: str | None = None, limit: int | None = None,
                  cursor: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"status": status or [], "name": name, "limit": limit, "cursor": cursor}
        return self.request("GET", "/api/v1/runs", params={k: v for k, v in params.items() if v not in (None, [])})

    def iter_runs(self, **filters: Any) -> Iterator[dict[str, Any]]:
        cursor = None
        while True:
            page = self.list_runs(cursor=cursor, **filters)
            yield from page["data"]
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def get_run(self, run_id: int) -> dict[str, Any]:
        return self.request("GET", f"/api/v1/runs/{run_id}")

    def cancel_run(self, run_id: int) -> dict[str, Any]:
        return self.request("POST", f"/api/v1/runs/{run_id}/cancel")

    def resume_run(self, run_id: int) -> dict[str, Any]:
        return self.request("POST", f"/api/v1/runs/{run_id}/resume")

    def delete_run(self, run_id: int) -> None:
        self.request("DELETE", f"/api/v1/runs/{run_id}")

    def report_transition(self, run_id: int, to: str, *, reason: str | None = None,
                          expected: str | None = None) -> dict[str, Any]:
        """Move a run by hand (admin tokens only)."""
        body = {"to": to, "reason": reason, "expected": expected}
        return self.request("POST", f"/api/v1/runs/{run_id}/transitions", json={k: v for k, v in body.items() if v})

    # worker reports: each names the run attempt it belongs to (a stale one is a 409) and the reporting host
    def report_checkpoint(self, run_id: int, step: int, *, attempt: int, host_name: str | None = None
                          ) -> dict[str, Any]:
        return self.request("POST", f"/api/v1/runs/{run_id}/checkpoints",
                            json=_report({"step": step}, attempt, host_name))

    def report_host_process(self, run_id: int, process_index: int, **fields: Any) -> dict[str, Any]:
        return self.request("PUT", f"/api/v1/runs/{run_id}/hosts/{process_index}", json=fields)

    def list_run_hosts(self, run_id: int, attempt: int | None = None) -> list[dict[str, Any]]:
        params = {"attempt": attempt} if attempt is not None else {}
        return self.request("GET", f"/api/v1/runs/{run_id}/hosts", params=params)["data"]

    def post_metrics(self, run_id: int, rows: list[dict[str, Any]], *, attempt: int,
                     host_name: str | None = None) -> dict[str, Any]:
        """rows: [{"step": int, "host": int (-1 = aggregated), "values": {key: float}}]; idempotent."""
        return self.request("POST", f"/api/v1/runs/{run_id}/metrics", json=_report({"rows": rows}, attempt, host_name))

    def post_events(self, run_id: int, events: list[dict[str, Any]], *, attempt: int,
                    host_name: str | None = None) -> dict[str, Any]:
        return self.request("POST", f"/api/v1/runs/{run_id}/events",
                            json=_report({"events": events}, attempt, host_name))

    def register_host(self, name: str, **fields: Any) -> dict[str, Any]:
        return self.request("POST", "/api/v1/hosts", json={"name": name, **fields})

    def heartbeat(self, name: str, info: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("POST", f"/api/v1/hosts/{name}/heartbeat", json={"info": info} if info is not None else None)

    # reads
    def metric_history(self, run_id: int, keys: list[str], *, hosts: list[int] | None = None,
                       max_points: int = 1000, start_step: int | None = None,
                       end_step: int | None = None) -> dict[str, Any]:
        params = {"key": keys, "host": hosts or [-1], "max_points": max_points, "start_step": start_step,
                  "end_step": end_step}
        return self.request("GET", f"/api/v1/runs/{run_id}/metrics/history",
                            params={k: v for k, v in params.items() if v is not None})

    def metric_keys(self, run_id: int) -> dict[str, Any]:
        """Every metric key of a run and the hosts (-1: the aggregate) that reported any."""
        return self.request("GET", f"/api/v1/runs/{run_id}/metrics/keys")

    # calibration: what the placement model learned from measured runs
    def import_observation(self, payload: dict[str, Any]) -> dict[str, Any]:
        """An observation_payload of a run directory (admin tokens only); idempotent per directory."""
        return self.request("POST", "/api/v1/calibration/observations", json=payload)

    def list_observations(self, *, hardware: str | None = None, limit: int | None = None,
                          cursor: str | None = None) -> dict[str, Any]:
        params = {"hardware": hardware, "limit": limit, "cursor": cursor}
        return self.request("GET", "/api/v1/calibration/observations",
                            params={k: v for k, v in params.items() if v is not None})

    def set_observation_excluded(self, observation_id: int, excluded: bool) -> dict[str, Any]:
        action = "exclude" if excluded else "include"
        return self.request("POST", f"/api/v1/calibration/observations/{observation_id}/{action}")

    def list_calibrations(self, hardware: str | None = None) -> dict[str, Any]:
        params = {"hardware": hardware} if hardware else {}
        return self.request("GET", "/api/v1/calibration/versions", params=params)

    def activate_calibration(self, calibration_id: int) -> dict[str, Any]:
        return self.request("POST", f"/api/v1/calibration/versions/{calibration_id}/activate")

    def metric_deliveries(self, run_id: int) -> dict[str, Any]:
        """Per series: values the API received (retries and repeats counted) against rows stored."""
        return self.request("GET", f"/api/v1/runs/{run_id}/metrics/deliveries")

    def metric_summary(self, run_id: int, host: int = -1) -> dict[str, Any]:
        return self.request("GET", f"/api/v1/runs/{run_id}/metrics/summary", params={"host": host})

    def events(self, run_id: int, after: int = 0) -> dict[str, Any]:
        return self.request("GET", f"/api/v1/runs/{run_id}/events", params={"after": after})

    def follow_events(self, run_id: int, after: int = 0) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event name, data) pairs from the SSE stream until the run ends; reconnects where it left off."""
        import httpx

        while True:
            with self._http.stream("GET", f"/api/v1/runs/{run_id}/events/stream", params={"after": after},
                                   timeout=httpx.Timeout(30.0, read=None)) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error_from(response)
                for name, data in _parse_sse(response.iter_lines()):
                    if name == "log":
                        after = max(after, int(data.get("id", after)))
                    yield name, data
                    if name == "end":
                        return


def _report(body: dict[str, Any], attempt: int, host_name: str | None) -> dict[str, Any]:
    return {**body, "attempt": attempt, **({"host_name": host_name} if host_name else {})}


def _parse_sse(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    name, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield name, json.loads("\n".join(data))
            name, data = "message", []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def _error_from(response: httpx.Response) -> ApiClientError:
    try:
        error = response.json()["error"]
        return ApiClientError(response.status_code, error["code"], error["message"], error.get("details"))
    except (ValueError, KeyError, TypeError):
        return ApiClientError(response.status_code, f"HTTP_{response.status_code}", response.text[:200])


# --- CLI --------------------------------------------------------------------------------------------

UrlOption = Annotated[str, typer.Option("--url", envvar="LOCOJAX_URL", help="control-plane URL")]
TokenOption = Annotated[str | None, typer.Option("--token", envvar="LOCOJAX_TOKEN", show_default=False,
                                                 help="API token (LOCOJAX_TOKEN)")]
JsonOption = Annotated[bool, typer.Option("--json", help="print the raw JSON response")]

runs_app = typer.Typer(help="List, inspect, cancel and resume runs on the control plane.", no_args_is_help=True)


def _client(url: str, token: str | None) -> ApiClient:
    if not token:
        typer.echo("no token: pass --token or set LOCOJAX_TOKEN (locojax token create --scope submit)", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR)
    return ApiClient(url, token)


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    import httpx

    try:
        return fn(*args, **kwargs)
    except ApiClientError as exc:
        typer.echo(f"error {exc.status} {exc.code}: {exc.message}", err=True)
        if isinstance(exc.details, list):
            for item in exc.details:
                if isinstance(item, dict) and item.get("field") is not None:
                    typer.echo(f"  {item['field'] or '<body>'}: {item.get('message')}", err=True)
        raise typer.Exit(EXIT_FAILED) from None
    except httpx.TransportError as exc:
        typer.echo(f"cannot reach the control plane: {exc}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None


def _print_run_line(run: dict[str, Any]) -> None:
    step = run.get("last_checkpoint_step")
    typer.echo(f"{run['id']:>6}  {run['status']:<10}  {run['mode']:<2}  {run['hosts_needed']:>3}h  "
               f"{run['name']:<32}  ckpt={'-' if step is None else step}  {run['created_at'][:19]}")


def _print(data: Any, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    elif isinstance(data, dict) and "status" in data and "id" in data:
        _print_run_line(data)
        if data.get("status_reason"):
            typer.echo(f"        {data['status_reason']}")


def submit(
    spec_path: Annotated[str, typer.Argument(metavar="SPEC.yaml", help="a RunSpec file (YAML or JSON)")],
    url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False,
    idempotency_key: Annotated[str | None, typer.Option(help="retrying with the same key never submits twice")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="follow the run's events until it finishes")] = False,
) -> None:
    """Validate SPEC.yaml locally, submit it, print the run. With --wait, exit 0 only if it SUCCEEDED."""
    try:
        spec = load_spec(spec_path)
    except SpecError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(EXIT_SPEC_ERROR) from None
    with _client(url, token) as client:
        run = _call(client.submit, spec.model_dump(mode="json"), idempotency_key=idempotency_key)
        _print(run, as_json)
        if wait:
            _follow(client, run["id"])
            run = _call(client.get_run, run["id"])
            _print(run, as_json)
            if run["status"] != RunStatus.SUCCEEDED:
                raise typer.Exit(EXIT_FAILED)


@runs_app.command("ls")
def runs_ls(
    url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False,
    status: Annotated[list[str] | None, typer.Option("--status", help="repeat for several")] = None,
    name: Annotated[str | None, typer.Option(help="substring of the run name")] = None,
    limit: Annotated[int, typer.Option(min=1, help="runs per page")] = 50,
    all_pages: Annotated[bool, typer.Option("--all", help="follow the cursor through every page")] = False,
) -> None:
    """Newest runs first."""
    with _client(url, token) as client:
        filters = {"status": [s.upper() for s in status or []], "name": name, "limit": limit}
        if all_pages:
            runs = _call(lambda: list(client.iter_runs(**filters)))
        else:
            runs = _call(client.list_runs, **filters)["data"]
        if as_json:
            typer.echo(json.dumps(runs, indent=2))
            return
        for run in runs:
            _print_run_line(run)


@runs_app.command("get")
def runs_get(run_id: int, url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False) -> None:
    """One run: status, reason, attempt, checkpoint, measured step time."""
    with _client(url, token) as client:
        run = _call(client.get_run, run_id)
    if as_json:
        typer.echo(json.dumps(run, indent=2))
        return
    _print_run_line(run)
    for field in ("status_reason", "attempt", "restarts", "max_restarts", "decision_id", "started_at",
                  "finished_at", "measured_step_s"):
        if run.get(field) is not None:
            typer.echo(f"        {field}: {run[field]}")


@runs_app.command("cancel")
def runs_cancel(run_id: int, url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False) -> None:
    """Cancel: QUEUED runs end at once, running ones stop at the next step boundary."""
    with _client(url, token) as client:
        _print(_call(client.cancel_run, run_id), as_json)


@runs_app.command("resume")
def runs_resume(run_id: int, url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False) -> None:
    """Resume a FAILED or CANCELLED run from its last checkpoint."""
    with _client(url, token) as client:
        _print(_call(client.resume_run, run_id), as_json)


@runs_app.command("delete")
def runs_delete(run_id: int, url: UrlOption = DEFAULT_URL, token: TokenOption = None) -> None:
    """Delete a finished run with its metrics and events."""
    with _client(url, token) as client:
        _call(client.delete_run, run_id)
    typer.echo(f"run {run_id} deleted")


@runs_app.command("metrics")
def runs_metrics(
    run_id: int, url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False,
    key: Annotated[list[str] | None, typer.Option("--key", "-k", help="series to fetch; default: the latest values")] = None,
    host: Annotated[int, typer.Option(help="process index; -1 = aggregated")] = -1,
    max_points: Annotated[int, typer.Option(min=2, help="downsample to at most this many points")] = 20,
) -> None:
    """Latest value of every metric, or (with --key) a downsampled history."""
    with _client(url, token) as client:
        if not key:
            summary = _call(client.metric_summary, run_id, host)
            if as_json:
                typer.echo(json.dumps(summary, indent=2))
                return
            for name, latest in summary["values"].items():
                typer.echo(f"{name:<36} {latest['value']:>14.6g}  (step {latest['step']})")
            return
        history = _call(client.metric_history, run_id, key, hosts=[host], max_points=max_points)
    if as_json:
        typer.echo(json.dumps(history, indent=2))
        return
    for series in history["series"]:
        typer.echo(f"{series['key']} (host {series['host']}, {series['bucket_steps']} step(s) per point)")
        for step, last, low, high in zip(series["steps"], series["last"], series["min"], series["max"]):
            typer.echo(f"  {step:>8}  {last:>14.6g}  [{low:.6g}, {high:.6g}]")


@runs_app.command("events")
def runs_events(
    run_id: int, url: UrlOption = DEFAULT_URL, token: TokenOption = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="stream new events until the run ends")] = False,
) -> None:
    """The run's log lines."""
    with _client(url, token) as client:
        if follow:
            _follow(client, run_id)
            return
        after = 0
        while True:
            page = _call(client.events, run_id, after)
            for event in page["data"]:
                _print_event(event)
            if not page["data"]:
                return
            after = page["next_after"]


def _print_event(event: dict[str, Any]) -> None:
    typer.echo(f"{event['ts'][:19]}  {event['level']:<7} {event['source']:<20} {event['message']}")


def _follow(client: ApiClient, run_id: int) -> None:
    import httpx

    after, failures = 0, 0
    while True:
        try:
            for name, data in client.follow_events(run_id, after):
                failures = 0
                if name == "log":
                    after = data["id"]
                    _print_event(data)
            return
        except httpx.TransportError:
            # The server restarted or the network blinked: reconnect after the last event printed.
            failures += 1
            time.sleep(min(2.0 ** failures, 10.0))
        except ApiClientError as exc:
            typer.echo(f"error {exc.status} {exc.code}: {exc.message}", err=True)
            raise typer.Exit(EXIT_FAILED) from None


def register(app: typer.Typer) -> None:
    app.command("submit")(submit)
    app.add_typer(runs_app, name="runs")

"""Bad input scenarios against the live API over HTTP: malformed run specs, malformed metric batches from a
worker, and a stateful schemathesis run over the whole API.

Every malformed request must be refused with a 4xx in the API's error shape whose message or details
name the problem (the field path when there is one), and must write nothing: row counts are read from
PostgreSQL before and after.
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.e2e.helpers import placed_sink, tiny_spec
from tests.e2e.infra import Stack
from tests.e2e.outcome import outcome


@dataclass(frozen=True)
class BadRequest:
    """One malformed request: `json` or raw `content`, and what the refusal must say.

    `names`: a field path the error's details must list (a prefix match, for pydantic's `[key]` suffixes),
    or, with `in_message=True`, words the message must contain (problems of the body as a whole).
    """

    label: str
    json: Any = None
    content: bytes | Callable[[], Iterator[bytes]] | None = None  # a callable: sent chunked, no length
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 422
    names: str = ""
    in_message: bool = False
    code: str | None = None

    def send(self, http: httpx.Client, url: str, token: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}", **self.headers}
        if self.content is not None:
            headers.setdefault("Content-Type", "application/json")
            content = self.content() if callable(self.content) else self.content
            return http.post(url, content=content, headers=headers)
        return http.post(url, json=self.json, headers=headers)


def judge(case: BadRequest, response: httpx.Response) -> tuple[bool, str]:
    """(refused as it should be, what was wrong otherwise)."""
    if response.status_code != case.status:
        return False, f"status {response.status_code}, expected {case.status}: {response.text[:200]}"
    try:
        error = response.json()["error"]
        message, details = error["message"], error["details"]
    except (ValueError, KeyError, TypeError):
        return False, f"not the error shape: {response.text[:200]}"
    if case.code is not None and error.get("code") != case.code:
        return False, f"code {error.get('code')}, expected {case.code}"
    if case.in_message:
        return (case.names.lower() in message.lower(), f"message {message!r} does not say {case.names!r}")
    fields = [str(item.get("field", "")) for item in details] if isinstance(details, list) else []
    named = any(name == case.names or name.startswith(case.names + ".") for name in fields)
    return named, f"fields {fields} do not name {case.names!r}"


# --- malformed run specs --------------------------------------------------------------------------------

def _spec(changes: dict[str, Any] | None = None, drop: str | None = None) -> dict[str, Any]:
    """A valid one-host spec with dotted-path `changes` applied (and `drop` removed)."""
    spec = copy.deepcopy(tiny_spec("bad-input", hosts=1, steps=2))
    for path, value in (changes or {}).items():
        *parents, leaf = path.split(".")
        node = spec
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    if drop:
        *parents, leaf = drop.split(".")
        node = spec
        for part in parents:
            node = node[part]
        del node[leaf]
    return spec


def _raw(changes: dict[str, Any], literal: str) -> bytes:
    """A body whose `__RAW__` value is replaced by JSON text pydantic never sees from json= (NaN, 10**400)."""
    return json.dumps({"spec": _spec(changes)}).replace('"__RAW__"', literal).encode()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def spec_cases(stack: Stack) -> list[BadRequest]:
    data, runs = stack.settings.data_roots[0], stack.settings.runs_root
    over = stack.settings.max_body_bytes + 512 * 1024

    def spec(label: str, names: str, changes: dict[str, Any] | None = None, **kwargs: Any) -> BadRequest:
        return BadRequest(label, json={"spec": _spec(changes)}, names=names, **kwargs)

    def path(label: str, names: str, changes: dict[str, Any]) -> BadRequest:
        return BadRequest(label, json={"spec": _spec(changes)}, names=names, code="PATH_NOT_ALLOWED")

    def chunks() -> Iterator[bytes]:
        yield b'{"spec": {"name": "chunked", "output_dir": "'
        for _ in range(over // 65536 + 1):
            yield b"x" * 65536
        yield b'"}}'

    return [
        # wrong types
        spec("name is a number", "spec.name", {"name": 42}),
        spec("steps is a word", "spec.steps", {"steps": "ten"}),
        spec("steps is a fraction", "spec.steps", {"steps": 2.5}),
        spec("model is a string", "spec.model", {"model": "tiny"}),
        spec("temperature is a word", "spec.rollout.temperature", {"rollout.temperature": "hot"}),
        spec("reward is a string, not a list", "spec.task.reward", {"task.reward": "format"}),
        BadRequest("spec is a list", json={"spec": []}, names="spec"),
        BadRequest("spec is missing", json={"name": "x"}, names="spec"),
        # negative or zero sizes
        spec("negative seed", "spec.seed", {"seed": -1}),
        spec("zero steps", "spec.steps", {"steps": 0}),
        spec("negative steps", "spec.steps", {"steps": -5}),
        spec("negative prompts per step", "spec.rollout.prompts_per_step", {"rollout.prompts_per_step": -4}),
        spec("zero group size", "spec.rollout.group_size", {"rollout.group_size": 0}),
        spec("zero hosts", "spec.placement.hosts", {"placement.hosts": 0}),
        spec("negative learning rate", "spec.optim.lr", {"optim.lr": -1.0}),
        # huge values
        spec("a trillion steps", "spec.steps", {"steps": 10**12}),
        spec("a billion new tokens", "spec.rollout.max_new_tokens", {"rollout.max_new_tokens": 10**9}),
        spec("a million hosts", "spec.placement.hosts", {"placement.hosts": 10**6}),
        spec("seed past 64 bits", "spec.seed", {"seed": 2**70}),
        spec("a name of 5000 characters", "spec.name", {"name": "n" * 5000}),
        spec("a million restarts", "spec.max_restarts", {"max_restarts": 10**6}),
        BadRequest("a 400-digit step count", content=_raw({"steps": "__RAW__"}, "1" * 400), names="spec.steps"),
        BadRequest("NaN learning rate", content=_raw({"optim.lr": "__RAW__"}, "NaN"), names="spec.optim.lr"),
        BadRequest("infinite temperature", content=_raw({"rollout.temperature": "__RAW__"}, "Infinity"),
                   names="spec.rollout.temperature"),
        # unknown names
        spec("unknown model preset", "spec.model.preset", {"model.preset": "gpt-17"}),
        spec("unknown task", "spec.task.name", {"task.name": "no-such-task"}, code="UNKNOWN_NAME"),
        spec("unknown reward", "spec.task.reward.0", {"task.reward": ["no_such_reward"]}, code="UNKNOWN_NAME"),
        spec("unknown algorithm", "spec.algo.name", {"algo.name": "ppo"}),
        spec("unknown mode", "spec.placement.mode", {"placement.mode": "tp"}),
        spec("unknown top-level field", "spec.epochs", {"epochs": 3}),
        spec("unknown nested field", "spec.rollout.beam_width", {"rollout.beam_width": 4}),
        # rules across fields
        spec("prompts not divisible by hosts", "spec", {"placement.hosts": 3}),
        spec("DA mode on one host", "spec.placement", {"placement.mode": "da"}),
        spec("difficulty 0 outside arith", "spec.task", {"task.name": "countdown", "task.difficulty": 0}),
        spec("a decision that does not exist", "spec.placement.decision_id", {"placement.decision_id": 2**31 - 2},
             code="DECISION_NOT_FOUND"),
        # deep nesting
        BadRequest("nesting 100,000 deep", content=b'{"spec": {"name": "deep", "model": ' + _nested(100_000).encode()
                   + b"}}", names="nested too deeply", in_message=True),
        spec("nesting 200 deep inside a section", "spec.model", {"model": json.loads(_nested(200))}),
        # bodies that are not (UTF-8) JSON, or too large
        BadRequest("not UTF-8", content='{"spec": {"name": "caf\u00e9"}}'.encode("latin-1"), names="UTF-8",
                   in_message=True),
        BadRequest("truncated JSON", content=b'{"spec": {"name": "cut', names="body", in_message=True),
        BadRequest("NUL in a string", json={"spec": _spec({"name": "a\u0000b"})}, names="NUL", in_message=True),
        BadRequest("form-encoded, not JSON", content=b"spec=name", headers={"Content-Type": "application/x-www-form-urlencoded"},
                   names="body", in_message=True),
        BadRequest("body over the size limit", content=json.dumps({"spec": _spec({"output_dir": "x" * over})}).encode(),
                   status=413, names="larger than", in_message=True),
        BadRequest("chunked body over the size limit", content=chunks, status=413, names="larger than",
                   in_message=True),
        BadRequest("idempotency key with control characters", json={"spec": _spec()},
                   headers={"Idempotency-Key": "key\twith\ttabs"}, names="Idempotency-Key"),
        # paths that leave the configured roots
        path("task.path traversal", "spec.task.path", {"task": {"name": "gsm8k", "path": str(data / "../../../etc/passwd")}}),
        path("task.path absolute elsewhere", "spec.task.path", {"task": {"name": "math", "path": "/etc/shadow"}}),
        path("model.checkpoint traversal", "spec.model.checkpoint", {"model.checkpoint": str(data / ".." / ".." / "ckpt")}),
        path("model.checkpoint relative escape", "spec.model.checkpoint", {"model.checkpoint": "../../../root"}),
        path("model.tokenizer elsewhere", "spec.model.tokenizer", {"model.tokenizer": "/root/.ssh/id_rsa"}),
        path("output_dir outside runs_root", "spec.output_dir", {"output_dir": "/tmp/elsewhere"}),
        path("output_dir traversal", "spec.output_dir", {"output_dir": str(runs / ".." / "escaped")}),
        path("checkpoint.dir traversal", "spec.checkpoint.dir", {"checkpoint.dir": str(runs / "a" / ".." / ".." / "b")}),
    ]


def bad_run_specs(stack: Stack) -> dict[str, Any]:
    cases = spec_cases(stack)
    before = stack.counts()
    results = []
    with stack.http() as http:
        for case in cases:
            try:
                response = case.send(http, "/api/v1/runs", stack.plane.admin_token)
                ok, why = judge(case, response)
            except httpx.TransportError as exc:
                ok, why = False, f"transport error {exc!r}"
            results.append({"case": case.label, "refused": ok, **({} if ok else {"why": why})})
    after = stack.counts()
    refused = sum(item["refused"] for item in results)
    return outcome({
        "every malformed spec refused naming the problem": refused == len(cases),
        "at least 30 cases": len(cases) >= 30,
        "nothing written": before == after,
    }, cases=len(cases), rejected=refused, rows_before=before, rows_after=after,
        not_refused=[item for item in results if not item["refused"]])


# --- malformed metric batches -----------------------------------------------------------------------------

def _row(step: int = 0, **values: float) -> dict[str, Any]:
    return {"step": step, "host": -1, "values": values or {"loss": 1.0}}


def batch_cases(stack: Stack) -> list[BadRequest]:
    limit = stack.settings.metrics_batch_max_values
    wide = {f"k{i}": float(i) for i in range(1000)}
    raw = json.dumps({"rows": [_row(0, loss="__RAW__")]})
    return [
        BadRequest("rows is an object", json={"rows": {}}, names="rows"),
        BadRequest("rows missing", json={}, names="rows"),
        BadRequest("no rows", json={"rows": []}, names="rows"),
        BadRequest("negative step", json={"rows": [_row(-1)]}, names="rows.0.step"),
        BadRequest("step is a word", json={"rows": [{"step": "one", "values": {"loss": 1.0}}]}, names="rows.0.step"),
        BadRequest("step past 32 bits", json={"rows": [_row(2**31)]}, names="rows.0.step"),
        BadRequest("host below -1", json={"rows": [{"step": 0, "host": -2, "values": {"loss": 1.0}}]},
                   names="rows.0.host"),
        BadRequest("no values", json={"rows": [{"step": 0, "values": {}}]}, names="rows.0.values"),
        BadRequest("a value is a word", json={"rows": [_row(0, loss="high")]}, names="rows.0.values.loss"),
        BadRequest("a NaN value", content=raw.replace('"__RAW__"', "NaN").encode(), names="rows.0.values.loss"),
        BadRequest("an infinite value", content=raw.replace('"__RAW__"', "-Infinity").encode(),
                   names="rows.0.values.loss"),
        BadRequest("a key with spaces", json={"rows": [{"step": 0, "values": {"bad key!": 1.0}}]},
                   names="rows.0.values"),
        BadRequest("a key of 300 characters", json={"rows": [{"step": 0, "values": {"k" * 300: 1.0}}]},
                   names="rows.0.values"),
        BadRequest("an unknown field in a row", json={"rows": [{**_row(0), "wall": 1}]}, names="rows.0.wall"),
        BadRequest("three good rows and a bad fourth", json={"rows": [_row(1), _row(2), _row(3), _row(4, loss="x")]},
                   names="rows.3.values.loss"),
        BadRequest("more values than the limit", json={"rows": [{"step": s, "values": wide}
                                                                for s in range(limit // 1000 + 1)], "attempt": 0},
                   status=413, code="BATCH_TOO_LARGE", names="limit", in_message=True),
        BadRequest("not UTF-8", content=b'{"rows": [{"step": 0, "values": {"caf\xe9": 1.0}}]}', names="UTF-8",
                   in_message=True),
        BadRequest("nesting 100,000 deep", content=b'{"rows": ' + _nested(100_000).encode() + b"}",
                   names="nested too deeply", in_message=True),
    ]


def bad_metric_batches(stack: Stack) -> dict[str, Any]:
    with stack.client() as api:
        # The batches' target: a run that never starts, placed on a plane host so a good batch is accepted.
        target = placed_sink(stack, api, f"batch-target-{secrets.token_hex(2)}")
    cases = batch_cases(stack)
    url = f"/api/v1/runs/{target['id']}/metrics"
    before = stack.counts(target["id"])
    results = []
    with stack.http() as http:
        for case in cases:
            try:
                ok, why = judge(case, case.send(http, url, stack.plane.worker_token))
            except httpx.TransportError as exc:
                ok, why = False, f"transport error {exc!r}"
            results.append({"case": case.label, "refused": ok, **({} if ok else {"why": why})})
        missing = http.post("/api/v1/runs/2147483000/metrics", json={"rows": [_row()], "attempt": 0},
                            headers={"Authorization": f"Bearer {stack.plane.worker_token}"})
        after = stack.counts(target["id"])
        # The control: a good batch is written, so the counts above could have moved.
        good = http.post(url, json={"rows": [_row(0), _row(1, loss=2.0, acc=0.5)], "attempt": 0},
                         headers={"Authorization": f"Bearer {stack.plane.worker_token}"})
        written = stack.counts(target["id"])["step_metrics"] - after["step_metrics"]
    with stack.client() as api:
        api.cancel_run(target["id"])
    refused = sum(item["refused"] for item in results)
    return outcome({
        "every malformed batch refused naming the problem": refused == len(cases),
        "a batch for a run that does not exist is 404": missing.status_code == 404,
        "no partial write": before == after,
        "a good batch is written (control)": good.status_code == 200 and written == 3,
    }, cases=len(cases), rejected=refused, target_run=target["id"], rows_before=before, rows_after=after,
        not_refused=[item for item in results if not item["refused"]])


# --- stateful fuzzing ---------------------------------------------------------------------------------

def stateful_fuzz(stack: Stack, max_examples: int = 40, steps: int = 10) -> dict[str, Any]:
    """A schemathesis state machine over the whole OpenAPI (links between operations inferred from the
    schema), as an admin, in-process on a database of its own on the private PostgreSQL. The scheduler is
    off there: the fuzzer's runs must not reach the workers, whose engines would train whatever it made up.
    Verdict: no response is a 5xx."""
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, Phase
    from hypothesis.errors import Flaky
    from schemathesis.checks import not_a_server_error

    from server.app import create_app
    from server.db import upgrade_to_head
    from server.services import tokens as token_service
    from server.settings import Settings

    url = stack.postgres.create_database(f"fuzz_{secrets.token_hex(3)}")
    upgrade_to_head(url)
    work = stack.work / "fuzz"
    (work / "data").mkdir(parents=True, exist_ok=True)
    settings = Settings(home=work / "home", database_url=url, broker_url="memory://", migrate_on_start=False,
                        scheduler_enabled=False, data_roots=[work / "data"], runs_root=work / "runs",
                        sse_max_s=1.0, sse_poll_s=0.05, readyz_timeout_s=1.0)
    app = create_app(settings, plugins=False)
    with app.state.db.write_session() as session:
        own, secret = token_service.create(session, name="fuzzer", scopes=["admin"])
    stats: dict[str, Any] = {"requests": 0, "server_errors": [], "operations": {}}

    class Fuzz(schemathesis.openapi.from_asgi("/openapi.json", app).as_state_machine()):  # type: ignore[misc]
        def before_call(self, case: Any) -> None:
            if case.path_parameters and case.path_parameters.get("token_id") == own.id:
                case.path_parameters["token_id"] = own.id + 1_000_000  # revoking itself would end the run

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"headers": {"Authorization": f"Bearer {secret}"}}

        def after_call(self, response: Any, case: Any) -> None:
            stats["requests"] += 1
            label = case.operation.label
            stats["operations"][label] = stats["operations"].get(label, 0) + 1
            if response.status_code >= 500:
                stats["server_errors"].append(f"{label}: {response.status_code} {response.text[:200]}")

        def validate_response(self, response: Any, case: Any, additional_checks: Any = None, **kwargs: Any) -> None:
            case.validate_response(response, checks=[not_a_server_error])

    error = None
    try:
        Fuzz.run(settings=hypothesis.settings(
            max_examples=max_examples, stateful_step_count=steps, deadline=None, database=None,
            suppress_health_check=list(HealthCheck), phases=[Phase.generate]))
    except Flaky:
        # Server state outlives each scenario, so a replay can draw differently; schemathesis' own runner
        # treats that the same way. The verdict is the 5xx count recorded above.
        pass
    except Exception as exc:  # noqa: BLE001 - reported, and fails the scenario
        error = f"{type(exc).__name__}: {str(exc)[:500]}"
    finally:
        app.state.db.dispose()
    operations = len(app.openapi()["paths"])
    return outcome({
        "no 5xx": not stats["server_errors"] and error is None,
        "the fuzzer exercised the API": stats["requests"] >= max_examples and len(stats["operations"]) >= 10,
    }, requests=stats["requests"], operations_called=len(stats["operations"]), paths_in_schema=operations,
        server_errors=stats["server_errors"][:10], error=error)

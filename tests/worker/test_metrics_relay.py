"""The worker's metrics relay against a fake API: every row the engine wrote is delivered once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from locojax.client import ApiClientError
from worker.supervisor import METRICS_BATCH_ROWS, MetricsRelay


class ValueLimitedApi:
    """Refuses batches over `max_values` values with a 413, as the API does (metrics_batch_max_values)."""

    def __init__(self, max_values: int, current_attempt: int = 0):
        self.max_values = max_values
        self.current_attempt = current_attempt
        self.stored: dict[tuple[int, int, str], float] = {}
        self.refused = 0
        self.posts = 0

    def post_metrics(self, run_id: int, rows: list[dict[str, Any]], *, attempt: int,
                     host_name: str | None = None) -> dict[str, Any]:
        self.posts += 1
        if attempt != self.current_attempt:
            raise ApiClientError(409, "STALE_ATTEMPT", f"attempt {attempt}, current {self.current_attempt}")
        values = sum(len(row["values"]) for row in rows)
        if values > self.max_values:
            self.refused += 1
            raise ApiClientError(413, "BATCH_TOO_LARGE", f"batch has {values} values")
        for row in rows:
            for key, value in row["values"].items():
                self.stored[(row["step"], row["host"], key)] = value
        return {"run_id": run_id, "values": values}


def test_batches_too_large_for_the_api_are_split_not_dropped(tmp_path: Path):
    keys = [f"layer{i}/grad_norm" for i in range(40)]  # 40 values a row: 500 rows is 20,000 values
    path = tmp_path / "metrics.jsonl"
    with path.open("w") as handle:
        for step in range(METRICS_BATCH_ROWS + 100):
            handle.write(json.dumps({"step": step, "host": "all", **{key: float(step) for key in keys}}) + "\n")
    api = ValueLimitedApi(max_values=5_000)
    relay = MetricsRelay(api, run_id=1, path=path)  # type: ignore[arg-type]
    relay.read()
    assert relay.flush() and relay.pending == []
    assert api.refused >= 1 and relay.batch_rows * len(keys) <= 5_000
    assert len(api.stored) == (METRICS_BATCH_ROWS + 100) * len(keys)


def test_a_stale_relay_stops_at_the_first_409(tmp_path: Path):
    """Issue 17: the relay of a killed attempt must not keep posting over the new attempt's steps."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "host": "all", "loss": 1.0}) + "\n" for step in range(1200)))
    api = ValueLimitedApi(max_values=100_000, current_attempt=1)
    relay = MetricsRelay(api, run_id=1, path=path, attempt=0, host_name="h0")  # type: ignore[arg-type]
    relay.read()
    assert relay.flush() and relay.stale and relay.pending == []
    assert api.posts == 1 and api.stored == {}  # one refused batch, then nothing more is sent
    with path.open("a") as handle:
        handle.write(json.dumps({"step": 1200, "host": "all", "loss": 1.0}) + "\n")
    relay.read()
    assert relay.flush() and api.posts == 1


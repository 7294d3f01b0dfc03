"""`locojax export-metrics RUN_ID --format tensorboard|csv|parquet [--out PATH]`: a run's whole metric
history, every key of every host and the aggregate, from the REST API.

The history is read in windows of steps small enough to come back raw (one point per step; a window
the server would downsample is halved), `HISTORY_SERIES` series per request. The table formats have one
row per (step, host) and one column per metric, as metrics.jsonl has (host "all": the aggregate);
`tensorboard` writes the event files a run writes itself (`locojax.tensorboard`: `host<i>/`, `all/`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Iterator

import typer

from locojax.client import DEFAULT_URL, ApiClient, TokenOption, UrlOption, _call, _client
from locojax.contract import ALL_HOSTS, AGGREGATE_HOST_INDEX, EXIT_SPEC_ERROR

FORMATS = ("tensorboard", "csv", "parquet")
WINDOW_STEPS = 1000  # steps per history request, halved while the server would downsample them
HISTORY_SERIES = 64  # (key, host) series per request: the server's default bound


def _host_label(host: int) -> str | int:
    return ALL_HOSTS if host == AGGREGATE_HOST_INDEX else host


def _series_batches(keys: list[str], hosts: list[int]) -> Iterator[tuple[list[str], list[int]]]:
    hosts_per_request = min(len(hosts), HISTORY_SERIES)
    keys_per_request = max(1, HISTORY_SERIES // hosts_per_request)
    for h in range(0, len(hosts), hosts_per_request):
        for k in range(0, len(keys), keys_per_request):
            yield keys[k:k + keys_per_request], hosts[h:h + hosts_per_request]


def fetch_records(client: ApiClient, run_id: int) -> tuple[list[str], list[dict[str, Any]]]:
    """(every key, sorted; one record per (step, host): {"step", "host", key: value, ...}), raw values."""
    listing = client.metric_keys(run_id)
    keys, hosts = sorted(listing["keys"]), sorted(listing["hosts"])
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for batch_keys, batch_hosts in _series_batches(keys, hosts):
        start, window = 0, WINDOW_STEPS
        while True:
            history = client.metric_history(run_id, batch_keys, hosts=batch_hosts, max_points=window,
                                            start_step=start, end_step=start + window - 1)
            if any(series["bucket_steps"] > 1 for series in history["series"]):
                window = max(1, window // 2)  # the server's bound is below ours: ask for fewer steps
                continue
            seen = False
            for series in history["series"]:
                for step, value in zip(series["steps"], series["last"]):
                    seen = True
                    rows.setdefault((step, series["host"]), {"step": step, "host": _host_label(series["host"])})[
                        series["key"]] = value
            start += window
            if not seen and not _has_later(client, run_id, batch_keys, batch_hosts, start):
                break
    ordered = sorted(rows.values(), key=lambda r: (r["step"], r["host"] == ALL_HOSTS,
                                                   r["host"] if r["host"] != ALL_HOSTS else 0))
    return keys, ordered


def _has_later(client: ApiClient, run_id: int, keys: list[str], hosts: list[int], start: int) -> bool:
    """Whether any of these series has a point at `start` or later (an empty window may sit in a gap)."""
    history = client.metric_history(run_id, keys, hosts=hosts, max_points=2, start_step=start)
    return any(series["steps"] for series in history["series"])


def write_csv(keys: list[str], records: list[dict[str, Any]], out: Path) -> None:
    import csv

    with out.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["step", "host", *keys])
        writer.writeheader()
        writer.writerows(records)


def write_parquet(keys: list[str], records: list[dict[str, Any]], out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns: dict[str, Any] = {
        "step": pa.array([r["step"] for r in records], pa.int64()),
        "host": pa.array([str(r["host"]) for r in records], pa.string()),
    }
    for key in keys:
        columns[key] = pa.array([r.get(key) for r in records], pa.float64())
    pq.write_table(pa.table(columns), out)


def write_tensorboard(records: list[dict[str, Any]], out: Path) -> None:
    from locojax.tensorboard import TensorBoardSink

    sink = TensorBoardSink(out)
    for record in records:
        sink.write(record["step"], record["host"], {k: v for k, v in record.items() if k not in ("step", "host")})
    sink.close()


def export_metrics(
    run_id: int,
    format: Annotated[str, typer.Option("--format", help="tensorboard, csv or parquet")] = "csv",
    out: Annotated[Path | None, typer.Option(help="file (csv, parquet) or directory (tensorboard); default "
                                                  "run-<id>-metrics.<format> or run-<id>-tensorboard/")] = None,
    url: UrlOption = DEFAULT_URL, token: TokenOption = None,
) -> None:
    """Write a run's metric history (every key, every host and the aggregate) from the control plane."""
    if format not in FORMATS:
        typer.echo(f"--format: expected one of {', '.join(FORMATS)}, got {format!r}", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR)
    target = out or Path(f"run-{run_id}-tensorboard" if format == "tensorboard" else f"run-{run_id}-metrics.{format}")
    if format == "tensorboard" and target.exists() and any(target.iterdir()):
        typer.echo(f"--out: {target} is not empty (event files would mix with what is there)", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR)
    with _client(url, token) as client:
        keys, records = _call(fetch_records, client, run_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    if format == "tensorboard":
        write_tensorboard(records, target)
    elif format == "parquet":
        write_parquet(keys, records, target)
    else:
        write_csv(keys, records, target)
    typer.echo(f"wrote {len(records)} record(s) of {len(keys)} metric(s) of run {run_id} to {target}")


def register(app: typer.Typer) -> None:
    app.command("export-metrics")(export_metrics)

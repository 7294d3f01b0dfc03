"""`locojax calibration ...` and `locojax export-metrics` against a real uvicorn server on loopback."""

from __future__ import annotations

import csv
import json

import pytest
import typer
from typer.testing import CliRunner

from locojax import calibration_client, export_metrics
from locojax.client import ApiClient
from locojax.contract import ENVIRONMENT_FILE, EXIT_FAILED, EXIT_SPEC_ERROR
from tests.placement_runs import SMALL_RUNS, write_run_dir
from tests.server.test_cli_and_client import live_server  # noqa: F401  (the module's server fixture)


def _app() -> typer.Typer:
    app = typer.Typer()
    calibration_client.register(app)
    export_metrics.register(app)
    return app


def test_import_list_exclude_and_activate(live_server, tmp_path):  # noqa: F811
    url, secrets = live_server
    runner = CliRunner()
    admin = {"LOCOJAX_URL": url, "LOCOJAX_TOKEN": secrets["admin"]}
    submit = {"LOCOJAX_URL": url, "LOCOJAX_TOKEN": secrets["submit"]}
    dirs = [str(write_run_dir(tmp_path / spec["name"], spec)) for spec in SMALL_RUNS[:3]]

    refused = runner.invoke(_app(), ["calibration", "import", dirs[0]], env=submit)
    assert refused.exit_code == EXIT_FAILED and "403" in refused.output
    imported = runner.invoke(_app(), ["calibration", "import", *dirs], env=admin)
    assert imported.exit_code == 0, imported.output
    assert imported.stdout.count("imported as observation") == 3 and "tpu-v5e calibration now v3" in imported.stdout
    again = runner.invoke(_app(), ["calibration", "import", dirs[1]], env=admin)
    assert "already imported" in again.stdout

    broken = write_run_dir(tmp_path / "broken", SMALL_RUNS[3])
    (broken / ENVIRONMENT_FILE).unlink()
    failed = runner.invoke(_app(), ["calibration", "import", str(broken), dirs[0]], env=admin)
    assert failed.exit_code == EXIT_SPEC_ERROR and f"{broken / ENVIRONMENT_FILE}: not found" in failed.output
    assert "already imported" not in failed.output  # nothing was sent

    listed = runner.invoke(_app(), ["calibration", "ls", "--hardware", "tpu-v5e", "--json"], env=submit)
    rows = json.loads(listed.stdout)
    assert [row["label"] for row in rows] == [SMALL_RUNS[i]["name"] for i in (2, 1, 0)]
    excluded = runner.invoke(_app(), ["calibration", "exclude", str(rows[0]["id"])], env=admin)
    assert excluded.exit_code == 0 and "excluded from the tpu-v5e fits" in excluded.stdout
    versions = runner.invoke(_app(), ["calibration", "versions", "--hardware", "tpu-v5e", "--json"], env=submit)
    oldest = json.loads(versions.stdout)[-1]
    activated = runner.invoke(_app(), ["calibration", "activate", str(oldest["id"])], env=admin)
    assert activated.exit_code == 0 and "tpu-v5e calibration v1 is active" in activated.stdout
    shown = runner.invoke(_app(), ["calibration", "versions"], env=submit).stdout
    assert any(line.startswith("*") and " v1 " in line for line in shown.splitlines())


def test_export_metrics_writes_every_key_host_and_step(live_server, tmp_path):  # noqa: F811
    url, secrets = live_server
    steps = 2300  # more than one history window (export_metrics.WINDOW_STEPS)
    with ApiClient(url, secrets["admin"]) as operator:
        run = operator.submit({"name": "export", "steps": steps})
        operator.report_transition(run["id"], "STARTING")
        operator.report_transition(run["id"], "RUNNING")
        for start in range(0, steps, 200):
            rows = [{"step": step, "host": host, "values": {"time/step": 0.5 + step / 1000 + host,
                                                            "reward/mean": step / steps}}
                    for step in range(start, min(start + 200, steps)) if step % 7 for host in (-1, 0, 1)]
            operator.post_metrics(run["id"], rows, attempt=0)
    env = {"LOCOJAX_URL": url, "LOCOJAX_TOKEN": secrets["submit"]}
    runner = CliRunner()
    expected = {("all" if host < 0 else str(host), step) for step in range(steps) if step % 7 for host in (-1, 0, 1)}

    out = tmp_path / "m.csv"
    done = runner.invoke(_app(), ["export-metrics", str(run["id"]), "--format", "csv", "--out", str(out)], env=env)
    assert done.exit_code == 0, done.output
    with out.open() as handle:
        records = list(csv.DictReader(handle))
    assert {(r["host"], int(r["step"])) for r in records} == expected and len(records) == len(expected)
    one = next(r for r in records if r["host"] == "1" and r["step"] == "2299")
    assert float(one["time/step"]) == pytest.approx(0.5 + 2.299 + 1) and float(one["reward/mean"]) == 2299 / steps

    pq = pytest.importorskip("pyarrow.parquet")
    parquet = tmp_path / "m.parquet"
    runner.invoke(_app(), ["export-metrics", str(run["id"]), "--format", "parquet", "--out", str(parquet)], env=env)
    table = pq.read_table(parquet).to_pylist()
    assert len(table) == len(records) and set(table[0]) == {"step", "host", "reward/mean", "time/step"}

    accumulator_module = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    board = tmp_path / "tb"
    runner.invoke(_app(), ["export-metrics", str(run["id"]), "--format", "tensorboard", "--out", str(board)], env=env)
    assert sorted(p.name for p in board.iterdir()) == ["all", "host0", "host1"]
    accumulator = accumulator_module.EventAccumulator(str(board / "all"),
                                                      size_guidance={accumulator_module.SCALARS: 0})
    accumulator.Reload()
    read = {event.step: event.value for event in accumulator.Scalars("time/step")}
    assert len(read) == len(expected) // 3 and read[2299] == pytest.approx(0.5 + 2.299 - 1)  # host -1
    bad = runner.invoke(_app(), ["export-metrics", str(run["id"]), "--format", "xml"], env=env)
    assert bad.exit_code == EXIT_SPEC_ERROR and "tensorboard, csv, parquet" in bad.output

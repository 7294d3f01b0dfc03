"""The host's own checks before anything is written: the start message is not trusted to name a safe run
directory (issue 17), nor a process of its run's layout (issue 39)."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.supervisor import HostSupervisor, WorkerContext


def _check(tmp_path: Path, output_dir: Path, run_id: int = 7, name: str = "mine") -> str | None:
    context = WorkerContext(host_name="h0", api=None, runs_root=tmp_path / "runs")  # type: ignore[arg-type]
    supervisor = HostSupervisor(context, run_id=run_id, attempt=0, process_index=0, num_processes=1, role="co",
                                resume=False, output_dir=str(output_dir))
    return supervisor.check_run_directory({"name": name})


def test_only_the_runs_own_directory_under_runs_root_is_written(tmp_path: Path):
    runs = tmp_path / "runs"
    (runs / "3-other" / ".control").mkdir(parents=True)
    (runs / "3-other" / ".control" / "run-id").write_text("3")
    assert _check(tmp_path, runs / "7-mine") is None  # new directory
    assert "is not" in _check(tmp_path, tmp_path / "elsewhere" / "7-mine")
    assert "is not" in _check(tmp_path, runs)  # the root itself
    assert "is not" in _check(tmp_path, runs / "3-other" / "7-mine")  # inside another run's directory
    assert "is not" in _check(tmp_path, runs / "7-mine" / ".." / "3-other")
    (runs / "7-mine").symlink_to(runs / "3-other")  # a link to another run's directory
    assert "is not" in _check(tmp_path, runs / "7-mine")
    (runs / "7-mine").unlink()
    (runs / "7-mine" / ".control").mkdir(parents=True)
    (runs / "7-mine" / ".control" / "run-id").write_text("3")  # left by another run (same id reused)
    assert "belongs to run 3" in _check(tmp_path, runs / "7-mine")
    (runs / "7-mine" / ".control" / "run-id").write_text("7")  # its own, from an earlier attempt
    assert _check(tmp_path, runs / "7-mine") is None


def test_the_run_marker_is_never_seen_half_written(tmp_path: Path):
    """Every host process of a run writes `.control/run-id` at start while the others check it (they
    share one file system here); a reader that caught the file truncated refused its own run's
    directory and cost the run a restart."""
    import threading

    from locojax.contract import read_run_marker, write_run_marker

    out = tmp_path / "runs" / "7-mine"
    write_run_marker(out, 7)
    seen: set[str | None] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            seen.add(read_run_marker(out))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(2000):
            write_run_marker(out, 7)
    finally:
        done.set()
        reader.join()
    assert seen == {"7"}
    assert sorted(p.name for p in (out / ".control").iterdir()) == ["run-id"]  # no temporary left behind


class _StoredRun:
    """The API as a host sees it, for one STARTING run whose stored spec the test chooses."""

    def __init__(self, spec: dict):
        self.spec, self.reports = spec, []

    def get_run(self, run_id: int) -> dict:
        return {"id": run_id, "name": "mine", "status": "STARTING", "attempt": 0, "spec": self.spec}

    def list_run_hosts(self, run_id: int, attempt: int) -> list[dict]:
        return [{"process_index": 0, "host_name": "h0", "pid": None, "address": None}]

    def report_host_process(self, run_id: int, index: int, **body) -> dict:
        self.reports.append(body)
        return body


def test_a_stored_spec_naming_a_checkpoint_directory_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                         monkeypatch):
    """The API refuses `checkpoint.dir` (PATH_NOT_ALLOWED); a spec forged in the database that sets it
    would have the engine write checkpoints wherever it names, so the host refuses it too."""
    import subprocess

    class EngineStarted(Exception):
        pass

    def no_engine(*args, **kwargs):
        raise EngineStarted

    monkeypatch.setattr(subprocess, "Popen", no_engine)
    elsewhere = tmp_path / "elsewhere"
    out = tmp_path / "runs" / "7-mine"
    for directory in (str(elsewhere), str(out / "checkpoints")):  # even its own run directory: the API's rule
        api = _StoredRun({"name": "mine", "steps": 2, "checkpoint": {"dir": directory, "every": 1}})
        context = WorkerContext(host_name="h0", api=api, runs_root=tmp_path / "runs")  # type: ignore[arg-type]
        supervisor = HostSupervisor(context, run_id=7, attempt=0, process_index=0, num_processes=1, role="co",
                                    resume=False, output_dir=str(out))
        assert supervisor.run() == "refused"
        [report] = api.reports
        assert report["status"] == "FAILED" and "spec.checkpoint.dir" in report["reason"]
        assert not elsewhere.exists() and not out.exists()  # no marker, start spec or secret written
    # The same stored spec without it gets past the check (to the engine, stubbed out here).
    api = _StoredRun({"name": "mine", "steps": 2})
    context = WorkerContext(host_name="h0", api=api, runs_root=tmp_path / "runs")  # type: ignore[arg-type]
    supervisor = HostSupervisor(context, run_id=7, attempt=0, process_index=0, num_processes=1, role="co",
                                resume=False, output_dir=str(out))
    with pytest.raises(EngineStarted):
        supervisor.run()


def test_a_message_for_a_process_outside_the_runs_layout_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                              monkeypatch):
    """The role picks the command line the run's mode gives the process (a CO host, an SC worker, a Ray
    node, a controller): a message whose role or process count is not the stored run's layout is refused."""
    import subprocess

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine process was started")

    monkeypatch.setattr(subprocess, "Popen", no_engine)
    out = tmp_path / "runs" / "7-mine"
    for num_processes, role in ((1, "worker"), (1, "controller"), (2, "co")):  # the run: CO on one host
        api = _StoredRun({"name": "mine", "steps": 2})
        context = WorkerContext(host_name="h0", api=api, runs_root=tmp_path / "runs")  # type: ignore[arg-type]
        supervisor = HostSupervisor(context, run_id=7, attempt=0, process_index=0, num_processes=num_processes,
                                    role=role, resume=False, output_dir=str(out))
        assert supervisor.run() == "refused"
        [report] = api.reports
        assert report["status"] == "FAILED" and "(its processes' roles: co)" in report["reason"], report
        assert not out.exists()

"""bench/tpu.sh's `tests` stage: the engine's numerics tests on the local device in ONE pytest process,
counted into a part (`tpu_tests` of scale_tpu.json, bench/tpu_merge.py).

    python3 bench/tpu_tests.py --out OUTDIR/part_tests.json [--stage tests]

What runs: `TEST_FILES` of tests/locojax (the model against its float32 reference, HF parity and
export, rollout log-probs against teacher forcing, the GRPO losses and gradients, sampling, the
checkpoint round trip and the HF export's row-major bytes), not slow, not multiprocess. On an
accelerator tests/locojax/conftest.py runs them at the highest matmul precision and skips those that
need several CPU devices. pytest's own addopts are replaced (`-o addopts=`): nothing here needs
pytest-timeout, whose absence would stop the run. The counts come from this module loaded as a pytest
plugin (`-p bench.tpu_tests`): passed, failed, skipped, xfailed, errors and the failed tests' ids, with the
device the session ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEST_FILES = tuple(f"tests/locojax/test_{name}.py"
                   for name in ("model", "hf", "rollout", "train", "algo", "sampling", "checkpoint"))
COUNTS_VARIABLE = "LOCOJAX_TPU_TESTS_COUNTS"

_counts = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0, "errors": 0, "failed_names": [], "skip_reasons": {},
           "xfail_reasons": {}}


def pytest_runtest_logreport(report) -> None:
    """Counts each test once: its call's outcome, or its setup's when that failed or skipped it."""
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.passed:
            _counts["passed"] += 1
        elif report.skipped and hasattr(report, "wasxfail"):  # an expected failure (strict: failing as marked)
            _counts["xfailed"] += 1
            _counts["xfail_reasons"][report.nodeid] = str(report.wasxfail)[:300]
        elif report.skipped:
            _counts["skipped"] += 1
            reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
            _counts["skip_reasons"][report.nodeid] = reason[:300]
        elif report.when == "call":
            _counts["failed"] += 1
            _counts["failed_names"].append(report.nodeid)
        else:
            _counts["errors"] += 1
            _counts["failed_names"].append(report.nodeid)
    elif report.when == "teardown" and report.failed:
        _counts["errors"] += 1
        _counts["failed_names"].append(report.nodeid + " (teardown)")


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get(COUNTS_VARIABLE)
    if not path:
        return
    device = None
    if "jax" in sys.modules:  # the tests opened the backend already; no new device is opened here
        import jax

        first = jax.devices()[0]
        device = {"platform": first.platform, "device_kind": first.device_kind, "devices": len(jax.devices())}
    Path(path).write_text(json.dumps({**_counts, "exit_status": int(exitstatus), "device": device}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stage", default="tests")
    parser.add_argument("--timeout", type=float, default=330.0, help="wall-clock limit of the pytest process (s)")
    args = parser.parse_args()
    from bench.tpu_merge import part_header

    counts_file = args.out.with_suffix(".counts.json")
    counts_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", *TEST_FILES, "-m", "not slow and not multiprocess", "-q",
               "-o", "addopts=", "-p", "no:cacheprovider", "-p", "bench.tpu_tests", "-rfEs"]
    env = {**os.environ, COUNTS_VARIABLE: str(counts_file),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, timeout=args.timeout)
        status = done.returncode
    except subprocess.TimeoutExpired:
        status = None
    wall = time.monotonic() - started
    counts = json.loads(counts_file.read_text()) if counts_file.is_file() else None
    counts_file.unlink(missing_ok=True)
    device = (counts or {}).pop("device", None) or {}
    part = {"benchmark": "tpu_tests",
            **part_header(args.stage, platform=device.get("platform", "unknown"), device_kind=device.get("device_kind")),
            "tpu_tests": counts or {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0, "errors": 1,
                                    "failed_names": [],
                                    "note": "pytest ended without counts "
                                            + ("(timed out)" if status is None else f"(exit status {status})")},
            "devices": device.get("devices"), "pytest_exit_status": status, "wall_s": wall,
            "command": " ".join(command[1:]), "files": list(TEST_FILES)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(part, indent=2) + "\n", encoding="utf-8")
    tests = part["tpu_tests"]
    print(f"tpu_tests on {part['platform']} ({part['device_kind']}): {tests['passed']} passed, {tests['failed']} "
          f"failed, {tests['skipped']} skipped, {tests['xfailed']} xfailed, {tests['errors']} errors in "
          f"{wall:.0f} s; wrote {args.out}")
    sys.exit(0 if status == 0 else 1)


if __name__ == "__main__":
    main()

"""Reliability and security of the control plane, with figures (issue 10).

Brings up a private PostgreSQL and a private Redis (never the shared servers), the API and three Celery
host workers on them, then runs every scenario of tests/e2e (the same code the tests assert on):

  bad input   malformed run specs and metric batches (4xx naming the problem, nothing written), a stateful
              schemathesis run over the whole API (no 5xx)
  security    auth matrix of every route, worker-token limits, secrets kept out of logs and responses,
              CSRF on every dashboard form, SQL injection and path traversal in every string parameter
  faults      kill -9 of an engine process, of a worker, Redis restart, PostgreSQL stopped for 10 s,
              kill -9 of the API: each run SUCCEEDED, every step's metrics stored, none lost, none stale
  load        `--clients` concurrent clients for `--duration` s while a run trains
  attacks     issue 18: rewards outside the operator's allowlist (and a spec forged in the database),
              spec-named endpoints, an engine process looking for credentials, cookie forgery and replay
              after logout, framing, a foreign Host, login brute force, oversized inputs; per attack
              what was sent, what came back, blocked or not
  isolation   issue 17: another tenant's cancel/resume/delete and idempotency key, worker tokens of other
              hosts, a second worker instance on a live host, forged process rows, hand-made transitions,
              stale attempts' reports, spec-chosen run directories and data paths out of the roots, a
              512-host run ahead of a 1-host one; per probe what was sent, what came back, blocked or not

Writes bench/results/reliability.json (per scenario: passed, recover_s, metrics_lost, values_reposted, checks,
details; for load: requests, errors, p50/p99 latency). The last line printed is
`faults_survived=<n>/<total> bad_inputs_rejected=<n>/<total> load_errors=<n> attacks_blocked=<n>/<tried>
isolation_blocked=<n>/<tried>`.

    .venv/bin/python bench/reliability.py [--duration 60] [--clients 50] [--only load,kill_api]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.infra import Stack  # noqa: E402
from tests.e2e.outcome import failed  # noqa: E402
from tests.e2e.scenarios import SCENARIOS, run  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "reliability.json"


def summary(results: dict[str, dict]) -> dict[str, object]:
    def group(name: str) -> dict[str, dict]:
        return {key: value for key, value in results.items() if SCENARIOS[key][0] == name}

    faults = group("fault")
    bad = {key: value for key, value in group("bad_input").items() if "cases" in value["details"]}
    load = results.get("load")
    attack = results.get("attacks", {}).get("details", {})
    isolated = results.get("isolation", {}).get("details", {})
    return {
        "faults_survived": sum(value["passed"] for value in faults.values()), "faults_total": len(faults),
        "bad_inputs_rejected": sum(value["details"].get("rejected", 0) for value in bad.values()),
        "bad_inputs_total": sum(value["details"]["cases"] for value in bad.values()),
        "load_errors": load["details"].get("errors") if load and "errors" in load["details"] else None,
        "attacks_tried": attack.get("attacks_tried"), "attacks_blocked": attack.get("attacks_blocked"),
        "isolation_tried": isolated.get("isolation_tried"), "isolation_blocked": isolated.get("isolation_blocked"),
        "scenarios_passed": sum(value["passed"] for value in results.values()), "scenarios_total": len(results),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=50, help="concurrent load clients")
    parser.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    names = [name for name in args.only.split(",") if name] or list(SCENARIOS)
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")

    started = time.monotonic()
    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    stack = Stack.start(Path(tempfile.mkdtemp(prefix="locojax-reliability-")))
    try:
        for name in names:
            kwargs = {"clients": args.clients, "duration_s": args.duration} if name == "load" else {}
            began = time.monotonic()
            try:
                result = run(stack, name, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a broken scenario is reported, and the rest still run
                traceback.print_exc()
                result = failed(exc)
            result["wall_s"] = round(time.monotonic() - began, 1)
            results[name] = result
            extra = ""
            if name == "load" and "requests" in result["details"]:
                d = result["details"]
                extra = (f" requests={d['requests']} errors={d['errors']} p50={d['p50_ms']}ms p99={d['p99_ms']}ms"
                         f" rps={d['requests_per_s']}")
            print(f"{SCENARIOS[name][0]:>9} {name:<20} {'PASS' if result['passed'] else 'FAIL'}"
                  f"  recover_s={result['recover_s']} lost={result['metrics_lost']} reposted={result['values_reposted']}"
                  f"  ({result['wall_s']} s){extra}", flush=True)
            if not result["passed"]:
                print("          " + json.dumps({k: v for k, v in result["checks"].items() if not v}), flush=True)
    finally:
        stack.close()

    totals = summary(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "reliability",
        "environment": {"python": platform.python_version(), "machine": platform.machine(),
                        "cpus": os.cpu_count(), "load_clients": args.clients, "load_duration_s": args.duration,
                        # The machine is shared: latencies depend on what else ran (1-minute load averages).
                        "loadavg_1m_before": round(load_before[0], 2), "loadavg_1m_after": round(os.getloadavg()[0], 2),
                        "settings": {"host_lost_s": stack.settings.host_lost_s,
                                     "scheduler_interval_s": stack.settings.scheduler_interval_s,
                                     "dispatch_resend_s": stack.settings.dispatch_resend_s,
                                     "max_body_bytes": stack.settings.max_body_bytes,
                                     "metrics_batch_max_values": stack.settings.metrics_batch_max_values}},
        "wall_s": round(time.monotonic() - started, 1),
        "summary": totals,
        "scenarios": results,
    }, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    print(f"faults_survived={totals['faults_survived']}/{totals['faults_total']} "
          f"bad_inputs_rejected={totals['bad_inputs_rejected']}/{totals['bad_inputs_total']} "
          f"load_errors={totals['load_errors']} attacks_blocked={totals['attacks_blocked']}/{totals['attacks_tried']} "
          f"isolation_blocked={totals['isolation_blocked']}/{totals['isolation_tried']}")
    return 0 if all(result["passed"] for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

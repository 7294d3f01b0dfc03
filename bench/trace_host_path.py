"""The host's critical path in each marked step of a kept CO trace (`bench/grpo_step.py --keep-trace FILE`).

    python3 bench/trace_host_path.py FILE                # one JSON line: a record per marked step
    python3 bench/trace_host_path.py FILE --events 0.3   # and the host events (all threads) in each wait

Per step (between two of the run loop's boundary marks): its period; the chip's wait before the update
(`device_idle_before_update_ms`: from the end of the last program before the train step to the train
step's start on the device, the XLA Modules line); when the run loop had the tokens (`wait:rollout
tokens` ends) after the rollout's end; how long it decoded the texts, scored, computed the advantages;
and from the update's dispatch (`dispatch:train`) to its start on the chip. The figures of
bench/results/size_a_host_path_tpu.json's `profiled_steps`. `--events MS` also lists every host event
longer than MS milliseconds that overlaps the wait, with its thread: how the late wake-ups behind the
TensorBoard sink's imports were first seen (no other traced thread was busy), before a round with
Python's tracer named the thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_trace import BOUNDARY, host_events  # noqa: E402

MS = 1e6  # nanoseconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--events", type=float, default=None, metavar="MS")
    args = parser.parse_args()

    from jax.profiler import ProfileData

    profile = ProfileData.from_file(args.trace)
    marks = sorted(event.start_ns for event in host_events(profile, lambda name: name == BOUNDARY))
    modules, host, loop = [], [], []
    for plane in profile.planes:
        for line in plane.lines:
            if plane.name.startswith("/device:") and line.name == "XLA Modules":
                modules = sorted((e.start_ns, e.start_ns + e.duration_ns, e.name.split("(")[0]) for e in line.events)
            elif plane.name.startswith("/host:"):
                events = [(e.start_ns, e.start_ns + e.duration_ns, e.name, line.name) for e in line.events]
                host += events
                if any(event[2] == "wait:rollout tokens" for event in events):
                    loop = sorted(events)
    host.sort()
    if not modules or len(marks) < 2 or not loop:
        raise SystemExit(f"{args.trace}: needs a device plane's XLA Modules line (an accelerator's trace; XLA:CPU has "
                         f"none), 2 step marks (found {len(marks)}) and the CO loop's annotations")
    steps = []
    for start, end in zip(marks, marks[1:]):
        inside = [m for m in modules if m[1] > start and m[0] < end]
        train = next(m for m in inside if m[2] == "jit_train_step")
        rollout_end = max(m[1] for m in inside if m[0] < train[0] and m[2] != "jit_train_step")

        def first(name: str):
            return next(e for e in loop if e[2] == name and start <= e[0] < end)

        wait, texts, reward, advantage, dispatch = (first(name) for name in (
            "wait:rollout tokens", "host:texts", "phase:time/reward", "phase:time/advantage", "dispatch:train"))
        steps.append({
            "period_ms": round((end - start) / MS, 3),
            "rollout_end_to_tokens_in_python_ms": round((wait[1] - rollout_end) / MS, 3),
            "texts_ms": round((texts[1] - texts[0]) / MS, 3),
            "reward_ms": round((reward[1] - reward[0]) / MS, 3),
            "advantage_ms": round((advantage[1] - advantage[0]) / MS, 3),
            "train_dispatch_to_device_start_ms": round((train[0] - dispatch[0]) / MS, 3),
            "device_idle_before_update_ms": round((train[0] - rollout_end) / MS, 3)})
        if args.events is not None:
            print(f"--- step: period {(end - start) / MS:.2f} ms, the chip waits {(train[0] - rollout_end) / MS:.2f} "
                  f"ms from {(rollout_end - start) / MS:.2f} ms", file=sys.stderr)
            for event in host:
                if event[1] > rollout_end and event[0] < train[0] and event[1] - event[0] > args.events * MS:
                    print(f"   {(event[0] - start) / MS:7.2f}..{(event[1] - start) / MS:7.2f} {event[2][:70]:70s} "
                          f"[{event[3][:28]}]", file=sys.stderr)
    print(json.dumps(steps))


if __name__ == "__main__":
    main()

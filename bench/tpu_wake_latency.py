"""How late the host thread notices a long program's results, by how it waits for them.

In a CO step the run loop dispatches the rollout (~21 ms on the chip at bench size a), does ~6 ms of
its own work, then waits ~15 ms in `jax.device_get` for the sampled tokens. TPU traces at size a
(bench/results/size_a_host_path_tpu.json) showed that thread returning 1-5 ms after the tokens had
reached host memory, with no other traced thread busy, and its next few milliseconds of Python
(decoding the texts) running up to 10x slower than in a quiet process. Short waits (~4 ms,
bench/tpu_host_latency.py) did not show it. This probe times, on one chip, a stand-in rollout of
`--program-ms` (a while loop; int32 [rows, new] tokens, [rows] lengths, a bool mask, each copied to
the host asynchronously right after the dispatch, as `RolloutRunner.launch` does), `--host-ms` of
Python work after the dispatch, then each way of waiting:

* `block`: `jax.device_get` at once (the engine's way): the thread sleeps in the runtime's wait;
* `poll`: `is_ready()` on the outputs in a loop (the thread stays on its core, holding the GIL
  between checks), then `jax.device_get`;
* `poll_sleep`: the same with `time.sleep(--poll-sleep-us)` between checks (the GIL let go);

and after each wait, a fixed piece of Python (`--work-rows` rows of bytes decoded and parsed, as
the reward's host work is) timed on its own. Per variant: the median and 90th percentile of the
wall time from the dispatch to the results in hand and of the work's time, over `--repeats` per
round, rounds alternating variants. The program's own device time is that of `device_only`
(dispatch, then `block_until_ready` on a scalar that stays on the chip), which pays the same wait.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tpu_host_latency import stand_in_rollout  # noqa: E402
from tpu_merge import part_header  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--loop-steps", type=int, default=10000, help="while-loop iterations (sets the program's time)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--host-ms", type=float, default=6.0, help="Python work between the dispatch and the wait")
    parser.add_argument("--poll-sleep-us", type=float, default=50.0)
    parser.add_argument("--work-rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    rows, new = args.rows, args.new

    rollout = jax.jit(stand_in_rollout(rows, new, args.loop_steps, args.width, vocabulary=256))
    weights = jax.device_put(jnp.eye(args.width, dtype=jnp.float32) * 0.9, device)

    def host_work(ms: float) -> None:  # Python holding the GIL, as the loop's own work between dispatches does
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass

    def fixed_work(tokens: np.ndarray, lengths: np.ndarray) -> float:
        """The reward's kind of host work on the results: bytes to text, then a parse per row."""
        started = time.perf_counter()
        texts = [bytes((row[:length] % 200 + 32).astype(np.uint8)).decode("latin-1")
                 for row, length in zip(tokens[:args.work_rows], lengths[:args.work_rows])]
        total = sum(len(text.split()) + text.count("7") for text in texts)
        assert total >= 0
        return time.perf_counter() - started

    def dispatch(seed: float):
        outputs = rollout(weights, jnp.float32(seed))
        for array in outputs:
            array.copy_to_host_async()
        return outputs

    def wait_block(outputs):
        return jax.device_get(outputs)

    def wait_poll(outputs):
        while not all(array.is_ready() for array in outputs):
            pass
        return jax.device_get(outputs)

    def wait_poll_sleep(outputs):
        pause = args.poll_sleep_us / 1e6
        while not all(array.is_ready() for array in outputs):
            time.sleep(pause)
        return jax.device_get(outputs)

    def device_only(seed: float):
        tokens, _, _ = rollout(weights, jnp.float32(seed))
        host_work(args.host_ms)
        jnp.sum(tokens).block_until_ready()

    waits = {"block": wait_block, "poll": wait_poll, "poll_sleep": wait_poll_sleep}

    def run(name: str, seed: float) -> tuple[float, float]:
        started = time.perf_counter()
        outputs = dispatch(seed)
        host_work(args.host_ms)
        tokens, lengths, _ = waits[name](outputs)
        in_hand = time.perf_counter() - started
        return in_hand, fixed_work(tokens, lengths)

    reference = jax.device_get(rollout(weights, jnp.float32(0.5)))
    for name in waits:  # the same results whichever way the thread waits
        outputs = dispatch(0.5)
        got = waits[name](outputs)
        for want, have in zip(reference, got):
            np.testing.assert_array_equal(want, have, err_msg=name)

    in_hand: dict[str, list[float]] = {name: [] for name in waits}
    work: dict[str, list[float]] = {name: [] for name in waits}
    device_samples: list[float] = []
    per_round: dict[str, list[float]] = {name: [] for name in [*waits, "device_only"]}
    for _ in range(args.rounds):
        device_only(0.5)
        samples = []
        for repeat in range(args.repeats):
            started = time.perf_counter()
            device_only(0.5 + repeat * 1e-3)
            samples.append(time.perf_counter() - started)
        device_samples += samples
        per_round["device_only"].append(statistics.median(samples))
        for name in waits:
            run(name, 0.5)
            round_in_hand = []
            for repeat in range(args.repeats):
                seconds, work_s = run(name, 0.5 + repeat * 1e-3)
                round_in_hand.append(seconds)
                work[name].append(work_s)
            in_hand[name] += round_in_hand
            per_round[name].append(statistics.median(round_in_hand))

    ms = 1e3
    result = {
        "benchmark": "tpu_wake_latency",
        **part_header(None, platform=jax.default_backend(), device_kind=device.device_kind),
        "settings": {k: getattr(args, k) for k in ("rows", "new", "loop_steps", "width", "host_ms", "poll_sleep_us",
                                                   "work_rows", "repeats", "rounds")},
        "device_only_ms": {"median": statistics.median(device_samples) * ms, "p90": percentile(device_samples, 90) * ms},
        "results_in_hand_ms": {name: {"median": statistics.median(v) * ms, "p90": percentile(v, 90) * ms,
                                      "max": max(v) * ms} for name, v in in_hand.items()},
        "work_after_wait_ms": {name: {"median": statistics.median(v) * ms, "p90": percentile(v, 90) * ms,
                                      "max": max(v) * ms} for name, v in work.items()},
        "median_ms_per_round": {name: [x * ms for x in v] for name, v in per_round.items()},
        "load_average": os.getloadavg(),
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
    }
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps({k: result[k] for k in ("device_only_ms", "results_in_hand_ms", "work_after_wait_ms")},
                     indent=1))


if __name__ == "__main__":
    main()

"""How long the host waits for a program's small results after the program ends, by how they come back.

The CO step's critical path on a TPU host starts when the rollout program ends: the host needs the
sampled tokens (to decode and score them) before it can dispatch the update. A trace at size a
showed ~1.5-2.5 ms from the rollout's end to the tokens in Python. This probe times, on one chip, a stand-in for the rollout (a while loop of
`--loop-ms` of work whose outputs are int32 [rows, new] tokens, [rows] lengths and a bool mask) and
the host's wait for those results, for each way of bringing them back:

* `three_async`: three device outputs, `copy_to_host_async()` on each right after the dispatch (the
  engine's way: `RolloutRunner.launch`);
* `packed_async`: one int32 [rows, new + 1] output (tokens and lengths side by side), the mask rebuilt
  on the host from the lengths;
* `packed_pinned`: the same single output placed by the program itself in pinned host memory
  (`memory_kind="pinned_host"`), so no transfer is dispatched after the program ends;
* `*_followed`: the same with a ~0.6 ms program queued behind the rollout before the host asks (the
  engine's reference pass), to see whether work queued behind delays the results.

Each variant's figure is the median over `--repeats` of (host sees the results) - (program ends),
where the program's end is the dispatch time plus its device time, measured in the same process by
the variant with the results left on the device (`block_until_ready` on a scalar reduction of them
costs the same completion signal, so the wait is measured against `device_only` instead: the wall
time of dispatch + block_until_ready on an output that stays on the chip). Rounds alternate variants.

Writes JSON (`--out`) with per-variant medians and spreads, the platform and the device kind.
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

from tpu_merge import part_header  # noqa: E402


def stand_in_rollout(rows: int, new: int, loop_steps: int, width: int, vocabulary: int = 1000):
    """A rollout's stand-in, (weights [width, width], seed) -> int32 [rows, new] tokens, [rows] lengths,
    bool [rows, new] mask: a while loop of `loop_steps` matmuls (their count sets its device time)."""
    import jax
    import jax.numpy as jnp

    def rollout_body(weights, seed):
        def step(carry):
            index, hidden, tokens = carry
            hidden = jnp.tanh(hidden @ weights)
            token = (jnp.argmax(hidden[:rows], axis=-1) % vocabulary).astype(jnp.int32)
            tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, index % new))
            return index + 1, hidden, tokens

        hidden = jnp.full((max(rows, 8), width), seed, jnp.float32)
        _, hidden, tokens = jax.lax.while_loop(lambda c: c[0] < loop_steps, step,
                                               (jnp.int32(0), hidden, jnp.zeros((rows, new), jnp.int32)))
        lengths = (jnp.abs(hidden[:rows, 0] * 1000).astype(jnp.int32) % new) + 1
        mask = jnp.arange(new)[None, :] < lengths[:, None]
        return tokens, lengths, mask

    return rollout_body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--loop-steps", type=int, default=64, help="while-loop iterations of the stand-in rollout")
    parser.add_argument("--width", type=int, default=1024, help="matmul width per iteration (sets the loop's time)")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    device = jax.devices()[0]
    memories = [memory.kind for memory in device.addressable_memories()]
    on_device = SingleDeviceSharding(device)
    pinned = SingleDeviceSharding(device, memory_kind="pinned_host") if "pinned_host" in memories else None
    rows, new = args.rows, args.new

    rollout_body = stand_in_rollout(rows, new, args.loop_steps, args.width)

    three = jax.jit(rollout_body)
    def packed_fn(w, s):
        tokens, lengths, _ = rollout_body(w, s)
        return jnp.concatenate([tokens, lengths[:, None]], axis=1)

    packed = jax.jit(packed_fn, out_shardings=on_device)
    packed_to_host = jax.jit(packed_fn, out_shardings=pinned) if pinned is not None else None
    follower = jax.jit(lambda w: jnp.tanh(w @ w) @ w)  # ~0.6 ms at width 2048 on a v5e
    follow_weights = jax.device_put(jnp.ones((2048, 2048), jnp.bfloat16) * 0.01, on_device)

    weights = jax.device_put(jnp.eye(args.width, dtype=jnp.float32) * 0.9, on_device)

    def run_three(seed, followed):
        tokens, lengths, mask = three(weights, jnp.float32(seed))
        for array in (tokens, lengths, mask):
            array.copy_to_host_async()
        if followed:
            follower(follow_weights)
        return jax.device_get((tokens, lengths, mask))

    def run_packed(seed, followed, fn):
        out = fn(weights, jnp.float32(seed))
        if fn is packed:
            out.copy_to_host_async()
        if followed:
            follower(follow_weights)
        host = np.asarray(out)
        tokens, lengths = host[:, :-1], host[:, -1]
        return tokens, lengths, np.arange(new)[None, :] < lengths[:, None]

    def run_device_only(seed, followed):
        tokens, lengths, mask = three(weights, jnp.float32(seed))
        if followed:
            follower(follow_weights)
        return tokens.block_until_ready()

    variants = {
        "device_only": lambda s: run_device_only(s, False),
        "three_async": lambda s: run_three(s, False),
        "packed_async": lambda s: run_packed(s, False, packed),
        "device_only_followed": lambda s: run_device_only(s, True),
        "three_async_followed": lambda s: run_three(s, True),
        "packed_async_followed": lambda s: run_packed(s, True, packed),
    }
    if packed_to_host is not None:
        variants["packed_pinned"] = lambda s: run_packed(s, False, packed_to_host)
        variants["packed_pinned_followed"] = lambda s: run_packed(s, True, packed_to_host)

    # The same results whichever way they come back.
    reference = run_three(1.0, False)
    for name, fn in variants.items():
        if name.startswith("device_only"):
            continue
        got = fn(1.0)
        for want, have in zip(reference, got):
            np.testing.assert_array_equal(np.asarray(want), np.asarray(have), err_msg=name)

    times: dict[str, list[float]] = {name: [] for name in variants}
    per_round: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        for name, fn in variants.items():
            fn(0.5)  # warm
            samples = []
            for repeat in range(args.repeats):
                started = time.perf_counter()
                fn(0.5 + repeat * 1e-3)
                samples.append(time.perf_counter() - started)
            times[name] += samples
            per_round[name].append(statistics.median(samples))

    medians = {name: statistics.median(samples) for name, samples in times.items()}
    extra_ms = {name: (medians[name] - medians["device_only_followed" if name.endswith("followed") else "device_only"]) * 1e3
                for name in variants if not name.startswith("device_only")}
    result = {
        "benchmark": "tpu_host_latency",
        **part_header(None, platform=jax.default_backend(), device_kind=device.device_kind),
        "memories": memories,
        "shape": {"rows": rows, "new": new, "loop_steps": args.loop_steps, "width": args.width},
        "repeats": args.repeats,
        "rounds": args.rounds,
        "median_wall_ms": {name: value * 1e3 for name, value in medians.items()},
        "median_wall_ms_per_round": {name: [v * 1e3 for v in values] for name, values in per_round.items()},
        "extra_ms_over_device_only": extra_ms,
        "load_average": os.getloadavg(),
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
    }
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps({k: result[k] for k in ("median_wall_ms", "extra_ms_over_device_only")}, indent=1))


if __name__ == "__main__":
    main()

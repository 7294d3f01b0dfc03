"""Where a GRPO train step's time goes on XLA:CPU, on the exact workload of bench/grpo_step.py.

    .venv/bin/python bench/profile_train_step.py                     # all parts, 5 reps each
    .venv/bin/python bench/profile_train_step.py --parts ref,train --reps 7 --json out.json
    XLA_FLAGS=--xla_dump_to=/tmp/dump .venv/bin/python bench/profile_train_step.py --parts train --reps 1

Workload (issue 4): the `small` preset in float32 on one CPU device; 8 arith prompts x 8 samples
left-padded to 64 prompt slots, 64 new tokens with no early stop (so the batch is [64, 128]);
GRPO with the k3 KL term (kl_coef 0.04), seq_mean_token_mean, num_iterations 1, AdamW + clip 1.0.
The batch is real: one rollout of the current policy produces tokens and old log-probs; the
reference log-probs come from the reference pass.

Parts (each jitted alone via `jax.jit(f).lower(...).compile()`, then called `--reps` times with
`block_until_ready`; CPU seconds are this process's user+system time over the call, all threads):
  rollout   the real `RolloutRunner.sample` (prefill + 64 decode steps)
  ref       the reference log-prob pass (`make_logprobs_fn`, as modes/co.py calls it)
  fwd       the model forward alone over all slots (logits [B, P+N, V]; training asks for N)
  loss      forward + log-probs + entropy + the GRPO objective (no gradient)
  grad      forward + backward of the GRPO objective (what the train step differentiates)
  opt       clip + AdamW update + apply (the optimizer alone, given gradients)
  train     the real jitted, donated `make_train_step` (grad + opt in one computation)
FLOPs are XLA's `cost_analysis()` of each compiled computation; GFLOP/s is FLOPs / CPU second
(so a process that gets one busy core of two still reads as the per-core rate it achieved; a quiet
f32 matmul of these shapes runs at ~110-230 GFLOP per CPU second on this machine's AVX-512 cores).
`temp MiB` is XLA's temporary buffer of the computation and `faults/call` the minor page faults of
one call: XLA:CPU mallocs the whole temporary buffer afresh on every call and glibc serves that
size with a new mmap, so every call faults (and the kernel zeroes) all of it again.

The machine is shared: compare CPU seconds, interleave A/B runs (e.g. alternate processes with
PYTHONPATH pointing at a baseline copy of `locojax/`), and read medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("rollout", "ref", "fwd", "loss", "grad", "opt", "train")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _costs(exe) -> tuple[float, float]:
    """(FLOPs, temporary buffer MiB) of a compiled computation, NaN where XLA does not say."""
    cost = exe.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    try:
        temp = exe.memory_analysis().temp_size_in_bytes / 2**20
    except Exception:  # noqa: BLE001 - not every backend reports it
        temp = float("nan")
    return float((cost or {}).get("flops", float("nan"))), temp


def _bench_spec():
    """make_spec of bench/grpo_step.py (imported by path: bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("_grpo_step_bench", ROOT / "bench" / "grpo_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_spec(steps=10)


def _print_op_table(trace_dir: str, calls: int, top: int = 40) -> None:
    """Sum the trace's XLA op events by name (needs the optional `xprof` package, e.g.
    `pip install --target /tmp/xp xprof` and PYTHONPATH=/tmp/xp); the ops are XLA:CPU thunks, so
    their times are wall times on the executing thread."""
    try:
        from xprof.convert import raw_to_tool_data
    except ImportError:
        print(f"trace written to {trace_dir} (install xprof to summarise it here)", file=sys.stderr)
        return
    import collections

    paths = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    data, _ = raw_to_tool_data.xspace_to_tool_data([str(paths[-1])], "trace_viewer", {})
    events = json.loads(data)["traceEvents"]
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            totals[e["name"]] += e["dur"] / 1e6
            counts[e["name"]] += 1
    skip = ("ThreadpoolListener", "ThunkExecutor", "$")
    ops = {k: v for k, v in totals.items() if not k.startswith(skip)}
    kinds: dict[str, float] = collections.defaultdict(float)
    for name, total in ops.items():
        kinds[name.split(".")[0]] += total
    print(f"\nXLA ops, summed over {calls} timed calls: {sum(ops.values()):.3f} s in {len(ops)} ops")
    print(f"{'op kind':60}{'total s':>10}")
    for name, total in sorted(kinds.items(), key=lambda kv: -kv[1])[:15]:
        print(f"{name[:60]:60}{total:10.3f}")
    print(f"\n{'op':60}{'total s':>10}{'count':>8}")
    for name, total in sorted(ops.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{name[:60]:60}{total:10.3f}{counts[name]:8d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per part (after one warm-up call)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the whole list of parts this many times, interleaved (A B C A B C ...)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--label", default="", help="a tag carried into the JSON (e.g. base/new)")
    parser.add_argument("--trace", help="also record a jax.profiler trace of the timed calls into this folder "
                                        "and, if the `xprof` package is importable, print the slowest HLO ops")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}")

    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import locojax
    import locojax.modes.common as common
    from locojax import train as T
    from locojax.algo.losses import LOSS_AGGREGATIONS, grpo_objective, token_mean_weights
    from locojax.model import forward, positions_from_mask
    from locojax.rollout import rollout_key

    print(f"locojax from {Path(locojax.__file__).parent}; jax {jax.__version__}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", file=sys.stderr, flush=True)

    spec = _bench_spec()
    policy = common.load_policy(spec)
    optimizer = T.make_optimizer(spec.optim, spec.steps, spec.algo.num_iterations)
    state = T.init_train_state(policy.params, optimizer, seed=spec.seed)
    reference_params = jax.tree.map(jnp.copy, state.params)
    temperature = common.train_temperature(spec)

    # The bench's one change to the CO loop: no early stop, every row decodes all new tokens.
    real_sampling_config = common.sampling_config
    common.sampling_config = lambda s, tok: dataclasses.replace(real_sampling_config(s, tok), eos_id=None)
    runner = common.RolloutRunner(spec, policy, spec.rollout.prompts_per_step, jax.local_devices())
    examples = common.prompts_for(common.make_task(spec.task), spec, 0, 0, 1)
    local_params = common.to_local(state.params, runner.replicated)
    prompt_tokens, prompt_mask, result = runner.sample(local_params, examples, rollout_key(spec.seed, 0), 0)
    jax.block_until_ready(result)

    ref_fn = T.make_logprobs_fn(policy.graphdef, temperature)
    rows = {
        "tokens": np.concatenate([prompt_tokens, np.asarray(result.tokens)], axis=1).astype(np.int32),
        "prompt_mask": prompt_mask,
        "completion_mask": np.asarray(result.mask),
        "old_logprobs": np.asarray(result.logprobs, np.float32),
        "advantages": np.random.default_rng(0).standard_normal(len(examples)).astype(np.float32),
    }
    rows["ref_logprobs"] = np.asarray(ref_fn(reference_params, rows["tokens"], rows["prompt_mask"],
                                             rows["completion_mask"]))
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    b, width = batch["tokens"].shape
    print(f"batch {b} x {width} (prompt slots {prompt_mask.shape[1]}, real prompt tokens "
          f"{int(prompt_mask.sum())}, completion tokens {int(rows['completion_mask'].sum())})",
          file=sys.stderr, flush=True)

    algo = spec.algo
    graphdef = policy.graphdef
    cmask = batch["completion_mask"].astype(bool)
    mb = {**batch, "completion_mask": cmask, "loss_weights": LOSS_AGGREGATIONS.get(algo.loss_agg)(cmask),
          "mean_weights": token_mean_weights(cmask)}

    def loss_fn(params, mb):  # as make_train_step's
        logp, entropy = T.completion_logprobs_and_entropy(
            graphdef, params, mb["tokens"], mb["prompt_mask"], mb["completion_mask"], temperature)
        return grpo_objective(
            logp, mb["old_logprobs"], mb["advantages"], mb["completion_mask"], mb["loss_weights"],
            mb["mean_weights"], clip_eps_low=algo.clip_eps, clip_eps_high=algo.clip_eps, kl_coef=algo.kl_coef,
            ref_logprobs=mb["ref_logprobs"], entropy=jax.lax.stop_gradient(entropy))

    def fwd(params, tokens, prompt_mask, completion_mask):
        kv_mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
        return forward(graphdef, params, tokens, positions_from_mask(kv_mask), kv_mask)[0]

    grads0 = jax.jit(jax.grad(lambda p, x: loss_fn(p, x)[0]))(state.params, mb)

    def opt(params, opt_state, grads):
        return T._apply(optimizer, params, opt_state, grads)

    train_step = T.make_train_step(graphdef, optimizer, algo, temperature=temperature)
    train_state = [jax.tree.map(jnp.copy, state)]  # the step donates its state; keep our own copy

    def compiled(fn, *xs):
        exe = jax.jit(fn).lower(*xs).compile()
        return exe, _costs(exe)

    cases = {}
    for name in parts:
        t0 = time.perf_counter()
        if name == "rollout":
            keys = iter(range(1, 10_000))
            call = lambda: runner.sample(local_params, examples, rollout_key(spec.seed, next(keys)), 0)[2]
            costs = (float("nan"), float("nan"))
        elif name == "ref":
            exe = ref_fn.lower(reference_params, batch["tokens"], batch["prompt_mask"],
                               batch["completion_mask"]).compile()
            costs = _costs(exe)
            call = lambda exe=exe: exe(reference_params, batch["tokens"], batch["prompt_mask"], batch["completion_mask"])
        elif name == "fwd":
            exe, costs = compiled(fwd, state.params, batch["tokens"], batch["prompt_mask"], batch["completion_mask"])
            call = lambda exe=exe: exe(state.params, batch["tokens"], batch["prompt_mask"], batch["completion_mask"])
        elif name == "loss":
            exe, costs = compiled(lambda p, x: loss_fn(p, x)[0], state.params, mb)
            call = lambda exe=exe: exe(state.params, mb)
        elif name == "grad":
            exe, costs = compiled(jax.grad(loss_fn, has_aux=True), state.params, mb)
            call = lambda exe=exe: exe(state.params, mb)
        elif name == "opt":
            exe, costs = compiled(opt, state.params, state.opt_state, grads0)
            call = lambda exe=exe: exe(state.params, state.opt_state, grads0)
        elif name == "train":
            exe = train_step.lower(train_state[0], batch).compile()
            costs = _costs(exe)

            def call(exe=exe):  # the step's jitted part takes the frozen weights (LoRA; else None) apart
                state, metrics = exe(train_state[0], train_state[0].frozen, batch)
                train_state[0] = state.replace(frozen=train_state[0].frozen)
                return train_state[0], metrics
        jax.block_until_ready(call())  # warm-up (and compile, for rollout)
        cases[name] = {"call": call, "flops": costs[0], "temp_mib": costs[1], "compile_s": time.perf_counter() - t0,
                       "cpu": [], "wall": [], "faults": []}

    if args.trace:
        jax.profiler.start_trace(args.trace)
    for _ in range(args.rounds):
        for name in parts:
            case = cases[name]
            for _ in range(args.reps):
                c0, w0, f0 = _cpu(), time.perf_counter(), _faults()
                jax.block_until_ready(case["call"]())
                case["cpu"].append(_cpu() - c0)
                case["wall"].append(time.perf_counter() - w0)
                case["faults"].append(_faults() - f0)
    if args.trace:
        jax.profiler.stop_trace()
        _print_op_table(args.trace, args.reps * args.rounds * len(parts))

    report = {"label": args.label, "load_avg": list(os.getloadavg()), "parts": {}}
    print(f"{'part':8}{'cpu s':>9}{'wall s':>9}{'GFLOP':>9}{'GFLOP/cpu-s':>13}{'temp MiB':>10}"
          f"{'faults/call':>13}{'compile s':>11}")
    for name in parts:
        case = cases[name]
        cpu, wall = statistics.median(case["cpu"]), statistics.median(case["wall"])
        gflop, faults = case["flops"] / 1e9, statistics.median(case["faults"])
        report["parts"][name] = {"cpu_s": cpu, "wall_s": wall, "gflop": gflop, "temp_mib": case["temp_mib"],
                                 "page_faults": faults, "cpu_all": case["cpu"], "wall_all": case["wall"],
                                 "compile_s": case["compile_s"]}
        print(f"{name:8}{cpu:9.3f}{wall:9.3f}{gflop:9.2f}{gflop / cpu:13.1f}{case['temp_mib']:10.0f}"
              f"{faults:13.0f}{case['compile_s']:11.1f}")
    print(f"load avg {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

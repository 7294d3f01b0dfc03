"""Steady-state GRPO step time: LoCoJAX's CO step against Tunix's `GRPOLearner`, same run, same work.

    .venv/bin/python bench/grpo_step.py            # -> bench/results/grpo_step.json

Workload (issue 4): the `small` preset (Qwen3: d_model 256, 4 layers, 4 heads, 4 kv heads, head_dim
64, d_ff 1024, vocabulary 384, tied embeddings), float32, ONE CPU device per side; 8 prompts of the
`arith` task (difficulty 1, the same strings on both sides, step by step) x 8 samples x 64 new
tokens with no early stop, prompts left-padded to 64 slots, temperature 1; the GSM8K `#### N`
exact-match reward on both; GRPO advantages (group mean/std); the clipped surrogate (eps 0.2 both
ways), `seq_mean_token_mean` aggregation, k3 KL penalty against a frozen reference with
kl_coef (Tunix: beta) 0.04, num_iterations 1; AdamW after global-norm clipping at 1.0, no
checkpoints. Both sides therefore pay a reference forward pass per step for the KL term.

Sides, each a subprocess so neither sees the other's compilation caches or memory:
  * LoCoJAX (`--side locojax`, this file in the project venv): the real `locojax.modes.co.run_co`
    loop, unmodified except that the rollout's `SamplingConfig` gets `eos_id=None` (our sampler
    otherwise stops at EOS), so every row decodes 64 tokens. Step k's period is the wall time
    between the metric records of steps k-1 and k, i.e. everything the loop does per step
    (rollout, reward, advantages, reference log-probs, train step, JSONL metrics; the parameter
    checksum is off, as in any spec without `debug.checksum_every`).
  * Tunix (bench/peers/tunix_grpo_step.py, in its own ignored venv bench/.peer-venvs/tunix, never a
    project dependency): `GRPOLearner.train` on a Qwen3 of identical dimensions built with
    `create_dummy_model`; step k's period is the wall time between the learner's pulls of batch k
    and batch k+1 from the training iterator.

Each run trains `--steps` steps; steps 0..warmup-1 (compilation) and the last step (LoCoJAX forces a
checkpoint there; Tunix closes its cluster) are dropped. The sides alternate run by run (A B B A ..)
so background load on this shared machine hits both alike; each side's figure is the median of
its pooled steady-state periods. Identical work is asserted: every rollout on both sides decoded
8*8 rows of exactly 64 tokens, and each side's loss trained on at least 98% of them (Tunix masks
completion tokens equal to the pad id, also ones sampled by chance; ours does not). The trained-token
counts are reported (`workload.trained_tokens_per_step`).

The last line printed is `ratio_vs_peer=<x>` (= peer_step_s / locojax_step_s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / "bench" / ".peer-venvs" / "tunix"
PEER_PACKAGE = "google-tunix==0.1.7"
PEER_SCRIPT = ROOT / "bench" / "peers" / "tunix_grpo_step.py"
RESULTS = ROOT / "bench" / "results" / "grpo_step.json"

PROMPTS, GROUP, NEW_TOKENS, PROMPT_SLOTS = 8, 8, 64, 64
KL_COEF, NUM_ITERATIONS, CLIP_EPS, LR, GRAD_CLIP = 0.04, 1, 0.2, 1e-6, 1.0
SEED = 0
PHASES = ("time/rollout", "time/reward", "time/advantage", "time/train", "time/device", "time/host",
          "time/network", "time/checkpoint", "time/step")


def make_spec(steps: int, output_dir: str | None = None):
    from locojax.spec import AlgoSpec, CheckpointSpec, ModelSpec, OptimSpec, RolloutSpec, RunSpec, TaskSpec

    return RunSpec(
        name="bench-grpo-step", seed=SEED,
        model=ModelSpec(preset="small", dtype="float32"),
        task=TaskSpec(name="arith", difficulty=1),
        rollout=RolloutSpec(prompts_per_step=PROMPTS, group_size=GROUP, max_prompt_tokens=PROMPT_SLOTS,
                            max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0),
        algo=AlgoSpec(name="grpo", clip_eps=CLIP_EPS, clip_eps_high=None, kl_coef=KL_COEF,
                      loss_agg="seq_mean_token_mean", num_iterations=NUM_ITERATIONS),
        optim=OptimSpec(lr=LR, warmup_steps=0, decay="constant", grad_clip=GRAD_CLIP, weight_decay=0.0),
        steps=steps,
        checkpoint=CheckpointSpec(every=0),
        output_dir=output_dir,
    )


# Tokens the loss trains on may fall short of the decoded slots only by pad ids sampled by chance
# (the peer masks them; ~1/384 of the tokens of a random-init model at temperature 1).
MIN_TRAINED_FRACTION = 0.98


def check_generated(side: str, generated: list[dict], steps: int) -> None:
    """The identical-work check: every rollout decoded PROMPTS*GROUP rows of exactly NEW_TOKENS slots,
    and the loss trained on (nearly) all of them: `tokens` counts trained tokens, not padded slots."""
    if len(generated) != steps:
        raise RuntimeError(f"{side}: {len(generated)} rollouts for {steps} steps")
    slots = PROMPTS * GROUP * NEW_TOKENS
    for i, g in enumerate(generated):
        if (g["rows"], g["slots"], g["min_len"], g["max_len"]) != (PROMPTS * GROUP, slots, NEW_TOKENS, NEW_TOKENS):
            raise RuntimeError(f"{side}: rollout {i} generated {g}, expected {PROMPTS * GROUP} rows x {NEW_TOKENS}")
        if not MIN_TRAINED_FRACTION * slots <= g["tokens"] <= slots:
            raise RuntimeError(f"{side}: rollout {i} trains on {g['tokens']} of {slots} slots")


def trained_tokens_per_step(runs: list[dict]) -> float:
    return statistics.mean(g["tokens"] for run in runs for g in run["generated"])


# ---------------------------------------------------------------------------------------------
# Our side (a subprocess of the orchestrator).


def locojax_side(steps: int, warmup: int) -> None:
    import dataclasses
    import resource

    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    import numpy as np

    import locojax.modes.common as common
    from locojax import metrics as m
    from locojax.modes.co import run_co

    assert len(jax.devices()) == 1, jax.devices()

    # The one change to the real CO loop: no early stop, so every row decodes NEW_TOKENS tokens.
    real_sampling_config = common.sampling_config
    common.sampling_config = lambda spec, tok: dataclasses.replace(real_sampling_config(spec, tok), eos_id=None)

    generated: list[dict] = []
    real_texts = common.RolloutRunner.texts

    def counting_texts(self, tokens, lengths):
        # Our loss trains on every slot of the completion mask (sampled pad ids included: the mask ends
        # only at EOS), whose row sums are these lengths, so trained tokens are their sum.
        lengths = np.asarray(lengths)
        generated.append({"rows": int(lengths.size), "slots": int(lengths.sum()), "tokens": int(lengths.sum()),
                          "min_len": int(lengths.min()), "max_len": int(lengths.max())})
        return real_texts(self, tokens, lengths)

    common.RolloutRunner.texts = counting_texts

    class StampSink:
        """Stamps the aggregate record of each step: the end of that step's loop body."""

        def __init__(self):
            self.stamps: list[float] = []
            self.cpu: list[float] = []
            self.records: list[dict] = []

        def write(self, step, host, metrics):
            if host == m.ALL_HOSTS:
                self.stamps.append(time.perf_counter())
                self.cpu.append(time.process_time())
                self.records.append(dict(metrics))

        def close(self):
            pass

    sink = StampSink()
    with tempfile.TemporaryDirectory(prefix="grpo-step-bench-") as out:
        started = time.perf_counter()
        result = run_co(make_spec(steps, out), console=False, extra_sinks=[sink])
        total = time.perf_counter() - started
    if result.status != "succeeded" or result.steps_done != steps:
        raise RuntimeError(f"run_co ended {result.status} after {result.steps_done} steps")

    kept = range(max(warmup, 1), steps - 1)  # step k = stamps[k] - stamps[k-1]
    periods = [sink.stamps[k] - sink.stamps[k - 1] for k in kept]
    phases = {name: [sink.records[k].get(name, 0.0) for k in kept] for name in PHASES}
    print(json.dumps({
        "side": "locojax",
        "periods_s": periods,
        "cpu_s": [sink.cpu[k] - sink.cpu[k - 1] for k in kept],  # process CPU seconds (all threads)
        "phases_s": phases,
        "first_steps_s": [sink.stamps[0] - started] + [sink.stamps[k] - sink.stamps[k - 1] for k in range(1, warmup)],
        "total_s": total,
        "generated": generated,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "reward_mean": [r.get("reward/mean") for r in sink.records],
        "versions": {"jax": jax.__version__},
        "devices": len(jax.devices()),
    }), flush=True)


# ---------------------------------------------------------------------------------------------
# Orchestrator.


def ensure_peer_venv() -> Path:
    """The peer venv's python; creates the venv and installs Tunix on first use (bench/rollout.py
    shares the same venv). Waits if another process is installing it right now."""
    python = PEER_VENV / "bin" / "python"
    probe = [str(python), "-c", "import tunix"]
    for _ in range(60):
        if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
            return python
        busy = subprocess.run(["pgrep", "-f", str(PEER_VENV) + ".*pip"], capture_output=True).returncode == 0
        if not busy:
            break
        print("another process is installing the peer venv; waiting ...", flush=True)
        time.sleep(30)
    print(f"installing {PEER_PACKAGE} into {PEER_VENV} (first run only) ...", flush=True)
    PEER_VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", PEER_PACKAGE], check=True)
    return python


def run_side(command: list[str], log: Path) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as err:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{command[:3]} failed ({proc.returncode}); see {log}\n{proc.stdout[-2000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    out = json.loads(line)
    out["wall_s"] = wall
    out["load_avg_1m"] = [load_before, os.getloadavg()[0]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=9, help="steps per run (default 9)")
    parser.add_argument("--warmup", type=int, default=2, help="leading steps dropped per run (default 2)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="runs per side, alternating L T, T L, ... (default 4; ~35 min on 2 busy cores)")
    parser.add_argument("--side", choices=["locojax"], help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.steps < args.warmup + 2 or args.warmup < 1:
        parser.error("need warmup >= 1 and steps >= warmup + 2")
    if args.side == "locojax":
        locojax_side(args.steps, args.warmup)
        return

    from locojax.model import get_preset
    from locojax.tasks import host_shard, make_task

    preset = get_preset("small")
    model = {k: getattr(preset, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                              "head_dim", "d_ff", "rope_theta", "norm_eps", "tie_embeddings")}
    assert preset.arch == "qwen3" and preset.qk_norm
    spec = make_spec(args.steps)
    task = make_task(spec.task)
    # The very prompts `run_co` draws at each step (host 0 of 1), handed to the peer in the same order.
    prompts = [[{"prompt": e.prompt, "answer": e.answer}
                for e in host_shard(task, spec.seed, step, PROMPTS, 0, 1)] for step in range(args.steps)]
    peer_python = ensure_peer_venv()

    logs = Path(tempfile.mkdtemp(prefix="grpo-step-bench-logs-"))
    config_path = logs / "peer_config.json"
    config_path.write_text(json.dumps({
        "seed": SEED, "steps": args.steps, "model": model, "prompts": prompts,
        "workload": {"group_size": GROUP, "new_tokens": NEW_TOKENS, "prompt_slots": PROMPT_SLOTS,
                     "temperature": 1.0},
        "algo": {"kl_coef": KL_COEF, "num_iterations": NUM_ITERATIONS, "clip_eps": CLIP_EPS},
        "optim": {"lr": LR, "grad_clip": GRAD_CLIP},
    }), encoding="utf-8")
    commands = {
        "locojax": [sys.executable, str(Path(__file__).resolve()), "--side", "locojax",
                    "--steps", str(args.steps), "--warmup", str(args.warmup)],
        "tunix": [str(peer_python), str(PEER_SCRIPT), str(config_path)],
    }

    runs: list[dict] = []
    load_start = os.getloadavg()
    for r in range(args.rounds):
        order = ("locojax", "tunix") if r % 2 == 0 else ("tunix", "locojax")
        for side in order:
            out = run_side(commands[side], logs / f"{side}-{r}.log")
            check_generated(side, out["generated"], args.steps)
            if side == "tunix":
                if out["train_steps"] != args.steps:
                    raise RuntimeError(f"tunix trained {out['train_steps']} steps, expected {args.steps}")
                out["periods_s"] = out["periods_s"][args.warmup:]  # steps warmup .. steps-2
                out["cpu_s"] = out["cpu_s"][args.warmup:]
                out["phases_s"] = {k: v[args.warmup:args.steps - 1] for k, v in out["phases_s"].items()}
            out["round"] = r
            runs.append(out)
            print(f"round {r} {side:8} median step {statistics.median(out['periods_s']):.3f}s "
                  f"over {len(out['periods_s'])} steps (run {out['wall_s']:.0f}s, "
                  f"load {out['load_avg_1m'][0]:.2f}->{out['load_avg_1m'][1]:.2f})", flush=True)
    load_end = os.getloadavg()

    ours = [run for run in runs if run["side"] == "locojax"]
    peer = [run for run in runs if run["side"] == "tunix"]
    our_periods = [p for run in ours for p in run["periods_s"]]
    peer_periods = [p for run in peer for p in run["periods_s"]]
    locojax_step_s = statistics.median(our_periods)
    peer_step_s = statistics.median(peer_periods)
    phases = {name: statistics.median(v for run in ours for v in run["phases_s"][name]) for name in PHASES}
    peer_phases = {name: statistics.median(v for run in peer for v in run["phases_s"][name])
                   for name in peer[0]["phases_s"]}
    our_cpu = statistics.median(c for run in ours for c in run["cpu_s"])
    peer_cpu = statistics.median(c for run in peer for c in run["cpu_s"])

    import jax

    result = {
        "locojax_step_s": locojax_step_s,
        "peer_step_s": peer_step_s,
        "ratio_vs_peer": peer_step_s / locojax_step_s,
        **phases,
        "locojax_peak_rss_mib": max(run["peak_rss_mib"] for run in ours),
        # Secondary, less sensitive to other processes on the machine: CPU seconds (all threads) that
        # each side's process burned per steady-state step, and their ratio.
        "locojax_cpu_s_per_step": our_cpu,
        "peer_cpu_s_per_step": peer_cpu,
        "cpu_ratio_vs_peer": peer_cpu / our_cpu,
        "peer_phases_s": {f"time/{k}": v for k, v in peer_phases.items()},
        "ratio_per_round": [
            statistics.median(next(x for x in peer if x["round"] == r)["periods_s"])
            / statistics.median(next(x for x in ours if x["round"] == r)["periods_s"]) for r in range(args.rounds)],
        "notes": [
            "time/train on our side includes the reference log-prob pass for the KL term (co.py times it there); "
            "the peer's reference pass is its time/reference",
            "peer phases are wrappers around RLCluster.generate / get_ref_per_token_logps / update_actor, "
            "for orientation only",
            "the machine is shared: compare per-run figures with their load averages; cpu_ratio_vs_peer is "
            "the less load-sensitive cross-check",
        ],
        "peer_peak_rss_mib": max(run["peak_rss_mib"] for run in peer),
        "peer": f"tunix {PEER_PACKAGE.split('==')[1]} GRPOLearner (vanilla rollout, Qwen3 of identical dims)",
        "workload": {
            "preset": "small", "dtype": "float32", "devices_per_side": 1, "task": "arith d1",
            "prompts": PROMPTS, "group_size": GROUP, "new_tokens": NEW_TOKENS, "early_stop": False,
            "prompt_slots": PROMPT_SLOTS, "temperature": 1.0, "reward": "gsm8k strict (#### N)",
            "kl_coef": KL_COEF, "kl_estimator": "k3 (Tunix kl_loss_mode=low_var_kl)",
            "num_iterations": NUM_ITERATIONS, "clip_eps": [CLIP_EPS, CLIP_EPS],
            "loss_agg": "seq_mean_token_mean (Tunix sequence-mean-token-mean)", "optimizer": "AdamW + clip 1.0",
            "tokens_generated_per_step": PROMPTS * GROUP * NEW_TOKENS,
            # What each side's loss trained on per step (mean over all steps of all runs): the peer
            # masks pad ids its sampler drew by chance, ours trains on them.
            "trained_tokens_per_step": {"locojax": trained_tokens_per_step(ours),
                                        "peer": trained_tokens_per_step(peer)},
        },
        "method": {
            "steps_per_run": args.steps, "warmup_dropped": args.warmup, "last_step_dropped": True,
            "runs_per_side": args.rounds, "order": "alternating (L T, T L, ...)",
            "statistic": "median of pooled steady-state step periods",
            "phase_statistic": "median per phase over the same steps (phases need not add up to the median step)",
        },
        "per_run": [{"side": run["side"], "round": run["round"], "median_step_s": statistics.median(run["periods_s"]),
                     "periods_s": run["periods_s"], "cpu_s": run["cpu_s"], "peak_rss_mib": run["peak_rss_mib"], "wall_s": run["wall_s"],
                     "load_avg_1m": run["load_avg_1m"]} for run in runs],
        "machine": {"cpus": os.cpu_count(), "jax": jax.__version__, "peer_versions": peer[0]["versions"],
                    "load_avg_start": list(load_start), "load_avg_end": list(load_end)},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    print(f"\n{'':30}{'step s':>9}{'min':>8}{'max':>8}{'n':>4}")
    for name, periods in (("locojax (CO loop)", our_periods), ("tunix 0.1.7 GRPOLearner", peer_periods)):
        print(f"{name:30}{statistics.median(periods):9.3f}{min(periods):8.3f}{max(periods):8.3f}{len(periods):4d}")
    print(f"CPU s per step: locojax {our_cpu:.2f}, tunix {peer_cpu:.2f} (ratio {peer_cpu / our_cpu:.2f})")
    print("tunix phases (median s): " + "  ".join(f"{k} {v:.3f}" for k, v in peer_phases.items()))
    print("locojax phases (median s): " + "  ".join(
        f"{k.split('/')[1]} {phases[k]:.3f}" for k in PHASES if k not in ("time/network", "time/checkpoint")))
    print(f"peak RSS: locojax {result['locojax_peak_rss_mib']:.0f} MiB, tunix {result['peer_peak_rss_mib']:.0f} MiB; "
          f"load avg 1m {load_start[0]:.2f} -> {load_end[0]:.2f} on {os.cpu_count()} cpus; "
          f"wrote {RESULTS.relative_to(ROOT)}")
    print(f"ratio_vs_peer={result['ratio_vs_peer']:.2f}")


if __name__ == "__main__":
    main()

"""Steady-state GRPO step time: LoCoJAX's CO step against Tunix's `GRPOLearner`, same run, same work.

    .venv/bin/python bench/grpo_step.py            # size a on this CPU -> bench/results/grpo_step.json
    python3 bench/grpo_step.py --platform tpu --size a --rounds 2 --peer-python python3 \
        --peer-path PEER_PYTHONPATH --out OUTDIR/part_size-a.json     # what bench/tpu.sh runs

Sizes (`--size`; the work of each is a function of the size alone, `SIZES`):
  * a (issue 4): the `small` preset (Qwen3: d_model 256, 4 layers, 4 heads, 4 kv heads, head_dim 64,
    d_ff 1024, vocabulary 384, tied embeddings), float32; 8 prompts of the `arith` task (difficulty 1,
    the same strings on both sides, step by step) x 8 samples x 64 new tokens with no early stop,
    prompts left-padded to 64 slots, temperature 1; the GSM8K `#### N` exact-match reward on both;
    GRPO advantages (group mean/std); the clipped surrogate (eps 0.2 both ways),
    `seq_mean_token_mean` aggregation, k3 KL penalty against a frozen reference with kl_coef (Tunix:
    beta) 0.04, num_iterations 1; AdamW after global-norm clipping at 1.0, no checkpoints. Both sides
    therefore pay a reference forward pass per step for the KL term.
  * b (issue 37): as a, with 32 prompts x 8 samples and 128 new tokens.
  * c (issue 37): Qwen3-0.6B, float32, on bench/scale.py's inputs (its random-weight HF directory with
    the exact 0.6B config, its Qwen-format tokenizer.json and GSM8K JSONL, built here the same way),
    scale.py's spec (kl_coef 0, so no reference model on either side; remat full in training), 96
    prompt + 128 new tokens, group 4, at the largest rows both sides fit. `--rows search` finds them:
    our side tries the prompt counts of `C_PROMPTS` its own memory plan accepts
    (locojax/placement/memory.py), largest first, in one process, until one runs; the peer tries those
    bench/scale.py's `peer_memory_estimate` puts within the chip, one process each, until one runs
    (`--peer-at-our-rows`: our largest rows first, so where the peer cannot run them its own error says why);
    then the side whose largest is larger runs again at the other's. Each attempt's outcome (and a
    failure's own error line) is in `rows_search`. `--rows N` or `--rows-from PART` runs rounds at
    known rows (a later stage of the same refresh).

Sides, each a subprocess so neither sees the other's compilation caches or memory, and each with
JAX's persistent compilation cache switched off (JAX_ENABLE_COMPILATION_CACHE=false): every run
compiles cold, and `compilation_cache` in each run's record says what JAX had configured:
  * LoCoJAX (`--side locojax`, this file): the real `locojax.modes.co.run_co` loop, unmodified except
    that the rollout's `SamplingConfig` gets `eos_id=None` (our sampler otherwise stops at EOS), so
    every row decodes all new tokens. Step k's period is the wall time between the metric records of
    steps k-1 and k, i.e. everything the loop does per step (rollout, reward, advantages, reference
    log-probs, train step, JSONL metrics; the parameter checksum is off).
  * Tunix (bench/peers/tunix_grpo_step.py; on a CPU in its own ignored venv bench/.peer-venvs/tunix,
    never a project dependency; elsewhere `--peer-python` and `--peer-path` name a Python and the
    PYTHONPATH that import it, and nothing is installed): `GRPOLearner.train` on a Qwen3 of identical
    dimensions built with `create_dummy_model`; step k's period is the wall time between the
    learner's pulls of batch k and batch k+1 from the training iterator.

Each run trains `--steps` steps; steps 0..warmup-1 (compilation) and the last step (LoCoJAX forces a
checkpoint there; Tunix closes its cluster) are dropped. The sides alternate run by run (A B B A ..)
so background load hits both alike; each side's figure is the median of its pooled steady-state
periods. Identical work is asserted: every rollout on both sides decoded rows x new tokens exactly,
over the same prompt buffer, and each side's loss trained on at least 98% of them (Tunix masks
completion tokens equal to the pad id, also ones sampled by chance; ours does not).

`device_idle_fraction` (with `--profile-steps N`, the default on a TPU): our side's last run trains N
more steps after the timed ones under jax.profiler (bench/profile_trace.py): the share of those
steps' wall time with no op running on the device, and the top ops by time per phase. The timed
periods are the same steps as in every other run; the profiler starts in the last timed step,
whose period is dropped (bench/profile_trace.py's lead-in step), and stops after the traced ones.
`--host-profile-steps N` (default 3 on a TPU) then runs N more under cProfile: the Python calls the
run loop's thread spends a steady step in (`host_profile`), i.e. what the host does while the device
trace shows the device waiting. `--keep-trace FILE` keeps the profiled steps' raw trace (*.xplane.pb,
~7 MB at size a): its host lines also hold the runtime's own events (transfers, buffer releases), which
the summary leaves out (`jax.profiler.ProfileData.from_serialized_xspace` reads it on any machine).

Every output (a part of a TPU refresh, or the CPU JSON) records the commit it measured, its date,
the platform and device kind (bench/tpu_merge.py `part_header`). The last line printed is
`ratio_vs_peer=<x>` (= peer_step_s / locojax_step_s).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `bench.*` when run as a script

PEER_VENV = ROOT / "bench" / ".peer-venvs" / "tunix"
PEER_PACKAGE = "google-tunix==0.1.7"
PEER_SCRIPT = ROOT / "bench" / "peers" / "tunix_grpo_step.py"
RESULTS = ROOT / "bench" / "results" / "grpo_step.json"
PROCESS_START = time.monotonic()  # --budget-s counts from here (building size c's inputs included)

NUM_ITERATIONS, CLIP_EPS, LR, GRAD_CLIP = 1, 0.2, 1e-6, 1.0
SEED = 0
PHASES = ("time/rollout", "time/reward", "time/advantage", "time/train", "time/device", "time/host",
          "time/network", "time/checkpoint", "time/step")
# Size c's prompt counts (x group 4) the rows search tries, largest first.
C_PROMPTS = (64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1)
# Seconds a run of each side is expected to take on a TPU v5e, cold (chip open, model built, compiled,
# steps): what the budget check reserves before it starts one (the run's own wall time replaces it once
# a run of that side has finished).
EXPECTED_RUN_S = {"a": 90.0, "b": 110.0, "c": 200.0, "lora": 300.0}
# Where the sides' first runs differ by more than the stage can absorb: on a v5e at Qwen3-1.7B LoRA, 16
# rows, our run took 64-81 s (137 s at 4B, 48 rows) and the peer's 271 s (most of it compiling), so 300 s
# for ours left an A M M A stage (bench/tpu.sh lora-rollout) one run short.
EXPECTED_SIDE_RUN_S = {("lora", "locojax"): 150.0}


@dataclasses.dataclass(frozen=True)
class Workload:
    """The work of one size, the same on both sides."""

    size: str
    preset: str
    prompts: int
    group: int
    new_tokens: int
    prompt_slots: int
    kl_coef: float
    remat: str = "none"
    dtype: str = "float32"
    scale_inputs: bool = False  # bench/scale.py's HF directory, tokenizer.json and GSM8K JSONL (size c)
    hf_weights: bool = True  # with scale_inputs: start from its random-weight HF directory, else from the preset
    lora_rank: int = 0  # > 0: LoRA on every linear layer (ours: model.lora; Tunix: qwix), alpha = lora_alpha
    lora_alpha: float = 0.0
    scan_layers: str = "auto"  # ours only: model.scan_layers ("auto", "true", "false")
    early_forward: str = "false"  # ours only: placement.early_forward ("true", "false")
    # Ours only: algo.micro_batch_size (rows per gradient micro-batch, the same update as the whole batch;
    # None: the engine's default). The peer trains its whole batch at once.
    micro_batch_size: int | None = None
    # Ours only: model.lora.rollout ("adapters": the low-rank path beside each projection at every decode
    # step; "merged": folded into a copy of the weights once per rollout).
    lora_rollout: str = "adapters"

    @property
    def rows(self) -> int:
        return self.prompts * self.group

    def trains_whole_micro_batches(self, prompts: int) -> bool:
        """Whether the engine takes `prompts` prompts' rows in micro-batches of micro_batch_size (it refuses
        a remainder): its own rule, locojax.placement.memory.num_micro_batches."""
        from locojax.placement.memory import num_micro_batches

        try:
            num_micro_batches(prompts * self.group, self.micro_batch_size)
        except ValueError:
            return False
        return True

    def with_prompts(self, prompts: int) -> "Workload":
        return dataclasses.replace(self, prompts=prompts)

    def scale_args(self, steps: int) -> types.SimpleNamespace:
        """The namespace bench/scale.py's spec and peer-config builders read."""
        return types.SimpleNamespace(seed=SEED, dtype=self.dtype, remat=self.remat, prompts=self.prompts,
                                     group=self.group, prompt_tokens=self.prompt_slots,
                                     new_tokens=self.new_tokens, steps=steps, model_preset=self.preset,
                                     micro_batch_size=self.micro_batch_size)


SIZES = {
    "a": Workload("a", "small", prompts=8, group=8, new_tokens=64, prompt_slots=64, kl_coef=0.04),
    "b": Workload("b", "small", prompts=32, group=8, new_tokens=128, prompt_slots=64, kl_coef=0.04),
    "c": Workload("c", "qwen3-0.6b", prompts=4, group=4, new_tokens=128, prompt_slots=96, kl_coef=0.0,
                  remat="full", scale_inputs=True),
    # Issue 40: LoRA rank 16 on every linear layer of a random-init bfloat16 Qwen3-1.7B on both sides,
    # 96 prompt + 256 new tokens, 64 rows or the largest both fit (`--rows search --max-prompts 8`);
    # bench/scale.py's tokenizer and JSONL, no HF directory (a 1.7B one would be 7 GB of random weights).
    "lora": Workload("lora", "qwen3-1.7b", prompts=8, group=8, new_tokens=256, prompt_slots=96, kl_coef=0.0,
                     remat="full", dtype="bfloat16", scale_inputs=True, hf_weights=False, lora_rank=16,
                     lora_alpha=32.0),
}
LORA_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


def _scale_bench():
    from bench import scale

    return scale


def _scan_layers(work: Workload) -> str | bool:
    return {"true": True, "false": False}.get(work.scan_layers, work.scan_layers)


def _early_forward(work: Workload) -> bool:
    return work.early_forward == "true"


def make_spec(work: Workload, steps: int, output_dir: str | None = None, inputs: dict | None = None):
    from locojax.spec import (
        AlgoSpec, CheckpointSpec, ModelSpec, OptimSpec, PlacementSpec, RolloutSpec, RunSpec, TaskSpec,
    )

    if work.scale_inputs:
        scale = _scale_bench()
        spec = scale.make_spec(inputs, work.scale_args(steps), f"bench-grpo-step-{work.size}",
                               Path(output_dir) if output_dir else None)
        if not work.hf_weights:
            spec["model"] = {"preset": work.preset, "tokenizer": str(inputs["tokenizer"]), "dtype": work.dtype,
                             "remat": work.remat}
        if work.lora_rank:
            spec["model"]["lora"] = {"rank": work.lora_rank, "alpha": work.lora_alpha, "targets": LORA_TARGETS,
                                     "rollout": work.lora_rollout}
        spec["model"]["scan_layers"] = _scan_layers(work)
        spec.setdefault("placement", {})["early_forward"] = _early_forward(work)
        return RunSpec.model_validate(spec)
    return RunSpec(
        name=f"bench-grpo-step-{work.size}", seed=SEED,
        model=ModelSpec(preset=work.preset, dtype=work.dtype, remat=work.remat, scan_layers=_scan_layers(work)),
        task=TaskSpec(name="arith", difficulty=1),
        rollout=RolloutSpec(prompts_per_step=work.prompts, group_size=work.group, max_prompt_tokens=work.prompt_slots,
                            max_new_tokens=work.new_tokens, temperature=1.0, top_p=1.0, top_k=0),
        algo=AlgoSpec(name="grpo", clip_eps=CLIP_EPS, clip_eps_high=None, kl_coef=work.kl_coef,
                      loss_agg="seq_mean_token_mean", num_iterations=NUM_ITERATIONS,
                      micro_batch_size=work.micro_batch_size),
        optim=OptimSpec(lr=LR, warmup_steps=0, decay="constant", grad_clip=GRAD_CLIP, weight_decay=0.0),
        steps=steps,
        placement=PlacementSpec(early_forward=_early_forward(work)),
        checkpoint=CheckpointSpec(every=0),
        output_dir=output_dir,
    )


def peer_config(work: Workload, steps: int, inputs: dict | None) -> dict:
    """The harness's CONFIG.json: the model's dimensions, the very prompts `run_co` draws at each step
    (host 0 of 1), the algorithm and optimizer settings."""
    if work.scale_inputs:
        config = _scale_bench().peer_config(inputs, work.scale_args(steps), steps)
        config["model"]["dtype"] = work.dtype
        if work.lora_rank:
            config["lora"] = {"rank": work.lora_rank, "alpha": work.lora_alpha}
        return config
    from locojax.model import get_preset
    from locojax.tasks import host_shard, make_task

    preset = get_preset(work.preset)
    assert preset.arch == "qwen3" and preset.qk_norm
    spec = make_spec(work, steps)
    task = make_task(spec.task)
    prompts = [[{"prompt": e.prompt, "answer": e.answer}
                for e in host_shard(task, spec.seed, step, work.prompts, 0, 1)] for step in range(steps)]
    model = {k: getattr(preset, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                              "head_dim", "d_ff", "rope_theta", "norm_eps", "tie_embeddings")}
    return {
        "seed": SEED, "steps": steps, "model": {**model, "remat": work.remat}, "prompts": prompts,
        "workload": {"group_size": work.group, "new_tokens": work.new_tokens, "prompt_slots": work.prompt_slots,
                     "temperature": 1.0},
        "algo": {"kl_coef": work.kl_coef, "num_iterations": NUM_ITERATIONS, "clip_eps": CLIP_EPS},
        "optim": {"lr": LR, "grad_clip": GRAD_CLIP},
    }


# Tokens the loss trains on may fall short of the decoded slots only by pad ids sampled by chance
# (the peer masks them; ~1/vocabulary of the tokens of a random-init model at temperature 1).
MIN_TRAINED_FRACTION = 0.98


def identical_work(work: Workload, generated: list[dict], steps: int) -> dict:
    """The identical-work check of one run: every rollout decoded rows x new tokens slots (over a prompt
    buffer of prompt_slots where the side reports it), and the loss trained on (nearly) all of them."""
    problems = []
    if len(generated) != steps:
        problems.append(f"{len(generated)} rollouts for {steps} steps")
    slots = work.rows * work.new_tokens
    for i, g in enumerate(generated):
        if (g["rows"], g["slots"], g["min_len"], g["max_len"]) != (work.rows, slots, work.new_tokens, work.new_tokens):
            problems.append(f"rollout {i} generated {g}, expected {work.rows} rows x {work.new_tokens}")
        if g.get("prompt_width", work.prompt_slots) != work.prompt_slots:
            problems.append(f"rollout {i} used a prompt buffer of {g['prompt_width']}, not {work.prompt_slots}")
        if not MIN_TRAINED_FRACTION * slots <= g["tokens"] <= slots:
            problems.append(f"rollout {i} trains on {g['tokens']} of {slots} slots")
    return {"ok": not problems, "problems": problems[:5],
            "trained_tokens_per_step": statistics.mean(g["tokens"] for g in generated) if generated else None}


# ---------------------------------------------------------------------------------------------
# Our side (a subprocess of the orchestrator).


def _error_line(error: BaseException) -> str:
    """The line of an exception that says what went wrong (an XLA status, a refusal), not its traceback."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for marker in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "refused", "does not fit"):
        for line in lines:
            if marker in line:
                return f"{type(error).__name__}: {line}"[:500]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:500]


def compilation_cache_state() -> dict:
    import jax

    return {"enabled": bool(jax.config.jax_enable_compilation_cache),
            "dir": jax.config.jax_compilation_cache_dir}


def locojax_side(args) -> None:
    import resource

    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    import numpy as np

    import locojax.modes.common as common
    from locojax import metrics as m
    from locojax.modes.co import run_co
    from locojax.placement.memory import GiB, MemoryPlanError, plan_for_spec, refusal

    from bench.profile_trace import HostProfiledSteps, ProfiledSteps, annotated_phases, summarise_trace, trace_file

    assert len(jax.devices()) == 1, jax.devices()
    base = workload_from_args(args)
    inputs = _scale_bench().input_paths(Path(args.work), base.preset) if base.scale_inputs else None

    # The one change to the real CO loop: no early stop, so every row decodes all new tokens.
    real_sampling_config = common.sampling_config
    common.sampling_config = lambda spec, tok: dataclasses.replace(real_sampling_config(spec, tok), eos_id=None)

    # The memory plan the engine checks (the analytic one on a CPU, the compiled one on an accelerator:
    # common.plans_by_compiling) is kept for the record. With --plan-refusal off a run it refuses is tried.
    plans: list = []
    if args.compiled_plan:  # a dry run of the accelerator path on a CPU
        common.plans_by_compiling = lambda platform: True

    def checked_analytic_plan(spec, devices, hosts, *, samples, echo=None):
        plan = plan_for_spec(spec, devices, hosts, samples=samples)
        plans.append(plan)
        print(plan.summary(), file=sys.stderr, flush=True)
        if not plan.fits and args.plan_refusal == "on":
            raise MemoryPlanError(refusal(plan))
        return plan

    real_compiled_plan = common.compiled_plan

    def recorded_compiled_plan(**kwargs):
        plan = real_compiled_plan(**kwargs)
        plans.append(plan)
        return plan if plan.fits or args.plan_refusal == "on" else dataclasses.replace(plan, capacity_bytes=None)

    common.check_spec_fits = checked_analytic_plan
    common.compiled_plan = recorded_compiled_plan

    generated: list[dict] = []
    real_texts = common.RolloutRunner.texts

    def counting_texts(self, tokens, lengths):
        # Our loss trains on every slot of the completion mask (sampled pad ids included: the mask ends
        # only at EOS), whose row sums are these lengths, so trained tokens are their sum.
        lengths = np.asarray(lengths)
        generated.append({"rows": int(lengths.size), "slots": int(lengths.sum()), "tokens": int(lengths.sum()),
                          "min_len": int(lengths.min()), "max_len": int(lengths.max()),
                          "prompt_width": int(self.prompt_len)})
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

    device = jax.devices()[0]
    compiled = common.plans_by_compiling(device.platform)
    attempts, done, side_started, longest = [], None, time.monotonic(), 0.0
    candidates = args.prompt_candidates or [base.prompts]
    traced_steps = args.profile_steps + 1 if args.profile_steps else 0
    total_steps = args.steps + traced_steps + (args.host_profile_steps + 1 if args.host_profile_steps else 0)
    for prompts in candidates:
        work = base.with_prompts(prompts)
        attempt = {"rows": work.rows, "prompts": prompts, "plan_source": "compiled" if compiled else "analytic"}
        attempts.append(attempt)
        if not compiled:  # the analytic plan costs nothing to ask before the run
            plan = plan_for_spec(make_spec(work, total_steps, None, inputs), jax.local_devices(), 1, samples=True)
            attempt.update(planned_gib=plan.peak_bytes / GiB, plan_fits=plan.fits, plan_line=plan.summary())
            if not plan.fits and args.plan_refusal == "on":
                attempt.update(status="refused by the memory plan", error=None)
                continue
        left = args.time_left_s - (time.monotonic() - side_started) if args.time_left_s else float("inf")
        if attempts[:-1] and left < 1.2 * longest + 30:  # another attempt would not end in the stage's time
            attempt.update(status="not tried: the stage's time", error=f"{left:.0f} s left, an attempt took "
                                                                         f"{longest:.0f} s")
            break
        attempt_started = time.monotonic()
        plans.clear()
        generated.clear()
        sink = StampSink()
        trace_dir = tempfile.mkdtemp(prefix="grpo-step-trace-") if args.profile_steps else None
        sinks = [sink] + ([ProfiledSteps(trace_dir, args.steps, args.profile_steps)] if trace_dir else [])
        host_profile = (HostProfiledSteps(args.steps + traced_steps + 1, args.host_profile_steps)
                        if args.host_profile_steps else None)
        sinks += [host_profile] if host_profile else []
        with tempfile.TemporaryDirectory(prefix="grpo-step-bench-") as out:
            started = time.perf_counter()
            try:
                with annotated_phases() if trace_dir else contextlib.nullcontext():
                    result = run_co(make_spec(work, total_steps, out, inputs), console=False, extra_sinks=sinks)
            except Exception as error:  # an attempt that does not fit: the next candidate is smaller
                refused = isinstance(error, MemoryPlanError)
                attempt.update(status="refused by the memory plan" if refused else "failed", error=_error_line(error),
                               **_plan_record(plans))
                print(f"rows {work.rows}: {attempt['error']}", file=sys.stderr, flush=True)
                del error
                gc.collect()  # the failed run's device buffers, before the next candidate allocates
                longest = max(longest, time.monotonic() - attempt_started)
                continue
            total = time.perf_counter() - started
        attempt.update(_plan_record(plans))
        if result.status != "succeeded" or result.steps_done != total_steps:
            attempt.update(status="failed", error=f"run_co ended {result.status} after {result.steps_done} steps")
            continue
        attempt.update(status="ran", error=None)
        done = (work, sink, started, total, trace_dir, host_profile)
        break

    record = {"side": "locojax", "attempts": attempts, "device": _device_record(device),
              "compilation_cache": compilation_cache_state(), "versions": {"jax": jax.__version__},
              "devices": len(jax.devices())}
    if done is None:
        tried = "; ".join(f"{a['rows']} rows {a['status']}" + (f" ({a['error']})" if a["error"] else "")
                          for a in attempts)
        print(json.dumps({**record, "ok": False, "error": f"no candidate rows ran: {tried}"}), flush=True)
        return
    work, sink, started, total, trace_dir, host_profile = done
    kept = range(max(args.warmup, 1), args.steps - 1)  # step k = stamps[k] - stamps[k-1]
    device_peaks = [r["memory/device_peak_gib"] for r in sink.records if "memory/device_peak_gib" in r]
    profile = None
    if trace_dir:
        try:
            profile = summarise_trace(trace_dir)
            if args.keep_trace:  # the raw trace, for what the summary leaves out (e.g. the host's threads)
                args.keep_trace.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(trace_file(trace_dir), args.keep_trace)
        except (OSError, ValueError) as error:
            profile = {"error": _error_line(error)}
    print(json.dumps({
        **record, "ok": True, "rows": work.rows, "prompts": work.prompts,
        "periods_s": [sink.stamps[k] - sink.stamps[k - 1] for k in kept],
        "cpu_s": [sink.cpu[k] - sink.cpu[k - 1] for k in kept],  # process CPU seconds (all threads)
        "phases_s": {name: [sink.records[k].get(name, 0.0) for k in kept] for name in PHASES},
        # Non-padding tokens each kept step trained on (prompt + completion), for model-FLOP counts.
        "train_tokens": [sink.records[k].get("throughput/train_tokens_per_s", 0.0) * sink.records[k].get("time/train", 0.0)
                         for k in kept],
        # From the mode's setup (chip open, memory plan and the programs it compiles, model built) to the
        # end of step 0: time/setup + its time/step. Step 0 alone would hide the ahead-of-loop compile.
        "first_step_s": sink.records[0].get("time/setup", 0.0) + sink.records[0]["time/step"],
        "step0_s": sink.records[0]["time/step"],
        # time/setup's parts (CO): the programs compiled ahead of the loop, the model and its state built.
        "setup_parts_s": {name: sink.records[0][name] for name in m.SETUP_PARTS if name in sink.records[0]},
        "steps_completed": len(sink.records),
        "setup_and_first_step_s": sink.stamps[0] - started,  # run_co's setup (model built) and step 0
        "total_s": total,
        "generated": generated[:args.steps],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_device_gib": max(device_peaks) if device_peaks else None,
        # The allocator's high-water mark lives as long as the process: after a failed attempt it is that one's.
        "peak_device_after_failed_attempt": any(a["status"] == "failed" for a in attempts),
        "planned_gib": attempts[-1].get("planned_gib"), "plan_line": attempts[-1].get("plan_line"),
        "plan_source": attempts[-1]["plan_source"],
        "reward_mean": [r.get("reward/mean") for r in sink.records],
        "profile": profile,
        "host_profile": host_profile.summary() if host_profile else None,
    }), flush=True)


def _plan_record(plans: list) -> dict:
    """The memory plan the engine checked last (its peak, whether it fits, its line), where it got that far."""
    if not plans:
        return {}
    plan = plans[-1]
    from locojax.placement.memory import GiB

    return {"planned_gib": plan.peak_bytes / GiB, "plan_fits": plan.fits, "plan_line": plan.summary()}


def _device_record(device) -> dict:
    stats = device.memory_stats() or {}
    return {"platform": device.platform, "device_kind": device.device_kind,
            "bytes_limit": stats.get("bytes_limit")}


def workload_from_args(args) -> Workload:
    work = SIZES[args.size]
    if args.model_preset:
        work = dataclasses.replace(work, preset=args.model_preset)
    return dataclasses.replace(work, scan_layers=args.scan_layers, micro_batch_size=args.micro_batch_size,
                               lora_rollout=args.lora_rollout, early_forward=args.early_forward)


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


def side_env(platform: str, pythonpath: str | None = None) -> dict[str, str]:
    """A side's environment: its platform (on a TPU, JAX_PLATFORMS unset: the chip) and no persistent
    compilation cache, so every run compiles cold on both sides."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("JAX_PLATFORMS", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return env


def run_side(command: list[str], log: Path, env: dict[str, str], timeout_s: float) -> dict:
    """One run of one side: its JSON line, or {"ok": False, "error": ...} when it failed or timed out."""
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as err:
        try:
            proc = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc = None
    wall = time.perf_counter() - started
    lines = [ln for ln in (proc.stdout if proc else "").splitlines() if ln.startswith("{")]
    if proc is None or proc.returncode != 0 or not lines:
        stderr = [ln for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
        how = f"timed out after {timeout_s:.0f} s" if proc is None else f"exit status {proc.returncode}"
        out = {"ok": False, "error": f"{how}: {_failure_line(stderr)}", "stderr_tail": stderr[-8:]}
    else:
        out = json.loads(lines[-1])
        out.setdefault("ok", True)
    out.update(wall_s=wall, load_avg_1m=[load_before, os.getloadavg()[0]], log=log.name)
    return out


FAILURE_MARKERS = ("RESOURCE_EXHAUSTED", "MemoryError", "Out of memory", "out of memory", "Error", "error")


def _failure_line(lines: list[str]) -> str:
    """A failed process's own error line: the last stderr line naming an error, else its last line."""
    for marker in FAILURE_MARKERS:
        for line in reversed(lines):
            if marker in line:
                return line.strip()[:500]
    return lines[-1].strip()[:500] if lines else "(no stderr)"


class Orchestrator:
    """Runs the sides one after the other within the stage's time budget, and keeps every run."""

    def __init__(self, args, work: Workload, inputs: dict | None, logs: Path, peer_python: str):
        self.args, self.base, self.inputs, self.logs = args, work, inputs, logs
        self.peer_python = peer_python
        self.deadline = PROCESS_START + args.budget_s if args.budget_s else None
        self.last_wall: dict[str, float] = {}
        self.runs: list[dict] = []
        self.skipped: list[str] = []
        self.count = 0

    def time_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def affordable(self, side: str, what: str) -> bool:
        expected = self.last_wall.get(side, EXPECTED_SIDE_RUN_S.get((self.base.size, side),
                                                                    EXPECTED_RUN_S.get(self.base.size, 120.0)))
        if self.time_left() < expected:
            self.skipped.append(f"{side} {what}: not started, {self.time_left():.0f} s of the stage's budget left "
                                f"and a run takes ~{expected:.0f} s")
            print(self.skipped[-1], flush=True)
            return False
        return True

    def run(self, side: str, work: Workload, round_index: int | None, candidates: list[int] | None = None,
            profile: bool = False) -> dict | None:
        args = self.args
        what = (f"round {round_index}" if round_index is not None else
                f"rows search, {','.join(str(p * work.group) for p in candidates)} rows" if candidates
                else f"rows {work.rows}")
        if side == "tunix" and args.peer == "none":
            return None
        if not self.affordable(side, what):
            return None
        self.count += 1
        log = self.logs / f"{self.count:02d}-{side}.log"
        timeout = min(args.side_timeout, max(self.time_left(), 1.0))
        if side == "locojax":
            command = [sys.executable, str(Path(__file__).resolve()), "--side", "locojax", "--size", work.size,
                       "--steps", str(args.steps), "--warmup", str(args.warmup), "--plan-refusal", args.plan_refusal,
                       "--prompt-candidates", ",".join(str(p) for p in (candidates or [work.prompts]))]
            if self.inputs:
                command += ["--work", str(args.work)]
            if args.model_preset:
                command += ["--model-preset", args.model_preset]
            command += ["--scan-layers", args.scan_layers, "--lora-rollout", args.lora_rollout,
                        "--early-forward", args.early_forward]
            if args.micro_batch_size:
                command += ["--micro-batch-size", str(args.micro_batch_size)]
            if profile and args.profile_steps:
                command += ["--profile-steps", str(args.profile_steps)]
            if profile and args.host_profile_steps:
                command += ["--host-profile-steps", str(args.host_profile_steps)]
            if profile and args.profile_steps and args.keep_trace:
                command += ["--keep-trace", str(args.keep_trace)]
            if args.compiled_plan:
                command += ["--compiled-plan"]
            command += ["--time-left-s", f"{timeout:.0f}"]
            out = run_side(command, log, side_env(args.platform), timeout)
        else:
            config_path = self.logs / f"{self.count:02d}-peer_config.json"
            config_path.write_text(json.dumps(peer_config(work, args.steps, self.inputs)), encoding="utf-8")
            out = run_side([self.peer_python, str(PEER_SCRIPT), str(config_path)], log,
                           side_env(args.platform, args.peer_path), timeout)
            out["rows"] = work.rows
            if out["ok"]:
                self._peer_figures(out)
        self.last_wall[side] = out["wall_s"]
        out.update(side=side, round=round_index, rows=out.get("rows", work.rows))
        if out["ok"]:
            out["identical_work"] = identical_work(work.with_prompts(out["rows"] // work.group), out["generated"],
                                                   args.steps)
            if not out["identical_work"]["ok"]:
                out["ok"] = False
                out["error"] = "identical-work check: " + "; ".join(out["identical_work"]["problems"])
        print(f"{side:8} {what}: " + (f"median step {statistics.median(out['periods_s']):.3f}s over "
                                      f"{len(out['periods_s'])} steps" if out["ok"] else f"FAILED {out['error']}")
              + f" (run {out['wall_s']:.0f}s, load {out['load_avg_1m'][0]:.2f})", flush=True)
        self.runs.append(out)
        return out

    def _peer_figures(self, out: dict) -> None:
        """The peer's periods, phases and first step trimmed to the steps our side keeps."""
        steps, warmup = self.args.steps, self.args.warmup
        if out["train_steps"] != steps:
            out.update(ok=False, error=f"tunix trained {out['train_steps']} steps, expected {steps}")
            return
        out["first_step_s"] = out["periods_s"][0]  # pull 0 to pull 1: step 0, compilation included
        out["periods_s"] = out["periods_s"][warmup:]  # steps warmup .. steps-2
        out["cpu_s"] = out["cpu_s"][warmup:]
        out["phases_s"] = {k: v[warmup:steps - 1] for k, v in out["phases_s"].items()}


def peer_candidates(work: Workload, capacity_bytes: float, max_prompts: int) -> tuple[list[int], list[dict]]:
    """Size c's prompt counts the peer's own memory estimate (bench/scale.py) puts within the device,
    largest first, and the estimate of every count considered."""
    from locojax.model import get_preset
    from locojax.placement.memory import GiB

    scale = _scale_bench()
    preset = get_preset(work.preset)
    fitting, estimates = [], []
    for prompts in [p for p in C_PROMPTS if p <= max_prompts]:
        estimate = scale.peer_memory_estimate(preset, work.with_prompts(prompts).scale_args(0), work.kl_coef,
                                              lora_rank=work.lora_rank)
        fits = estimate["estimate_gib"] * GiB <= capacity_bytes
        estimates.append({"rows": prompts * work.group, "estimate_gib": estimate["estimate_gib"], "fits": fits})
        if fits:
            fitting.append(prompts)
    return fitting, estimates


def search_rows(orchestrator: Orchestrator, work: Workload, args) -> dict:
    """Size c: each side's largest rows (its own accounting picks, a run verifies), then the rows both
    fit, with a run of the side that ran larger at those rows."""
    ours = orchestrator.run("locojax", work, None, candidates=[p for p in C_PROMPTS if p <= args.max_prompts
                                                               and work.trains_whole_micro_batches(p)])
    record = {"locojax": {"largest_rows": ours["rows"] if ours and ours["ok"] else None,
                          "attempts": ours.get("attempts", []) if ours else []}}
    capacity = ((ours or {}).get("device") or {}).get("bytes_limit")
    if not capacity:  # a CPU shares the host's memory; an accelerator our side could not report on: its size
        capacity = (_scale_bench()._meminfo_gib()["MemAvailable"] if args.platform == "cpu"
                    else args.peer_capacity_gib) * 1024**3
    fitting, estimates = peer_candidates(work, capacity, min(args.max_prompts, args.peer_max_prompts))
    peer_attempts, peer_rows = [], None
    ours_prompts = record["locojax"]["largest_rows"] // work.group if record["locojax"]["largest_rows"] else None
    if args.peer_at_our_rows and ours_prompts and ours_prompts not in fitting[:1]:
        # The peer at our largest rows first, whatever its estimate says: where it cannot run them, its
        # own error says why (the estimate is ours, not the peer's).
        fitting = [ours_prompts] + [p for p in fitting if p < ours_prompts]
    for prompts in fitting:
        out = orchestrator.run("tunix", work.with_prompts(prompts), None)
        if out is None:
            break
        peer_attempts.append({"rows": prompts * work.group, "status": "ran" if out["ok"] else "failed",
                              "error": None if out["ok"] else out["error"], "wall_s": out["wall_s"]})
        if out["ok"]:
            peer_rows = prompts * work.group
            break
    record["peer"] = {"largest_rows": peer_rows, "attempts": peer_attempts, "capacity_gib": capacity / 1024**3,
                      "estimates": estimates,
                      "estimate_note": "bench/scale.py peer_memory_estimate: policy, gradients, AdamW (and a "
                                       "reference at kl > 0) in float32 plus 3 full-vocabulary logits over every "
                                       "slot; activations not counted"}
    sizes = [r for r in (record["locojax"]["largest_rows"], peer_rows) if r]
    record["rows_both_fit"] = min(sizes) if len(sizes) == 2 else None
    both = record["rows_both_fit"]
    if both:
        for side, rows in (("locojax", record["locojax"]["largest_rows"]), ("tunix", peer_rows)):
            if rows != both:
                orchestrator.run(side, work.with_prompts(both // work.group), 0)
        for run in orchestrator.runs:  # the searches that ran at the rows both fit are rounds too
            if run["rows"] == both and run["round"] is None:
                run["round"] = 0
    return record


def run_rounds(orchestrator: Orchestrator, work: Workload, rounds: int, peer_first: bool, first_round: int = 0) -> None:
    """Rounds `first_round` .. `first_round + rounds - 1`, alternating; our side's run in the last round
    trains the profiled steps after its timed ones."""
    for r in range(first_round, first_round + rounds):
        order = ("locojax", "tunix") if (r % 2 == 0) != peer_first else ("tunix", "locojax")
        for side in order:
            orchestrator.run(side, work, r, profile=side == "locojax" and r == first_round + rounds - 1)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _spread(values: list[float]) -> float | None:
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else None


def summarise(per_run: list[dict], rows: int | None = None) -> dict:
    """The size's figures from its runs (of one part, or pooled across parts by bench/tpu_merge.py):
    the runs that completed at `rows` (default: the rows most runs used) with the identical-work check
    passed; each side's step is the median of its pooled steady periods."""
    ok = [run for run in per_run if run.get("ok") and run.get("round") is not None]
    if rows is None and ok:
        rows = statistics.mode(run["rows"] for run in ok)
    ours = [run for run in ok if run["side"] == "locojax" and run["rows"] == rows]
    peer = [run for run in ok if run["side"] == "tunix" and run["rows"] == rows]
    figures: dict = {"rows": rows, "rounds_per_side": {"locojax": len(ours), "peer": len(peer)}}
    if not ours:
        return {**figures, "locojax_step_s": None, "peer_step_s": None, "ratio_vs_peer": None}
    our_periods = [p for run in ours for p in run["periods_s"]]
    locojax_step_s = statistics.median(our_periods)
    our_round_medians = [statistics.median(run["periods_s"]) for run in ours]
    profiles = [run["profile"] for run in ours if run.get("profile") and "error" not in run["profile"]]
    host_profiles = [run["host_profile"] for run in ours if run.get("host_profile")]
    # Each run against its own plan; pooled across parts (bench/tpu_merge.py tags each run with its part's
    # date), the newest part's runs speak for the plan, since an older commit's plan may have changed since.
    peaks = [(run.get("part_date_utc", ""), run["peak_device_gib"], run["planned_gib"]) for run in ours
             if run.get("peak_device_gib") and run.get("planned_gib") and not run.get("peak_device_after_failed_attempt")]
    newest = max(peaks, default=None)
    figures.update({
        "locojax_step_s": locojax_step_s,
        **{name: statistics.median(v for run in ours for v in run["phases_s"][name]) for name in PHASES},
        "locojax_first_step_s": _median(run.get("first_step_s") for run in ours),
        "locojax_first_step_s_per_run": [run.get("first_step_s") for run in ours],
        "locojax_cpu_s_per_step": statistics.median(c for run in ours for c in run["cpu_s"]),
        "locojax_peak_rss_mib": max(run["peak_rss_mib"] for run in ours),
        "locojax_round_medians_s": our_round_medians,
        "locojax_spread": _spread(our_round_medians),
        "device_idle_fraction": profiles[-1]["device_idle_fraction"] if profiles else None,
        "profile": profiles[-1] if profiles else None,
        "host_profile": host_profiles[-1] if host_profiles else None,
        "peak_device_gib": newest[1] if newest else None,
        "planned_gib": newest[2] if newest else ours[0].get("planned_gib"),
        "peak_device_vs_plan": newest[1] / newest[2] if newest else None,
        "peak_device_vs_plan_per_run": [peak / plan for _, peak, plan in peaks],
    })
    if not peer:
        return {**figures, "peer_step_s": None, "ratio_vs_peer": None,
                "identical_work": {"locojax": [run["identical_work"] for run in ours], "peer": []}}
    peer_periods = [p for run in peer for p in run["periods_s"]]
    peer_step_s = statistics.median(peer_periods)
    peer_round_medians = [statistics.median(run["periods_s"]) for run in peer]
    our_cpu = figures["locojax_cpu_s_per_step"]
    peer_cpu = statistics.median(c for run in peer for c in run["cpu_s"])
    figures.update({
        "peer_step_s": peer_step_s,
        "ratio_vs_peer": peer_step_s / locojax_step_s,
        # Runs paired in the order they ran (round r of each side).
        "ratio_per_round": [p / o for p, o in zip(peer_round_medians, our_round_medians)],
        "peer_phases_s": {f"time/{name}": _median(v for run in peer for v in run["phases_s"][name])
                          for name in peer[0]["phases_s"]},
        "peer_first_step_s": _median(run.get("first_step_s") for run in peer),
        "peer_first_step_s_per_run": [run.get("first_step_s") for run in peer],
        "peer_cpu_s_per_step": peer_cpu,
        "cpu_ratio_vs_peer": peer_cpu / our_cpu,
        "peer_peak_rss_mib": max(run["peak_rss_mib"] for run in peer),
        "peer_peak_device_gib": max((run.get("peak_device_gib") or 0.0 for run in peer), default=0.0) or None,
        "peer_round_medians_s": peer_round_medians,
        "peer_spread": _spread(peer_round_medians),
        "identical_work": {"ok": all(run["identical_work"]["ok"] for run in ours + peer),
                           "trained_tokens_per_step": {
                               "locojax": statistics.mean(run["identical_work"]["trained_tokens_per_step"] for run in ours),
                               "peer": statistics.mean(run["identical_work"]["trained_tokens_per_step"] for run in peer)}},
    })
    return figures


def per_run_record(run: dict) -> dict:
    """What a part keeps of one run (the generated-token log is summarised by its identical-work check)."""
    keep = ("side", "round", "rows", "ok", "error", "periods_s", "cpu_s", "phases_s", "first_step_s", "step0_s",
            "setup_and_first_step_s", "total_s", "wall_s", "load_avg_1m", "peak_rss_mib", "peak_device_gib",
            "train_tokens", "steps_completed", "planned_gib", "plan_line", "peak_device_after_failed_attempt",
            "identical_work", "compilation_cache", "profile", "host_profile", "device", "versions",
            "reference_model", "last_step_s", "log", "stderr_tail")
    record = {k: run[k] for k in keep if k in run}
    if record.get("periods_s"):
        record["median_step_s"] = statistics.median(record["periods_s"])
    return record


def workload_record(work: Workload, args) -> dict:
    record = {"size": work.size, "preset": work.preset, "dtype": work.dtype, "devices_per_side": 1,
              "prompts": work.prompts, "group_size": work.group, "rows": work.rows, "new_tokens": work.new_tokens,
              "prompt_slots": work.prompt_slots, "early_stop": False, "temperature": 1.0, "kl_coef": work.kl_coef,
              "remat": work.remat, "num_iterations": NUM_ITERATIONS, "scan_layers": work.scan_layers,
              "early_forward": work.early_forward,
              "micro_batch_size": work.micro_batch_size}
    if work.lora_rank:
        record.update(lora={"rank": work.lora_rank, "alpha": work.lora_alpha, "targets": LORA_TARGETS,
                            "rollout": work.lora_rollout,
                            "peer": "qwix LoraProvider on every linear layer (Tunix's own recipe)"})
    if work.scale_inputs:
        weights = "random-weight HF directory" if work.hf_weights else "the preset's random init on each side"
        record.update(task=f"gsm8k (bench/scale.py's JSONL and tokenizer.json; {weights})",
                      spec="bench/scale.py make_spec (kl_coef 0, lr 1e-6, the spec's default clipping and "
                           "loss aggregation)", group_varies_by="prompts (rows search)")
    else:
        record.update(task="arith d1", reward="gsm8k strict (#### N)", kl_estimator="k3 (Tunix low_var_kl)",
                      clip_eps=[CLIP_EPS, CLIP_EPS], loss_agg="seq_mean_token_mean", optimizer="AdamW + clip 1.0")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="a")
    parser.add_argument("--early-forward", choices=("true", "false"), default="false",
                        help="our side's placement.early_forward (default false, the engine's default)")
    parser.add_argument("--scan-layers", choices=("auto", "true", "false"), default="auto",
                        help="our side's model.scan_layers (default auto: the engine's choice for the platform)")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="our side's algo.micro_batch_size (rows per gradient micro-batch, the same update; e.g. "
                             "16 lets the 4B LoRA train step fit 64 rows, whose whole batch the plan refused); "
                             "the peer trains its whole batch")
    parser.add_argument("--lora-rollout", choices=("adapters", "merged"), default="adapters",
                        help="size lora, our side's model.lora.rollout (default adapters)")
    parser.add_argument("--peer", choices=("tunix", "none"), default="tunix",
                        help="none: our side's runs alone (e.g. two settings of ours, each its own part, with the "
                             "peer's runs from another part; bench/tpu_merge.py pools them per setting)")
    parser.add_argument("--platform", choices=("cpu", "tpu"), default="cpu",
                        help="where both sides run; tpu: JAX_PLATFORMS unset, the peer from --peer-python")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 9; size c 6)")
    parser.add_argument("--warmup", type=int, default=2, help="leading steps dropped per run (default 2)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="runs per side, alternating L T, T L, ... (default 4; ~35 min on 2 busy cores)")
    parser.add_argument("--peer-first", action="store_true", help="start the alternation with the peer")
    parser.add_argument("--rows", default=None,
                        help="size c: 'search' (each side's largest rows, then the rows both fit) or a row count")
    parser.add_argument("--rows-from", type=Path, default=None,
                        help="size c: the rows both fit, from the part of an earlier --rows search")
    parser.add_argument("--max-prompts", type=int, default=max(C_PROMPTS), help="size c search: at most this many prompts")
    parser.add_argument("--peer-max-prompts", type=int, default=max(C_PROMPTS), help=argparse.SUPPRESS)
    parser.add_argument("--peer-at-our-rows", action="store_true",
                        help="rows search: the peer first tries our largest rows even where its memory estimate "
                             "says they will not fit, so a failure there is recorded with the peer's own error")
    parser.add_argument("--peer-capacity-gib", type=float, default=15.75,
                        help="size c search: device memory the peer's estimate is held against when our side "
                             "could not report it (default: a TPU v5e's 15.75 GiB)")
    parser.add_argument("--plan-refusal", choices=("on", "off"), default="on",
                        help="off: our side also tries rows its memory plan refuses (recorded per attempt)")
    parser.add_argument("--peer-python", default=None, help="a Python that imports Tunix with --peer-path "
                                                            "(default on a CPU: the bench's own venv)")
    parser.add_argument("--peer-path", default=None, help="the PYTHONPATH the peer runs with")
    parser.add_argument("--side-timeout", type=float, default=3600.0, help="wall-clock limit of one run (s)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the stage's time: no run is started that would not finish within it")
    parser.add_argument("--profile-steps", type=int, default=None,
                        help="steps profiled after our side's last timed run (default 3 on a TPU, 0 on a CPU)")
    parser.add_argument("--keep-trace", type=Path, default=None,
                        help="copy the profiled steps' raw trace (*.xplane.pb) to this file")
    parser.add_argument("--host-profile-steps", type=int, default=None,
                        help="steps run under cProfile after the profiled ones, in the same run (default 3 on "
                             "a TPU, 0 on a CPU)")
    parser.add_argument("--work", type=Path, default=None, help="size c: where its inputs are built (default: temp)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench/results/grpo_step.json on a CPU at size a; required otherwise")
    parser.add_argument("--stage", default=None, help="the bench/tpu.sh stage this part is (recorded)")
    parser.add_argument("--logs", type=Path, default=None, help="where each run's stderr goes (default: temp)")
    parser.add_argument("--side", choices=["locojax"], help=argparse.SUPPRESS)  # internal
    parser.add_argument("--prompt-candidates", type=lambda s: [int(p) for p in s.split(",") if p],
                        default=None, help=argparse.SUPPRESS)  # internal
    parser.add_argument("--time-left-s", type=float, default=None, help=argparse.SUPPRESS)  # internal
    # Development only: our side plans memory as on an accelerator (compiled programs), on a CPU.
    parser.add_argument("--compiled-plan", action="store_true", help=argparse.SUPPRESS)
    # Development only: size c at a small preset, to check its paths on a CPU.
    parser.add_argument("--model-preset", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 6 if args.size == "c" else 5 if args.size == "lora" else 9
    if args.profile_steps is None:
        args.profile_steps = 3 if args.platform == "tpu" else 0
    if args.host_profile_steps is None:
        args.host_profile_steps = 3 if args.platform == "tpu" else 0
    if args.steps < args.warmup + 2 or args.warmup < 1:
        parser.error("need warmup >= 1 and steps >= warmup + 2")
    if args.side == "locojax":
        locojax_side(args)
        return
    if args.out is None:
        if args.platform != "cpu" or args.size != "a":
            parser.error("--out is required except for size a on a CPU")
        args.out = RESULTS
    if args.platform != "cpu" and not args.peer_python and args.peer != "none":
        parser.error("--platform tpu needs --peer-python (and --peer-path): nothing is installed at benchmark time")
    if not SIZES[args.size].scale_inputs and (args.rows or args.rows_from):
        parser.error("--rows and --rows-from are for sizes c and lora")

    from bench.tpu_merge import part_header

    work = workload_from_args(args)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="grpo-step-bench-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    inputs = None
    if work.scale_inputs:
        args.work = args.work or Path(tempfile.mkdtemp(prefix="grpo-step-c-"))
        args.work.mkdir(parents=True, exist_ok=True)
        inputs = prepare_scale_inputs(args.work, work.preset, weights=work.hf_weights)
    peer_python = args.peer_python or ("" if args.peer == "none" else str(ensure_peer_venv()))
    orchestrator = Orchestrator(args, work, inputs, logs, peer_python)
    load_start = os.getloadavg()
    rows_search = None
    if work.scale_inputs:
        if args.rows == "search":
            rows_search = search_rows(orchestrator, work, args)
            if rows_search["rows_both_fit"] and args.rounds > 1:  # the search's runs at those rows are round 0
                run_rounds(orchestrator, work.with_prompts(rows_search["rows_both_fit"] // work.group),
                           args.rounds - 1, args.peer_first, first_round=1)
            work = work.with_prompts((rows_search["rows_both_fit"] or work.rows) // work.group)
        else:
            rows = (json.loads(args.rows_from.read_text())["rows_search"]["rows_both_fit"] if args.rows_from
                    else int(args.rows) if args.rows else work.rows)
            if not rows:
                raise SystemExit(f"{args.rows_from}'s rows search found no rows both sides fit (its rows_search "
                                 f"says why); give the rows (--rows N) to measure anyway")
            if rows % work.group:
                raise SystemExit(f"size c needs rows that are a multiple of the group {work.group}, got {rows}")
            work = work.with_prompts(rows // work.group)
            run_rounds(orchestrator, work, args.rounds, args.peer_first)
    else:
        run_rounds(orchestrator, work, args.rounds, args.peer_first)
    load_end = os.getloadavg()

    per_run = [per_run_record(run) for run in orchestrator.runs]
    figures = summarise(per_run, work.rows)
    device = next((run["device"] for run in orchestrator.runs if run.get("device")), {})
    import jax

    result = {
        "benchmark": "grpo_step", "size": work.size,
        **part_header(args.stage, platform=device.get("platform", args.platform),
                      device_kind=device.get("device_kind")),
        **figures,
        "rows_search": rows_search,
        "skipped": orchestrator.skipped,
        "notes": [
            "time/train on our side includes the reference log-prob pass for the KL term (co.py times it there); "
            "the peer's reference pass is its time/reference",
            "peer phases are wrappers around RLCluster.generate / get_ref_per_token_logps / update_actor, "
            "for orientation only",
            "first_step_s: ours is time/setup + step 0's time/step (from the mode's setup, where the compiled "
            "memory plan compiles the step's programs, to the end of step 0); the peer's its first period "
            "(batch pull 0 to pull 1); both compile cold "
            "(JAX_ENABLE_COMPILATION_CACHE=false, per run `compilation_cache`)",
            "on a shared CPU compare per-run figures with their load averages; cpu_ratio_vs_peer is the less "
            "load-sensitive cross-check",
        ],
        "peer": f"tunix {PEER_PACKAGE.split('==')[1]} GRPOLearner (vanilla rollout, Qwen3 of identical dims)",
        "workload": workload_record(work, args),
        "method": {
            "steps_per_run": args.steps, "warmup_dropped": args.warmup, "last_step_dropped": True,
            "runs_per_side": args.rounds, "order": "alternating (L T, T L, ...)"
                                                   + (", peer first" if args.peer_first else ""),
            "statistic": "median of pooled steady-state step periods",
            "phase_statistic": "median per phase over the same steps (phases need not add up to the median step)",
            "profile_steps": args.profile_steps,
            "compilation_cache": "off on both sides (JAX_ENABLE_COMPILATION_CACHE=false)",
        },
        "per_run": per_run,
        "machine": {"cpus": os.cpu_count(), "jax": jax.__version__,
                    "peer_versions": next((run["versions"] for run in orchestrator.runs
                                           if run["side"] == "tunix" and run.get("versions")), None),
                    "load_avg_start": list(load_start), "load_avg_end": list(load_end)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print_table(result)
    print(f"wrote {args.out}; side logs in {logs}")
    if result["ratio_vs_peer"] is None:
        print("ratio_vs_peer=none")
        sys.exit(0 if args.peer == "none" and result["locojax_step_s"] is not None else 1)
    print(f"ratio_vs_peer={result['ratio_vs_peer']:.2f}")


def prepare_scale_inputs(work_dir: Path, preset: str, weights: bool = True) -> dict:
    """bench/scale.py's inputs in `work_dir`: built once (deterministic in the seed), reused after;
    without `weights`, its tokenizer and JSONL alone."""
    scale = _scale_bench()
    paths = scale.input_paths(work_dir, preset)
    if not (((paths["model"] / "config.json").is_file() or not weights) and paths["tokenizer"].is_file()
            and paths["data"].is_file()):
        print(f"building bench/scale.py's {preset} inputs in {work_dir} ...", flush=True)
        paths = scale.build_inputs(work_dir, SEED, preset, weights=weights)
    return {k: str(v) for k, v in paths.items()}


def print_table(result: dict) -> None:
    runs = [r for r in result["per_run"] if r.get("ok") and r.get("rows") == result["rows"] and r["round"] is not None]
    print(f"\nsize {result['size']}, {result['rows']} rows, on {result['platform']} ({result.get('device_kind')})")
    print(f"{'':30}{'step s':>9}{'min':>8}{'max':>8}{'n':>4}")
    for side, name in (("locojax", "locojax (CO loop)"), ("tunix", "tunix 0.1.7 GRPOLearner")):
        periods = [p for r in runs if r["side"] == side for p in r["periods_s"]]
        if periods:
            print(f"{name:30}{statistics.median(periods):9.3f}{min(periods):8.3f}{max(periods):8.3f}{len(periods):4d}")
    if result.get("peer_phases_s"):
        print("tunix phases (median s): " + "  ".join(f"{k} {v:.3f}" for k, v in result["peer_phases_s"].items()
                                                       if v is not None))
    if result.get("locojax_step_s"):
        print("locojax phases (median s): " + "  ".join(
            f"{k.split('/')[1]} {result[k]:.3f}" for k in PHASES if k not in ("time/network", "time/checkpoint")))
    if result.get("device_idle_fraction") is not None:
        print(f"device_idle_fraction {result['device_idle_fraction']:.3f} "
              f"({result['profile']['source']['kind']})")
    for line in result["skipped"]:
        print("skipped: " + line)


if __name__ == "__main__":
    main()

"""Does LoRA GRPO learn? Its held-out accuracy gain next to full fine-tuning's, from the same start.

On the demo task (locojax.demo: arith difficulty 0, the `small` preset, CO on one host) this script runs
one SFT warm start, then GRPO runs from its exported model with the same seed, steps and rollout: full
fine-tuning and LoRA (rank 16, alpha 32, every projection), each over a small learning-rate grid fixed
before the runs (`--full-lrs`, `--lora-lrs`). The headline is `ratio` = LoRA's held-out greedy-accuracy
gain / full fine-tuning's, each at its own selected learning rate (issue 40's target: >= 0.8).

Three disjoint prompt sets, none of which the GRPO runs train on:
* every GRPO run's eval block asks for `--eval-prompts` + `--val-prompts` held-out prompts, so the
  engine's training view skips all of them (locojax.tasks.held_out: generated tasks hold out the
  first distinct prompts past the training range, and training skips any example with such a prompt);
* the first `--eval-prompts` of that list are the held-out *test* prompts (the same first prompts a
  run with `eval.prompts = --eval-prompts` holds out), the next `--val-prompts` the *validation* prompts.
Selection (`choose_lr`): each candidate's final model is scored greedily on the validation prompts
only; per method, the learning rate with the highest validation accuracy wins (ties: the lower rate).
Only the two selected runs are then scored on the test prompts, once, before (the SFT model: fresh
adapters add exactly zero, checked on the validation prompts) and after. Same seed and steps means
re-running a selected candidate would reproduce it, so its selection run is its final run.

The engine's own in-run evaluation (greedy, k=1, on test + validation together, at step 0 and after
the last step) cannot be switched off while keeping the split; this script ignores its figures.

The machine is shared: the 1-minute load average is recorded at the start and end of every run, with
each run's wall time, GRPO seconds per step and evaluation seconds. Run it under the shared lock:

    flock /tmp/locojax-heavy.lock .venv/bin/python bench/lora_learning.py

Writes bench/results/lora_learning.json after every run (`complete: false` until the end) and prints a
table. A file's earlier headline is kept under `earlier` (results are never overwritten away).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "bench" / "results" / "lora_learning.json"
TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
TARGET_RATIO = 0.8
SELECTION_RULE = ("highest greedy accuracy on the validation prompts after the last GRPO step, among runs that "
                  "succeeded; ties go to the lower learning rate")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_lrs(text: str, field: str) -> list[float]:
    """A comma-separated list of positive learning rates, e.g. `3e-4,1e-3`; errors name `field`."""
    try:
        lrs = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not a comma-separated list of numbers") from None
    if not lrs:
        raise ValueError(f"{field}: give at least one learning rate")
    if any(not lr > 0 for lr in lrs):
        raise ValueError(f"{field}: learning rates must be positive (got {text!r})")
    if len(set(lrs)) != len(lrs):
        raise ValueError(f"{field}: {text!r} repeats a learning rate")
    return lrs


def split_eval_prompts(held_out: Sequence, test_count: int, val_count: int) -> tuple[list, list]:
    """(test, validation): the first `test_count` held-out examples and the `val_count` after them."""
    if len(held_out) != test_count + val_count:
        raise ValueError(f"expected {test_count} + {val_count} held-out prompts, the task gave {len(held_out)}")
    test, val = list(held_out[:test_count]), list(held_out[test_count:])
    if {e.prompt for e in test} & {e.prompt for e in val}:
        raise ValueError("test and validation prompts overlap")
    return test, val


def choose_lr(candidates: Sequence[dict]) -> tuple[float, str]:
    """The selected learning rate of one method and why (`SELECTION_RULE`). Each candidate: {"lr",
    "status", "val_accuracy"}; runs that did not succeed are never chosen."""
    eligible = [c for c in candidates if c["status"] == "succeeded" and c.get("val_accuracy") is not None]
    if not eligible:
        raise ValueError("no candidate run succeeded; nothing to select")
    best = max(eligible, key=lambda c: (c["val_accuracy"], -c["lr"]))
    others = ", ".join(f"{c['lr']:g}: {c['val_accuracy']:.4f}" for c in eligible if c is not best)
    tied = [c["lr"] for c in eligible if c is not best and c["val_accuracy"] == best["val_accuracy"]]
    skipped = [c["lr"] for c in candidates if c not in eligible]
    reason = (f"lr {best['lr']:g} has the highest validation accuracy ({best['val_accuracy']:.4f}; others "
              f"{others or 'none'})"
              + (f"; tied with {', '.join(f'{lr:g}' for lr in tied)}: the lower rate wins" if tied else "")
              + (f"; not eligible (failed): {skipped}" if skipped else ""))
    return best["lr"], reason


def _timed_run(spec) -> dict:
    from locojax import metrics as m
    from locojax.contract import METRICS_FILE
    from locojax.runner import run_mode

    shutil.rmtree(spec.output_dir, ignore_errors=True)
    load_start, start = os.getloadavg()[0], time.perf_counter()
    result = run_mode(spec, console=False)
    wall = time.perf_counter() - start
    records = m.read_jsonl(Path(spec.output_dir) / METRICS_FILE)
    steps = [r for r in records if r.get("host") == m.ALL_HOSTS and m.TIME_STEP in r]
    out = {"status": result.status, "steps_done": result.steps_done, "wall_s": round(wall, 1),
           "load_avg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
           "s_per_step": round(sum(r[m.TIME_STEP] for r in steps[1:]) / max(1, len(steps) - 1), 3),
           "checkpoint_bytes": result.checkpoint_bytes}
    if spec.kind == "grpo":
        rewards = [r[m.REWARD_MEAN] for r in steps if m.REWARD_MEAN in r]
        if rewards:
            out.update(reward_first10=round(sum(rewards[:10]) / len(rewards[:10]), 4),
                       reward_last10=round(sum(rewards[-10:]) / len(rewards[-10:]), 4))
    else:
        out["final_loss"] = result.final_metrics.get(m.LOSS_SFT)
    return out


class _Scorer:
    """Greedy accuracy of one method's models (full or LoRA: their param trees differ) on the test and
    validation prompts, each compiled once."""

    def __init__(self, spec, test: list, val: list):
        import jax

        from locojax.evaluate import Evaluator, eval_rewards
        from locojax.policy import load_policy
        from locojax.spec import EvalSpec
        from locojax.tasks import make_task

        greedy_only = EvalSpec(every=0, prompts=len(test) + len(val), k=1)
        self.spec, self.policy = spec, load_policy(spec)
        self.start_params = self.policy.params  # the SFT model (with LoRA: plus fresh, zero-effect adapters)
        names = eval_rewards(greedy_only, make_task(spec.task))  # the task's own correctness rewards
        self.evaluators = {"test": Evaluator(spec, greedy_only, self.policy, test, names, 0, jax.local_devices()),
                           "val": Evaluator(spec, greedy_only, self.policy, val, names, 0, jax.local_devices())}

    def trained_params(self, run_spec):
        """The final params of the run `run_spec` (its latest checkpoint) in this scorer's tree."""
        from locojax.commands import restore_trained_params

        restore_trained_params(run_spec, self.policy, Path(run_spec.output_dir))
        params, self.policy.params = self.policy.params, self.start_params
        return params

    def accuracy(self, split: str, params) -> tuple[float, float]:
        """(greedy accuracy, seconds) on `split` ("test" or "val")."""
        start = time.perf_counter()
        counts = self.evaluators[split](params)
        return round(counts.correct / counts.prompts, 4), round(time.perf_counter() - start, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/locojax-lora-learning"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--grpo-steps", type=int, default=200)
    parser.add_argument("--full-lrs", default="1e-4,5e-5,2e-4",
                        help="full fine-tuning's grid; the first runs before the LoRA grid, the rest after it")
    parser.add_argument("--lora-lrs", default="3e-4,6e-4,1e-3,2e-3", help="LoRA's grid")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--eval-prompts", type=int, default=1024, help="held-out test prompts")
    parser.add_argument("--val-prompts", type=int, default=512, help="validation prompts (learning-rate selection)")
    parser.add_argument("--result", type=Path, default=RESULT,
                        help="where to write the JSON (another file for a run at other settings)")
    args = parser.parse_args()
    try:
        full_lrs, lora_lrs = parse_lrs(args.full_lrs, "--full-lrs"), parse_lrs(args.lora_lrs, "--lora-lrs")
    except ValueError as exc:
        parser.error(str(exc))
    for field, value in (("--eval-prompts", args.eval_prompts), ("--val-prompts", args.val_prompts)):
        if value < 1:
            parser.error(f"{field} must be at least 1 (got {value})")

    from locojax.commands import configure_jax

    configure_jax(1)
    from locojax.demo import demo_specs
    from locojax.spec import RunSpec
    from locojax.tasks import load_task_data

    sft, grpo = demo_specs(args.out, args.grpo_steps, args.seed, args.sft_steps)
    # Both sets held out of every GRPO run's training; the engine's own evaluation of them is ignored.
    evaluation = {**grpo.eval.model_dump(), "every": 0, "prompts": args.eval_prompts + args.val_prompts, "k": 1}
    lora = {"rank": args.rank, "alpha": args.alpha, "targets": TARGETS}

    def grpo_spec(name: str, lr: float, with_lora: bool) -> RunSpec:
        body = grpo.model_dump(mode="json")
        body.update(name=name, output_dir=str(args.out / name), eval=evaluation,
                    optim={**body["optim"], "lr": lr}, checkpoint={"every": 0, "keep": 1})
        if with_lora:
            body["model"] = {**body["model"], "lora": lora}
        return RunSpec.model_validate(body)

    test, val = split_eval_prompts(load_task_data(grpo.task, RunSpec.model_validate(
        {**grpo.model_dump(mode="json"), "eval": evaluation}).eval).held_out, args.eval_prompts, args.val_prompts)

    earlier = None
    if args.result.is_file():
        previous = json.loads(args.result.read_text(encoding="utf-8"))
        if previous.get("complete", True):  # a finished result, not this script's own partial file
            earlier = {key: previous[key] for key in previous if key != "earlier"}
            earlier["earlier"] = previous.get("earlier")

    result = {
        "commit": _commit(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cores": len(os.sched_getaffinity(0)), "complete": False,
        "setting": {"task": "arith difficulty 0 (locojax.demo)", "preset": "small", "seed": args.seed,
                    "sft_steps": args.sft_steps, "grpo_steps": args.grpo_steps, "lora": lora,
                    "rollout": grpo.rollout.model_dump(), "warmup_steps": grpo.optim.warmup_steps,
                    "full_lr_grid": full_lrs, "lora_lr_grid": lora_lrs},
        "eval_prompts": args.eval_prompts, "val_prompts": args.val_prompts,
        "selection_rule": SELECTION_RULE, "target_ratio": TARGET_RATIO,
        "runs": {}, "earlier": earlier,
    }

    def save() -> None:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    result["runs"]["sft"] = _timed_run(sft)
    save()
    scorers = {"full": _Scorer(grpo_spec("score-full", full_lrs[0], False), test, val),
               "lora": _Scorer(grpo_spec("score-lora", lora_lrs[0], True), test, val)}
    start_val = {method: scorer.accuracy("val", scorer.start_params)[0] for method, scorer in scorers.items()}
    if start_val["full"] != start_val["lora"]:
        raise RuntimeError(f"fresh adapters changed the SFT model's validation accuracy: {start_val}")
    result["val_accuracy_before"] = start_val["full"]

    order = [("full", full_lrs[0])] + [("lora", lr) for lr in lora_lrs] + [("full", lr) for lr in full_lrs[1:]]
    candidates: dict[str, list[dict]] = {"full": [], "lora": []}
    specs = {}
    for method, lr in order:
        name = f"grpo-{method}-lr{lr:g}"
        spec = specs[(method, lr)] = grpo_spec(name, lr, method == "lora")
        run = _timed_run(spec)
        run.update(method=method, lr=lr, val_accuracy=None)
        if run["status"] == "succeeded":
            run["val_accuracy"], run["val_eval_s"] = scorers[method].accuracy(
                "val", scorers[method].trained_params(spec))
        result["runs"][name] = run
        candidates[method].append(run)
        result["selection"] = {m_: [{k: c[k] for k in ("lr", "status", "val_accuracy", "reward_first10",
                                                       "reward_last10") if k in c} for c in cs]
                               for m_, cs in candidates.items()}
        save()

    chosen = {}
    for method in ("full", "lora"):
        lr, reason = choose_lr(candidates[method])
        scorer = scorers[method]
        before, before_s = scorer.accuracy("test", scorer.start_params)
        after, after_s = scorer.accuracy("test", scorer.trained_params(specs[(method, lr)]))
        chosen[method] = {"lr": lr, "why": reason, "run": f"grpo-{method}-lr{lr:g}", "test_accuracy_before": before,
                          "test_accuracy_after": after, "gain": round(after - before, 4),
                          "test_eval_s": [before_s, after_s]}
    full_gain, lora_gain = chosen["full"]["gain"], chosen["lora"]["gain"]
    ratio = lora_gain / full_gain if full_gain > 0 else None
    result.update(full_lr=chosen["full"]["lr"], lora_lr=chosen["lora"]["lr"], full_gain=full_gain,
                  lora_gain=lora_gain, ratio=None if ratio is None else round(ratio, 3),
                  meets_target=ratio is not None and ratio >= TARGET_RATIO, chosen=chosen, complete=True,
                  finished_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    save()

    print(f"validation accuracy before GRPO {result['val_accuracy_before']:.4f} ({args.val_prompts} prompts)")
    print(f"{'run':24} {'val acc':>8} {'reward 1st10':>12} {'last10':>7} {'s/step':>7} {'wall s':>7} load")
    for name, r in result["runs"].items():
        if name == "sft":
            continue
        print(f"{name:24} {r['val_accuracy'] if r['val_accuracy'] is not None else float('nan'):8.4f} "
              f"{r.get('reward_first10', float('nan')):12.4f} {r.get('reward_last10', float('nan')):7.4f} "
              f"{r['s_per_step']:7.3f} {r['wall_s']:7.1f} {r['load_avg_1m']}")
    for method, c in chosen.items():
        print(f"{method}: lr {c['lr']:g} ({c['why']}); test ({args.eval_prompts} prompts) "
              f"{c['test_accuracy_before']:.4f} -> {c['test_accuracy_after']:.4f} ({c['gain']:+.4f})")
    print(f"ratio (LoRA gain / full gain) = {result['ratio']} (target >= {TARGET_RATIO}) -> {args.result}")


if __name__ == "__main__":
    main()

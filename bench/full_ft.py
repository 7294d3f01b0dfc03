"""Full fine-tuning of the largest Qwen3 preset the memory plan lets onto one chip, run to confirm the plan
(issue 40: beside LoRA's models, the largest a full-weight GRPO run fits).

    python bench/full_ft.py --platform tpu --out OUTDIR/part_full-ft.json [--presets qwen3-1.7b,qwen3-0.6b]

Tries the presets from the largest down, each as bench/scale.py runs `locojax train` (bfloat16, remat full,
LoRA's workload: 96 prompt + 256 new tokens, 64 rows, kl_coef 0): a preset the engine's plan refuses
(on an accelerator the compiled plan, whose refusal names the term that overflows) is recorded with the
refusal and the next is tried; the first that runs is the answer, its steps, device peak and plan
recorded (`peak_device_vs_plan`). A run that fails otherwise is recorded as failed, and the search stops:
a crash says nothing about what fits. The part is bench/tpu.sh's `full-ft` stage; bench/tpu_merge.py puts
it in lora_tpu.json under `full_ft`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Largest first. Not Qwen3-4B: its bfloat16 weights and their gradients alone are 16 GB, a whole v5e, before
# any optimizer state, and building its random checkpoint would take a minute of the stage for a certain no.
DEFAULT_PRESETS = ("qwen3-1.7b", "qwen3-0.6b")
RUN_KEYS = ("model", "steps_completed", "step_s", "step_s_rounds", "rollout_tokens_per_s", "planned_gib",
            "plan_line", "peak_device_gib", "peak_device_vs_plan", "first_step_s_cold", "setup_parts_s", "batch",
            "wall_s")


def scale_command(args: argparse.Namespace, preset: str, out: Path, work: Path) -> list[str]:
    return [sys.executable, str(ROOT / "bench" / "scale.py"), "--platform", args.platform, "--stage", "full-ft",
            "--no-rest", "--no-peer", "--skip-limits", "--rounds", "1", "--steps", str(args.steps),
            "--model-preset", preset, "--dtype", "bfloat16", "--remat", "full", "--prompts", str(args.prompts),
            "--group", str(args.group), "--prompt-tokens", str(args.prompt_tokens), "--new-tokens",
            str(args.new_tokens), "--work", str(work), "--out", str(out),
            "--load-note", "one chip, nothing else on it"]


def refusal_line(text: str) -> str | None:
    """The engine's refusal in a failed run's output, if that is why it failed."""
    from locojax.placement.memory import DOES_NOT_FIT

    for line in text.splitlines():
        if DOES_NOT_FIT in line:
            return line.strip()[:1500]
    return None


def attempt(args: argparse.Namespace, preset: str) -> tuple[dict, dict | None]:
    """(what happened to `preset`, the scale JSON of a run that ran)."""
    work = args.work / preset
    work.mkdir(parents=True, exist_ok=True)
    out = work / "scale.json"
    started = time.monotonic()
    done = subprocess.run(scale_command(args, preset, out, work), capture_output=True, text=True)
    record = {"preset": preset, "wall_s": round(time.monotonic() - started, 1)}
    if done.returncode == 0 and out.is_file():
        return {**record, "status": "ran"}, json.loads(out.read_text(encoding="utf-8"))
    text = done.stdout + done.stderr
    refused = refusal_line(text)
    if refused:
        return {**record, "status": "refused by the memory plan", "refusal": refused}, None
    return {**record, "status": "failed", "exit_status": done.returncode, "output_tail": text[-2000:]}, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default="cpu")
    parser.add_argument("--presets", default=",".join(DEFAULT_PRESETS),
                        help="comma-separated, largest first (bench/scale.py's --model-preset forms)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="steps of the run that fits (the first compiles)")
    parser.add_argument("--work", type=Path, required=True, help="each preset's inputs and run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    presets = [name for name in args.presets.split(",") if name]
    if not presets:
        parser.error("--presets: name at least one preset")
    from bench.tpu_merge import part_header

    attempts, ran = [], None
    for preset in presets:
        record, result = attempt(args, preset)
        attempts.append(record)
        print(json.dumps(record)[:600], flush=True)
        if record["status"] != "refused by the memory plan":
            ran = result
            break
    run = {key: ran.get(key) for key in RUN_KEYS} if ran else None
    part = {"benchmark": "full_ft",
            **part_header("full-ft", platform=(ran or {}).get("platform", args.platform),
                         device_kind=(ran or {}).get("device_kind")),
            "workload": {"dtype": "bfloat16", "remat": "full", "prompts": args.prompts, "group_size": args.group,
                         "rows": args.prompts * args.group, "prompt_tokens": args.prompt_tokens,
                         "new_tokens": args.new_tokens, "kl_coef": 0.0, "lora": None},
            "attempts": attempts,
            "largest_preset_that_fits": attempts[-1]["preset"] if ran else None,
            "run": run}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(part, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: largest preset that fits: {part['largest_preset_that_fits']}", flush=True)
    if ran is None:
        sys.exit(1)


if __name__ == "__main__":
    main()

"""The parts of a TPU refresh (bench/tpu.sh): what each part records about the source it measured, and
the merge of the parts into bench/results/grpo_step_tpu.json and bench/results/scale_tpu.json.

    python3 bench/tpu_merge.py PARTS_DIR [--out-dir bench/results]

Every stage of bench/tpu.sh writes one part, `part_<stage>.json`, headed by `part_header`: the stage,
the commit (LOCOJAX_BENCH_COMMIT where set, which wins over a copied checkout's .git, else git; as bench/tpu.sh
was given it), whether tracked files differed from it (`dirty`, null where git cannot say), a sha256
over the engine's and the benchmarks' sources (`source_digest`, comparable with or without git), the
UTC date, the platform and device kind. A refresh may span sessions; the lead commits the parts under
bench/results/tpu_parts/ and merges them, on any machine (no JAX needed):
  * grpo_step_tpu.json: `sizes` a, b, c from the parts of bench/grpo_step.py, each size's runs pooled
    over its parts (size c: the rows-search part and the rounds parts at the rows both sides fit) and
    summarised by bench/grpo_step.py's own `summarise`;
  * scale_tpu.json: the `scale` part (bench/scale.py's 0.6B bf16 rounds), completed by the `limits`
    part's machine limits (bench/scale.py `apply_limits`) and the `tests` part's `tpu_tests`;
  * lora_tpu.json: the `lora-*` parts (bench/grpo_step.py --size lora, one model each; `merge_lora`), and
    the `full-ft` part (bench/full_ft.py: the largest preset a full-weight run fits) under `full_ft`.
  * train_variants_tpu.json: the train-variants stage's runs, copied under PARTS_DIR/train_variants/
    (`merge_train_variants`).
The first three list their parts (`parts`: file, stage, commit, date) and say `mixed_commits: true` when the parts
measured different sources.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

COMMIT_VARIABLE = "LOCOJAX_BENCH_COMMIT"
SOURCE_DIRS = ("locojax", "bench")
GRPO_SIZES = ("a", "b", "c")
# The bar for each size (ratio_vs_peer at least this), and its goal.
TARGETS = {"a": {"ratio_vs_peer": 1.3, "goal": 2.0}, "b": {"ratio_vs_peer": 1.5, "goal": 2.0},
           "c": {"ratio_vs_peer": 1.35, "goal": 1.6}}


def _git(*command: str) -> str | None:
    try:
        done = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_digest(root: Path = ROOT) -> str:
    """sha256 over the paths and bytes of the engine's and the benchmarks' sources (*.py, *.sh)."""
    digest = hashlib.sha256()
    for folder in SOURCE_DIRS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".py", ".sh") and path.is_file() and ".peer-venvs" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def source_state() -> dict:
    # A commit named by the caller wins: a copied checkout (a device machine's) may carry a stale .git.
    if os.environ.get(COMMIT_VARIABLE):
        return {"commit": os.environ[COMMIT_VARIABLE], "commit_from": COMMIT_VARIABLE, "dirty": None,
                "git_head_here": _git("rev-parse", "HEAD"), "source_digest": source_digest()}
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    if commit:
        origin = "git"
    else:
        commit, origin = "unknown", "none (no .git here and no " + COMMIT_VARIABLE + ")"
    return {"commit": commit, "commit_from": origin, "dirty": None if status is None else bool(status),
            "source_digest": source_digest()}


def part_header(stage: str | None, *, platform: str, device_kind: str | None) -> dict:
    """What every part records about what it measured, where and when."""
    return {"stage": stage, **source_state(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "platform": platform, "device_kind": device_kind}


def load_parts(parts_dir: Path) -> list[dict]:
    """Every `part_*.json` in `parts_dir`, oldest first, each with its file name under `_file`."""
    parts = []
    for path in sorted(parts_dir.glob("part_*.json")):
        if path.name.endswith(".partial.json"):  # bench/scale.py's phases so far, of a stage that failed
            continue
        try:
            part = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise SystemExit(f"{path}: not JSON ({error})") from None
        part["_file"] = path.name
        parts.append(part)
    return sorted(parts, key=lambda part: (part.get("date_utc") or "", part["_file"]))


def parts_record(parts: list[dict]) -> tuple[list[dict], bool]:
    """The parts' provenance, and whether they measured different sources (commits or source digests
    differ; a part measured with uncommitted changes says so in its own `dirty`)."""
    record = [{"file": part["_file"], "stage": part.get("stage"), "commit": part.get("commit"),
               "dirty": part.get("dirty"), "source_digest": part.get("source_digest"),
               "date_utc": part.get("date_utc"), "device_kind": part.get("device_kind")} for part in parts]
    mixed = len({p["commit"] for p in record}) > 1 or len({p["source_digest"] for p in record}) > 1
    return record, mixed


def merged_commit(record: list[dict]) -> str:
    """The commit the merged figures measured: the parts' one commit, else theirs joined (mixed_commits)."""
    return ", ".join(dict.fromkeys(str(p["commit"]) for p in record))


def _platform(parts: list[dict]) -> tuple[str | None, str | None]:
    platforms = sorted({part.get("platform") for part in parts if part.get("platform")})
    kinds = sorted({part.get("device_kind") for part in parts if part.get("device_kind")})
    return (", ".join(platforms) or None), (", ".join(kinds) or None)


def _combined_search(searches: list[dict]) -> dict | None:
    """One rows search from several parts': the newest that tried the peer (a search of ours alone,
    `--peer none`, has nothing to say about the peer's rows or the rows both fit), with our largest rows
    the largest any search ran (e.g. micro-batches fitting more rows than an earlier whole-batch search)."""
    if not searches:
        return None
    tried_peer = [search for search in searches if (search.get("peer") or {}).get("attempts")]
    search = dict((tried_peer or searches)[-1])
    ours = [s["locojax"] for s in searches if (s.get("locojax") or {}).get("largest_rows")]
    if ours:
        search["locojax"] = max(ours, key=lambda record: record["largest_rows"])
    return search


def merge_size(size: str, parts: list[dict]) -> dict:
    """One size's figures from all its parts' runs (bench/grpo_step.py `summarise`)."""
    from bench.grpo_step import summarise

    searches = [part["rows_search"] for part in parts if part.get("rows_search")]
    search = _combined_search(searches)
    rows = search["rows_both_fit"] if search and search.get("rows_both_fit") else parts[-1].get("rows")
    pooled = [{**run, "part_date_utc": part.get("date_utc", ""), "part_commit": part.get("commit")}
              for part in parts for run in part.get("per_run", [])]
    record, mixed = parts_record(parts)
    figures = summarise(pooled, rows)
    merged = {**figures, "workload": {**parts[-1].get("workload", {}), "rows": rows},
              "parts": record, "mixed_commits": mixed,
              "skipped": [line for part in parts for line in part.get("skipped", [])],
              # Figures a part's runs were corrected by after the fact, with why (kept with the result).
              "corrections": [line for part in parts for line in part.get("corrections", [])],
              "target": TARGETS.get(size)}
    if figures.get("ratio_vs_peer") is not None and size in TARGETS:
        merged["meets_target"] = figures["ratio_vs_peer"] >= TARGETS[size]["ratio_vs_peer"]
    if search:
        merged["rows_search"] = search
        merged["largest_rows"] = {"locojax": search["locojax"]["largest_rows"], "peer": search["peer"]["largest_rows"]}
    enough = min(figures.get("rounds_per_side", {}).values() or [0])
    if enough < 2:
        merged["rounds_note"] = f"{enough} round(s) on the side with fewest at {rows} rows; the figure asks for >= 2"
    merged["per_run"] = pooled
    return merged


def merge_grpo(parts: list[dict]) -> dict | None:
    grpo = [part for part in parts if part.get("benchmark") == "grpo_step" and part.get("size") in GRPO_SIZES]
    if not grpo:
        return None
    record, mixed = parts_record(grpo)
    platform, device_kind = _platform(grpo)
    sizes = {size: merge_size(size, [p for p in grpo if p.get("size") == size])
             for size in GRPO_SIZES if any(p.get("size") == size for p in grpo)}
    return {"benchmark": "grpo_step_tpu", "platform": platform, "device_kind": device_kind,
            "commit": merged_commit(record), "parts": record, "mixed_commits": mixed, "sizes": sizes,
            "method": "bench/grpo_step.py per size; ratio_vs_peer = peer_step_s / locojax_step_s, the median "
                      "steady step of each side's pooled runs, both sides compiling cold; see each size's parts"}


LORA_TARGET_RATIO = {"ratio_vs_peer": 1.5, "goal": 2.0}  # issue 40, at Qwen3-1.7B


def lora_train_flops_per_token(config, rank: int, targets: list[str], tokens_per_row: float) -> dict:
    """Model FLOPs per trained token of a LoRA step, MaxText's way (a rematerialised forward not counted):
    the frozen projections and head run forward and pass the input gradient back (4 x their parameters),
    the adapters also get weight gradients (6 x theirs), attention as in bench/scale.py's count
    (6 x layers x heads x head_dim x the row's length, per token, causal)."""
    from locojax.model.config import LoRAConfig, lora_param_count, lora_projection_dims

    dims = lora_projection_dims(config)
    frozen = config.n_layers * sum(a * b for a, b in dims.values()) + config.vocab_size * config.d_model
    adapters = lora_param_count(config.replace(lora=LoRAConfig(rank=rank, alpha=1.0, targets=tuple(targets))))
    attention = 6 * config.n_layers * config.n_heads * config.head_dim * tokens_per_row
    return {"flops_per_token": 4 * frozen + 6 * adapters + attention, "frozen_matmul_params": frozen,
            "adapter_params": adapters,
            "method": "4 x frozen matmul params (forward + input gradient; LM head incl.) + 6 x adapter params "
                      "+ causal attention 6 x layers x heads x head_dim x row length, per non-padding token; "
                      "remat's recompute not counted"}


def _lora_rollout(part: dict) -> str:
    """A lora part's model.lora.rollout on our side (parts from before the setting: "adapters")."""
    return (part.get("workload", {}).get("lora") or {}).get("rollout", "adapters")


def _with_peer_runs(parts: list[dict], rollout: str) -> list[dict]:
    """The parts of one rollout setting of ours, with the peer's runs of every other part beside them:
    the peer's work does not depend on how our side runs its rollout, so its runs compare with each."""
    own = [part for part in parts if _lora_rollout(part) == rollout]
    others = [{**part, "per_run": [run for run in part.get("per_run", []) if run.get("side") == "tunix"]}
              for part in parts if _lora_rollout(part) != rollout]
    return [part for part in others if part["per_run"]] + own


def merge_lora(parts: list[dict]) -> dict | None:
    """bench/results/lora_tpu.json (issue 40) from the `lora` parts of bench/grpo_step.py, one model each.
    The model's figures are ours at the largest rows our side fit (up to 64): rows, step, rollout tokens/s,
    train phase against the measured matmul peak (the limits part's) on LoRA's model FLOPs, peak vs plan.
    Against the peer: `ratio_vs_peer` at the rows both fit (the same work), and the throughput ratio with
    each side at its own largest rows (trained tokens a second), since memory headroom is a result too."""
    import statistics

    from bench.scale import model_config

    lora = [part for part in parts if part.get("benchmark") == "grpo_step" and part.get("size") == "lora"]
    full = [part for part in parts if part.get("benchmark") == "full_ft"]  # bench/full_ft.py, the newest
    if not (lora or full):
        return None
    limits = [part for part in parts if part.get("benchmark") == "scale_limits"]
    peak = limits[-1]["limits"]["matmul_peak_gflop_s"] * 1e9 if limits else None
    models = {}
    for preset in dict.fromkeys(part["workload"]["preset"] for part in lora):
        of_preset = [part for part in lora if part["workload"]["preset"] == preset]
        variants = {rollout: merge_size("lora", _with_peer_runs(of_preset, rollout))
                    for rollout in dict.fromkeys(_lora_rollout(part) for part in of_preset)}
        # The model's figures at our largest rows: the default rollout's runs (the others may have run only
        # at the rows both fit). The comparison with the peer: the rollout setting that compares best,
        # named, with every setting's figures beside it.
        merged = variants.get("adapters") or next(iter(variants.values()))
        best = max(variants, key=lambda rollout: variants[rollout].get("ratio_vs_peer") or 0.0)
        work = merged["workload"]
        ok = [run for run in merged["per_run"] if run.get("side") == "locojax" and run.get("ok")]
        rows = max((run["rows"] for run in ok), default=None)
        ours = [run for run in ok if run["rows"] == rows]
        periods = [p for run in ours for p in run.get("periods_s", [])]
        phases = {name: statistics.median(v for run in ours for v in run.get("phases_s", {}).get(name, []))
                  for name in ("time/rollout", "time/train") if any(run.get("phases_s", {}).get(name) for run in ours)}
        tokens = [t for run in ours for t in run.get("train_tokens", []) if t]
        at_largest = max(ours, key=lambda run: run.get("peak_device_gib") or 0.0, default={})
        figures = {"steps_completed": max((run.get("steps_completed") or 0 for run in ours), default=0),
                   "rows": rows, "step_s": statistics.median(periods) if periods else None,
                   "rollout_tokens_per_s": (rows * work["new_tokens"] / phases["time/rollout"]
                                            if rows and phases.get("time/rollout") else None),
                   "phases_s": phases, "peak_device_gib": at_largest.get("peak_device_gib"),
                   "planned_gib": at_largest.get("planned_gib"),
                   "peak_device_vs_plan": (at_largest["peak_device_gib"] / at_largest["planned_gib"]
                                           if at_largest.get("peak_device_gib") and at_largest.get("planned_gib")
                                           else None)}
        if tokens and phases.get("time/train") and peak and rows:
            count = lora_train_flops_per_token(model_config(preset), work["lora"]["rank"], work["lora"]["targets"],
                                               statistics.median(tokens) / rows)
            figures["train_model_flops_per_step"] = count["flops_per_token"] * statistics.median(tokens)
            figures["train_vs_matmul_peak"] = figures["train_model_flops_per_step"] / phases["time/train"] / peak
            figures["train_flops"] = count
        compared = variants[best]
        if compared.get("ratio_vs_peer") is not None:
            peer_rows = (compared["rows_search"]["peer"]["largest_rows"] if "rows_search" in compared
                         else compared["rows"])
            figures.update(ratio_vs_peer=compared["ratio_vs_peer"], ratio_rows=compared["rows"],
                           ratio_lora_rollout=best, peer_step_s=compared.get("peer_step_s"), ours_at_ratio_rows={
                               "step_s": compared.get("locojax_step_s"),
                               "phases_s": {name: compared.get(name) for name in ("time/rollout", "time/train")},
                               "peak_device_vs_plan": compared.get("peak_device_vs_plan")},
                           peer_largest_rows=peer_rows, target=LORA_TARGET_RATIO,
                           meets_target=compared["ratio_vs_peer"] >= LORA_TARGET_RATIO["ratio_vs_peer"])
            if figures["step_s"] and compared.get("peer_step_s") and peer_rows:
                figures["throughput_ratio_at_largest_rows"] = (
                    (rows / figures["step_s"]) / (peer_rows / compared["peer_step_s"]))
        if len(variants) > 1:
            figures["lora_rollout_variants"] = {
                rollout: {"rows": v["rows"], "locojax_step_s": v.get("locojax_step_s"),
                          "ratio_vs_peer": v.get("ratio_vs_peer"), "rounds_per_side": v.get("rounds_per_side"),
                          "locojax_spread": v.get("locojax_spread"),
                          "phases_s": {name: v.get(name) for name in ("time/rollout", "time/train")},
                          "peak_device_vs_plan": v.get("peak_device_vs_plan"),
                          "commits": sorted({p["commit"] for p in v["parts"]})}
                for rollout, v in variants.items()}
        models[preset] = {**figures, "detail": merged}
        if best != "adapters" and compared is not merged:
            models[preset]["detail_at_ratio"] = compared
    used = lora + limits[-1:] + full[-1:]
    record, mixed = parts_record(used)
    platform, device_kind = _platform(used)
    full_ft = None
    if full:  # the largest preset a full-weight run fits, by the plan, and that run's peak against its plan
        part = full[-1]
        full_ft = {key: part.get(key) for key in ("largest_preset_that_fits", "workload", "attempts", "run")}
        full_ft["peak_device_vs_plan"] = (part.get("run") or {}).get("peak_device_vs_plan")
    return {"benchmark": "lora_tpu", "platform": platform, "device_kind": device_kind,
            "commit": merged_commit(record), "parts": record, "mixed_commits": mixed, "models": models,
            "full_ft": full_ft, "matmul_peak_flops": peak,
            "method": "bench/grpo_step.py --size lora per model (LoRA rank 16 on every linear layer, bfloat16, "
                      "96 prompt + 256 new tokens, 64 rows or the largest that fit); each model's figures at our "
                      "largest rows; ratio_vs_peer at the rows both fit; train_vs_matmul_peak on LoRA's model "
                      "FLOPs (lora_train_flops_per_token) over the limits part's measured peak"}


def _with_xfailed(counts: dict) -> dict:
    """A tests part's counts with its expected failures apart from its skips: parts written before the
    plugin counted them (bench/tpu_tests.py) list them among the skips, where their reason is the marked
    test's source, `pytest.mark.xfail(...)` included."""
    if "xfailed" in counts:
        return counts
    reasons = counts.get("skip_reasons", {})
    xfails = {test: reason for test, reason in reasons.items() if "mark.xfail(" in reason}
    return {**counts, "skipped": counts["skipped"] - len(xfails), "xfailed": len(xfails),
            "skip_reasons": {test: reason for test, reason in reasons.items() if test not in xfails},
            "xfail_reasons": xfails,
            "corrections": ["xfailed: counted from skip_reasons (the part's plugin counted expected failures as "
                            "skips)"] if xfails else []}


def merge_scale(parts: list[dict]) -> dict | None:
    from bench.scale import apply_limits

    runs = [part for part in parts if part.get("benchmark") == "scale" and part.get("rounds")]
    limits = [part for part in parts if part.get("benchmark") == "scale_limits"]
    tests = [part for part in parts if part.get("benchmark") == "tpu_tests"]
    if not (runs or limits or tests):
        return None
    used = runs[-1:] + limits[-1:] + tests[-1:]
    result = dict(runs[-1]) if runs else {"benchmark": "scale", "note": "no `scale` part: the 0.6B rounds are missing"}
    result.pop("_file", None)
    if limits:
        if runs and limits[-1]["batch"] != result["batch"]:
            raise SystemExit(f"{limits[-1]['_file']} measured limits at {limits[-1]['batch']}, not the rounds' "
                             f"{result['batch']}")
        apply_limits(result, limits[-1]["limits"])
    result["tpu_tests"] = _with_xfailed(tests[-1]["tpu_tests"]) if tests else None
    measured = limits[-1]["limits"] if limits else {}
    if {"stream_bandwidth_gb_s", "matmul_peak_gflop_s"} <= set(measured):
        # In the hardware profile's units, for locojax/placement/measured_constants.json to cite.
        result["chip_constants"] = {
            "hbm_bandwidth": measured["stream_bandwidth_gb_s"] * 1e9,  # bytes/s read, median around decode
            "peak_flops": measured["matmul_peak_gflop_s"] * 1e9,  # bf16 matmul FLOP/s
            "from": "limits.stream_bandwidth_gb_s and limits.matmul_peak_gflop_s, x 1e9"}
    record, mixed = parts_record(used)
    platform, device_kind = _platform(used)
    for key in ("stage", "commit_from", "dirty", "source_digest", "date_utc"):
        result.pop(key, None)  # per part, in `parts`
    result.update(platform=platform, device_kind=device_kind, commit=merged_commit(record), parts=record,
                  mixed_commits=mixed)
    return result


def merge_train_variants(variants_dir: Path, parts: list[dict]) -> dict | None:
    """bench/results/train_variants_tpu.json from the train-variants stage's `variant_<remat>_<size>.json`
    (bench/scale.py runs of the scale batch, one per remat policy and micro-batch size): each variant's
    train step against the bf16 matmul peak of the latest `limits` part, fastest first."""
    files = sorted(p for p in variants_dir.glob("variant_*.json") if not p.name.endswith(".partial.json"))
    if not files:
        return None
    limits = [part for part in parts if part.get("benchmark") == "scale_limits"]
    peak = limits[-1]["limits"]["matmul_peak_gflop_s"] * 1e9 if limits else None
    variants, shapes = [], set()
    for path in files:
        run = json.loads(path.read_text(encoding="utf-8"))
        shapes.add(json.dumps({k: v for k, v in run["batch"].items() if k not in ("remat", "micro_batch_size")},
                              sort_keys=True))
        flops = run["train_flops"]["flops"]
        variants.append({
            "file": path.name, "commit": run["commit"], "remat": run["batch"]["remat"],
            "micro_batch_size": run["batch"].get("micro_batch_size"), "train_s": run["train_s"],
            "step_s": run["step_s"], "rollout_s": run["rounds"][0]["rollout_s"],
            "train_vs_matmul_peak": flops / run["train_s"] / peak if peak else None,
            "peak_device_gib": run["peak_device_gib"], "planned_gib": run["planned_gib"],
            "peak_device_vs_plan": run["peak_device_vs_plan"],
            "setup_and_first_step_s": run["rounds"][0]["first_step_s"],
            "steps_completed": run["steps_completed"], "load_average_before": run.get("load_average_before")})
    variants.sort(key=lambda variant: variant["train_s"])
    if len(shapes) > 1:
        raise SystemExit(f"{variants_dir}: the variants ran different batches: {sorted(shapes)}")
    return {"benchmark": "train_variants_tpu", "platform": "tpu",
            "commit": ", ".join(dict.fromkeys(v["commit"] for v in variants)),
            "batch": json.loads(shapes.pop()), "model": "qwen3-0.6b (exact config, random weights)",
            "matmul_peak_gflop_s": peak / 1e9 if peak else None,
            "matmul_peak_from": limits[-1]["_file"] + " at " + str(limits[-1].get("commit")) if limits else None,
            "method": "one `locojax train` round of 3 steps per variant (bench/tpu.sh train-variants), one after "
                      "another on the chip; train_s the median of the steady steps' time/train; model FLOPs as "
                      "scale_tpu.json counts them (remat's recompute not counted)",
            "variants": variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts_dir", type=Path)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    parts = load_parts(args.parts_dir)
    if not parts:
        raise SystemExit(f"no part_*.json in {args.parts_dir}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, merged in (("grpo_step_tpu.json", merge_grpo(parts)), ("scale_tpu.json", merge_scale(parts)),
                         ("lora_tpu.json", merge_lora(parts)),
                         ("train_variants_tpu.json", merge_train_variants(args.parts_dir / "train_variants", parts))):
        if merged is None:
            print(f"{name}: no parts for it")
            continue
        (args.out_dir / name).write_text(json.dumps(merged, indent=2) + "\n", encoding="utf-8")
        if "parts" not in merged:
            print(f"wrote {args.out_dir / name} from {len(merged['variants'])} variants")
            continue
        print(f"wrote {args.out_dir / name} from {', '.join(p['file'] for p in merged['parts'])}"
              f"{' (MIXED commits)' if merged['mixed_commits'] else ''}")
        if name == "grpo_step_tpu.json":
            for size, figures in merged["sizes"].items():
                ratio = figures.get("ratio_vs_peer")
                print(f"  size {size}: {figures.get('rows')} rows, ratio_vs_peer "
                      f"{'none' if ratio is None else f'{ratio:.2f}'}, idle {figures.get('device_idle_fraction')}")


if __name__ == "__main__":
    main()

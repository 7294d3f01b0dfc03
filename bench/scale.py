"""Real scale (issue 21): a Qwen3-0.6B GRPO run end to end on this machine, against its memory plan and
the machine's physical limits. Writes bench/results/scale.json.

What it builds (nothing is downloaded): a Hugging Face directory with the exact Qwen3-0.6B config and
random weights (`save_hf_checkpoint` of the `qwen3-0.6b` preset), a `tokenizer.json` in Qwen's format
(byte-level BPE with Qwen2's pre-tokenizer split and its special tokens, trained here by the
`tokenizers` library on the bench's own text) and a small GSM8K-format JSONL.

What it runs, each round:
  * `locojax train SPEC` (CO, one host, one CPU device) for --steps steps, as a subprocess whose peak
    RSS comes from wait4; the engine prints its memory plan at start, parsed as `planned_gib`;
  * once, the same spec submitted over REST to `locojax up` (the embedded control plane), watched to
    SUCCEEDED; the engine process's peak RSS is its VmHWM;
  * in this process: the machine's streaming memory bandwidth and matmul peak, and the engine's own
    decode kernel timed at 1 and N new tokens, so decode time excludes prefill.
Figures: steady `step_s` (median of steps after the first, which compiles), `rollout_tokens_per_s`,
`peak_rss_gib` vs `planned_gib`, `decode_vs_roofline` = decode tokens/s / (bandwidth x batch / bytes
read per decode step), `train_vs_matmul_peak` = the train phase's model FLOP/s / measured matmul peak.

    .venv/bin/python bench/scale.py                    # 1 round, 3 steps
    .venv/bin/python bench/scale.py --rounds 2 --no-rest
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "scale.json"
GiB = 1024**3
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2/Qwen3 tokenizer.json pre-tokenizer: this split regex, then byte-level without its own regex.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
NAMES = ["Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jade"]
ITEMS = ["apples", "marbles", "books", "stamps", "pencils", "cookies", "shells", "coins"]


def gsm8k_records(count: int, seed: int = 0) -> list[dict]:
    """Word problems in GSM8K's format: a question, and a worked answer ending in `#### N`."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        have, more, give = rng.randint(2, 40), rng.randint(2, 40), rng.randint(1, 20)
        total = have + more - give
        records.append({
            "question": f"{name} has {have} {item}. {name} buys {more} more {item} and then gives {give} to a "
                        f"friend. How many {item} does {name} have now?",
            "answer": f"{name} has {have} + {more} = <<{have}+{more}={have + more}>>{have + more} {item} after "
                      f"buying.\nAfter giving {give} away, {name} has {have + more} - {give} = "
                      f"<<{have + more}-{give}={total}>>{total} {item}.\n#### {total}"})
    return records


def build_tokenizer(texts: list[str], path: Path, vocab_size: int = 2048) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    (path.parent / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))


def build_inputs(work: Path, seed: int) -> dict[str, Path]:
    """The HF directory, tokenizer and JSONL, built in a child process so this one stays small."""
    paths = {"model": work / "qwen3-0.6b-random", "data": work / "gsm8k.jsonl"}
    paths["tokenizer"] = paths["model"] / "tokenizer.json"
    records = gsm8k_records(64, seed)
    paths["data"].write_text("".join(json.dumps(r) + "\n" for r in records))
    code = (f"from locojax.model import create_model, get_preset\nfrom locojax.model.hf import save_hf_checkpoint\n"
            f"save_hf_checkpoint(create_model(get_preset('qwen3-0.6b'), seed={seed}), {str(paths['model'])!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=_env())
    build_tokenizer([r["question"] + "\n" + r["answer"] for r in records], paths["tokenizer"])
    return paths


def make_spec(paths: dict[str, Path], args, name: str, output_dir: Path | None) -> dict:
    spec = {
        "name": name, "seed": args.seed,
        "model": {"checkpoint": str(paths["model"]), "tokenizer": str(paths["tokenizer"]),
                  "dtype": "float32", "remat": args.remat},
        "task": {"name": "gsm8k", "path": str(paths["data"])},
        "rollout": {"prompts_per_step": args.prompts, "group_size": args.group, "max_prompt_tokens": args.prompt_tokens,
                    "max_new_tokens": args.new_tokens, "temperature": 1.0},
        "algo": {"name": "grpo", "kl_coef": 0.0},
        "optim": {"lr": 1e-6, "warmup_steps": 0},
        "steps": args.steps,
        "placement": {"mode": "co", "hosts": 1, "devices_per_host": 1},
        "checkpoint": {"every": 0, "keep": 1},
    }
    if output_dir is not None:
        spec["output_dir"] = str(output_dir)
    return spec


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


PLAN_LINE = re.compile(r"memory plan per device .*?: peak ([0-9.]+) GiB")


def step_figures(metrics_file: Path, steps: int) -> dict:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("host") in ("all", 0, "0") and "time/step" in r]
    by_step = {int(r["step"]): r for r in rows}
    steady = [by_step[s] for s in sorted(by_step) if s > 0] or list(by_step.values())

    def median(key):
        return statistics.median(float(r[key]) for r in steady if key in r)

    # The last step saves the run's checkpoint (~7 GB of Orbax state here): step time excludes it.
    for row in rows:
        row["step_without_checkpoint_s"] = float(row["time/step"]) - float(row.get("time/checkpoint", 0.0))
    return {"steps_completed": len(by_step), "step_s": median("step_without_checkpoint_s"),
            "checkpoint_s": max(float(r.get("time/checkpoint", 0.0)) for r in rows),
            "rollout_s": median("time/rollout"),
            "train_s": median("time/train"), "rollout_tokens_per_s": median("throughput/rollout_tokens_per_s"),
            "first_step_s": float(by_step[min(by_step)]["time/step"]) if by_step else None,
            "per_step_s": [float(by_step[s]["time/step"]) for s in sorted(by_step)]}


def run_cli(paths, args, work: Path, round_index: int) -> dict:
    out = work / f"cli-{round_index}"
    spec_path = work / f"cli-{round_index}.json"
    spec_path.write_text(json.dumps(make_spec(paths, args, f"scale-cli-{round_index}", out)))
    log = work / f"cli-{round_index}.log"
    started = time.monotonic()
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "locojax.cli", "train", str(spec_path)], cwd=work,
                                   env=_env(), stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    text = log.read_text()
    if status != 0:
        raise RuntimeError(f"locojax train failed (status {status}):\n{text[-3000:]}")
    planned = PLAN_LINE.search(text)
    figures = step_figures(out / "metrics.jsonl", args.steps)
    figures.update(wall_s=time.monotonic() - started, peak_rss_gib=usage.ru_maxrss * 1024 / GiB,
                   planned_gib=float(planned.group(1)) if planned else None, plan_line=planned.group(0) if planned else None)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # ~7 GB of Orbax state per run
    return figures


def _processes_with(marker: bytes, path: Path) -> list[Path]:
    """The control plane's processes (their LOCOJAX_HOME) and the engine processes it starts (whose
    command line names the run's spec under `path`; the worker gives them their own environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if (marker in (entry / "environ").read_bytes().split(b"\0")
                        or str(path).encode() in (entry / "cmdline").read_bytes()):
                    found.append(entry)
            except OSError:
                continue
    return found


def _vm_hwm_bytes(proc: Path) -> int:
    try:
        for line in (proc / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_rest(paths, args, work: Path) -> dict:
    from locojax.client import ApiClient
    from locojax.launch import free_port

    home = work / "up-home"
    port = free_port()
    env = _env(LOCOJAX_HOME=str(home), LOCOJAX_RUNS_ROOT=str(work / "up-runs"), LOCOJAX_DATA_ROOTS=str(work))
    for name in ("LOCOJAX_DATABASE_URL", "LOCOJAX_BROKER_URL"):
        env.pop(name, None)  # the embedded defaults: SQLite and its broker under LOCOJAX_HOME
    log = (work / "up.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "locojax.cli", "up", "--hosts", "1", "--port", str(port)],
                               cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = f"LOCOJAX_HOME={home}".encode()
    try:
        token, deadline = None, time.monotonic() + 180
        while token is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            log.write(line)
            if match := re.search(r"^\s+token\s+(\S+)", line):
                token = match.group(1)
        if token is None:
            raise RuntimeError(f"locojax up printed no token; see {work / 'up.log'}")
        url = f"http://127.0.0.1:{port}"
        started, peak = time.monotonic(), 0
        with ApiClient(url, token) as api:
            run = api.submit(make_spec(paths, args, "scale-rest", None))
            while True:
                for proc in _processes_with(marker, work / "up-runs"):
                    peak = max(peak, _vm_hwm_bytes(proc))
                current = api.get_run(run["id"])
                if current["status"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    break
                if time.monotonic() - started > args.rest_timeout:
                    raise RuntimeError(f"REST run still {current['status']} after {args.rest_timeout} s")
                time.sleep(1.0)
        runs_root = work / "up-runs"
        metrics = next(runs_root.rglob("metrics.jsonl"), None)
        figures = step_figures(metrics, args.steps) if metrics else {}
        figures.update(status=current["status"], wall_s=time.monotonic() - started, peak_rss_gib=peak / GiB,
                       last_checkpoint_step=current.get("last_checkpoint_step"))
        return figures
    finally:
        process.send_signal(2)  # Ctrl-C: `locojax up` stops its workers and engine processes
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        shutil.rmtree(work / "up-runs", ignore_errors=True)


def machine_limits(paths, args) -> dict:
    """Streaming bandwidth and matmul peak of this machine, and the engine's decode time per token
    (generate at 1 and at N new tokens, the difference per token: prefill excluded)."""
    import jax
    import numpy as np

    from locojax.model.config import param_count
    from locojax.model.hf import load_hf_checkpoint
    from locojax.placement.probe import measure_matmul_flops, measure_memory_bandwidth
    from locojax.rollout import SamplingConfig, make_generate_fn
    from locojax.spec import RolloutSpec
    from locojax.tokenizer import load_tokenizer
    from locojax.train import split_params

    bandwidth = measure_memory_bandwidth(megabytes=1024, repeats=5)
    matmul = measure_matmul_flops(size=2048, repeats=5)
    model = load_hf_checkpoint(paths["model"])
    config = model.config
    graphdef, params = split_params(model)
    tokenizer = load_tokenizer(paths["tokenizer"])
    batch = args.prompts * args.group
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, 1000, (batch, args.prompt_tokens)).astype(np.int32)
    mask = np.ones((batch, args.prompt_tokens), bool)
    timings = {}
    for new in (1, args.new_tokens):
        sampling = SamplingConfig.from_spec(RolloutSpec(max_new_tokens=new, max_prompt_tokens=args.prompt_tokens,
                                                        temperature=1.0), tokenizer)
        generate = make_generate_fn(config, graphdef, sampling, args.prompt_tokens, batch, tuple(jax.local_devices()))
        jax.block_until_ready(generate(params, tokens, mask, jax.random.PRNGKey(0), 0))
        best = float("inf")
        for repeat in range(2):
            start = time.perf_counter()
            jax.block_until_ready(generate(params, tokens, mask, jax.random.PRNGKey(repeat + 1), 0))
            best = min(best, time.perf_counter() - start)
        timings[new] = best
    decode_step_s = (timings[args.new_tokens] - timings[1]) / (args.new_tokens - 1)
    weight_bytes = param_count(config) * 4
    mean_context = args.prompt_tokens + args.new_tokens / 2
    bytes_per_step = weight_bytes + batch * mean_context * config.kv_bytes_per_token(4)
    decode_tokens_per_s = batch / decode_step_s
    roofline_tokens_per_s = bandwidth * batch / bytes_per_step
    return {"stream_bandwidth_gb_s": bandwidth / 1e9, "matmul_peak_gflop_s": matmul / 1e9,
            "decode_step_s": decode_step_s, "prefill_plus_one_token_s": timings[1],
            "decode_tokens_per_s": decode_tokens_per_s, "decode_bytes_per_step": bytes_per_step,
            "roofline_decode_tokens_per_s": roofline_tokens_per_s,
            "decode_vs_roofline": decode_tokens_per_s / roofline_tokens_per_s, "params": param_count(config),
            "config": {k: getattr(config, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                                       "head_dim", "d_ff", "tie_embeddings", "max_seq_len")}}


def train_model_flops(limits: dict, args) -> float:
    """Model FLOPs of one train step (remat's recompute excluded, as MFU counts them): 6 x the layers'
    parameters x every slot (the step runs on padded slots too), plus 6 x the head for the scored
    completion slots, plus attention's 4 x width x context per token per layer, x3 for the backward."""
    config = limits["config"]
    rows, seq = args.prompts * args.group, args.prompt_tokens + args.new_tokens
    head = config["vocab_size"] * config["d_model"]
    body = limits["params"] - head
    attention = 3 * 4 * config["n_layers"] * config["n_heads"] * config["head_dim"] * seq / 2
    return 6 * body * rows * seq + 6 * head * rows * args.new_tokens + attention * rows * seq


def summarise(args, limits: dict, rounds: list[dict], rest: dict | None, load_before, wall_s: float) -> dict:
    """scale.json's figures from the phases' results."""
    step_times = [r["step_s"] for r in rounds]
    train_s = statistics.median(r["train_s"] for r in rounds)
    model_flops = train_model_flops(limits, args)
    peak = max(r["peak_rss_gib"] for r in rounds)
    planned = rounds[0]["planned_gib"]
    result = {
        "benchmark": "scale", "model": "qwen3-0.6b (exact config, random weights)", "mode": "co",
        "batch": {"prompts": args.prompts, "group_size": args.group, "max_prompt_tokens": args.prompt_tokens,
                  "max_new_tokens": args.new_tokens, "dtype": "float32", "remat": args.remat},
        "steps_completed": min(r["steps_completed"] for r in rounds),
        "step_s": statistics.median(step_times),
        "step_s_rounds": step_times,
        "step_s_spread": (max(step_times) - min(step_times)) / statistics.median(step_times),
        "rollout_tokens_per_s": statistics.median(r["rollout_tokens_per_s"] for r in rounds),
        "peak_rss_gib": peak,
        "planned_gib": planned,
        "peak_rss_vs_plan": peak / planned if planned else None,
        "plan_line": rounds[0]["plan_line"],
        "rest": rest,
        "decode_vs_roofline": limits["decode_vs_roofline"],
        "train_model_flops_per_step": model_flops,
        "train_s": train_s,
        "train_vs_matmul_peak": model_flops / train_s / (limits["matmul_peak_gflop_s"] * 1e9),
        "limits": limits,
        "rounds": rounds,
        "ratio_vs_peer": None,
        "peer_note": ("Tunix not run: its GRPO keeps a policy, a reference model and AdamW state for the 0.6B in "
                      "float32 in one process (~12 GB before activations and its full-vocabulary logits), which "
                      "does not fit beside this run in the 24 GiB the machine's other jobs share, and it would "
                      "double the bench's time; bench/grpo_step.py compares the two engines at the small preset"),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "load_note": args.load_note,
        "cpu_count": os.cpu_count(), "wall_s": wall_s,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="locojax train runs (the REST run is once)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--remat", choices=("none", "full"), default="full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-rest", action="store_true", help="skip the run through `locojax up`")
    parser.add_argument("--rest-timeout", type=float, default=600.0)
    parser.add_argument("--work", type=Path, default=None, help="default: a temporary directory, removed after")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--load-note", default="", help="what else ran on the machine, recorded in the JSON")
    parser.add_argument("--resume-partial", action="store_true",
                        help="reuse the phases <out>.partial.json holds (needs the same --work) and run the rest")
    args = parser.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="locojax-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = time.monotonic()
    try:
        paths = build_inputs(work, args.seed) if not args.resume_partial else {
            "model": work / "qwen3-0.6b-random", "data": work / "gsm8k.jsonl",
            "tokenizer": work / "qwen3-0.6b-random" / "tokenizer.json"}
        # Each phase's figures land in <out>.partial as they come, so a failure late keeps the rest.
        partial = args.out.with_suffix(".partial.json")
        done = json.loads(partial.read_text()) if args.resume_partial and partial.is_file() else {}
        if "limits" in done:
            limits, rounds = done["limits"], done.get("rounds", [])
            load_before = tuple(done.get("load_average_before", load_before))
        else:
            limits, rounds = machine_limits(paths, args), []
        partial.write_text(json.dumps({"limits": limits, "load_average_before": load_before}, indent=2))
        for index in range(len(rounds), args.rounds):
            rounds.append(run_cli(paths, args, work, index))
            partial.write_text(json.dumps({"limits": limits, "rounds": rounds, "load_average_before": load_before},
                                          indent=2))
        rest = None if args.no_rest else run_rest(paths, args, work)
        partial.unlink(missing_ok=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result = summarise(args, limits, rounds, rest, load_before, time.monotonic() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("steps_completed", "step_s", "rollout_tokens_per_s", "peak_rss_gib",
                                             "planned_gib", "peak_rss_vs_plan", "decode_vs_roofline",
                                             "train_vs_matmul_peak", "load_average_before")}, indent=2))


if __name__ == "__main__":
    main()

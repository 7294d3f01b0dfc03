"""Real scale (issue 21): a Qwen3-0.6B GRPO run end to end on this machine, against its memory plan and
the machine's physical limits. Writes bench/results/scale.json.

What it builds (nothing is downloaded): a Hugging Face directory with the exact Qwen3-0.6B config and
random weights (`save_hf_checkpoint` of the `qwen3-0.6b` preset), a `tokenizer.json` in Qwen's format
(byte-level BPE with Qwen2's pre-tokenizer split and its special tokens, trained here by the
`tokenizers` library on the bench's own text) and a small GSM8K-format JSONL.

What it runs, each round:
  * `locojax train SPEC` (CO, one host, one CPU device) for --steps steps, as a subprocess whose peak
    RSS is its VmHWM, sampled while it runs; the engine prints its memory plan at start, parsed as `planned_gib`;
  * once, the same spec submitted over REST to `locojax up` (the embedded control plane), watched to
    SUCCEEDED; the engine process's peak RSS is its VmHWM;
  * in a child process: the machine's matmul peak, and the engine's own decode loop timed alone (its
    prefill run apart, untimed), 5 times, each between two reads of the machine's read bandwidth
    (`measure_limits`: this VM's speed drifts within minutes).
Figures: steady `step_s` (median of steps after the first, which compiles), `rollout_tokens_per_s`,
`peak_rss_gib` vs `planned_gib`, `decode_vs_roofline` = decode tokens/s / (read bandwidth x batch / bytes
read per decode step), with `limits.decode_breakdown` (what a decode step is made of), the same ratio at
fewer rows (`limits.decode_by_rows`, --decode-rows) and `decode_vs_attainable` (the step against the
larger of its bandwidth and matmul floors),
`train_vs_matmul_peak` = the train phase's model FLOP/s / measured matmul peak.

The peer (on by default; `--no-peer` skips it): after LoCoJAX's runs, never beside them (memory), and
once scale.json holds their figures, Tunix's `GRPOLearner` (bench/peers/tunix_grpo_step.py, in the venv
bench/grpo_step.py installs) on the same RunSpec: a Qwen3 of the preset's exact dimensions, random
weights, the prompts `run_co` draws from the same JSONL, the same `tokenizer.json` and special ids,
kl_coef 0 (so no reference model), remat per decoder layer in training, the spec's lr, AdamW betas,
clipping and loss aggregation, temperature 1. Its steady step is the median of its step periods after
the first; the harness cannot time its last step, so it runs --steps + 1 steps to have as many as
LoCoJAX. `ratio_vs_peer` = peer step / LoCoJAX `step_s` (>1: LoCoJAX faster), given only when both
sides decoded rows x new tokens completion slots per step over the same prompt buffer
(`peer.identical_work`). The peer runs in a subprocess under --peer-timeout; a failure (OOM kill,
MemoryError, XLA out of memory, timeout) leaves `ratio_vs_peer` null and `peer` = {"ran": false,
"reason": exit status or signal, the kernel's OOM-kill count, stderr's last lines, peak RSS, MemTotal},
with the memory estimate and MemAvailable recorded before it started either way.

    .venv/bin/python bench/scale.py                    # 1 round, 3 steps, then the peer
    .venv/bin/python bench/scale.py --rounds 2 --no-rest --no-peer
    .venv/bin/python bench/scale.py --peer-only --work DIR   # the peer alone, on DIR's inputs, into --out
    .venv/bin/python bench/scale.py --limits-only --work DIR # the limits phase alone, on DIR's model, into --out
"""

from __future__ import annotations

import argparse
import dataclasses
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `bench.*` when run as a script
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


# What `--model-preset NAME@FIELD=INT,...` may change. The tokenizer keeps min(2048, vocab_size) ids
# (`build_inputs`), so a larger vocabulary only widens the model's head and embedding.
DIMENSION_FIELDS = ("d_model", "d_ff", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size")


def model_config(preset: str):
    """The model `--model-preset` names: a preset, or a preset with some dimensions changed,
    `small@d_model=512,d_ff=2048,n_heads=8` or `small@vocab_size=151936` (the placement model's
    calibration runs small models of more than one width and vocabulary size: bench/tpu.sh's
    placement-runs). Its name says what changed."""
    from locojax.model import get_preset

    base, _, changes = preset.partition("@")
    config = get_preset(base)
    if not changes:
        return config
    fields = {}
    for item in changes.split(","):
        key, _, value = item.partition("=")
        if key not in DIMENSION_FIELDS or not value.isdigit():
            raise SystemExit(f"--model-preset {preset}: expected NAME@FIELD=INT,... over "
                             f"{', '.join(DIMENSION_FIELDS)}; got {item!r}")
        fields[key] = int(value)
    return dataclasses.replace(config, name=preset, **fields)


def input_paths(work: Path, preset: str) -> dict[str, Path]:
    """Where a work directory holds the HF directory, its tokenizer and the JSONL."""
    model = work / f"{preset.replace('@', '-').replace(',', '-').replace('=', '')}-random"
    return {"model": model, "tokenizer": model / "tokenizer.json", "data": work / "gsm8k.jsonl"}


def build_inputs(work: Path, seed: int, preset: str, weights: bool = True) -> dict[str, Path]:
    """The HF directory (weights built in a child process so this one stays small), its tokenizer and
    the JSONL. Without `weights`, only the JSONL and tokenizer: all the peer reads (it builds its own
    random model). Both are deterministic in `seed` (`inputs_sha256` in scale.json checks it)."""
    paths = input_paths(work, preset)
    records = gsm8k_records(64, seed)
    paths["data"].write_text("".join(json.dumps(r) + "\n" for r in records))
    if weights:
        code = (f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
                f"from scale import model_config\n"
                f"from locojax.model import create_model\n"
                f"from locojax.model.hf import save_hf_checkpoint\n"
                f"save_hf_checkpoint(create_model(model_config({preset!r}), seed={seed}), {str(paths['model'])!r})\n")
        subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=_env())
    paths["model"].mkdir(parents=True, exist_ok=True)
    # The tokenizer's ids must fit the model's vocabulary (the dev presets have 384 ids).
    build_tokenizer([r["question"] + "\n" + r["answer"] for r in records], paths["tokenizer"],
                    vocab_size=min(2048, model_config(preset).vocab_size))
    return paths


def input_digests(paths: dict[str, Path]) -> dict[str, str]:
    """sha256 of the files both engines read: the JSONL and the tokenizer."""
    import hashlib

    return {name: hashlib.sha256(paths[name].read_bytes()).hexdigest() for name in ("data", "tokenizer")}


# The remat policies the peer harness (bench/peers/tunix_grpo_step.py) maps to one of Tunix's own.
PEER_REMAT = ("none", "full")


def make_spec(paths: dict[str, Path], args, name: str, output_dir: Path | None) -> dict:
    spec = {
        "name": name, "seed": args.seed,
        "model": {"checkpoint": str(paths["model"]), "tokenizer": str(paths["tokenizer"]),
                  "dtype": args.dtype, "remat": args.remat},
        "task": {"name": "gsm8k", "path": str(paths["data"])},
        "rollout": {"prompts_per_step": args.prompts, "group_size": args.group, "max_prompt_tokens": args.prompt_tokens,
                    "max_new_tokens": args.new_tokens, "temperature": 1.0},
        "algo": {"name": "grpo", "kl_coef": 0.0,
                 **({"micro_batch_size": args.micro_batch_size} if args.micro_batch_size else {})},
        "optim": {"lr": 1e-6, "warmup_steps": 0},
        "steps": args.steps,
        "placement": {"mode": "co", "hosts": 1, "devices_per_host": 1},
        "checkpoint": {"every": 0, "keep": 1},
    }
    if output_dir is not None:
        spec["output_dir"] = str(output_dir)
    return spec


def _env(**extra: str) -> dict[str, str]:
    # The checkout first; a PYTHONPATH already set (packages carried to a machine without an index) after it.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


# JAX_PLATFORMS per --platform; on a TPU it stays unset (JAX picks the chip), as a user's run has it.
JAX_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "tpu": None}


def platform_env(platform: str, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (default: this process's environment) with JAX_PLATFORMS set for `platform`."""
    env = {**(os.environ if base is None else base), "TF_CPP_MIN_LOG_LEVEL": "2", **extra}
    if JAX_PLATFORM[platform] is None:
        env.pop("JAX_PLATFORMS", None)
    else:
        env["JAX_PLATFORMS"] = JAX_PLATFORM[platform]
    return env


PLAN_LINE = re.compile(r"memory plan per device .*?: peak ([0-9.]+) GiB")


def step_figures(metrics_file: Path, steps: int) -> dict:
    from locojax.contract import SETUP_PARTS

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("host") in ("all", 0, "0") and "time/step" in r]
    by_step = {int(r["step"]): r for r in rows}
    steady = [by_step[s] for s in sorted(by_step) if s > 0] or list(by_step.values())
    first = by_step[min(by_step)] if by_step else {}

    def median(key):
        return statistics.median(float(r[key]) for r in steady if key in r)

    # The last step saves the run's checkpoint (~7 GB of Orbax state here): step time excludes it.
    for row in rows:
        row["step_without_checkpoint_s"] = float(row["time/step"]) - float(row.get("time/checkpoint", 0.0))
    device_peaks = [float(r["memory/device_peak_gib"]) for r in rows if "memory/device_peak_gib" in r]
    return {"steps_completed": len(by_step), "step_s": median("step_without_checkpoint_s"),
            "peak_device_gib": max(device_peaks) if device_peaks else None,
            "checkpoint_s": max(float(r.get("time/checkpoint", 0.0)) for r in rows),
            "rollout_s": median("time/rollout"),
            "completion_len_mean": median("completion/len_mean") if any("completion/len_mean" in r for r in steady)
            else None,
            "train_s": median("time/train"), "rollout_tokens_per_s": median("throughput/rollout_tokens_per_s"),
            # The mode's setup (devices opened, the programs the compiled memory plan compiles, model
            # built) plus step 0: where the engine compiles ahead of the loop, step 0 alone hides it.
            "first_step_s": float(first.get("time/setup", 0.0)) + float(first["time/step"]) if first else None,
            "setup_s": float(first["time/setup"]) if "time/setup" in first else None,
            "setup_parts_s": {name: float(first[name]) for name in SETUP_PARTS if name in first},
            "per_step_s": [float(by_step[s]["time/step"]) for s in sorted(by_step)],
            "completion_len_max": [by_step[s].get("completion/len_max") for s in sorted(by_step)]}


def loop_first_step_s(figures: dict) -> float | None:
    """Seconds from the run loop's start (the chip open, the model built) to the end of step 0, from a
    round's `step_figures`: its setup and step 0 less the setup's parts that open the backend and build
    the model (`time/setup_backend`, `time/setup_model`); the programs' compilation stays in. None where
    the run did not report those parts (an engine before them): its whole setup is not this clock."""
    parts = figures.get("setup_parts_s") or {}
    if figures.get("first_step_s") is None or not {"time/setup_backend", "time/setup_model"} <= parts.keys():
        return None
    return figures["first_step_s"] - parts["time/setup_backend"] - parts["time/setup_model"]


def engine_has_cache_flag() -> bool:
    """Whether `locojax train` takes `--compilation-cache DIR` at this commit."""
    import inspect

    from locojax import commands

    return any("--compilation-cache" in (getattr(parameter.default, "param_decls", None) or ())
               or name == "compilation_cache" for name, parameter in inspect.signature(commands.train).parameters.items())


def cache_arguments(args, work: Path, round_index: int) -> tuple[list[str], dict[str, str], dict | None]:
    """What round `round_index` runs with under `--compilation-cache cold-warm`: round 0 with an empty
    persistent compilation cache folder, every later round with the same folder (filled by round 0):
    the engine's `--compilation-cache DIR` where `locojax train` has it, else JAX's own variables
    (the same cache). Under `off`, none: `--no-compilation-cache` where `locojax train` would otherwise
    use its default folder, shared with earlier runs."""
    if args.compilation_cache == "off":
        return (["--no-compilation-cache"] if engine_has_cache_flag() else []), {}, None
    folder = work / "compilation-cache"
    if round_index == 0:
        shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    entries = sum(1 for _ in folder.rglob("*") if _.is_file())
    record = {"dir": str(folder), "files_before": entries, "state": "cold" if entries == 0 else "warm"}
    if engine_has_cache_flag():
        return ["--compilation-cache", str(folder)], {}, {**record, "via": "locojax train --compilation-cache"}
    env = {"JAX_COMPILATION_CACHE_DIR": str(folder), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    return [], env, {**record, "via": "JAX_COMPILATION_CACHE_DIR (locojax train has no --compilation-cache here)"}


def run_cli(paths, args, work: Path, round_index: int) -> dict:
    out = work / f"cli-{round_index}"
    spec_path = work / f"cli-{round_index}.json"
    spec_path.write_text(json.dumps(make_spec(paths, args, f"scale-cli-{round_index}", out)))
    logs = work / f"cli-{round_index}-logs"
    logs.mkdir(exist_ok=True)
    flags, cache_env, cache = cache_arguments(args, work, round_index)
    # Peak RSS sampled from the child's VmHWM (`run_process`): wait4's ru_maxrss would carry this
    # process's own high-water mark (it timed the decode kernel on the loaded 0.6B model) into the child's.
    done = run_process([sys.executable, "-m", "locojax.cli", "train", str(spec_path), *flags], logs, timeout_s=7200,
                       platform=args.platform, env={**os.environ, **cache_env})
    text = (logs / "stdout.log").read_text() + (logs / "stderr.log").read_text()
    if done["returncode"] != 0:
        raise RuntimeError(f"locojax train failed (status {done['returncode']}):\n{text[-3000:]}")
    planned = PLAN_LINE.search(text)
    figures = step_figures(out / "metrics.jsonl", args.steps)
    figures.update(wall_s=done["wall_s"], peak_rss_gib=done["peak_rss_gib"],
                   planned_gib=float(planned.group(1)) if planned else None, plan_line=planned.group(0) if planned else None,
                   compilation_cache=cache)
    if cache:
        cache["files_after"] = sum(1 for _ in Path(cache["dir"]).rglob("*") if _.is_file())
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
    """`measure_limits` in a child process, so this process stays small: the rounds after it are
    planned against the machine's MemAvailable, and a 0.6B model held here (2.4 GB and its buffers)
    took enough of it that the second of two rounds was refused."""
    code = ("import json, sys, types\nsys.path.insert(0, {root!r})\nfrom bench.scale import measure_limits\n"
            "print(json.dumps(measure_limits({paths!r}, types.SimpleNamespace(**{args!r}))))\n").format(
        root=str(ROOT), paths={k: str(v) for k, v in paths.items()},
        args={k: getattr(args, k) for k in ("prompts", "group", "prompt_tokens", "new_tokens", "dtype", "platform",
                                            "decode_rows")})
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=platform_env(args.platform, _env()))
    if done.returncode != 0:
        raise RuntimeError(f"measuring the machine's limits failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _best_s(run, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `run` (after one untimed call that compiles)."""
    import jax

    jax.block_until_ready(run())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(gib: int = 1, repeats: int = 5) -> dict:
    """Bytes/s the machine's cores read from memory: a jitted sum over `gib` GiB (larger than every
    cache), the access decode makes of its weights. Also, for reference, `x * 2` into a fresh output
    (what locojax probe's measure_memory_bandwidth times): XLA:CPU page-faults a new output buffer on
    every call, so that figure (7.4 GB/s here, against 41 GB/s read) measures the faults more than
    the memory, and a roofline on it sat below the engine's own decode."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((gib * 2**30 // 4,), jnp.float32)
    total, scale = jax.jit(jnp.sum), jax.jit(lambda v: v * 2.0)
    read_s = _best_s(lambda: total(x), repeats)
    fresh_s = _best_s(lambda: scale(x), repeats)
    return {"read_gb_s": x.nbytes / read_s / 1e9, "scale_into_fresh_output_gb_s": 2 * x.nbytes / fresh_s / 1e9}


def decode_breakdown(config, rows: int, repeats: int = 5, dtype: str = "float32") -> tuple[dict, dict]:
    """Seconds of the pieces one decode step of `rows` sequences is made of, each alone at the model's
    shapes (random values) and computed as the engine computes them: every layer's projections and MLP
    through the engine's `_linear` on [out, in] weights (its decode form, weight @ rows.T), the
    vocabulary head the same way on the [V, D] embedding, and drawing the next token from [rows, vocab]
    logits with the engine's `sample_tokens` (an inverse-CDF draw and the log-prob). What the step
    takes beyond their sum is the rest: attention over the cache, norms, rotary, the cache update, the
    loop. `layer_matmuls_gb_s` is the rate those matmuls read their weights at, to set beside the
    machine's read bandwidth."""
    import jax
    import jax.numpy as jnp

    from locojax.model.transformer import _linear
    from locojax.rollout import SamplingConfig, sample_tokens

    key, dt = jax.random.PRNGKey(0), jnp.dtype(dtype)
    width, heads, kv, head_dim, hidden = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff
    # q, k, v, o, gate, up, down of every layer, [out, in] as the model stores them.
    shapes = [(heads * head_dim, width), (kv * head_dim, width), (kv * head_dim, width), (width, heads * head_dim),
              (hidden, width), (hidden, width), (width, hidden)]
    layers = [(jax.random.normal(key, shape, jnp.float32) * 0.01).astype(dt)
              for _ in range(config.n_layers) for shape in shapes]
    x = jax.random.normal(key, (rows, width), jnp.float32).astype(dt)

    def project(x, w):
        return _linear(x, w, dt, decode=True)

    @jax.jit
    def body(x, weights):  # each layer's weights read once, in the order a decode step reads them
        for i in range(0, len(weights), 7):
            q, k, v = (project(x, weights[i + j]) for j in range(3))
            x = x + project(q + jnp.tile(k + v, (1, heads // kv)), weights[i + 3]) * 1e-3
            x = x + project(project(x, weights[i + 4]) * project(x, weights[i + 5]), weights[i + 6]) * 1e-3
        return x

    head = (jax.random.normal(key, (config.vocab_size, width), jnp.float32) * 0.01).astype(dt)
    logits = jax.random.normal(key, (rows, config.vocab_size), jnp.float32)  # the sampler draws in float32
    sampling = SamplingConfig(max_new_tokens=1, temperature=1.0)
    draw = jax.jit(lambda keys, z: sample_tokens(z, keys, sampling))
    row_keys = jax.random.split(jax.random.key(0), rows)
    layer_s = _best_s(lambda: body(x, layers), repeats)
    pieces = {"layer_matmuls_s": layer_s,
              "head_matmul_s": _best_s(lambda: jax.jit(project)(x, head), repeats),
              "sampling_s": _best_s(lambda: draw(row_keys, logits), repeats)}
    rates = {"layer_matmuls_gb_s": sum(w.nbytes for w in layers) / layer_s / 1e9}
    del layers, head
    return pieces, rates


def matmul_peak(dtype: str, size: int, repeats: int = 5) -> float:
    """FLOP/s of a jitted square matmul of random `dtype` values (on a GPU, float32 goes through
    XLA's default precision, as the engine's own float32 matmuls do)."""
    import jax
    import jax.numpy as jnp

    a, b = (jax.random.normal(jax.random.key(i), (size, size), jnp.float32).astype(dtype) for i in (0, 1))
    matmul = jax.jit(jnp.matmul)
    return 2 * size**3 / _best_s(lambda: matmul(a, b), repeats)


def measure_limits(paths, args, repeats: int = 5) -> dict:
    """Read bandwidth and matmul peak of this machine, and the engine's decode time per token, with what
    a decode step is made of (`decode_breakdown`).

    The decode loop is timed alone: the engine's prefill and decode halves jitted apart
    (`make_prefill_and_decode_fns`, tested to sample what one generate call samples), the prefill run
    untimed, then its N - 1 decode steps timed. Until stop 30 the step was the difference of a
    1-token and an N-token generate call; prefill alone took 10-15 s there and varied by ~3 s, so
    the difference over 31 tokens swung the ratio from 0.31 to 0.67. Each of `repeats` samples times
    the loop between two reads of the bandwidth and keeps its own ratio; the figure is their median,
    `decode_vs_roofline_sample_range` the lowest and highest. `decode_by_rows`: the same, 3 samples each,
    at the fewer rows of `args.decode_rows`, with which of the step's two floors is the higher
    (`bound_by`): where it is the matmuls', the bandwidth roofline is not the limit at that row count."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from locojax.model.config import param_count
    from locojax.model.hf import load_hf_checkpoint
    from locojax.placement.probe import measure_matmul_flops
    from locojax.rollout import SamplingConfig, default_decode_segments, make_prefill_and_decode_fns
    from locojax.spec import RolloutSpec
    from locojax.tokenizer import load_tokenizer
    from locojax.train import split_params

    paths = {k: Path(v) for k, v in paths.items()}
    dtype = getattr(args, "dtype", "float32")
    on_accelerator = getattr(args, "platform", "cpu") in ("gpu", "tpu")
    # On an accelerator: the model's own dtype at a size that keeps the matrix units busy past the
    # launch; the same read at 4 GiB, so one call is ~1-5 ms of HBM traffic and not its dispatch.
    matmul = matmul_peak(dtype, 8192) if on_accelerator else measure_matmul_flops(size=2048, repeats=5)
    bandwidth_gib = 4 if on_accelerator else 1
    model = load_hf_checkpoint(paths["model"], dtype=dtype)
    config = model.config
    graphdef, params = split_params(model)
    del model
    tokenizer = load_tokenizer(paths["tokenizer"])
    batch = args.prompts * args.group
    # No EOS: every row decodes all N tokens, so each sample times the same N - 1 steps.
    sampling = dataclasses.replace(SamplingConfig.from_spec(RolloutSpec(
        max_new_tokens=args.new_tokens, max_prompt_tokens=args.prompt_tokens, temperature=1.0), tokenizer), eos_id=None)
    itemsize = np.dtype(jnp.dtype(dtype)).itemsize
    weight_bytes = param_count(config) * itemsize
    mean_context = args.prompt_tokens + args.new_tokens / 2
    decode_steps = args.new_tokens - 1

    def step_bytes(rows: int) -> float:
        return weight_bytes + rows * mean_context * config.kv_bytes_per_token(itemsize)

    def floors(rows: int, bandwidth: float) -> dict:
        """The two lower bounds on a decode step of `rows` sequences: reading the weights and the cache
        once at the measured bandwidth, and the matmuls' FLOPs at the measured matmul peak."""
        return {"weight_read_floor_s": step_bytes(rows) / bandwidth,
                "matmul_floor_s": 2 * param_count(config) * rows / matmul}

    def decode_samples(rows: int, repeats: int, segments: int | None = None) -> list[dict]:
        """`repeats` timings of the decode loop of `rows` sequences, each between two bandwidth reads.
        `segments`: the engine's decode loops (`locojax.rollout.decode_segments`; None: its default)."""
        tokens = np.random.default_rng(0).integers(10, 1000, (rows, args.prompt_tokens)).astype(np.int32)
        mask = np.ones((rows, args.prompt_tokens), bool)
        prefill, decode = make_prefill_and_decode_fns(config, graphdef, sampling, args.prompt_tokens, rows,
                                                      tuple(jax.local_devices()), segments=segments)
        jax.block_until_ready(decode(params, prefill(params, tokens, mask, jax.random.key(0))))  # compiles both
        samples = []
        for repeat in range(repeats):
            before = read_bandwidth(bandwidth_gib, repeats=3)
            start = time.perf_counter()
            state = jax.block_until_ready(prefill(params, tokens, mask, jax.random.key(repeat + 1)))
            prefill_s = time.perf_counter() - start
            start = time.perf_counter()
            state = jax.block_until_ready(decode(params, state))
            loop_s = time.perf_counter() - start
            if int(state.step) != args.new_tokens:
                raise RuntimeError(f"the decode loop stopped at token {int(state.step)} of {args.new_tokens}")
            del state
            after = read_bandwidth(bandwidth_gib, repeats=3)
            sample_bandwidth = (before["read_gb_s"] + after["read_gb_s"]) / 2 * 1e9
            step_s = loop_s / decode_steps
            samples.append({"read_gb_s_before": before["read_gb_s"], "read_gb_s_after": after["read_gb_s"],
                            "scale_into_fresh_output_gb_s": after["scale_into_fresh_output_gb_s"],
                            "prefill_s": prefill_s, "decode_loop_s": loop_s, "decode_step_s": step_s,
                            "decode_vs_roofline": (rows / step_s) / (sample_bandwidth * rows / step_bytes(rows))})
        return samples

    def summary(rows: int, samples: list[dict]) -> dict:
        ratios = sorted(sample["decode_vs_roofline"] for sample in samples)
        step_s = statistics.median(sample["decode_step_s"] for sample in samples)
        bandwidth = statistics.median((s["read_gb_s_before"] + s["read_gb_s_after"]) / 2 for s in samples) * 1e9
        bounds = floors(rows, bandwidth)
        return {"rows": rows, "decode_step_s": step_s, "decode_tokens_per_s": rows / step_s,
                "stream_bandwidth_gb_s": bandwidth / 1e9, "decode_vs_roofline": statistics.median(ratios),
                "decode_vs_roofline_sample_range": [ratios[0], ratios[-1]], **bounds,
                "bound_by": "weights" if bounds["weight_read_floor_s"] >= bounds["matmul_floor_s"] else "matmuls",
                "decode_vs_attainable": max(bounds.values()) / step_s}

    segments = default_decode_segments(args.new_tokens, jax.devices()[0].platform)
    samples = decode_samples(batch, repeats)
    main = summary(batch, samples)
    # The same loop as one loop over the whole cache (the engine before decode segments), where the
    # engine runs more than one: what reading only the filled slots is worth, in the same process.
    one_loop = summary(batch, decode_samples(batch, 3, segments=1)) if segments > 1 else None
    # Fewer rows than the rollout's: below the ridge (where the matmul floor falls under the weight
    # read), the step is bound by reading the weights whatever the core count; at the rollout's rows
    # a CPU with few cores can be bound by its matmuls instead, where the roofline above is not the limit.
    by_rows = [summary(rows, decode_samples(rows, 3)) for rows in getattr(args, "decode_rows", ()) if rows < batch]
    pieces, rates = decode_breakdown(config, batch, dtype=dtype)
    del params
    breakdown = {**pieces, "rest_s": main["decode_step_s"] - sum(pieces.values()), **rates,
                 "weight_read_floor_s": main["weight_read_floor_s"], "matmul_floor_s": main["matmul_floor_s"]}
    device = jax.devices()[0]
    return {"platform": device.platform, "device_kind": device.device_kind, "jax": jax.__version__,
            "dtype": dtype, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "stream_bandwidth_gb_s": main["stream_bandwidth_gb_s"],
            "bandwidth_note": ("stream_bandwidth_gb_s is the median read bandwidth (a sum over 1 GiB, see "
                               "read_bandwidth) around the decode samples, decode_step_s their median step; "
                               "decode_vs_roofline is the median of the samples' own ratios (decode_samples)"),
            "matmul_peak_gflop_s": matmul / 1e9,
            "decode_step_s": main["decode_step_s"], "decode_steps_timed": decode_steps,
            "prefill_s": statistics.median(sample["prefill_s"] for sample in samples),
            "decode_tokens_per_s": main["decode_tokens_per_s"], "decode_bytes_per_step": step_bytes(batch),
            "roofline_decode_tokens_per_s": main["stream_bandwidth_gb_s"] * 1e9 * batch / step_bytes(batch),
            "decode_vs_roofline": main["decode_vs_roofline"],
            "decode_vs_roofline_sample_range": main["decode_vs_roofline_sample_range"],
            "decode_bound_by": main["bound_by"], "decode_vs_attainable": main["decode_vs_attainable"],
            "attainable_note": ("decode_vs_attainable = the larger of the step's two floors (weight_read_floor_s, "
                                "matmul_floor_s) / the measured step: the full roofline, min(matmul peak, "
                                "bandwidth x intensity); decode_vs_roofline is its bandwidth half alone"),
            "decode_segments": segments,
            "decode_one_loop": None if one_loop is None else {
                k: one_loop[k] for k in ("decode_step_s", "decode_vs_roofline", "decode_vs_roofline_sample_range")},
            "decode_samples": samples, "decode_by_rows": by_rows, "decode_breakdown": breakdown,
            "params": param_count(config),
            "config": {k: getattr(config, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                                       "head_dim", "d_ff", "tie_embeddings", "max_seq_len")}}


# The bf16 matrix peak a TPU v5e chip is sold at, beside the one measured in the limits' process.
NOMINAL_PEAK_FLOP_S = {"TPU v5 lite": 197e12}


def prompt_lengths(paths, args, steps: range) -> list[int]:
    """Tokens (BOS included, truncated to the prompt buffer as the engine's encode_prompts does) of every
    row's prompt at `steps`, as `run_co` draws them (host 0 of 1, each prompt repeated group times)."""
    from locojax.spec import TaskSpec
    from locojax.tasks import host_shard, make_task
    from locojax.tokenizer import load_tokenizer

    task = make_task(TaskSpec(name="gsm8k", path=str(paths["data"])))
    tokenizer = load_tokenizer(paths["tokenizer"])
    return [min(len(tokenizer.encode(e.prompt, add_bos=True)), args.prompt_tokens)
            for step in steps for e in host_shard(task, args.seed, step, args.prompts, 0, 1)
            for _ in range(args.group)]


def train_model_flops(config, args, prompt_tokens: list[int], completion_len: float) -> dict:
    """Model FLOPs of one train step as MaxText counts them: 6 x the matmul parameters (every layer's
    projections and MLP, and the LM head; not the embedding lookup or the norms) x the batch's
    non-padding tokens, plus attention, 6 x layers x query heads x head dim x the sum over rows of
    their length squared (causal: half of 4 x L^2 forward, x3 with the backward). A rematerialised
    forward is not counted. `prompt_tokens`: each row's prompt length over the steps averaged;
    `completion_len`: the mean completion length the rounds logged (completion/len_mean)."""
    from locojax.model.config import param_count

    layer = (config.d_model * config.head_dim * (2 * config.n_heads + 2 * config.n_kv_heads)
             + 3 * config.d_model * config.d_ff)
    matmul_params = config.n_layers * layer + config.vocab_size * config.d_model
    per_row = len(prompt_tokens) / (args.prompts * args.group)  # steps averaged over
    lengths = [p + completion_len for p in prompt_tokens]
    tokens = sum(lengths) / per_row
    attention = 6 * config.n_layers * config.n_heads * config.head_dim * sum(n * n for n in lengths) / per_row
    return {"flops": 6 * matmul_params * tokens + attention, "matmul_params": matmul_params,
            "params": param_count(config), "nonpadding_tokens_per_step": tokens, "attention_flops": attention,
            "prompt_tokens_mean": statistics.mean(prompt_tokens), "completion_tokens_mean": completion_len,
            "method": "MaxText: 6 x matmul params (LM head incl.) x non-padding tokens + causal attention "
                      "(6 x layers x heads x head_dim x sum of rows' length^2); remat's recompute not counted"}


def apply_limits(result: dict, limits: dict) -> None:
    """The limits' figures into `result` (scale.json's keys): decode_vs_roofline, and the train phase's
    model FLOP/s over the matmul peak measured with them (and over the chip's nominal peak)."""
    result["limits"] = limits
    result["decode_vs_roofline"] = limits["decode_vs_roofline"]
    flops, train_s = result.get("train_model_flops_per_step"), result.get("train_s")
    achieved = flops / train_s if flops and train_s else None
    result["train_flop_s"] = achieved
    result["train_vs_matmul_peak"] = achieved / (limits["matmul_peak_gflop_s"] * 1e9) if achieved else None
    nominal = NOMINAL_PEAK_FLOP_S.get(limits.get("device_kind"))
    if nominal:
        result["train_vs_197_tflops"] = achieved / nominal if achieved else None


# ---------------------------------------------------------------------------------------------
# The peer: Tunix's GRPOLearner at the same config, after LoCoJAX's runs (never beside them: memory).


def _grpo_step_bench():
    """bench/grpo_step.py, imported by path (bench/ is not a package): its peer venv and harness."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_grpo_step_bench", ROOT / "bench" / "grpo_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _meminfo_gib() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        if name in ("MemTotal", "MemAvailable"):
            fields[name] = int(value.split()[0]) * 1024 / GiB  # kB
    return fields


def _oom_kills() -> int | None:
    """The kernel's count of OOM kills since boot (/proc/vmstat), None where it is not exposed."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def peer_memory_estimate(config, args, kl_coef: float, lora_rank: int = 0) -> dict:
    """What a float32 Tunix GRPO step holds at least: policy, gradients and AdamW's two moments (and a
    reference model when the KL term is on), plus ~3 full-vocabulary float32 logits tensors over every
    slot (Tunix computes log-probs from the logits of the whole prompt + completion sequence). With
    `lora_rank`, one copy of the weights in `args.dtype` (the frozen base, also the reference) and the
    adapters' float32 values, gradients and moments (rank x (in + out) per projection, all seven)."""
    from locojax.model.config import param_count

    params = param_count(config)
    rows, slots = args.prompts * args.group, args.prompt_tokens + args.new_tokens
    logits_gib = 3 * rows * slots * config.vocab_size * 4 / GiB
    logits_terms = f"3 x {rows} rows x {slots} slots x {config.vocab_size} vocab x 4 B (activations not counted)"
    if lora_rank:
        from locojax.model.config import LORA_MODULES, LoRAConfig, lora_param_count

        all_seven = LoRAConfig(rank=lora_rank, alpha=1.0, targets=tuple(LORA_MODULES))
        adapters = lora_param_count(config.replace(lora=all_seven))
        weight_bytes = 2 if getattr(args, "dtype", "float32") == "bfloat16" else 4
        state_gib = (weight_bytes * params + 4 * 4 * adapters) / GiB
        return {"params": params, "adapter_params": adapters, "state_gib": state_gib, "logits_gib": logits_gib,
                "estimate_gib": state_gib + logits_gib,
                "estimate_terms": f"{weight_bytes} B x {params} params + 4 x 4 B x {adapters} adapter values + "
                                  + logits_terms}
    copies = 4 + (1 if kl_coef else 0)
    state_gib = copies * 4 * params / GiB
    return {"params": params, "float32_copies_of_params": copies, "state_gib": state_gib, "logits_gib": logits_gib,
            "estimate_gib": state_gib + logits_gib,
            "estimate_terms": f"{copies} x 4 B x {params} params + " + logits_terms}


def peer_config(paths, args, peer_steps: int) -> dict:
    """The harness's CONFIG.json: the very RunSpec the LoCoJAX side trains (dims from its preset; algo,
    optimizer and sampling from the validated spec, defaults included) and the prompts `run_co` draws."""
    from locojax.spec import RunSpec, TaskSpec
    from locojax.tasks import host_shard, make_task
    from locojax.tokenizer import load_tokenizer

    preset = model_config(args.model_preset)
    # Tunix's Qwen3 always has QK-norm: only a Qwen3 preset is the same model on both sides.
    assert preset.arch == "qwen3" and preset.qk_norm, preset
    spec = RunSpec.model_validate(make_spec(paths, args, "scale-peer", None))
    if spec.model.remat not in PEER_REMAT:
        raise SystemExit(f"remat {spec.model.remat} has no Tunix counterpart (its RematConfig keeps nothing or "
                         f"rematerialises whole decoder layers: {', '.join(PEER_REMAT)}); run with --no-peer")
    task = make_task(TaskSpec(name="gsm8k", path=str(paths["data"])))
    tokenizer = load_tokenizer(paths["tokenizer"])
    # The prompts of steps 0..peer_steps-1, host 0 of 1, as `run_co` draws them (same seed, same JSONL).
    prompts = [[{"prompt": e.prompt, "answer": e.answer}
                for e in host_shard(task, spec.seed, step, spec.rollout.prompts_per_step, 0, 1)]
               for step in range(peer_steps)]
    model = {k: getattr(preset, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                              "head_dim", "d_ff", "rope_theta", "norm_eps", "tie_embeddings")}
    return {
        "seed": spec.seed, "steps": peer_steps, "model": {**model, "remat": spec.model.remat}, "prompts": prompts,
        "tokenizer": {"path": str(paths["tokenizer"]), "bos_id": tokenizer.bos_id, "pad_id": tokenizer.pad_id},
        "workload": {"group_size": spec.rollout.group_size, "new_tokens": spec.rollout.max_new_tokens,
                     "prompt_slots": spec.rollout.max_prompt_tokens, "temperature": spec.rollout.temperature},
        "algo": {"kl_coef": spec.algo.kl_coef, "num_iterations": spec.algo.num_iterations,
                 "clip_eps": spec.algo.clip_eps, "loss_agg": spec.algo.loss_agg},
        "optim": {"lr": spec.optim.lr, "grad_clip": spec.optim.grad_clip, "b1": spec.optim.b1, "b2": spec.optim.b2,
                  "weight_decay": spec.optim.weight_decay},
        # For the record only (the harness does not read them): the longest prompt in LoCoJAX's ids.
        "longest_prompt_tokens": max(len(tokenizer.encode(row["prompt"], add_bos=True))
                                     for step in prompts for row in step),
        "clip_eps_high": spec.algo.clip_eps_high,
    }


def run_process(command: list[str], log_dir: Path, timeout_s: float, sample_s: float = 0.5,
                platform: str = "cpu", env: dict[str, str] | None = None) -> dict:
    """Runs `command` in its own session, killed (with everything it started) after `timeout_s`.

    Peak RSS is the child's VmHWM, read every `sample_s` while it runs (a high-water mark, so only growth
    in its last `sample_s` can be missed), not wait4's ru_maxrss: Linux carries the RSS high-water mark
    of the process that spawned it into a child's ru_maxrss at exec, and this process may hold a
    loaded model by then. The child is reaped only after the sampling stops, so its pid cannot be reused
    under the sampler or the timeout's kill."""
    import signal
    import threading

    stdout_path, stderr_path = log_dir / "stdout.log", log_dir / "stderr.log"
    env = platform_env(platform, env)
    timed_out, exited = threading.Event(), threading.Event()
    peak = [0]
    oom_before = _oom_kills()
    started = time.monotonic()
    with stdout_path.open("w") as out, stderr_path.open("w") as err:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)

        def kill_on_timeout():
            timed_out.set()
            os.killpg(process.pid, signal.SIGKILL)

        def sample_peak():
            while not exited.wait(sample_s):
                peak[0] = max(peak[0], _vm_hwm_bytes(Path(f"/proc/{process.pid}")))

        timer = threading.Timer(timeout_s, kill_on_timeout)
        sampler = threading.Thread(target=sample_peak, daemon=True)
        timer.start()
        sampler.start()
        try:
            os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        finally:
            timer.cancel()
            exited.set()
            sampler.join()
        _, status, _ = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    oom_after = _oom_kills()
    return {"returncode": process.returncode, "timed_out": timed_out.is_set(), "wall_s": time.monotonic() - started,
            "peak_rss_gib": peak[0] / GiB, "stdout": stdout_path.read_text(), "stderr": stderr_path.read_text(),
            "oom_kills_during_run": None if oom_before is None or oom_after is None else oom_after - oom_before}


FAILURE_MARKERS = ("MemoryError", "RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM")


def failure_reason(process: dict, timeout_s: float, memory: dict) -> tuple[str, str]:
    """What the process left: one sentence (how it ended, what its stderr mentions, the peak RSS it
    reached, the machine's memory) and its stderr's last lines (addresses in them elided)."""
    import signal

    code = process["returncode"]
    if process["timed_out"]:
        how = f"killed by this bench's --peer-timeout after {timeout_s:.0f} s"
    elif code < 0:
        how = f"killed by signal {-code} ({signal.Signals(-code).name})"
        if process["oom_kills_during_run"] is not None:
            how += f"; the kernel counted {process['oom_kills_during_run']} OOM kill(s) during the run (/proc/vmstat)"
    else:
        how = f"exited with status {code}"
    markers = [m for m in FAILURE_MARKERS if m in process["stderr"]]
    tail = "\n".join(process["stderr"].strip().splitlines()[-15:])[-2500:]
    tail = re.sub(r"\w+://\S+", "<address>", tail)  # library error messages cite documentation pages
    summary = (f"{how}{'; stderr mentions ' + ', '.join(markers) if markers else ''}; peak RSS "
               f"{process['peak_rss_gib']:.2f} GiB after {process['wall_s']:.0f} s; MemTotal "
               f"{memory['mem_total_gib']:.1f} GiB, MemAvailable {memory['mem_available_gib']:.1f} GiB at start "
               f"(estimate {memory['estimate_gib']:.2f} GiB)")
    return summary, tail


def steady_part(values: list[float]) -> list[float]:
    """The steady part of a per-step series, as step_figures takes LoCoJAX's: every step after the first
    (which compiles), or all of them when there is only one."""
    return values[1:] or values


def run_peer(paths, args, work: Path) -> dict:
    """Tunix's GRPOLearner on the same spec, prompts and tokenizer: `peer` for scale.json, ran or not."""

    bench = _grpo_step_bench()
    # LoCoJAX's step_s is the median of its steps after the first. The harness times a step from one
    # batch pull to the next, so its last step has no period: one more step gives the same count.
    peer_steps = args.steps + 1
    config = peer_config(paths, args, peer_steps)
    preset = model_config(args.model_preset)
    memory = peer_memory_estimate(preset, args, config["algo"]["kl_coef"])
    meminfo = _meminfo_gib()
    memory.update(mem_total_gib=meminfo["MemTotal"], mem_available_gib=meminfo["MemAvailable"],
                  below_estimate=meminfo["MemAvailable"] < memory["estimate_gib"])
    if memory["below_estimate"]:
        print(f"MemAvailable {meminfo['MemAvailable']:.1f} GiB is below the peer's estimated "
              f"{memory['estimate_gib']:.1f} GiB; running it anyway (an OOM kill is an answer too)", flush=True)
    record = {"package": bench.PEER_PACKAGE, "steps": peer_steps,
              "steps_note": "one more step than LoCoJAX: the peer's last step has no next batch pull to end its "
                            "period; its steady step is the median of its periods after the first, as many as "
                            "LoCoJAX's steps after the first",
              "memory": memory, "longest_prompt_tokens": config["longest_prompt_tokens"],
              "config": {k: config[k] for k in ("model", "workload", "algo", "optim")},
              "differences": [
                  f"Tunix's GRPOConfig has one clip epsilon ({config['algo']['clip_eps']} both ways); LoCoJAX "
                  f"clips above at {config['clip_eps_high']} (clip_eps_high): an elementwise bound, no work",
                  "no stop token on the peer: every row decodes all new tokens; LoCoJAX decodes all of them "
                  "unless every row has stopped (completion_len_max checks it) and ends a row's loss mask at "
                  "its EOS",
                  "LoCoJAX's step_s excludes its checkpoint save; the peer saves none"]}
    try:
        python = bench.ensure_peer_venv()
    except (subprocess.CalledProcessError, OSError) as error:
        return {"ran": False, "reason": f"could not install {bench.PEER_PACKAGE} into its venv: {error}", **record}
    log_dir = work / "peer"
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path = log_dir / "peer_config.json"
    config_path.write_text(json.dumps(config))
    load_before = os.getloadavg()
    print(f"peer: {bench.PEER_PACKAGE} GRPOLearner, {peer_steps} steps (timeout {args.peer_timeout:.0f} s; "
          f"logs in {log_dir}) ...", flush=True)
    process = run_process([str(python), str(bench.PEER_SCRIPT), str(config_path)], log_dir, args.peer_timeout)
    record.update(wall_s=process["wall_s"], peak_rss_gib=process["peak_rss_gib"],
                  load_average_before=load_before, load_average_after=os.getloadavg())
    lines = [line for line in process["stdout"].splitlines() if line.startswith("{")]
    if process["returncode"] != 0 or not lines:
        summary, tail = failure_reason(process, args.peer_timeout, memory)
        return {"ran": False, "reason": f"{summary}. Last lines of stderr:\n{tail}", "summary": summary,
                **record}
    out = json.loads(lines[-1])
    if out["train_steps"] != peer_steps:
        return {"ran": False, "reason": f"the peer trained {out['train_steps']} steps, not {peer_steps}", **record}
    steady = steady_part(out["periods_s"])  # period k is step k, k = 0 .. peer_steps - 2
    kept = range(1, peer_steps - 1) if peer_steps > 2 else range(peer_steps - 1)  # the steps of `steady`
    phases = {name: statistics.median(values[k] for k in kept) for name, values in out["phases_s"].items()
              if len(values) == peer_steps}
    record.update(ran=True, step_s=statistics.median(steady), periods_s=out["periods_s"], steady_periods_s=steady,
                  last_step_s=out["last_step_s"], total_s=out["total_s"],
                  generated=out["generated"], versions=out["versions"], phases=phases,
                  reference_model=out.get("reference_model"))
    return record


def identical_work(result: dict, peer: dict, args, work: Path | None) -> dict:
    """Did both sides decode rows x new tokens completion slots per step over the same prompt buffer?
    The peer counts its rollouts; LoCoJAX decodes every slot while any row is still going, so its steps
    decoded rows x N exactly when completion/len_max reached N (from scale.json, else the metrics files
    a --work directory keeps). `locojax_ok` is None where neither holds them (a scale.json older than
    `completion_len_max`): unknown, which does not withhold the ratio; the note says so."""
    rows, new, slots = args.prompts * args.group, args.new_tokens, args.prompts * args.group * args.new_tokens
    len_max = [step for r in result["rounds"] for step in (r.get("completion_len_max") or [])]
    if not len_max and work is not None:
        for metrics in sorted(work.glob("cli-*/metrics.jsonl")):
            len_max += step_figures(metrics, args.steps)["completion_len_max"]
    peer_ok = all(g["rows"] == rows and g["slots"] == slots and g["min_len"] == g["max_len"] == new
                  and g.get("prompt_width", args.prompt_tokens) == args.prompt_tokens for g in peer["generated"])
    locojax_ok = all(m is not None and int(m) == new for m in len_max) if len_max else None
    check = {"rows_per_step": rows, "new_tokens": new, "completion_slots_per_step": slots,
             "prompt_slots": args.prompt_tokens,
             "peer_slots_per_step": [g["slots"] for g in peer["generated"]],
             "peer_prompt_width": [g.get("prompt_width") for g in peer["generated"]],
             "locojax_completion_len_max": len_max, "peer_ok": peer_ok, "locojax_ok": locojax_ok,
             "same": peer_ok and locojax_ok is not False}
    if locojax_ok is None:
        check["note"] = ("LoCoJAX's completion lengths are not recorded for this run: its train step runs over "
                         "rows x new tokens slots by construction, and its decode loop would stop early only if "
                         "every row sampled EOS, which is not checked here")
    return check


def merge_peer(result: dict, peer: dict, args, work: Path | None) -> None:
    """`peer`, `ratio_vs_peer` and `peer_note` of scale.json from the peer's record."""
    result["peer"] = peer
    result["ratio_vs_peer"] = None
    name = peer["package"].replace("google-", "").replace("==", " ")
    if not peer["ran"]:
        result["peer_note"] = (f"{name} GRPOLearner did not complete at this config: "
                               f"{peer.get('summary', peer['reason'])} (peer.reason has its stderr)")
        return
    peer["identical_work"] = check = identical_work(result, peer, args, work)
    if not check["same"]:
        result["peer_note"] = (f"{name} GRPOLearner ran, but the two sides' work differed (see "
                               f"peer.identical_work), so no ratio is given")
        return
    result["ratio_vs_peer"] = peer["step_s"] / result["step_s"]
    result["peer_note"] = (
        f"{name} GRPOLearner on the same spec, prompts and tokenizer (kl_coef {peer['config']['algo']['kl_coef']:g}"
        f"{', no reference model' if not peer['reference_model'] else ''}, remat {peer['config']['model']['remat']} "
        f"in training): steady step {peer['step_s']:.3g} s (median of its {len(peer['steady_periods_s'])} periods "
        f"after the first, {peer['steps']} steps) against LoCoJAX's {result['step_s']:.3g} s; ratio_vs_peer = "
        f"peer / LoCoJAX (>1: LoCoJAX faster); peak RSS {peer['peak_rss_gib']:.3g} GiB against LoCoJAX's "
        f"{result['peak_rss_gib']:.3g} GiB"
        f"{'; LoCoJAX decoded slots not recorded (peer.identical_work.note)' if check['locojax_ok'] is None else ''}")


def summarise(args, limits: dict | None, rounds: list[dict], rest: dict | None, load_before, wall_s: float,
              paths: dict | None = None) -> dict:
    """scale.json's figures from the phases' results (the limits' figures, where they were measured
    in this run, by `apply_limits`). Model FLOPs count the prompts' real lengths from `paths`' task
    and tokenizer; without `paths`, every prompt slot."""

    step_times = [r["step_s"] for r in rounds]
    train_s = statistics.median(r["train_s"] for r in rounds)
    completions = [r["completion_len_mean"] for r in rounds if r.get("completion_len_mean")]
    # The prompts of the steps step_s and train_s are medians of (every step after the first).
    prompts = (prompt_lengths(paths, args, range(1, max(args.steps, 2))) if paths is not None
               else [args.prompt_tokens] * args.prompts * args.group)
    flops = train_model_flops(model_config(args.model_preset), args, prompts,
                              statistics.median(completions) if completions else args.new_tokens)
    peak = max(r["peak_rss_gib"] for r in rounds)
    planned = rounds[0]["planned_gib"]
    caches = [r.get("compilation_cache") for r in rounds]
    result = {
        "benchmark": "scale", "model": f"{args.model_preset} (exact config, random weights)", "mode": "co",
        "seed": args.seed, "commit": source_commit(),
        "batch": {"prompts": args.prompts, "group_size": args.group, "max_prompt_tokens": args.prompt_tokens,
                  "max_new_tokens": args.new_tokens, "dtype": args.dtype, "remat": args.remat,
                  "micro_batch_size": args.micro_batch_size},
        "platform": args.platform,
        "steps_completed": min(r["steps_completed"] for r in rounds),
        "step_s": statistics.median(step_times),
        "step_s_rounds": step_times,
        "step_s_spread": (max(step_times) - min(step_times)) / statistics.median(step_times),
        "rollout_tokens_per_s": statistics.median(r["rollout_tokens_per_s"] for r in rounds),
        "peak_rss_gib": peak,
        "planned_gib": planned,
        "peak_rss_vs_plan": peak / planned if planned else None,
        "plan_line": rounds[0]["plan_line"],
        # Accelerators: the allocator's own high-water mark (`memory/device_peak_gib`), the figure the
        # plan forecasts there; the host RSS above is then the Python process, not the model.
        "peak_device_gib": max((r.get("peak_device_gib") or 0.0) for r in rounds) or None,
        "peak_device_vs_plan": (max((r.get("peak_device_gib") or 0.0) for r in rounds) / planned
                                if planned and any(r.get("peak_device_gib") for r in rounds) else None),
        # From the run loop's start (the chip open, the model built) to the end of step 0, the clock
        # issue 37 sets: time/setup + step 0's time/step less time/setup_backend and time/setup_model,
        # so the run's compilation counts and opening the chip and building the model do not
        # (`loop_first_step_s`); with an empty persistent compilation cache, then from the one round 0
        # filled (--compilation-cache). setup_and_first_step_s_*: the whole setup included.
        "first_step_s_cold": loop_first_step_s(rounds[0]) if caches[0] else None,
        "first_step_s_warm": (statistics.median(loop_first_step_s(r) for r, c in zip(rounds, caches)
                                                if c and c["state"] == "warm")
                              if any(c and c["state"] == "warm" for c in caches) else None),
        "first_step_s_rounds": [loop_first_step_s(r) for r in rounds],
        "setup_and_first_step_s_cold": rounds[0]["first_step_s"] if caches[0] else None,
        "setup_and_first_step_s_rounds": [r["first_step_s"] for r in rounds],
        "setup_parts_s_rounds": [r.get("setup_parts_s") for r in rounds],
        "rest": rest,
        "decode_vs_roofline": None,
        "train_model_flops_per_step": flops["flops"],
        "train_flops": flops,
        "train_s": train_s,
        "train_vs_matmul_peak": None,
        "limits": None,
        "rounds": rounds,
        "ratio_vs_peer": None,
        "peer_note": ("no Tunix run recorded: the bench ran with --no-peer, or its peer had not finished when this "
                      "was written; `bench/scale.py --peer-only --work DIR` adds one"),
        "peer": None,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "load_note": args.load_note,
        "cpu_count": os.cpu_count(), "wall_s": wall_s,
    }
    if limits is not None:
        apply_limits(result, limits)
    return result


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def run_locojax(args, work: Path) -> dict:
    """The LoCoJAX phases (machine limits, `locojax train` rounds, the REST run, the profiled run):
    scale.json's figures."""
    load_before = os.getloadavg()
    started = time.monotonic()
    if not args.resume_partial:  # a --work reused from an earlier run: its run directories are not this run's
        for stale in [*work.glob("cli-*"), *work.glob("profile-*")]:
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    paths = input_paths(work, args.model_preset) if args.resume_partial else (
        build_inputs(work, args.seed, args.model_preset))
    # Each phase's figures land in <out>.partial as they come, so a failure late keeps the rest.
    partial = args.out.with_suffix(".partial.json")
    done = json.loads(partial.read_text()) if args.resume_partial and partial.is_file() else {}
    if "limits" in done:
        limits, rounds = done["limits"], done.get("rounds", [])
        load_before = tuple(done.get("load_average_before", load_before))
    else:
        limits, rounds = (None if args.skip_limits else machine_limits(paths, args)), []
    partial.write_text(json.dumps({"limits": limits, "load_average_before": load_before}, indent=2))
    for index in range(len(rounds), args.rounds):
        rounds.append(run_cli(paths, args, work, index))
        partial.write_text(json.dumps({"limits": limits, "rounds": rounds, "load_average_before": load_before},
                                      indent=2))
    rest = None if args.no_rest else run_rest(paths, args, work)
    profile = profile_run(paths, args, work) if args.profile_steps else None
    partial.unlink(missing_ok=True)
    result = summarise(args, limits, rounds, rest, load_before, time.monotonic() - started, paths)
    result["inputs_sha256"] = input_digests(paths)
    if profile is not None:
        result["profile"] = profile
        result["device_idle_fraction"] = profile.get("device_idle_fraction")
    if args.runs_tar:
        result["runs_tar"] = pack_run_files(work, args.runs_tar)
    return result


PROFILE_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from bench.scale import profile_child
print(json.dumps(profile_child({spec!r}, {trace!r}, {first!r}, {steps!r})))
"""


def profile_child(spec_json: str, trace_dir: str, first_step: int, steps: int) -> dict:
    """Runs the spec's CO loop in this process with steps `first_step` .. `first_step + steps - 1`
    traced (bench/profile_trace.py): the trace's summary and the device it ran on."""
    from bench.profile_trace import ProfiledSteps, annotated_phases, summarise_trace
    from locojax.modes.co import run_co
    from locojax.spec import RunSpec

    spec = RunSpec.model_validate_json(spec_json)
    with annotated_phases():
        result = run_co(spec, console=False, extra_sinks=[ProfiledSteps(trace_dir, first_step, steps)])
    if result.status != "succeeded":
        raise RuntimeError(f"the profiled run ended {result.status} after {result.steps_done} steps")
    import jax

    device = jax.devices()[0]
    return {**summarise_trace(trace_dir), "device": {"platform": device.platform, "device_kind": device.device_kind}}


def profile_run(paths, args, work: Path) -> dict:
    """One more run of the rounds' spec (in a child process; from the compilation cache the rounds
    filled, where --compilation-cache is on) whose steps after the first are profiled: where the
    steady step's time goes (top ops by time, per phase) and how much of it the device idles."""
    from locojax.spec import RunSpec

    out = work / "profile-run"
    spec = RunSpec.model_validate(make_spec(paths, args, "scale-profile", out)).model_copy(
        update={"steps": args.profile_steps + 3})  # step 0 compiles, 1 leads in; the last one saves the checkpoint
    trace = work / "profile-trace"
    shutil.rmtree(trace, ignore_errors=True)
    code = PROFILE_CHILD.format(root=str(ROOT), spec=spec.model_dump_json(), trace=str(trace), first=2,
                                steps=args.profile_steps)
    cache_env = {}
    if args.compilation_cache != "off":
        cache_env = {"JAX_COMPILATION_CACHE_DIR": str(work / "compilation-cache"),
                     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=platform_env(args.platform, _env(), **cache_env))
    (work / "profile-run-stderr.log").write_text(done.stderr)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    if done.returncode != 0:
        return {"error": f"the profiled run failed (status {done.returncode}): "
                         + " | ".join(done.stderr.strip().splitlines()[-3:])[-1500:]}
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    summary.update(wall_s=time.monotonic() - started, compilation_cache=cache_env.get("JAX_COMPILATION_CACHE_DIR"))
    return summary


# environment.json too: `locojax calibration import` and bench/placement_tpu.py read a run from these.
RUN_FILES = ("metrics.jsonl", "spec.yaml", "result.json", "environment.json", "stdout.log", "stderr.log")


def pack_run_files(work: Path, tar_path: Path) -> dict:
    """Every run directory's metrics.jsonl, spec.yaml and result.json (and the runs' logs) in one
    tarball, for calibrating the placement model later."""
    import tarfile

    files = sorted(p for p in work.rglob("*") if p.is_file() and p.name in RUN_FILES
                   and "checkpoints" not in p.parts)
    tar_path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar_path, "w:gz") as tar:
        for path in files:
            tar.add(path, arcname=str(path.relative_to(work)))
    return {"file": tar_path.name, "members": [str(p.relative_to(work)) for p in files]}


def load_recorded_run(args, flag: str) -> dict:
    """The existing --out that `flag` adds to; its batch and lengths become this run's, so what is
    measured now describes the same run."""
    if not args.out.is_file():
        raise SystemExit(f"{flag} adds to an existing {args.out}; run the full bench first")
    result = json.loads(args.out.read_text())
    batch = result["batch"]
    args.prompts, args.group = batch["prompts"], batch["group_size"]
    args.prompt_tokens, args.new_tokens = batch["max_prompt_tokens"], batch["max_new_tokens"]
    return result


def source_commit() -> str:
    """The checkout's commit, with "+changes" when the engine or the bench differ from it; where
    LOCOJAX_BENCH_COMMIT is set (bench/tpu.sh on a machine given a copy of the checkout, whose .git
    may be older than its files), that commit."""
    if os.environ.get("LOCOJAX_BENCH_COMMIT"):
        return os.environ["LOCOJAX_BENCH_COMMIT"][:7]

    def git(*command):
        return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--", "locojax", "bench/scale.py") else "")


def rerun_limits(args) -> None:
    """--limits-only: the limits phase again, into the existing --out (`load_recorded_run`), on --work's
    model (built from the recorded seed where --work lacks it); train_vs_matmul_peak is recomputed from the
    rounds' train time and the new matmul peak, and `limits_rerun` says when and under what load, and keeps
    the full run's own pair (this VM's host can change between sessions, and the ratio then mixes two)."""
    result = load_recorded_run(args, "--limits-only")
    if result.get("platform", "cpu") != args.platform:
        raise SystemExit(f"{args.out} was measured on {result.get('platform', 'cpu')}; its limits cannot come "
                         f"from --platform {args.platform}")
    paths = input_paths(args.work, args.model_preset)
    if not (paths["model"] / "config.json").is_file():  # deterministic in the seed: rebuilt, then checked
        args.work.mkdir(parents=True, exist_ok=True)
        paths = build_inputs(args.work, result.get("seed", args.seed), args.model_preset)
    recorded_digests = result.get("inputs_sha256")
    if recorded_digests and recorded_digests != input_digests(paths):
        raise SystemExit(f"the JSONL or tokenizer in {args.work} differ from those {args.out} was measured with")
    load_before = os.getloadavg()
    full_run = {"full_run_train_vs_matmul_peak": result.get("train_vs_matmul_peak"),
                "full_run_matmul_peak_gflop_s": result.get("limits", {}).get("matmul_peak_gflop_s")}
    limits = machine_limits(paths, args)
    apply_limits(result, limits)
    # The rounds' train time is of their dtype: against another dtype's matmul peak it means nothing.
    if result["batch"].get("dtype", "float32") != args.dtype:
        result["train_vs_matmul_peak"] = None
        result.pop("train_vs_197_tflops", None)
    result["limits_rerun"] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": source_commit(),
                              "dtype": args.dtype, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                              "load_average_before": load_before, "load_average_after": os.getloadavg(),
                              "load_note": args.load_note, **full_run,
                              "note": ("train_vs_matmul_peak pairs the full run's train time with this rerun's "
                                       "matmul peak: it holds only on the host the full run used")}
    _write(args.out, result)
    print(json.dumps({k: result[k] for k in ("decode_vs_roofline", "train_vs_matmul_peak")}
                     | {"decode_vs_roofline_sample_range": limits["decode_vs_roofline_sample_range"]}, indent=2))


def limits_part(args, work: Path) -> None:
    """--limits-part: the limits phase alone on this run's batch, written as a part of a refresh
    (bench/tpu_merge.py completes the `scale` part's rounds with it)."""
    from bench.tpu_merge import part_header

    paths = input_paths(work, args.model_preset)
    if not ((paths["model"] / "config.json").is_file() and paths["data"].is_file()):
        paths = build_inputs(work, args.seed, args.model_preset)
    limits = machine_limits(paths, args)
    part = {"benchmark": "scale_limits",
            **part_header(args.stage, platform=limits["platform"], device_kind=limits["device_kind"]),
            "batch": {"prompts": args.prompts, "group_size": args.group, "max_prompt_tokens": args.prompt_tokens,
                      "max_new_tokens": args.new_tokens, "dtype": args.dtype, "remat": args.remat,
                      "micro_batch_size": args.micro_batch_size},
            "inputs_sha256": input_digests(paths), "limits": limits, "load_note": args.load_note}
    _write(args.out, part)
    print(json.dumps({k: limits[k] for k in ("decode_vs_roofline", "decode_step_s", "stream_bandwidth_gb_s",
                                             "matmul_peak_gflop_s", "device_kind")}, indent=2))


def load_for_peer_only(args, work: Path) -> tuple[dict, str]:
    """The existing scale.json a --peer-only run adds to, and where the peer's inputs come from. The
    file's batch, steps and seed become this run's, so the peer repeats the LoCoJAX run it describes;
    the JSONL and tokenizer are the --work directory's, or rebuilt from the seed where it lacks them."""

    result = load_recorded_run(args, "--peer-only")
    args.remat = result["batch"]["remat"]
    args.micro_batch_size = result["batch"].get("micro_batch_size")
    args.steps, args.seed = result["steps_completed"], result.get("seed", args.seed)
    recorded = result["limits"]["config"]
    preset = model_config(args.model_preset)
    if any(getattr(preset, key) != value for key, value in recorded.items()):
        raise SystemExit(f"{args.out} records a model {recorded}, not the {args.model_preset} preset")
    paths = input_paths(work, args.model_preset)
    if paths["data"].is_file() and paths["tokenizer"].is_file():
        source = f"the full run's --work directory {work}"
    else:
        paths = build_inputs(work, args.seed, args.model_preset, weights=False)
        source = (f"rebuilt from seed {args.seed} (the JSONL and tokenizer.json; the bench builds them "
                  f"deterministically)")
    recorded_digests = result.get("inputs_sha256")
    if recorded_digests and recorded_digests != input_digests(paths):
        raise SystemExit(f"the JSONL or tokenizer in {work} differ from those {args.out} was measured with")
    if not recorded_digests:
        source += "; this scale.json predates inputs_sha256, so they are not checked against its run"
    return result, source


def _row_counts(text: str) -> tuple[int, ...]:
    try:
        rows = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--decode-rows takes comma-separated row counts, got {text!r}") from None
    if any(count < 1 for count in rows):
        raise argparse.ArgumentTypeError(f"--decode-rows counts must be >= 1, got {text!r}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="locojax train runs (the REST run is once)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--remat", choices=("none", "dots", "full"), default="full")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="algo.micro_batch_size (sequences per gradient micro-batch; default: the engine's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="model.dtype of the runs and of the limits phase's decode")
    parser.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default="cpu",
                        help="where the engine's processes run (JAX_PLATFORMS; unset on a TPU); figures are only "
                             "compared within one. A TPU VM opens no socket: no REST phase there")
    parser.add_argument("--compilation-cache", choices=("off", "cold-warm"), default="off",
                        help="cold-warm: round 0 with an empty persistent compilation cache folder, later rounds "
                             "with the one it filled (first_step_s_cold, first_step_s_warm)")
    parser.add_argument("--skip-limits", action="store_true",
                        help="no limits phase (bench/tpu.sh measures it in a stage of its own, --limits-part)")
    parser.add_argument("--limits-part", action="store_true",
                        help="only the limits phase, written to --out as a part of a refresh (bench/tpu_merge.py)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the rounds, one more run with this many steady steps profiled: "
                             "device_idle_fraction and the top ops by time per phase")
    parser.add_argument("--runs-tar", type=Path, default=None,
                        help="a tarball of every run directory's metrics.jsonl, spec.yaml, result.json and logs")
    parser.add_argument("--stage", default=None, help="the bench/tpu.sh stage this is: the JSON becomes its part")
    parser.add_argument("--decode-rows", type=_row_counts, default=(1, 4, 8),
                        help="the limits phase also times decode at these row counts (comma-separated; those "
                             "below prompts x group), to show where the step turns from weights- to matmul-bound")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-rest", action="store_true", help="skip the run through `locojax up`")
    parser.add_argument("--rest-timeout", type=float, default=600.0)
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                        help="after LoCoJAX's runs, Tunix's GRPOLearner at the same config (default: on)")
    parser.add_argument("--peer-timeout", type=float, default=3600.0, help="wall-clock limit of the peer run (s)")
    parser.add_argument("--peer-only", action="store_true",
                        help="run only the peer and add it to the existing --out (inputs from --work, or rebuilt)")
    parser.add_argument("--limits-only", action="store_true",
                        help="rerun only the machine limits (decode vs roofline, matmul peak) into the existing --out, "
                             "on the model in --work")
    parser.add_argument("--work", type=Path, default=None, help="default: a temporary directory, removed after")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--load-note", default="", help="what else ran on the machine, recorded in the JSON")
    parser.add_argument("--resume-partial", action="store_true",
                        help="reuse the phases <out>.partial.json holds (needs the same --work) and run the rest")
    # Development only: the whole bench (peer included) at a small preset, to check its paths quickly.
    parser.add_argument("--model-preset", default="qwen3-0.6b", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_only and (not args.peer or args.resume_partial):
        parser.error("--peer-only goes with neither --no-peer nor --resume-partial")
    if args.peer and not (args.limits_part or args.limits_only) and args.remat not in PEER_REMAT:
        parser.error(f"--remat {args.remat} has no Tunix counterpart ({', '.join(PEER_REMAT)}): add --no-peer")
    if args.platform == "tpu":
        args.no_rest = True  # no socket can open there
    if args.limits_part:
        work = args.work or Path(tempfile.mkdtemp(prefix="locojax-scale-"))
        work.mkdir(parents=True, exist_ok=True)
        limits_part(args, work)
        return
    if args.limits_only:
        if args.work is None or args.peer_only or args.resume_partial:
            parser.error("--limits-only needs --work (the model it times) and goes with neither --peer-only "
                         "nor --resume-partial")
        rerun_limits(args)
        return

    work = args.work or Path(tempfile.mkdtemp(prefix="locojax-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        inputs = f"the inputs this run built in {'--work ' + str(work) if args.work else 'a temporary directory'}"
        if args.peer_only:
            result, inputs = load_for_peer_only(args, work)
        else:
            result = run_locojax(args, work)
            if args.stage:
                from bench.tpu_merge import part_header

                device = (result.get("profile") or {}).get("device") or {}
                result.update(part_header(args.stage, platform=device.get("platform", args.platform),
                                          device_kind=device.get("device_kind")))
                if args.platform == "tpu":
                    result["rest_note"] = "no REST phase: the TPU VM opens no socket"
            # Written before the peer starts, so its failure or a crash here cannot lose LoCoJAX's figures.
            _write(args.out, result)
            print(json.dumps({k: result[k] for k in ("steps_completed", "step_s", "rollout_tokens_per_s",
                                                     "peak_rss_gib", "planned_gib", "peak_rss_vs_plan",
                                                     "decode_vs_roofline", "train_vs_matmul_peak",
                                                     "load_average_before")}, indent=2), flush=True)
        if args.peer:
            peer = run_peer(input_paths(work, args.model_preset), args, work)
            peer["inputs"] = inputs
            merge_peer(result, peer, args, work)
            _write(args.out, result)
            print(json.dumps({k: result[k] for k in ("ratio_vs_peer", "peer_note")}, indent=2))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

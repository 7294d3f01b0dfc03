"""Rollout throughput: LoCoJAX's jitted while-loop sampler against Tunix's sampler, same run.

    .venv/bin/python bench/rollout.py            # -> bench/results/rollout.json
    python3 bench/rollout.py --platform gpu --peer-python python3 --out bench/results/rollout_gpu.json

On a GPU (`--platform gpu`) both sides run on the accelerator; `--peer-python` names a Python that
already imports Tunix (a machine with no package index cannot build the peer venv). Where the peer
cannot start there, LoCoJAX's rounds still run and `peer` says why it did not.

Workload (issue 3): the `small` preset (d_model 256, 4 layers, 4 heads, 4 kv heads, head_dim 64,
d_ff 1024, byte vocabulary padded to 384), float32, 64 prompts x 64 new tokens with no early stop,
temperature 1, prompts of the `arith` task left-padded to 64 slots. Both samplers get the same
prompt strings and return the same things (texts, tokens and per-token log-probs), and both are
timed from prompt strings in to results on the host, so each side pays its own tokenisation and
post-processing.

The peer is Tunix 0.1.7 (`google-tunix`), installed by this script into its own ignored venv
(bench/.peer-venvs/tunix), never a project dependency. It builds a Qwen3 of identical dimensions and
runs in a subprocess of this script (this same file, `--peer`), answering one timed rollout per line
on stdin, so the two sides alternate round by round (on a shared 2-core machine, alternating keeps
background load from favouring one side); each side's figure is its median round.

Also reported: achieved model FLOP/s as a fraction of this machine's float32 matmul peak, measured
here with large jitted matmuls. Model FLOPs count matmuls (2 x multiply-adds per token, lm head
included) plus attention over the real context of each token; work on padding is not counted.

What bounds the ratio: both samplers run one while-loop over the same per-token forward pass, and on
XLA:CPU most of a decode step is memory traffic in attention, not matmuls. With the KV cache stored
slot-major ([B, S, K, Dh], Tunix's layout too) XLA transposes the whole cache twice per layer per
step; a head-major cache ([B, K, S, Dh]) removes that and measured ~1.5-1.8x faster rollouts here.
What is left to LoCoJAX's loop itself (one dispatch, no per-step mask rebuild from a token buffer, no
host post-processing) is worth little next to that. Expect noise: the 2-core machine is shared.

The last line printed is `ratio_vs_peer=<x>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / "bench" / ".peer-venvs" / "tunix"
PEER_PACKAGE = "google-tunix==0.1.7"
RESULTS = ROOT / "bench" / "results" / "rollout.json"

# The `small` preset's dimensions, spelled out for the peer (which cannot import locojax). Tunix's
# Qwen3 always applies QK-norm (q_norm/k_norm on every layer), so `qk_norm` must be True here; the
# peer checks its model has them. `dtype` is both the parameter and the compute dtype on each side.
SMALL = dict(vocab_size=384, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=1024,
             rope_theta=10_000.0, norm_eps=1e-6, tie_embeddings=True, qk_norm=True, dtype="float32",
             param_dtype="float32")
BOS, EOS, PAD = 256, 257, 258
NEVER = -1  # an EOS id no token can equal: every row decodes all new tokens


# ---------------------------------------------------------------------------------------------
# Peer side: runs inside the Tunix venv; imports nothing from this project.


class _PeerByteTokenizer:
    """The byte tokenizer of locojax.tokenizer, in the method-style interface Tunix's adapter expects."""

    def encode(self, text: str, **_) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, **_) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def bos_id(self) -> int:
        return BOS

    def eos_id(self) -> int:
        return EOS

    def pad_id(self) -> int:
        return PAD


def peer_main(config: dict) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import AxisType
    from tunix.generate import sampler as sampler_lib
    from tunix.models.dummy_model_creator import create_dummy_model
    from tunix.models.qwen3 import model as qwen3

    prompts, new_tokens, prompt_len = config["prompts"], config["new_tokens"], config["prompt_len"]
    # Tunix's Qwen3 names mesh axes `fsdp` and `tp` and needs Auto axis types (PITFALLS.md).
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    model_config = qwen3.ModelConfig(
        num_layers=SMALL["n_layers"], vocab_size=SMALL["vocab_size"], embed_dim=SMALL["d_model"],
        hidden_dim=SMALL["d_ff"], num_heads=SMALL["n_heads"], head_dim=SMALL["head_dim"],
        num_kv_heads=SMALL["n_kv_heads"], rope_theta=int(SMALL["rope_theta"]), norm_eps=SMALL["norm_eps"],
        use_tied_embedding=SMALL["tie_embeddings"],
        shd_config=qwen3.ShardingConfig.get_default_sharding(is_sampling=True),
        # Pinned, not left to Tunix's defaults: the KV cache and every matmul follow config.dtype.
        dtype=jnp.dtype(SMALL["dtype"]), param_dtype=jnp.dtype(SMALL["param_dtype"]),
    )
    with jax.set_mesh(mesh):
        model = create_dummy_model(qwen3.Qwen3, model_config, mesh=mesh, random_seed=0)
        if SMALL["qk_norm"] and not all(hasattr(layer.attn, "q_norm") and hasattr(layer.attn, "k_norm")
                                        for layer in model.layers):
            raise RuntimeError("the peer's Qwen3 has no QK-norm; the two models would differ")
        param_dtypes = {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))}
        if param_dtypes != {jnp.dtype(SMALL["param_dtype"])}:
            raise RuntimeError(f"the peer's parameters are {param_dtypes}, expected {SMALL['param_dtype']}")
        cache = sampler_lib.CacheConfig(cache_size=prompt_len + new_tokens, num_layers=SMALL["n_layers"],
                                        num_kv_heads=SMALL["n_kv_heads"], head_dim=SMALL["head_dim"])
        sampler = sampler_lib.Sampler(model, _PeerByteTokenizer(), cache)

        def rollout(seed: int):
            # An explicit seed per call: Tunix reuses PRNGKey(0) otherwise (PITFALLS.md).
            return sampler(prompts, max_generation_steps=new_tokens, max_prompt_length=prompt_len,
                           temperature=1.0, top_p=1.0, seed=seed, eos_tokens=[NEVER], return_logprobs=True)

        started = time.perf_counter()
        out = rollout(10_000)
        print(json.dumps({"ready": True, "first_call_s": time.perf_counter() - started,
                          "jax": jax.__version__, "devices": len(jax.devices()),
                          "platform": jax.devices()[0].platform}), flush=True)
        for line in sys.stdin:
            command = line.split()
            if not command or command[0] == "quit":
                break
            seed = int(command[1])
            started = time.perf_counter()
            out = rollout(seed)
            seconds = time.perf_counter() - started
            tokens = sum(len(t) for t in out.tokens)
            print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


# ---------------------------------------------------------------------------------------------
# Our side.


def ensure_peer_venv() -> Path:
    """The peer venv's python, creating the venv and installing Tunix on first use."""
    python = PEER_VENV / "bin" / "python"
    probe = [str(python), "-c", "import tunix"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"installing {PEER_PACKAGE} into {PEER_VENV} (first run only) ...", flush=True)
    PEER_VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", PEER_PACKAGE], check=True)
    return python


def matmul_peak_flops(sizes=(512, 1024, 2048), repeats: int = 5) -> float:
    """Best float32 FLOP/s of a jitted square matmul on this machine's default device."""
    import jax
    import jax.numpy as jnp

    best = 0.0
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        matmul = jax.jit(jnp.matmul)
        matmul(a, b).block_until_ready()
        for _ in range(repeats):
            started = time.perf_counter()
            matmul(a, b).block_until_ready()
            best = max(best, 2 * n**3 / (time.perf_counter() - started))
    return best


def model_flops(prompt_lengths: list[int], new_tokens: int) -> float:
    """Model FLOPs of one rollout (see the module docstring)."""
    d, layers, heads, head_dim = SMALL["d_model"], SMALL["n_layers"], SMALL["n_heads"], SMALL["head_dim"]
    kv_heads, d_ff, vocab = SMALL["n_kv_heads"], SMALL["d_ff"], SMALL["vocab_size"]
    matmul_params = layers * (d * heads * head_dim * 2 + d * kv_heads * head_dim * 2 + 3 * d * d_ff) + d * vocab
    per_context = 4 * layers * heads * head_dim  # QK^T and PV: 2 FLOPs x 2 matmuls per attended slot
    total = 0.0
    for length in prompt_lengths:
        tokens = length + new_tokens  # every prompt token and every fed-back token is one forward token
        total += tokens * 2 * matmul_params
        total += per_context * sum(context for context in range(1, tokens + 1))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                        help="where both sides run (the peer inherits this process's JAX_PLATFORMS)")
    parser.add_argument("--peer-python", default=None,
                        help="a Python that imports Tunix already (default: the bench's own venv, built on first use)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--peer", default=None, help=argparse.SUPPRESS)  # internal: run the peer side
    args = parser.parse_args()
    # Both sides on one platform (the peer inherits this environment): the comparison is one machine's.
    os.environ["JAX_PLATFORMS"] = {"cpu": "cpu", "gpu": "cuda"}[args.platform]
    if args.platform == "gpu":
        # The two processes share the one GPU: each takes what it uses, not 75% up front.
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if args.peer is not None:
        peer_main(json.loads(args.peer))
        return

    import jax
    from flax import nnx

    from locojax.model import create_model, get_preset
    from locojax.rollout import SamplingConfig, decode_completions, encode_prompts, make_generate_fn, rollout_key
    from locojax.tasks import ArithTask
    from locojax.tokenizer import ByteTokenizer

    config = get_preset("small")
    stale = {k: (v, getattr(config, k)) for k, v in SMALL.items() if getattr(config, k) != v}
    assert not stale, f"bench dims out of date with the preset (bench, preset): {stale}"
    task = ArithTask(difficulty=1)
    prompts = [task.example(i).prompt for i in range(args.batch)]
    tokenizer = ByteTokenizer()
    batch, new_tokens, prompt_len = args.batch, args.new_tokens, args.prompt_len

    peer_python = args.peer_python or ensure_peer_venv()
    peer_config = json.dumps({"prompts": prompts, "new_tokens": new_tokens, "prompt_len": prompt_len})
    peer = subprocess.Popen([str(peer_python), __file__, "--peer", peer_config], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)

    graphdef, params = nnx.split(create_model(config, seed=0))
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, eos_id=None, pad_id=tokenizer.pad_id)
    generate = make_generate_fn(config, graphdef, sampling, prompt_len, batch)

    def ours(seed: int) -> tuple[float, int]:
        started = time.perf_counter()
        tokens, mask = encode_prompts(prompts, tokenizer, prompt_len)
        result = jax.device_get(generate(params, tokens, mask, rollout_key(seed, 0, 0)))
        decode_completions(result, tokenizer)
        return time.perf_counter() - started, int(result.lengths.sum())

    started = time.perf_counter()
    ours(10_000)
    our_first_call = time.perf_counter() - started

    def peer_reply() -> dict:
        line = peer.stdout.readline()
        if not line:  # the peer died; its traceback went to our stderr
            raise RuntimeError(f"the Tunix peer exited with code {peer.wait()}")
        return json.loads(line)

    try:
        peer_ready = peer_reply()
    except RuntimeError as error:  # LoCoJAX's figures still count; the JSON says why there is no peer
        peer_ready, peer_failure = None, str(error)

    def theirs(seed: int) -> tuple[float, int]:
        peer.stdin.write(f"run {seed}\n")
        peer.stdin.flush()
        reply = peer_reply()
        return reply["seconds"], reply["tokens"]

    rounds: list[dict] = []
    load_before = os.getloadavg()
    for r in range(args.rounds):
        order = (("locojax", ours), ("peer", theirs)) if r % 2 == 0 else (("peer", theirs), ("locojax", ours))
        if peer_ready is None:
            order = (("locojax", ours),)
        row = {}
        for name, run in order:
            seconds, tokens = run(r)
            if tokens != batch * new_tokens:
                raise RuntimeError(f"{name} produced {tokens} tokens, expected {batch * new_tokens}")
            row[name] = seconds
        rounds.append(row)
        print(f"round {r}: " + "  ".join(f"{name} {seconds:.3f}s" for name, seconds in row.items()), flush=True)
    load_after = os.getloadavg()
    if peer_ready is not None:
        peer.stdin.write("quit\n")
        peer.stdin.flush()
        peer.wait(timeout=60)

    # On a GPU the small sizes time the launch, not the multiply.
    peak = matmul_peak_flops((2048, 4096, 8192) if args.platform == "gpu" else (512, 1024, 2048))
    ours_s = statistics.median(row["locojax"] for row in rounds)
    peer_s = statistics.median(row["peer"] for row in rounds) if peer_ready is not None else None
    _, mask = encode_prompts(prompts, tokenizer, prompt_len)
    flops = model_flops([int(n) for n in mask.sum(axis=1)], new_tokens)
    result = {
        "locojax_tokens_per_s": batch * new_tokens / ours_s,
        "peer_tokens_per_s": batch * new_tokens / peer_s if peer_s else None,
        "ratio_vs_peer": peer_s / ours_s if peer_s else None,
        "fraction_of_matmul_peak": flops / ours_s / peak,
        "locojax_model_flops_per_s": flops / ours_s,
        "matmul_peak_flops_per_s": peak,
        "peer": f"tunix {PEER_PACKAGE.split('==')[1]} Sampler (Qwen3, identical dims)",
        "workload": {"preset": "small", "dtype": SMALL["dtype"], "batch": batch, "new_tokens": new_tokens,
                     "prompt_slots": prompt_len, "early_stop": False, "temperature": 1.0, "task": "arith d1"},
        "rounds": rounds,
        # (slowest - fastest) / median round of each side: how far one round can sit from the figure.
        "spread": {name: (max(r[name] for r in rounds) - min(r[name] for r in rounds))
                   / statistics.median(r[name] for r in rounds) for name in rounds[0]},
        "first_call_s": {"locojax": our_first_call, "peer": peer_ready and peer_ready["first_call_s"]},
        "peer_failure": None if peer_ready is not None else peer_failure,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip() or None,
        "machine": {"cpus": os.cpu_count(), "devices": len(jax.devices()), "jax": jax.__version__,
                    "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
                    "peer_platform": peer_ready and peer_ready["platform"],
                    "peer_jax": peer_ready and peer_ready["jax"], "load_avg_1m_before": load_before[0],
                    "load_avg_1m_after": load_after[0]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"\n{'':28}{'tokens/s':>12}{'median s':>10}")
    print(f"{'locojax (while_loop)':28}{result['locojax_tokens_per_s']:12.0f}{ours_s:10.3f}")
    if peer_s:
        print(f"{'tunix 0.1.7 Sampler':28}{result['peer_tokens_per_s']:12.0f}{peer_s:10.3f}")
    print(f"model FLOP/s {flops / ours_s / 1e9:.1f} G of matmul peak {peak / 1e9:.1f} G "
          f"= {result['fraction_of_matmul_peak']:.3f}; wrote {args.out}")
    print(f"ratio_vs_peer={result['ratio_vs_peer']:.2f}" if peer_s else f"ratio_vs_peer=None ({peer_failure})")


if __name__ == "__main__":
    main()

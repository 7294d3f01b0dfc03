"""Peer side of bench/grpo_step.py and bench/scale.py: Tunix 0.1.7's `GRPOLearner`, timed step by step.

Runs ONLY in a Python that imports Tunix (on a CPU the venv bench/.peer-venvs/tunix; on a TPU the
machine's Python with the peer's own target folder on PYTHONPATH, bench/tpu.sh) and imports nothing
from this project:

    bench/.peer-venvs/tunix/bin/python bench/peers/tunix_grpo_step.py CONFIG.json

CONFIG.json (written by bench/grpo_step.py or bench/scale.py) holds the model dimensions, the algorithm
settings and the prompts/answers of every step, so both sides train on the same prompt strings. Prints
one JSON line (the last line of stdout) with the per-step wall periods and the token counts of every
rollout.

Optional keys, each defaulting to what bench/grpo_step.py runs: `model.remat` ("none", or "full":
Tunix's `RematConfig.DECODER` in training, each decoder layer rematerialised as LoCoJAX's `remat: full`
does, and none in rollouts, as LoCoJAX's; see `rollouts_without_remat`);
`algo.loss_agg` (LoCoJAX's name; default seq_mean_token_mean); `optim.b1`, `optim.b2`,
`optim.weight_decay`; and `tokenizer` = {"path", "bos_id", "pad_id"}: a local `tokenizer.json` with the
special ids the LoCoJAX side uses, in place of the byte tokenizer (a model whose vocabulary is a BPE's,
e.g. bench/scale.py's Qwen3-0.6B). With `algo.kl_coef` 0 no reference model is built: Tunix's GRPO
skips the reference log-probs at beta 0 and `RLCluster` takes `reference=None`, so the run holds only
the policy, its gradients and AdamW state, as LoCoJAX's does at kl_coef 0. `model.dtype` ("float32"
default, or "bfloat16"): the Qwen3's dtype and param_dtype. `lora` = {"rank", "alpha"}: Tunix's LoRA
(qwix adapters on every linear layer of the base model, which stays the frozen reference; only the
adapters train), as LoCoJAX's `model.lora` with every target.

How a step is timed: `GRPOLearner.train` pulls one batch from the training iterator at the start of
each global step (rollout -> reference log-probs -> rewards -> advantages -> train step -> metrics)
and the next pull only happens after that step's update. The iterator below stamps
`time.perf_counter()` at every pull, so step k's wall period is stamp[k+1] - stamp[k]: the same
"start of one step to start of the next" period the LoCoJAX side measures.
"""

from __future__ import annotations

import json
import re
import resource
import sys
import time
from fractions import Fraction


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255, then BOS 256 and PAD 258 — the ids of locojax's byte tokenizer, in
    the method-style interface Tunix's TokenizerAdapter accepts. `eos_id()` is -1, an id no sampled
    token can equal: there is no EOS on this side, as `SamplingConfig(eos_id=None)` on ours, so every
    completion is max_tokens_to_generate long and no completion token is masked after an "EOS"."""

    def encode(self, text: str, **_) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, **_) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def bos_id(self) -> int:
        return 256

    def eos_id(self) -> int:
        return -1

    def pad_id(self) -> int:
        return 258


class FileTokenizer:
    """A local HF `tokenizer.json` (through the `tokenizers` library) with the LoCoJAX side's special ids,
    in the same method-style interface. `encode` prepends BOS itself, so a prompt's ids are exactly
    LoCoJAX's (BOS + text): Tunix's sampler adds BOS only when `bos_id()` is truthy, which id 0 is not,
    and where it does add one its `dedup_bos_ids` drops the repeat. `eos_id()` is -1 as ByteTokenizer's:
    no stop token, every completion is max_tokens_to_generate long."""

    def __init__(self, path: str, bos_id: int, pad_id: int):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(path)
        self._bos, self._pad = bos_id, pad_id

    def encode(self, text: str, **_) -> list[int]:
        return [self._bos, *self._tokenizer.encode(text, add_special_tokens=False).ids]

    def decode(self, ids, **_) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def bos_id(self) -> int:
        return self._bos

    def eos_id(self) -> int:
        return -1

    def pad_id(self) -> int:
        return self._pad


# LoCoJAX's loss aggregation names (AlgoSpec.loss_agg) and Tunix's for the same reduction.
LOSS_AGG = {"token_mean": "token-mean", "seq_mean_token_mean": "sequence-mean-token-mean",
            "seq_mean_token_sum_norm": "sequence-mean-token-sum-norm"}

_STRICT = re.compile(r"####\s*(-?\s*\$?\s*-?\s*(?:\d(?:[\d,]*\d)?(?:\.\d+)?|\.\d+))")


def _number(text: str) -> Fraction | None:
    cleaned = text.strip().replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def gsm8k_strict(prompts, completions, answer, **_) -> list[float]:
    """1.0 where the number after `####` equals the answer: the cheap reward both sides score with
    (LoCoJAX's `gsm8k` reward on the `arith` task)."""
    out = []
    for completion, truth in zip(completions, answer):
        match = _STRICT.search(completion)
        predicted = _number(match.group(1)) if match else None
        out.append(1.0 if predicted is not None and predicted == _number(str(truth)) else 0.0)
    return out


def rollouts_without_remat(generate, model_config, none):
    """`generate` with the model's remat switched off while it runs.

    Tunix's layers apply `remat_config` wherever the model runs, and its sampler fails under it (flax
    raises TraceContextError from nnx.remat inside the decode while_loop); LoCoJAX rematerialises only
    the training forward. Every layer reads the one ModelConfig they share when a computation is traced,
    and a rollout never overlaps a train step here (actor and rollout share a mesh, so Tunix does not
    run rollouts asynchronously): so the config says `none` for exactly the span of each rollout."""

    def wrapper(*args, **kwargs):
        training_remat = model_config.remat_config
        model_config.remat_config = none
        try:
            return generate(*args, **kwargs)
        finally:
            model_config.remat_config = training_remat

    return wrapper


# Every linear layer of Tunix's Qwen3 (attention einsums and MLP projections), as `model.lora.targets`
# q, k, v, o, gate, up, down.
LORA_MODULES = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"


def main(config_path: str) -> None:
    with open(config_path, encoding="utf-8") as fh:
        cfg = json.load(fh)

    import jax
    import numpy as np

    jax.config.update("jax_num_cpu_devices", 1)
    import optax
    from jax.sharding import AxisType
    from tunix.models.dummy_model_creator import create_dummy_model
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    dims, algo, work = cfg["model"], cfg["algo"], cfg["workload"]
    steps = cfg["steps"]
    assert len(cfg["prompts"]) == steps
    assert len(jax.devices()) == 1, jax.devices()

    # Tunix's Qwen3 names its mesh axes `fsdp` and `tp` and needs Auto axis types (PITFALLS.md).
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    model_config = qwen3.ModelConfig(
        num_layers=dims["n_layers"], vocab_size=dims["vocab_size"], embed_dim=dims["d_model"],
        hidden_dim=dims["d_ff"], num_heads=dims["n_heads"], head_dim=dims["head_dim"],
        num_kv_heads=dims["n_kv_heads"], rope_theta=int(dims["rope_theta"]), norm_eps=dims["norm_eps"],
        use_tied_embedding=dims["tie_embeddings"], dtype=dims.get("dtype", "float32"),
        param_dtype=dims.get("dtype", "float32"),
        remat_config={"none": qwen3.RematConfig.NONE,
                      "full": qwen3.RematConfig.DECODER}[dims.get("remat", "none")],
    )
    lora = cfg.get("lora")  # {rank, alpha}: adapters on every linear layer, as LoCoJAX's `model.lora`
    with jax.set_mesh(mesh):
        if lora:
            import qwix
            from flax import nnx

            # Tunix's own LoRA recipe (its GRPO CLI): qwix adapters on the base model, which stays the
            # frozen reference (one copy of the weights); only the adapters train.
            base = create_dummy_model(qwen3.Qwen3, model_config, mesh=mesh, random_seed=cfg["seed"])
            provider = qwix.LoraProvider(module_path=LORA_MODULES, rank=lora["rank"], alpha=lora["alpha"])
            actor = qwix.apply_lora_to_model(base, provider, rngs=nnx.Rngs(cfg["seed"]), **base.get_model_input())
            lora_values = sum(x.size for x in jax.tree.leaves(nnx.state(actor, nnx.LoRAParam)))
            assert lora_values > 0, "qwix matched no linear layer of Tunix's Qwen3"
            reference = base if algo["kl_coef"] != 0 else None
        else:
            actor = create_dummy_model(qwen3.Qwen3, model_config, mesh=mesh, random_seed=cfg["seed"])
            # The frozen reference starts equal to the policy, as LoCoJAX's does; at beta 0 there is none.
            reference = (create_dummy_model(qwen3.Qwen3, model_config, mesh=mesh, random_seed=cfg["seed"])
                         if algo["kl_coef"] != 0 else None)
    tokenizer = FileTokenizer(**cfg["tokenizer"]) if cfg.get("tokenizer") else ByteTokenizer()

    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=work["new_tokens"],
        max_prompt_length=work["prompt_slots"],
        kv_cache_size=work["prompt_slots"] + work["new_tokens"],
        temperature=work["temperature"], top_p=1.0, top_k=None,
        eos_tokens=[-1],  # no stop token: every row decodes all new tokens
        seed=cfg["seed"],  # Tunix reuses PRNGKey(0) on every call unless a seed is set (PITFALLS.md)
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(cfg["optim"]["grad_clip"]),
        optax.adamw(cfg["optim"]["lr"], b1=cfg["optim"].get("b1", 0.9), b2=cfg["optim"].get("b2", 0.999),
                    weight_decay=cfg["optim"].get("weight_decay", 0.0)),
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer,
            eval_every_n_steps=10**9,
            max_steps=steps,
            checkpoint_root_directory=None,
            metrics_logging_options=None,
            pbar_description=None,
        ),
        rollout_config=rollout_config,
    )
    cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=tokenizer,
                                       cluster_config=cluster_config)
    grpo_config = grpo_learner.GRPOConfig(
        num_generations=work["group_size"],
        num_iterations=algo["num_iterations"],
        beta=algo["kl_coef"],
        kl_loss_mode="low_var_kl",  # the k3 estimator, as LoCoJAX's KL penalty
        epsilon=algo["clip_eps"],
        loss_agg_mode=LOSS_AGG[algo.get("loss_agg", "seq_mean_token_mean")],
    )
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=grpo_config, reward_fns=[gsm8k_strict])

    # Count what every rollout actually generated (the identical-work check): `slots` is what was
    # decoded (rows x their lengths), `tokens` what the loss trains on. GRPOLearner masks every
    # completion token equal to the pad id (`completion_mask = ids != pad`), also one the sampler drew
    # by chance (no id is excluded from sampling, on either side), so only non-pad tokens count.
    # `prompt_width` is the prompt buffer the sampler used: it widens it to the next power of two
    # when a prompt is longer than max_prompt_length, which would be more work than the other side's.
    generated: list[dict] = []
    original_generate = cluster.generate
    pad_id = tokenizer.pad_id()

    def counting_generate(*args, **kwargs):
        out = original_generate(*args, **kwargs)
        lengths = [len(t) for t in out.tokens]
        trained = sum(int((np.asarray(t) != pad_id).sum()) for t in out.tokens)
        generated.append({"rows": len(lengths), "slots": int(sum(lengths)), "tokens": trained,
                          "min_len": int(min(lengths)), "max_len": int(max(lengths)),
                          "prompt_width": int(np.shape(out.left_padded_prompt_tokens)[1])})
        return out

    cluster.generate = counting_generate
    if model_config.remat_config != qwen3.RematConfig.NONE:
        cluster.generate = rollouts_without_remat(cluster.generate, model_config, qwen3.RematConfig.NONE)

    # Rough phase timings of the peer, for the report only (the step period is what is compared):
    # rollout = `generate` (blocks: it returns host tokens and texts), reference = reference
    # log-probs until ready (never called at beta 0), train = `update_actor` (Tunix may leave its
    # last update in flight; the next rollout then waits for it).
    phases: dict[str, list[float]] = {"rollout": [], "reference": [], "train": []}

    def timed(name, fn, block=False):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            if block:
                jax.block_until_ready(out)
            phases[name].append(time.perf_counter() - started)
            return out
        return wrapper

    cluster.generate = timed("rollout", cluster.generate)
    cluster.get_ref_per_token_logps = timed("reference", cluster.get_ref_per_token_logps, block=True)
    cluster.update_actor = timed("train", cluster.update_actor)

    pulls: list[float] = []
    cpu: list[float] = []

    def batches():
        for step, batch in enumerate(cfg["prompts"]):
            rollout_config.seed = cfg["seed"] * 100_003 + step  # a fresh sampling key per step
            pulls.append(time.perf_counter())
            cpu.append(time.process_time())
            yield {"prompts": np.array([row["prompt"] for row in batch]),
                   "answer": np.array([row["answer"] for row in batch])}

    started = time.perf_counter()
    learner.train(batches())
    ended = time.perf_counter()

    periods = [b - a for a, b in zip(pulls, pulls[1:])]  # step k = pulls[k+1] - pulls[k]
    result = {
        "side": "tunix",
        "periods_s": periods,  # steps 0 .. steps-2; the last step's end has no next pull
        "cpu_s": [b - a for a, b in zip(cpu, cpu[1:])],  # process CPU seconds (all threads) per step
        "phases_s": phases,
        "last_step_s": ended - pulls[-1],  # ends after learner.train's close(), reported only
        "total_s": ended - started,
        "generated": generated,
        "train_steps": int(cluster.actor_trainer.train_steps),
        "reference_model": reference is not None,
        "lora": {**lora, "adapter_values": lora_values} if lora else None,
        "dtype": dims.get("dtype", "float32"),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "versions": {"jax": jax.__version__, "tunix": _version("google-tunix"), "flax": _version("flax"),
                     "optax": _version("optax")},
        "devices": len(jax.devices()),
        # The allocator's high-water mark where the runtime reports one (an accelerator's), for memory headroom.
        # A TPU runtime reserves programs' temporaries apart from the allocator's buffers: both count
        # (bench/tpu_memory_probe.py), as in LoCoJAX's `memory/device_peak_gib`.
        "peak_device_gib": (((stats := jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use") or 0)
                            + (stats.get("peak_bytes_reserved") or 0)) / 2**30 or None,
        "device": {"platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind},
        # The benchmark runs both sides with JAX's persistent compilation cache off: every run compiles cold.
        "compilation_cache": {"enabled": bool(jax.config.jax_enable_compilation_cache),
                              "dir": jax.config.jax_compilation_cache_dir},
    }
    print(json.dumps(result), flush=True)


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main(sys.argv[1])

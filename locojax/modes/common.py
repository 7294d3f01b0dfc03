"""The pieces every coordination mode shares, so CO, DA and SC run the same kernels.

A mode differs only in *where* these run and what crosses between processes: CO calls them on every
host for its own prompts; SC calls rollout per simulated host but gathers everything to one
controller before scoring; DA calls them on rollout actors and ships batches to train actors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from locojax import metrics as m
from locojax.algo import compute_advantages
from locojax.model import ModelConfig, create_model, get_preset
from locojax.rewards import score
from locojax.rollout import (
    RolloutResult,
    SamplingConfig,
    decode_completions,
    encode_prompts,
    make_generate_fn,
    rollout_mesh,
)
from locojax.spec import RunSpec
from locojax.tasks import Example, Task, host_shard, repeat_examples, reward_names
from locojax.tokenizer import Tokenizer, load_tokenizer
from locojax.checkpoint import Checkpointer
from locojax.model.sharding import batch_sharding, make_mesh, shard_state
from locojax.tasks import load_task_data
from locojax.train import (
    TrainState,
    init_train_state,
    make_optimizer,
    make_sft_step,
    make_train_step,
    split_params,
)


@dataclasses.dataclass
class Policy:
    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: Tokenizer


def load_policy(spec: RunSpec) -> Policy:
    """The starting policy: a preset initialised from the run's seed, or a local HF checkpoint
    directory (e.g. `<output_dir>/model` of an SFT run). Every host builds bit-identical params."""
    tokenizer = load_tokenizer(spec.model.tokenizer)
    if spec.model.checkpoint:
        from locojax.model.hf import load_hf_checkpoint

        path = Path(spec.model.checkpoint)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.checkpoint: {path} holds no config.json (expected a HF directory, "
                                    "e.g. <output_dir>/model of a finished SFT run)")
        model = load_hf_checkpoint(path, dtype=spec.model.dtype)
    else:
        config = get_preset(spec.model.preset).replace(param_dtype=spec.model.dtype, dtype=spec.model.dtype)
        model = create_model(config, seed=spec.seed)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"model.tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
                         f"{model.config.vocab_size}")
    graphdef, params = split_params(model)
    return Policy(model.config, graphdef, params, tokenizer)


def sampling_config(spec: RunSpec, tokenizer: Tokenizer) -> SamplingConfig:
    return SamplingConfig.from_spec(spec.rollout, tokenizer)


def to_local(params: nnx.State, sharding: NamedSharding) -> nnx.State:
    """A host-local replicated copy of (globally replicated) params: one addressable shard per leaf,
    placed on this host's rollout mesh. No cross-host traffic: every host holds the full params."""
    return jax.device_put(jax.tree.map(lambda x: x.addressable_data(0), params), sharding)


@dataclasses.dataclass
class HostRollout:
    """One host's share of a step after rollout, reward and advantages, on the host (numpy)."""

    examples: list[Example]  # [b] prompts repeated G times
    prompt_tokens: np.ndarray  # [b, P] int32
    prompt_mask: np.ndarray  # [b, P] bool
    result: RolloutResult  # device arrays [b, N]
    completions: list[str]  # [b]
    rewards: np.ndarray  # [b] float32
    per_fn: dict[str, np.ndarray]
    advantages: np.ndarray | None = None  # [b] float32

    def batch(self, ref_logprobs: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The train-step batch layout of `locojax.train` for this host's rows."""
        tokens = np.concatenate([self.prompt_tokens, np.asarray(self.result.tokens)], axis=1)
        out = {
            "tokens": tokens.astype(np.int32),
            "prompt_mask": self.prompt_mask,
            "completion_mask": np.asarray(self.result.mask),
            "old_logprobs": np.asarray(self.result.logprobs, np.float32),
            "advantages": np.asarray(self.advantages, np.float32),
        }
        if ref_logprobs is not None:
            out["ref_logprobs"] = np.asarray(ref_logprobs, np.float32)
        return out

    def metrics(self, group_size: int, rollout_s: float, eos_id: int | None) -> dict[str, float]:
        mask = np.asarray(self.result.mask)
        finished = ((np.asarray(self.result.tokens) == eos_id) & mask).any(axis=1)
        out = {**m.reward_metrics(self.rewards, group_size, self.per_fn),
               **m.completion_metrics(mask, finished)}
        out[m.THROUGHPUT_ROLLOUT_TOKENS] = m.throughput(mask.sum(), rollout_s)
        return out


class RolloutRunner:
    """Rollout + detokenise for a fixed per-host batch on a given set of local devices."""

    def __init__(self, spec: RunSpec, policy: Policy, prompts: int, devices: Sequence[jax.Device]):
        self.spec = spec
        self.policy = policy
        self.batch_size = prompts * spec.rollout.group_size
        self.sampling = sampling_config(spec, policy.tokenizer)
        self.prompt_len = spec.rollout.max_prompt_tokens
        self.devices = tuple(devices)
        self.mesh = rollout_mesh(self.batch_size, self.devices)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.generate = make_generate_fn(policy.config, policy.graphdef, self.sampling, self.prompt_len,
                                         self.batch_size, self.devices)

    def sample(self, params_local: nnx.State, examples: Sequence[Example], key: jax.Array, row_offset: int):
        """Dispatch rollout for `examples` (already repeated G times, rows `row_offset`... of the
        step's global batch); returns device arrays."""
        tokens, mask = encode_prompts([e.prompt for e in examples], self.policy.tokenizer, self.prompt_len)
        return tokens, mask, self.generate(params_local, tokens, mask, key, row_offset)

    def completions(self, result: RolloutResult) -> list[str]:
        return decode_completions(result, self.policy.tokenizer)


def prompts_for(task: Task, spec: RunSpec, step: int, host: int, num_hosts: int) -> list[Example]:
    """Host `host`'s prompts of step `step`, each repeated group_size times (groups stay on one host)."""
    shard = host_shard(task, spec.seed, step, spec.rollout.prompts_per_step, host, num_hosts)
    return repeat_examples(shard, spec.rollout.group_size)


def score_and_normalise(spec: RunSpec, task: Task, examples: Sequence[Example], completions: Sequence[str],
                        pool, timer: m.PhaseTimer) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """Rewards on host CPU threads, then group-normalised advantages (every group is local)."""
    with timer.phase(m.TIME_REWARD):
        rewards, per_fn = score(reward_names(spec.task, task), list(completions), list(examples), pool)
    with timer.phase(m.TIME_ADVANTAGE):
        advantages = np.asarray(
            compute_advantages(spec.algo.name, np.asarray(rewards, np.float32), spec.rollout.group_size))
    return np.asarray(rewards, np.float32), per_fn, advantages


def params_checksum(params: nnx.State) -> float:
    """A float-exact fingerprint of this host's copy of the params (48 bits of a hash), reported per
    host so a test can check that all hosts hold identical weights after every step."""
    import hashlib

    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        digest.update(np.asarray(leaf.addressable_data(0) if hasattr(leaf, "addressable_data") else leaf).tobytes())
    return float(int(digest.hexdigest()[:12], 16))


@dataclasses.dataclass
class Trainer:
    """Everything a mode needs to train on a mesh: the policy, data, optimizer state and step."""

    policy: Policy
    task: Task
    mesh: jax.sharding.Mesh
    state: TrainState
    train_step: Callable
    checkpoints: Checkpointer
    start_step: int
    # The frozen KL reference (kl_coef > 0 only): the run's *starting* policy, copied before any
    # restore, so a resumed run penalises against the same policy as a straight one.
    reference_params: nnx.State | None = None
    # The spec's eval block's held-out examples, none of whose prompts `task` ever yields.
    held_out: tuple[Example, ...] = ()

    def global_batch(self, host_rows: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows -> the global batch sharded over the mesh's data axis."""
        return {k: jax.make_array_from_process_local_data(batch_sharding(self.mesh, v.ndim), v)
                for k, v in host_rows.items()}

    def checkpoint(self, spec: RunSpec, force: bool = False) -> None:
        self.checkpoints.save(self.state, {"run": spec.name}, force=force)


def prepare_trainer(spec: RunSpec, devices: Sequence[jax.Device], checkpoint_dir: Path, resume: bool) -> Trainer:
    """Policy, task, optimizer and a TrainState replicated over a data-parallel mesh of `devices`;
    restored from the latest checkpoint when `resume` and one exists. The step function is the GRPO
    step, or the SFT step (one update per step) for `kind: sft`."""
    policy = load_policy(spec)
    mesh = make_mesh(devices)
    sft = spec.kind == "sft"
    optimizer = make_optimizer(spec.optim, spec.steps, 1 if sft else spec.algo.num_iterations)
    state = init_train_state(shard_state(policy.params, mesh), optimizer, seed=spec.seed)
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    # A copy: the train step donates the state's buffers.
    reference_params = jax.tree.map(jnp.copy, state.params) if not sft and spec.algo.kl_coef > 0 else None
    checkpoints = Checkpointer(spec.checkpoint.dir or checkpoint_dir, every=spec.checkpoint.every,
                               keep=spec.checkpoint.keep)
    start_step = 0
    if resume:
        restored = checkpoints.restore_latest(state)
        if restored is not None:
            state = restored[0]
            start_step = int(jax.device_get(state.step))
    if sft:
        train_step = make_sft_step(policy.graphdef, optimizer, micro_batch_size=spec.algo.micro_batch_size, mesh=mesh)
    else:
        train_step = make_train_step(policy.graphdef, optimizer, spec.algo, temperature=train_temperature(spec),
                                     mesh=mesh)
    data = load_task_data(spec.task, spec.eval)
    return Trainer(policy, data.train, mesh, state, train_step, checkpoints, start_step, reference_params,
                   data.held_out)


def train_temperature(spec: RunSpec) -> float:
    # Greedy rollout (T=0) reports log softmax(logits); train at T=1 to match it.
    return spec.rollout.temperature if spec.rollout.temperature > 0 else 1.0

"""The pieces every coordination mode shares, so CO, DA and SC run the same kernels.

A mode differs only in *where* these run and what crosses between processes: CO calls them on every
host for its own prompts; SC calls rollout per simulated host but gathers everything to one
controller before scoring; DA calls them on rollout actors and ships batches to train actors.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from locojax import metrics as m
from locojax.algo import compute_advantages
from locojax.rewards import score
from locojax.rollout import (
    RolloutResult,
    decode_completions,
    encode_prompts,
    make_generate_fn,
    rollout_key,
    rollout_mesh,
)
from locojax.contract import EngineStatus, HostStatus
from locojax.modes import spec_mode
from locojax.policy import (  # noqa: F401  (the modes' imports)
    Policy, abstract_policy, already_local, host_copy, load_policy, sampling_config, to_local)
from locojax.runner import ModeSession
from locojax.spec import RunSpec
from locojax.tasks import Example, Task, host_shard, repeat_examples, reward_names
from locojax.checkpoint import Checkpointer
from locojax.model.sharding import batch_sharding, make_mesh, shard_state, state_shardings
from locojax.compiled_plan import compiled_plan
from locojax.placement.memory import MemoryPlan, MemoryPlanError, MeshShape, check_spec_fits, refusal
from locojax.tasks import load_task_data
from locojax.model.transformer import adapters_off, split_adapters
from locojax.train import (
    EarlyForwardStep,
    early_forward_applies,
    model_params,
    reference_logprobs_fn,
    TrainState,
    init_train_state,
    make_optimizer,
    make_sft_step,
    make_train_step,
    optimizer_state_shardings,
)


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
        return rollout_metrics(np.asarray(self.result.tokens), np.asarray(self.result.mask), self.rewards,
                               self.per_fn, group_size, rollout_s, eos_id)


def rollout_metrics(tokens: np.ndarray, mask: np.ndarray, rewards: np.ndarray, per_fn: dict[str, np.ndarray],
                    group_size: int, rollout_s: float, eos_id: int | None) -> dict[str, float]:
    """Reward, completion and rollout-throughput metrics of one host's rollout (host arrays [b, N])."""
    finished = ((tokens == eos_id) & mask).any(axis=1)
    out = {**m.reward_metrics(rewards, group_size, per_fn), **m.completion_metrics(mask, finished)}
    out[m.THROUGHPUT_ROLLOUT_TOKENS] = m.throughput(mask.sum(), rollout_s)
    return out


@dataclasses.dataclass
class DispatchedRollout:
    """One host's rollout as dispatched: its prompts (host copies for the metrics, device copies for the
    train batch) and the device result, possibly still being computed."""

    examples: list[Example]  # [b] prompts repeated G times
    prompt_tokens: np.ndarray  # [b, P] int32
    prompt_mask: np.ndarray  # [b, P] bool
    device_prompt_tokens: jax.Array  # the same on the rollout mesh
    device_prompt_mask: jax.Array
    result: RolloutResult  # device arrays [b, N]


@dataclasses.dataclass
class PreparedRollout:
    """A rollout's inputs before its dispatch (`RolloutRunner.prepare`): everything but the params."""

    examples: list[Example]
    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray
    device_prompt_tokens: jax.Array
    device_prompt_mask: jax.Array
    key: jax.Array
    # The rows' global offset, an int32 already on the rollout mesh: put there with the prompts, not by the
    # rollout's dispatch (a TPU trace at size a: 0.4-1.4 ms of that dispatch, with the chip idle).
    row_offset: jax.Array


@jax.jit
def rollout_rows(prompt_tokens: jax.Array, prompt_mask: jax.Array, result: RolloutResult) -> dict[str, jax.Array]:
    """The train-step batch layout of `locojax.train` for a rollout's rows, built where the rollout is
    (advantages come later, from the host): no round trip of tokens and log-probs through host memory."""
    return {"tokens": jnp.concatenate([prompt_tokens, result.tokens], axis=1), "prompt_mask": prompt_mask,
            "completion_mask": result.mask, "old_logprobs": result.logprobs}


REWARD_THREADS = 4  # reward functions run on the host CPU, in this many threads per scoring process


def open_devices(local_only: bool = False) -> tuple[list[jax.Device], float]:
    """The devices a session trains on (this process's alone with `local_only`) and the seconds the
    call took: the first call in a process starts the backend (a TPU's runtime opens the chip), the
    part of time/setup reported as time/setup_backend."""
    started = time.perf_counter()
    devices = jax.local_devices() if local_only else jax.devices()
    return list(devices), time.perf_counter() - started


def reward_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads a mode's scoring process runs reward functions in (`score_and_normalise`'s pool)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=REWARD_THREADS, thread_name_prefix="reward")


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
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec("data"))
        self.generate = make_generate_fn(policy.config, policy.graphdef, self.sampling, self.prompt_len,
                                         self.batch_size, self.devices)

    def sample(self, params_local: nnx.State, examples: Sequence[Example], key: jax.Array, row_offset: int):
        """Dispatch rollout for `examples` (already repeated G times, rows `row_offset`... of the
        step's global batch); returns device arrays."""
        tokens, mask = encode_prompts([e.prompt for e in examples], self.policy.tokenizer, self.prompt_len)
        return tokens, mask, self.generate(params_local, tokens, mask, key, row_offset)

    def dispatch(self, params_local: nnx.State, examples: Sequence[Example], key: jax.Array,
                 row_offset: int) -> DispatchedRollout:
        """`sample`, keeping the prompts' device copies for the train batch (`rollout_rows`)."""
        return self.launch(params_local, self.prepare(examples, key, row_offset))

    def prepare(self, examples: Sequence[Example], key: jax.Array, row_offset: int) -> PreparedRollout:
        """A rollout's inputs, tokenised and on the rollout mesh, before the params it samples from
        exist: the host can do this while the device still works on the step before."""
        tokens, mask = encode_prompts([e.prompt for e in examples], self.policy.tokenizer, self.prompt_len)
        device_tokens, device_mask = jax.device_put((tokens, mask), self.batch_sharding)
        device_row_offset = jax.device_put(np.int32(row_offset), self.replicated)
        return PreparedRollout(list(examples), tokens, mask, device_tokens, device_mask, key, device_row_offset)

    def launch(self, params_local: nnx.State, prepared: PreparedRollout) -> DispatchedRollout:
        """Dispatch a prepared rollout from `params_local` (returns at once; the device samples)."""
        result = self.generate(params_local, prepared.device_prompt_tokens, prepared.device_prompt_mask,
                               prepared.key, prepared.row_offset)
        # The host reads these three next (texts, rewards, metrics): their copies start as soon as the
        # device has them, not when the host asks.
        for host_bound in (result.tokens, result.lengths, result.mask):
            host_bound.copy_to_host_async()
        return DispatchedRollout(prepared.examples, prepared.prompt_tokens, prepared.prompt_mask,
                                 prepared.device_prompt_tokens, prepared.device_prompt_mask, result)

    def completions(self, result: RolloutResult) -> list[str]:
        return decode_completions(result, self.policy.tokenizer)

    def texts(self, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
        """Completion texts from host copies of a result's tokens and lengths."""
        return self.policy.tokenizer.decode_batch([row[:length] for row, length in zip(tokens, lengths)])


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


# One piece of a leaf for the fingerprint: (leaf index, the piece's offset in the leaf, the leaf's shape).
_PieceLayout = tuple[int, tuple[int, ...], tuple[int, ...]]


@functools.partial(jax.jit, static_argnames=("layout",))
def _fingerprint(pieces: list[jax.Array], layout: tuple[_PieceLayout, ...]) -> jax.Array:
    # Integer arithmetic wraps mod 2**32, so the sum is exact and independent of reduction order:
    # the same values give the same fingerprint on any device and any host.
    total = jnp.zeros((), jnp.uint32)
    for piece, (index, offsets, shape) in zip(pieces, layout):
        bits = jax.lax.bitcast_convert_type(piece, jnp.uint32 if piece.dtype.itemsize == 4 else jnp.uint16)
        # Each value's flat position in the whole leaf, however the leaf is cut into pieces.
        strides = [math.prod(shape[axis + 1:]) for axis in range(len(shape))]
        position = jnp.zeros(piece.shape, jnp.uint32)
        for axis, (offset, stride) in enumerate(zip(offsets, strides)):
            along = (jnp.arange(piece.shape[axis], dtype=jnp.uint32) + jnp.uint32(offset)) * jnp.uint32(stride)
            position = position + along.reshape([-1 if a == axis else 1 for a in range(piece.ndim)])
        # A position-dependent odd weight, so swapped or shifted values change the fingerprint too.
        weights = (position + jnp.uint32(index * 0x9E37)) * jnp.uint32(2654435761) | 1
        total = total + jnp.sum(bits.astype(jnp.uint32) * weights, dtype=jnp.uint32)
    return total


def _distinct_pieces(leaf) -> list[tuple[jax.Array, tuple[int, ...]]]:
    """Every distinct part of this host's copy of `leaf` once, as (its shard, its offset in the leaf):
    all the shards over the host's devices when it is sharded (FSDP/tensor), one copy of a replica."""
    if not isinstance(leaf, jax.Array):
        return [(jnp.asarray(leaf), (0,) * np.ndim(leaf))]
    pieces = {}
    for shard in leaf.addressable_shards:
        offsets = tuple(part.indices(size)[0] for part, size in zip(shard.index, leaf.shape))
        pieces.setdefault(offsets, shard.data)  # replicas of a part hold the same values
    return [(data, offsets) for offsets, data in pieces.items()]


def params_checksum(params: nnx.State) -> jax.Array:
    """A fingerprint of this host's copy of the params as one device scalar (uint32, exact as a float):
    reported per host, when `debug.checksum_every` asks, so a test can check that all hosts hold
    identical weights.

    It covers every value this host holds: each distinct shard of a leaf sharded over the host's devices
    (FSDP/tensor), one copy of a replicated one, each value weighted by its position in the whole leaf.
    So it depends only on the values, not on how they are placed: the same params give the same checksum
    replicated, sharded any way over this host's devices, or on another device. Each device fingerprints
    the shards it holds; only the per-device scalars move (to the first one), nothing to the host."""
    by_device: dict[jax.Device, tuple[list[jax.Array], list[_PieceLayout]]] = {}
    for index, leaf in enumerate(jax.tree.leaves(params)):
        for data, offsets in _distinct_pieces(leaf):
            pieces, layout = by_device.setdefault(next(iter(data.devices())), ([], []))
            pieces.append(data)
            layout.append((index, offsets, tuple(np.shape(leaf))))
    partials = [_fingerprint(pieces, tuple(layout)) for pieces, layout in by_device.values()]
    if not partials:
        return jnp.zeros((), jnp.uint32)
    home = next(iter(partials[0].devices()))
    total = partials[0]
    for partial in partials[1:]:
        total = total + jax.device_put(partial, home)
    return total


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
    # Parts of the setup's wall time (contract's SETUP_PARTS), for step 0's record.
    setup_phases: dict[str, float] = dataclasses.field(default_factory=dict)
    # The GRPO step as forward and update (placement.early_forward), where the run uses it; else None.
    early_forward: EarlyForwardStep | None = None

    def global_batch(self, host_rows: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows -> the global batch sharded over the mesh's data axis."""
        return {k: jax.make_array_from_process_local_data(batch_sharding(self.mesh, v.ndim), v)
                for k, v in host_rows.items()}

    @property
    def rows_move_on_devices(self) -> bool:
        """Whether rows on this host's devices reach the train mesh device to device (one process), not
        through host memory (`global_batch_from_device`)."""
        return rows_move_on_devices()

    def global_batch_from_device(self, local_rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """`global_batch` of rows already on this host's devices. With one process they move device to
        device onto the train mesh (nothing when already placed); across processes they go through host
        memory, as `jax.make_array_from_process_local_data` takes this process's rows from there."""
        if not self.rows_move_on_devices:
            return self.global_batch(jax.device_get(local_rows))
        # One batched call: a call per array cost the host ~0.3 ms each between the rewards and the train
        # step's dispatch, with the device waiting (a TPU trace at the small preset).
        return jax.device_put(local_rows, {k: batch_sharding(self.mesh, v.ndim) for k, v in local_rows.items()})

    def checkpoint(self, spec: RunSpec, force: bool = False) -> None:
        self.checkpoints.save(self.state, {"run": spec.name}, force=force)


class TrainerSession(ModeSession):
    """A mode session that trains in this process with a `Trainer` (CO, SC, SFT): it checkpoints,
    finishes and closes the same way."""

    def __init__(self, spec: RunSpec, trainer: Trainer):
        self.spec, self.trainer = spec, trainer
        self.start_step = trainer.start_step

    def checkpoint(self, force: bool) -> None:
        self.trainer.checkpoint(self.spec, force=force)

    def finish(self, status: EngineStatus, steps_done: int, where: HostStatus) -> int | None:
        self.trainer.checkpoints.wait_until_finished()
        return self.trainer.checkpoints.latest_step()

    @property
    def setup_phases(self) -> dict[str, float]:
        return self.trainer.setup_phases

    def close(self) -> None:
        self.trainer.checkpoints.close()


def prepare_trainer(spec: RunSpec, devices: Sequence[jax.Device], checkpoint_dir: Path, resume: bool,
                    rollout_devices: Sequence[jax.Device] | None = None) -> Trainer:
    """Policy, task, optimizer and a TrainState on the spec's data x fsdp x tensor mesh of `devices`
    (params and AdamW moments sharded per the logical-axis rules), after the memory plan says it fits;
    restored from the latest checkpoint when `resume` and one exists. The step function is the GRPO
    step, or the SFT step (one update per step) for `kind: sft`.

    The plan is checked before the first parameter exists (this host's share of `devices`): on CPU the
    analytic one; on an accelerator the compiled one (`locojax.compiled_plan`), for which the train step
    (and, given `rollout_devices`, the devices this process decodes on, rollout) is compiled from
    abstract shapes first, and the run then reuses what was compiled."""
    mode = spec_mode(spec)
    samples = mode.samples  # False: SFT, trained on the task's reference answers
    local = [d for d in devices if d.process_index == jax.process_index()]
    mesh = make_mesh(devices, fsdp=spec.placement.fsdp, tensor=spec.placement.tensor)
    optimizer = make_optimizer(spec.optim, spec.steps, spec.algo.num_iterations if samples else 1)
    compile_s = 0.0
    if not plans_by_compiling(local[0].platform):
        check_spec_fits(spec, local, jax.process_count(), samples=samples)
        model_started = time.perf_counter()
        policy = load_policy(spec, mesh)
        train_step = _train_step(spec, policy.graphdef, optimizer, mesh, samples)
        early = _early_forward_step(spec, policy.graphdef, optimizer, mesh)
    else:
        compile_started = time.perf_counter()
        shapes = abstract_policy(spec)
        train_step = _train_step(spec, shapes.graphdef, optimizer, mesh, samples)
        early = _early_forward_step(spec, shapes.graphdef, optimizer, mesh)
        check_compiled_plan(spec, shapes, optimizer, mesh, train_step, local, rollout_devices, early)
        model_started = time.perf_counter()
        compile_s = model_started - compile_started
        policy = load_policy(spec)
    lora = spec.model.lora is not None
    state = init_train_state(shard_state(policy.params, mesh), optimizer, seed=spec.seed, lora=lora)
    state = jax.device_put(state, train_state_shardings(state, optimizer, mesh))
    reference_params = None
    if samples and spec.algo.kl_coef > 0:
        # With LoRA the reference is the base model: the frozen weights themselves (never donated) with
        # the adapters switched off. Otherwise a copy, since the train step donates the state's buffers.
        reference_params = (model_params(adapters_off(state.params), state.frozen) if lora
                            else jax.tree.map(jnp.copy, state.params))
    checkpoints = Checkpointer(spec.checkpoint.dir or checkpoint_dir, every=spec.checkpoint.every,
                               keep=spec.checkpoint.keep)
    start_step = 0
    if resume:
        restored = checkpoints.restore_latest(state)
        if restored is not None:
            state = restored[0]
            start_step = int(jax.device_get(state.step))
    jax.block_until_ready(state)  # the model's time is its own, not the first step's
    setup_phases = {m.TIME_SETUP_COMPILE: compile_s, m.TIME_SETUP_MODEL: time.perf_counter() - model_started}
    data = load_task_data(spec.task, spec.eval)
    return Trainer(policy, data.train, mesh, state, train_step, checkpoints, start_step, reference_params,
                   data.held_out, setup_phases, early)


def plans_by_compiling(platform: str) -> bool:
    """Whether a run on `platform` takes its memory plan from its compiled programs: on accelerators. On
    CPU the analytic plan is the calibrated one (bench/scale.py: peak RSS 1.00 of it) and also covers the
    process's runtime, which no program's memory analysis sees."""
    return platform != "cpu"


def _train_step(spec: RunSpec, graphdef: nnx.GraphDef, optimizer, mesh: jax.sharding.Mesh, samples: bool):
    if not samples:
        return make_sft_step(graphdef, optimizer, micro_batch_size=spec.algo.micro_batch_size, mesh=mesh,
                             remat=spec.model.remat)
    return make_train_step(graphdef, optimizer, spec.algo, temperature=train_temperature(spec), mesh=mesh,
                           remat=spec.model.remat)


def rows_move_on_devices() -> bool:
    """`Trainer.rows_move_on_devices`, before a Trainer exists: with one process."""
    return jax.process_count() == 1


def _early_forward_refusal(spec: RunSpec, mesh: jax.sharding.Mesh) -> str | None:
    """Why `placement.early_forward` cannot apply to this run (None: it can)."""
    mode = spec_mode(spec)
    if not (mode.early_forward and mode.samples):
        return f"mode '{mode.name}' does not run it"
    if not rows_move_on_devices():
        return "across processes the rows reach the train mesh through host memory, after the rewards"
    rows = spec.rollout.prompts_per_step * spec.rollout.group_size
    if not early_forward_applies(spec.algo, mesh, rows, spec.rollout.max_prompt_tokens + spec.rollout.max_new_tokens):
        return "it needs algo.num_iterations 1 and the batch in one micro-batch (algo.micro_batch_size)"
    return None


def _early_forward_step(spec: RunSpec, graphdef: nnx.GraphDef, optimizer,
                        mesh: jax.sharding.Mesh) -> EarlyForwardStep | None:
    """The run's `EarlyForwardStep` when `placement.early_forward` asks for one; where it cannot apply, an
    error naming why."""
    if not spec.placement.early_forward:
        return None
    refusal = _early_forward_refusal(spec, mesh)
    if refusal is not None:
        raise ValueError(f"placement.early_forward: true, but {refusal}")
    return EarlyForwardStep(graphdef, optimizer, spec.algo, temperature=train_temperature(spec), mesh=mesh,
                            remat=spec.model.remat)


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree, shardings)


def check_compiled_plan(spec: RunSpec, shapes: Policy, optimizer, mesh: jax.sharding.Mesh, train_step,
                        local: Sequence[jax.Device], rollout_devices: Sequence[jax.Device] | None,
                        early_forward: EarlyForwardStep | None = None) -> MemoryPlan:
    """Print the compiled plan (stderr) and raise `MemoryPlanError` when it does not fit; see `prepare_trainer`.
    The abstract inputs are the ones the run's calls will carry (shapes, dtypes, shardings), so the
    programs compiled here are the ones the run uses: with `early_forward`, its forward and update in
    place of the one-program train step."""
    samples = spec_mode(spec).samples
    params = _abstract(shapes.params, state_shardings(shapes.params, mesh))
    lora = spec.model.lora is not None
    state = jax.eval_shape(functools.partial(init_train_state, optimizer=optimizer, seed=spec.seed, lora=lora), params)
    sharded = state.replace(params=params)
    if lora:
        frozen, adapters = split_adapters(params)
        sharded = state.replace(params=adapters, frozen=frozen)
    state = _abstract(state, train_state_shardings(sharded, optimizer, mesh))
    rows = spec.rollout.prompts_per_step * (spec.rollout.group_size if samples else 1)
    prompt_len, new_len = spec.rollout.max_prompt_tokens, spec.rollout.max_new_tokens
    layout = {"tokens": ((rows, prompt_len + new_len), jnp.int32), "prompt_mask": ((rows, prompt_len), jnp.bool_),
              "completion_mask": ((rows, new_len), jnp.bool_)}
    if samples:
        layout.update(old_logprobs=((rows, new_len), jnp.float32), advantages=((rows,), jnp.float32))
        if spec.algo.kl_coef > 0:
            layout["ref_logprobs"] = ((rows, new_len), jnp.float32)
    batch = {key: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, len(shape)))
             for key, (shape, dtype) in layout.items()}
    rollout = reference = rollout_params = reference_params = None
    if samples and rollout_devices is not None:
        host_rows = rows // spec_mode(spec).rollout_hosts(spec.placement)
        sampling = sampling_config(spec, shapes.tokenizer)
        generate = make_generate_fn(shapes.config, shapes.graphdef, sampling, prompt_len, host_rows,
                                    tuple(rollout_devices))
        rollout_mesh_ = generate.batch_sharding.mesh
        replicated = NamedSharding(rollout_mesh_, PartitionSpec())
        # As `to_local` will hand them to the rollout and the reference pass: the train state's own
        # arrays where already placed so, else copies on the rollout mesh (the shardings are part of what
        # the programs are compiled for).
        local_params = (params if already_local(params, replicated)
                        else _abstract(shapes.params, jax.tree.map(lambda _: replicated, shapes.params)))
        prompts = jax.ShapeDtypeStruct((host_rows, prompt_len), jnp.int32, sharding=generate.batch_sharding)
        prompt_mask = jax.ShapeDtypeStruct((host_rows, prompt_len), jnp.bool_, sharding=generate.batch_sharding)
        key = jax.eval_shape(lambda: rollout_key(spec.seed, 0))
        # The row offset as `RolloutRunner.prepare` places it: on the rollout mesh, replicated.
        row_offset = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        rollout = (generate.jitted, (local_params, prompts, prompt_mask, key, row_offset))
        rollout_params = local_params if spec.placement.fsdp * spec.placement.tensor > 1 else None
        if spec.algo.kl_coef > 0:
            sequences = jax.ShapeDtypeStruct((host_rows, prompt_len + new_len), jnp.int32,
                                             sharding=generate.batch_sharding)
            completion = jax.ShapeDtypeStruct((host_rows, new_len), jnp.bool_, sharding=generate.batch_sharding)
            reference = (reference_logprobs_fn(shapes.graphdef, train_temperature(spec)),
                         (local_params, sequences, prompt_mask, completion))
            reference_params = local_params
    plan = compiled_plan(train_step=train_step, abstract_state=state, abstract_batch=batch, devices=local,
                         mesh=MeshShape(mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"]),
                         remat=spec.model.remat, dtype=spec.model.dtype, rollout=rollout,
                         rollout_params=rollout_params, reference=reference, reference_params=reference_params,
                         early_forward=early_forward)
    print(plan.summary(), file=sys.stderr, flush=True)
    if not plan.fits:
        raise MemoryPlanError(refusal(plan))
    return plan


def train_state_shardings(state: TrainState, optimizer, mesh: jax.sharding.Mesh) -> TrainState:
    """Params and every params-shaped part of the optimizer state sharded per the model's logical-axis
    rules (FSDP/tensor on those mesh axes); the step counter, key and scalars replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    param_shardings = jax.tree.map(lambda x: x.sharding, state.params)
    opt_shardings = optimizer_state_shardings(optimizer.tx, state.opt_state, param_shardings, replicated)
    frozen = None if state.frozen is None else jax.tree.map(lambda x: x.sharding, state.frozen)
    return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings, rng=replicated,
                      frozen=frozen)


def train_temperature(spec: RunSpec) -> float:
    # Greedy rollout (T=0) reports log softmax(logits); train at T=1 to match it.
    return spec.rollout.temperature if spec.rollout.temperature > 0 else 1.0

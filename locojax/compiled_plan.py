"""The memory plan of a run on an accelerator, read from the programs XLA compiles for that chip.

The analytic plan (`locojax.placement.memory`) counts every term from the model's shapes with factors
measured from XLA:CPU's buffer assignment; on a TPU it over-stated the device peak by 2-3x (a
Qwen3-0.6B bfloat16 run of 128 rows: planned 13.1 GiB, peak 4.5 GiB; ../shared/reference/TPU.md), and
refused runs that fit. On accelerators the engine therefore compiles the run's large programs ahead of
time from abstract shapes (nothing is allocated) and takes XLA's own memory analysis of each:

  * persistent: the train state (params, AdamW moments, step, key) as the train step receives it,
    plus the frozen KL reference and the replicated copy rollout decodes from when training shards
    the params (FSDP/tensor). With LoRA the state's params and moments are the adapters', the frozen
    weights a term of their own (counted once), and the KL reference only its zeroed adapters: it runs
    on the same frozen buffers;
  * train: the step's temporaries (gradients, activations, logit chunks: on a TPU what its runtime
    reserves for them, XLA's peak beyond the arguments; see PEAK_ANALYSIS_PLATFORMS), its batch and
    the outputs it does not write over its donated state;
  * rollout: the generate program's temporaries (KV cache, sampling logits), its prompts and outputs;
  * reference: the KL reference pass's, when the run has one.
The peak is persistent + the largest of the transients (they run one after another on the chip).

The programs compiled here are the ones the run then calls: JAX keeps them, keyed by the same shapes
and shardings, so the run's first step reuses them instead of compiling again.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import jax

from locojax.placement.memory import DOES_NOT_FIT, MemoryPlan, MemoryPlanError, MeshShape, device_capacity


def _device_bytes(tree: Any) -> float:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs carrying shardings."""
    total = 0.0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


class _Lowered:
    """A program already lowered, as `_compile_all` takes programs: `.lower()` returns it."""

    def __init__(self, lowered):
        self.lowered = lowered

    def lower(self):
        return self.lowered


def _compile_all(programs: dict[str, tuple[Callable, tuple]],
                 followers: dict[str, tuple[str, Callable]] | None = None) -> dict[str, Any]:
    """XLA's memory analysis of each (jitted, abstract arguments) program, keyed like `programs`.

    Each is traced and lowered here, one after the other (tracing holds the GIL), then all are compiled
    at once, one thread each: XLA compiles without the GIL, and a run's train step, rollout and KL pass
    are independent programs, so the run's first step waits for the slowest compile, not their sum.
    `followers`: {name: (leader, lower)}, programs whose arguments come from another's compiled outputs
    (the early forward's update takes its forward's saved buffers, whose shardings XLA picks when it
    compiles the forward): `lower(leader's compiled program)` lowers one, in its own thread as soon as its
    leader is compiled, beside the others."""
    lowered = {name: jitted.lower(*arguments) for name, (jitted, arguments) in programs.items()}
    followers = followers or {}
    with ThreadPoolExecutor(max_workers=len(lowered) + len(followers), thread_name_prefix="locojax-compile") as pool:
        compiled = {name: pool.submit(lowering.compile) for name, lowering in lowered.items()}
        for name, (leader, lower) in followers.items():
            compiled[name] = pool.submit(lambda leader=leader, lower=lower: lower(compiled[leader].result()).compile())
        analyses = {}
        for name, future in compiled.items():
            try:
                analyses[name] = future.result().memory_analysis()
            except Exception as error:  # XLA's own refusal: the program cannot fit the device at all
                if "RESOURCE_EXHAUSTED" not in str(error):
                    raise
                raise MemoryPlanError(program_too_large(name, error)) from error
        return analyses


def program_too_large(name: str, error: Exception) -> str:
    """A refusal for a program XLA would not compile because its buffers exceed the device (XLA:TPU
    checks its temporaries against HBM at compile time), naming the program and XLA's figure."""
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"{DOES_NOT_FIT}: XLA cannot compile the {name} program for this device, its "
            f"{PROGRAM_TERMS.get(name, name)} exceed the device's memory ({detail}). What would fit: fewer "
            f"rollout.prompts_per_step or group_size (or algo.micro_batch_size), shorter "
            f"rollout.max_prompt_tokens or max_new_tokens, model.remat: full, model.dtype: bfloat16, or "
            f"placement.fsdp over more devices per host.")


# What each compiled program holds beyond the persistent state, as a refusal names it.
PROGRAM_TERMS = {"train": "train step's temporaries (activations, gradients, logit chunks)",
                 "train_forward": "train step's forward pass's temporaries and what it saves for the update "
                                  "(activations, weights as the backward reads them)",
                 "rollout": "rollout's temporaries (KV cache, sampling logits)",
                 "reference": "KL reference pass's temporaries"}


# Platforms whose runtime reserves for a program what XLA's heap simulation says it needs at its peak
# beyond its arguments (`peak_memory_in_bytes - argument_size_in_bytes`), which can be far less than the
# temporary allocation XLA reports (`temp_size_in_bytes`), buffers whose lives do not overlap sharing
# space. Measured on a v5e (bench/results/tpu_memory_timeline_tpu.json): every program's reservation
# (`bytes_reserved` once it ran) within 0.01 GiB of that figure for the rollouts and within 0.03-0.32
# GiB for the train steps, where temp_size over-stated by 0.7-3.1 GiB (Qwen3-0.6B bf16, 128 rows: train
# reserved 4.40 GiB, peak - arguments 4.08, temp_size 7.15). XLA:CPU reports no such peak (a few KiB
# for any program), so elsewhere the plan keeps temp_size.
PEAK_ANALYSIS_PLATFORMS = frozenset({"tpu"})


def program_temporaries(analysis, platform: str) -> float:
    """Bytes a compiled program (`analysis`: its `memory_analysis()`) needs while it runs beyond its
    arguments and its outputs that do not overwrite a donated argument, as the plan counts them on
    `platform`: XLA's temporary allocation, or on PEAK_ANALYSIS_PLATFORMS its heap simulation's peak
    (a v5e reported a temporary allocation of 0 for small programs that still need memory)."""
    if platform not in PEAK_ANALYSIS_PLATFORMS:
        return float(analysis.temp_size_in_bytes)
    outputs = max(0.0, analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
    return max(0.0, analysis.peak_memory_in_bytes - analysis.argument_size_in_bytes - outputs)


def _transient(analysis, argument_bytes: float, platform: str) -> dict[str, float]:
    """What a program needs beyond the persistent buffers among its arguments: its temporaries, the
    rest of its arguments, and the outputs that do not overwrite a donated argument."""
    inputs = max(0.0, analysis.argument_size_in_bytes - argument_bytes)
    outputs = max(0.0, analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
    return {"temporaries": program_temporaries(analysis, platform), "inputs": inputs, "outputs": outputs}


def compiled_plan(*, train_step: Callable, abstract_state: Any, abstract_batch: dict, devices: Sequence[jax.Device],
                  mesh: MeshShape, remat: str, dtype: str,
                  rollout: tuple[Callable, tuple] | None = None, rollout_params: Any = None,
                  reference: tuple[Callable, tuple] | None = None, reference_params: Any = None,
                  early_forward: Any = None) -> MemoryPlan:
    """The plan of a run from its compiled programs: `train_step` (jitted) on the abstract state and
    batch; `rollout` = (jitted generate, its abstract arguments, params first), whose params are
    `rollout_params` (the same buffers as the state's params unless training shards them);
    `reference` = (jitted KL log-prob pass, its abstract arguments, reference params first).
    `early_forward` (a `locojax.train.EarlyForwardStep`): the run trains with its forward and update
    instead of `train_step`; the train terms are those of the one of the two that needs more, the
    forward's saved buffers counted as its outputs and as the update's inputs."""
    state_bytes = _device_bytes(abstract_state)  # the frozen weights (LoRA) included
    params_bytes = _device_bytes(abstract_state.params)
    frozen_bytes = _device_bytes(abstract_state.frozen)
    persistent = {"params": params_bytes, "optimizer": state_bytes - params_bytes - frozen_bytes}
    if abstract_state.frozen is not None:
        persistent = {"frozen": frozen_bytes, "adapters": params_bytes, "optimizer": persistent["optimizer"]}
    programs = {"train": (train_step, (abstract_state, abstract_batch))}
    followers = None
    if early_forward is not None:
        forward = early_forward.lower_forward(abstract_state, abstract_batch)

        saved_forward = []

        def lower_update(compiled_forward):
            saved = jax.tree.map(lambda out, sharding: jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=sharding),
                                 forward.out_info, compiled_forward.output_shardings)
            saved_forward.append(saved)
            return early_forward.lower_update(abstract_state, abstract_batch, saved)

        programs = {"train_forward": (_Lowered(forward), ())}
        followers = {"train": ("train_forward", lower_update)}
    if rollout is not None:
        programs["rollout"] = rollout
    if reference is not None:
        programs["reference"] = reference
    analyses = _compile_all(programs, followers)
    platform = devices[0].platform
    train = {f"train_{name}": value
             for name, value in _transient(analyses["train"], state_bytes, platform).items()}
    if early_forward is not None:
        # What the forward saves is its output and the update's input: a term of its own in both.
        saved_bytes = _device_bytes(saved_forward[0])
        train["train_inputs"] = max(0.0, train["train_inputs"] - saved_bytes)
        train["train_saved_forward"] = saved_bytes
        # The forward's arguments are the weights (params and frozen), not the optimizer state.
        forward = _transient(analyses["train_forward"], params_bytes + frozen_bytes, platform)
        forward = {"train_temporaries": forward["temporaries"], "train_inputs": forward["inputs"],
                   "train_outputs": max(0.0, forward["outputs"] - saved_bytes), "train_saved_forward": saved_bytes}
        train = max(train, forward, key=lambda terms: sum(terms.values()))
    rollout_terms: dict[str, float] = {}
    if rollout is not None:
        held = _device_bytes(rollout[1][0])
        if rollout_params is not None:
            persistent["rollout_params"] = held
        rollout_terms = {f"rollout_{name}": value
                         for name, value in _transient(analyses["rollout"], held, platform).items()}
    reference_terms: dict[str, float] = {}
    if reference is not None:
        held = _device_bytes(reference[1][0])
        # With LoRA the reference's weights are the frozen ones already counted; only its adapters are its own.
        persistent["reference"] = held if abstract_state.frozen is None else max(0.0, held - frozen_bytes)
        reference_terms = {f"reference_{name}": value
                           for name, value in _transient(analyses["reference"], held, platform).items()}
    capacity, capacity_name, runtime = device_capacity(devices)
    return MemoryPlan(persistent, train, rollout_terms, runtime, mesh, remat, dtype, capacity, capacity_name,
                      reference=reference_terms, source="compiled")

"""Supervised warm start: teacher-forced training on a task's reference answers, as an ordinary run.

RL from a random model sees zero reward (PITFALLS.md), so a GRPO run starts from the model an SFT run
(`kind: sft`) exports: a Hugging Face directory `<output_dir>/model` (config.json + model.safetensors)
that a GRPO spec's `model.checkpoint` names. An SFT run is a run like any other: it writes
`metrics.jsonl` (per-host and "all" rows, `time/step`), `hosts/host0.json` (step and phase), Orbax
checkpoints every `checkpoint.every` steps for an exact `--resume`, and `result.json`; it stops at a
step boundary once the cancel file exists. It is single-host (data parallel over that host's devices).

How the spec reads for SFT: batch size `rollout.prompts_per_step`; learning rate, warmup and decay
`optim.*`; prompt and reference slots `rollout.max_prompt_tokens` / `rollout.max_new_tokens`
(a reference longer than that is cut, its EOS with it); `algo.micro_batch_size` bounds memory.
Keep `optim.decay: constant`: a prototype that ended SFT on a cosine-decayed rate left a fragile model
that GRPO made worse (PITFALLS.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from locojax import metrics as m
from locojax.contract import ADAPTER_DIR, EXPORT_DIR, EngineStatus, HostStatus
from locojax.modes.common import TrainerSession, open_devices, prepare_trainer
from locojax.rollout import encode_prompts
from locojax.runner import StepOutput, checkpoint_dir, output_dir, run
from locojax.spec import RunSpec
from locojax.tasks import Example, global_batch
from locojax.tokenizer import Tokenizer

# SFT reads a different data stream from GRPO's with the same seed, so the RL prompts of a run that
# starts from this model are not the ones it was taught the answers of, in the same order.
SFT_DATA_SEED_OFFSET = 7919


def export_dir(spec: RunSpec) -> Path:
    """Where an SFT run writes the HF directory a GRPO spec's `model.checkpoint` can name."""
    return output_dir(spec) / EXPORT_DIR


def reference_batch(examples: Sequence[Example], tokenizer: Tokenizer, prompt_len: int,
                    completion_len: int) -> dict[str, np.ndarray]:
    """Prompts left-padded to `prompt_len`; reference + EOS right-padded to `completion_len`."""
    prompt_tokens, prompt_mask = encode_prompts([e.prompt for e in examples], tokenizer, prompt_len)
    completion = np.full((len(examples), completion_len), tokenizer.pad_id, np.int32)
    completion_mask = np.zeros((len(examples), completion_len), bool)
    for row, example in enumerate(examples):
        ids = (tokenizer.encode(example.reference) + [tokenizer.eos_id])[:completion_len]
        completion[row, :len(ids)] = ids
        completion_mask[row, :len(ids)] = True
    return {"tokens": np.concatenate([prompt_tokens, completion], axis=1), "prompt_mask": prompt_mask,
            "completion_mask": completion_mask}


def sft_examples(task, spec: RunSpec, step: int) -> list[Example]:
    """Step `step`'s batch: a pure function of (seed, step), so a resumed run sees the same data."""
    return global_batch(task, spec.seed + SFT_DATA_SEED_OFFSET, step, spec.rollout.prompts_per_step)


class SFTSession(TrainerSession):
    """An SFT run in this process: one teacher-forced update per step."""

    # A cancel that arrives during the last step lets the run finish: the model is complete.
    last_step_ignores_cancel = True

    def __init__(self, spec: RunSpec, *, resume: bool = False):
        if spec.kind != "sft":
            raise ValueError(f"run_sft needs a spec with kind 'sft', got {spec.kind!r}")
        devices, backend_s = open_devices(local_only=True)
        if jax.process_count() != 1:
            raise ValueError("an SFT run is single-host (placement.hosts 1); start it with `locojax train` or "
                             "`locojax host` without --num-processes")
        super().__init__(spec, prepare_trainer(spec, devices, checkpoint_dir(spec), resume))
        self.trainer.setup_phases[m.TIME_SETUP_BACKEND] = backend_s

    def step(self, step: int, timer: m.PhaseTimer, where: HostStatus) -> StepOutput:
        spec, trainer = self.spec, self.trainer
        where(step, "train")
        with timer.phase(m.TIME_TRAIN):
            # Building the batch is host work (tokenising); only the step is device time.
            rows = reference_batch(sft_examples(trainer.task, spec, step), trainer.policy.tokenizer,
                                   spec.rollout.max_prompt_tokens, spec.rollout.max_new_tokens)
            with timer.device() as span:
                trainer.state, train_metrics = trainer.train_step(trainer.state, trainer.global_batch(rows))
                span.ready(trainer.state)
        return StepOutput(train_metrics, int(rows["prompt_mask"].sum() + rows["completion_mask"].sum()))

    def finish(self, status: EngineStatus, steps_done: int, where: HostStatus) -> int | None:
        last = super().finish(status, steps_done, where)
        if status is EngineStatus.SUCCEEDED:
            # Only a finished run exports: a GRPO run queued behind it must not start from half a warm start.
            where(steps_done, "export")
            export_model(self.spec, self.trainer)
        return last


def export_model(spec: RunSpec, trainer) -> None:
    """`export_policy` of the trained model into the run's output directory."""
    export_policy(nnx.merge(trainer.policy.graphdef, trainer.state.model_params), output_dir(spec))


def export_policy(model, out: Path) -> list[Path]:
    """Write `<out>/model` (a Hugging Face directory; with LoRA the adapters merged into the weights) and,
    for a LoRA model, `<out>/adapter` (the adapters alone, in PEFT's format). Each is written aside and
    renamed, so it is either absent or complete. Returns the directories written."""
    from locojax.model.hf import save_hf_checkpoint, save_peft_adapter

    writers = [(EXPORT_DIR, save_hf_checkpoint)]
    if model.config.lora is not None:
        writers.append((ADAPTER_DIR, save_peft_adapter))
    written = []
    for name, write in writers:
        final, partial = out / name, out / (name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        write(model, partial)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        written.append(final)
    return written


def run_sft(spec: RunSpec, **options):
    """Run (or resume) an SFT run in this process; exports `<output_dir>/model` when it completes."""
    return run(spec, SFTSession, **options)

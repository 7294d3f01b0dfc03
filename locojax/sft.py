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
from locojax.rollout import encode_prompts
from locojax.spec import RunSpec
from locojax.tasks import Example, global_batch
from locojax.tokenizer import Tokenizer

# SFT reads a different data stream from GRPO's with the same seed, so the RL prompts of a run that
# starts from this model are not the ones it was taught the answers of, in the same order.
SFT_DATA_SEED_OFFSET = 7919
EXPORT_DIR = "model"


def export_dir(spec: RunSpec) -> Path:
    """Where an SFT run writes the HF directory a GRPO spec's `model.checkpoint` can name."""
    from locojax.modes.run_files import output_dir

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


def run_sft(
    spec: RunSpec,
    *,
    resume: bool = False,
    console: bool = True,
    cancel_file: str | Path | None = None,
    extra_sinks: Sequence[m.MetricSink] = (),
):
    """Run (or resume) an SFT run in this process; exports `<output_dir>/model` when it completes."""
    from locojax.model.hf import save_hf_checkpoint
    from locojax.modes.run_files import HostStatus, RunResult, cancel_requested, finish, make_logger, start_output
    from locojax.modes.common import prepare_trainer

    if spec.kind != "sft":
        raise ValueError(f"run_sft needs a spec with kind 'sft', got {spec.kind!r}")
    if jax.process_count() != 1:
        raise ValueError("an SFT run is single-host (placement.hosts 1); start it with `locojax train` or "
                         "`locojax host` without --num-processes")
    out = start_output(spec, 0)
    trainer = prepare_trainer(spec, jax.local_devices(), out / "checkpoints", resume)
    tokenizer = trainer.policy.tokenizer
    logger = make_logger(spec, out, 0, trainer.start_step, console, extra_sinks)
    timer = m.PhaseTimer()
    where = HostStatus(out, 0)
    status, steps_done, combined = "succeeded", trainer.start_step, {}
    try:
        for step in range(trainer.start_step, spec.steps):
            with timer.step():
                where(step, "train")
                with timer.phase(m.TIME_TRAIN):
                    # Building the batch is host work (tokenising); only the step is device time.
                    rows = reference_batch(sft_examples(trainer.task, spec, step), tokenizer,
                                           spec.rollout.max_prompt_tokens, spec.rollout.max_new_tokens)
                    with timer.device() as span:
                        trainer.state, train_metrics = trainer.train_step(trainer.state, trainer.global_batch(rows))
                        span.ready(trainer.state)
                where(step, "checkpoint")
                with timer.phase(m.TIME_CHECKPOINT):
                    trainer.checkpoint(spec, force=step + 1 == spec.steps)
                where(step, "metrics")
                record = {k: float(v) for k, v in jax.device_get(train_metrics).items()}
            record.update(timer.metrics())
            train_tokens = int(rows["prompt_mask"].sum() + rows["completion_mask"].sum())
            record[m.THROUGHPUT_TRAIN_TOKENS] = m.throughput(train_tokens, record.get(m.TIME_TRAIN, 0.0))
            combined = logger.log_hosts(step, [record])
            steps_done = step + 1
            if cancel_requested(cancel_file) and steps_done < spec.steps:
                status = "cancelled"
                trainer.checkpoint(spec, force=True)
                break
        trainer.checkpoints.wait_until_finished()
        if status == "succeeded":
            # Only a finished run exports: a GRPO run queued behind it must not start from half a warm start.
            where(steps_done, "export")
            # Written aside and renamed, so `model/` is either absent or complete.
            final, partial = export_dir(spec), export_dir(spec).with_name(EXPORT_DIR + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            save_hf_checkpoint(nnx.merge(trainer.policy.graphdef, trainer.state.params), partial)
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
    finally:
        logger.close()
        trainer.checkpoints.close()
    return finish(out, 0, RunResult(status, steps_done, trainer.checkpoints.latest_step(), combined))

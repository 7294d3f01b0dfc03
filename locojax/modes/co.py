"""CO (colocated) mode — the heart of the paper (DESIGN §5).

Every host runs this same loop as its own Python process (multi-controller). Per step, host h:
  1. takes its shard of the step's prompts (deterministic from seed, step, h);
  2. samples G completions per prompt on its local devices (no cross-host traffic);
  3. scores rewards on its CPU threads;
  4. normalises advantages per group (every group lives on one host);
  5. contributes its rows to the global batch (`jax.make_array_from_process_local_data`) for one
     jitted SPMD train step on the global mesh, whose gradient all-reduce is the only collective;
  6. reports metrics (gathered so host 0 writes per-host and aggregate records) and checkpoints.
The chip is kept fed (STYLE habit 14): rollout results stay on the devices and become the train rows
there (only the tokens travel to the host, for scoring, and the advantages back); with a KL term the
reference pass runs on the chip while the host scores, and so does the update's forward pass
(placement.early_forward: the update then only pulls the loss's gradient back); and right after the
update is dispatched, the next step's rollout is queued behind it, so the chip decodes while the host
logs this step and starts the next. The next step's `time/rollout` therefore counts only the part of
its rollout that was not yet done when that step began.
With an eval block, steps it names start with a held-out evaluation (locojax.evaluate), outside the
step's timers: each host evaluates its shard, and the counts travel in the step's metrics gather;
one more evaluation follows the last step, recorded at step = steps.
With one process there is no `jax.distributed` at all; the same code runs on the local devices.
"""

from __future__ import annotations

import jax

from locojax import metrics as m
from locojax.contract import CHECKSUM_KEY, HostStatus, RunResult
from locojax.evaluate import Evaluator, eval_rewards, evaluation_due
from locojax.model.sharding import batch_sharding
from locojax.modes.common import (
    DispatchedRollout,
    PreparedRollout,
    RolloutRunner,
    TrainerSession,
    open_devices,
    params_checksum,
    prepare_trainer,
    prompts_for,
    reward_pool,
    rollout_metrics,
    rollout_rows,
    score_and_normalise,
    to_local,
    train_temperature,
)
from locojax.rollout import rollout_key
from locojax.runner import StepOutput, checkpoint_dir, checksum_due, run
from locojax.spec import RunSpec
from locojax.tasks import host_slice
from locojax.train import reference_logprobs_fn


class COSession(TrainerSession):
    """This process's share of a CO run; every process of the job builds one."""

    def __init__(self, spec: RunSpec, *, resume: bool = False):
        devices, backend_s = open_devices()
        num_hosts, host = jax.process_count(), jax.process_index()
        if spec.rollout.prompts_per_step % num_hosts:
            raise ValueError(f"rollout.prompts_per_step ({spec.rollout.prompts_per_step}) is not divisible by the "
                             f"{num_hosts} hosts of this job")
        super().__init__(spec, prepare_trainer(spec, devices, checkpoint_dir(spec), resume,
                                               rollout_devices=jax.local_devices()))
        self.trainer.setup_phases[m.TIME_SETUP_BACKEND] = backend_s
        self.host, self.num_hosts = host, num_hosts
        prompts_per_host = spec.rollout.prompts_per_step // num_hosts
        self.rows_per_host = prompts_per_host * spec.rollout.group_size
        self.runner = RolloutRunner(spec, self.trainer.policy, prompts_per_host, jax.local_devices())
        self.use_kl = spec.algo.kl_coef > 0
        # Rows that move to the train mesh device to device go there without waiting for the host.
        self.rows_move_ahead = self.trainer.rows_move_on_devices
        if self.use_kl:  # the frozen reference is the starting policy (not a restored one), kept host-locally
            self.reference_params = to_local(self.trainer.reference_params, self.runner.replicated)
            self.reference_logprobs = reference_logprobs_fn(self.trainer.policy.graphdef, train_temperature(spec))
        self.evaluator = None
        if spec.eval is not None:
            first, shard = host_slice(self.trainer.held_out, host, num_hosts)
            self.evaluator = Evaluator(spec, spec.eval, self.trainer.policy, shard,
                                       eval_rewards(spec.eval, self.trainer.task), first, jax.local_devices())
        self.pool = reward_pool()
        # A rollout dispatched at the end of the previous step (`_prefetch_rollout`), and its step.
        self._next_rollout: DispatchedRollout | None = None
        self._next_rollout_step: int | None = None
        # The next step's rollout inputs, prepared while the device samples this step's (`_prepare_next`).
        self._prepared: PreparedRollout | None = None
        self._prepared_step: int | None = None

    def evaluate(self, step: int, where: HostStatus) -> dict[str, float]:
        if self.evaluator is None or not evaluation_due(self.spec.eval, step):
            return {}
        where(step, "eval")
        return self.evaluator.timed(self.trainer.state.model_params)

    def step(self, step: int, timer: m.PhaseTimer, where: HostStatus) -> StepOutput:
        spec, trainer = self.spec, self.trainer
        where(step, "rollout")
        with timer.phase(m.TIME_ROLLOUT):
            rollout = self._next_rollout if self._next_rollout_step == step else self._dispatch_rollout(step)
            self._next_rollout = self._next_rollout_step = None
            # Queued behind the rollout on the chip: the train rows stay there, and the reference pass runs
            # while the host scores rewards below.
            rows = rollout_rows(rollout.device_prompt_tokens, rollout.device_prompt_mask, rollout.result)
            if self.use_kl:
                rows["ref_logprobs"] = self.reference_logprobs(
                    self.reference_params, rows["tokens"], rows["prompt_mask"], rows["completion_mask"])
            if self.rows_move_ahead:  # to the train mesh now, queued too: only the advantages wait below
                rows = trainer.global_batch_from_device(rows)
            saved_forward = None
            if trainer.early_forward is not None:  # the update's forward pass, queued too (rows_move_ahead)
                with jax.profiler.TraceAnnotation("dispatch:train forward"):
                    saved_forward = trainer.early_forward.forward(trainer.state, rows)
            self._prepare_next(step + 1)  # the host's part of the next rollout, while the device samples
            with timer.device() as span, jax.profiler.TraceAnnotation("wait:rollout tokens"):
                # One transfer of what the host needs: the texts to score and the metrics.
                tokens, lengths, mask = span.ready(jax.device_get(
                    (rollout.result.tokens, rollout.result.lengths, rollout.result.mask)))
            with jax.profiler.TraceAnnotation("host:texts"):
                completions = self.runner.texts(tokens, lengths)
        rollout_s = timer.last_phase(m.TIME_ROLLOUT)
        where(step, "reward")
        rewards, per_fn, advantages = score_and_normalise(
            spec, trainer.task, rollout.examples, completions, self.pool, timer)
        where(step, "train")
        with timer.device(m.TIME_TRAIN) as span:
            with jax.profiler.TraceAnnotation("dispatch:train"):  # in a profile's timeline; ~1 us otherwise
                if self.rows_move_ahead:
                    rows["advantages"] = jax.device_put(advantages, batch_sharding(trainer.mesh, 1))
                    batch = rows
                else:
                    rows["advantages"] = jax.device_put(advantages, self.runner.batch_sharding)
                    batch = trainer.global_batch_from_device(rows)
                # The step's old state (donated) and batch are let go only after the next rollout's
                # dispatch: releasing their ~50 arrays held a TPU host 1.4-8.7 ms right here, the device
                # idle behind it (a trace at size a).
                previous_state = trainer.state
                if saved_forward is not None:
                    trainer.state, train_metrics = trainer.early_forward.update(previous_state, batch, saved_forward)
                else:
                    trainer.state, train_metrics = trainer.train_step(previous_state, batch)
            # The next step's rollout goes in the chip's queue now, so it starts as soon as this update
            # is done, while this host logs the step and the next one begins.
            with jax.profiler.TraceAnnotation("dispatch:next rollout"):
                self._prefetch_rollout(step + 1)
            del previous_state, batch, saved_forward
            with jax.profiler.TraceAnnotation("wait:train"):
                span.ready(trainer.state)
        record = {**rollout_metrics(tokens, mask, rewards, per_fn, spec.rollout.group_size, rollout_s,
                                    trainer.policy.tokenizer.eos_id),
                  **train_metrics}
        if checksum_due(spec, step):
            record[CHECKSUM_KEY] = params_checksum(trainer.state.params)
        return StepOutput(record, int(rollout.prompt_mask.sum() + mask.sum()))

    def _prepared_inputs(self, step: int) -> PreparedRollout:
        examples = prompts_for(self.trainer.task, self.spec, step, self.host, self.num_hosts)
        return self.runner.prepare(examples, rollout_key(self.spec.seed, step), self.host * self.rows_per_host)

    def _dispatch_rollout(self, step: int) -> DispatchedRollout:
        inputs = self._prepared if self._prepared_step == step else self._prepared_inputs(step)
        self._prepared = self._prepared_step = None
        with jax.profiler.TraceAnnotation("dispatch:rollout params"):
            local_params = to_local(self.trainer.state.model_params, self.runner.replicated)
        with jax.profiler.TraceAnnotation("dispatch:rollout launch"):
            return self.runner.launch(local_params, inputs)

    def _prefetch_due(self, step: int) -> bool:
        """Whether step `step`'s rollout is dispatched ahead: not past the run's end, nor with an
        evaluation before that step (it reads the same params, but keeps its own timing)."""
        return step < self.spec.steps and not (self.spec.eval is not None and evaluation_due(self.spec.eval, step))

    def _prepare_next(self, step: int) -> None:
        """Step `step`'s prompts, tokens and key, made while the device samples this step: the host
        would otherwise make them between the train step's dispatch and the rollout's, with the device
        idle after the train step (a TPU trace at size a: 4-13 ms a step)."""
        if self._prefetch_due(step):
            self._prepared, self._prepared_step = self._prepared_inputs(step), step

    def _prefetch_rollout(self, step: int) -> None:
        """Dispatch step `step`'s rollout ahead, from the params just updated (`_prefetch_due`)."""
        if self._prefetch_due(step):
            self._next_rollout, self._next_rollout_step = self._dispatch_rollout(step), step

    def gather(self, record):
        return m.gather_host_metrics(record)

    def final_evaluation(self, where: HostStatus) -> dict[str, float] | None:
        if self.evaluator is None:
            return None
        where(self.spec.steps, "eval")
        return self.evaluator.timed(self.trainer.state.model_params)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        super().close()


def run_co(spec: RunSpec, **options) -> RunResult:
    """Run (or resume) a CO run on this process's share of the hosts. Every process calls this."""
    return run(spec, COSession, **options)

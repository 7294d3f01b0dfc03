"""CO (colocated) mode — the heart of the paper (DESIGN §5).

Every host runs this same loop as its own Python process (multi-controller). Per step, host h:
  1. takes its shard of the step's prompts (deterministic from seed, step, h);
  2. samples G completions per prompt on its local devices (no cross-host traffic);
  3. scores rewards on its CPU threads;
  4. normalises advantages per group (every group lives on one host);
  5. contributes its rows to the global batch (`jax.make_array_from_process_local_data`) for one
     jitted SPMD train step on the global mesh, whose gradient all-reduce is the only collective;
  6. reports metrics (gathered so host 0 writes per-host and aggregate records) and checkpoints.
With an eval block, steps it names start with a held-out evaluation (locojax.evaluate), outside the
step's timers: each host evaluates its shard, and the counts travel in the step's metrics gather;
one more evaluation follows the last step, recorded at step = steps.
With one process there is no `jax.distributed` at all; the same code runs on the local devices.
"""

from __future__ import annotations

import jax
import numpy as np

from locojax import metrics as m
from locojax.contract import CHECKSUM_KEY, HostStatus, RunResult
from locojax.evaluate import Evaluator, eval_rewards, evaluation_due
from locojax.modes.common import (
    HostRollout,
    RolloutRunner,
    TrainerSession,
    params_checksum,
    prepare_trainer,
    prompts_for,
    reward_pool,
    score_and_normalise,
    to_local,
    train_temperature,
)
from locojax.rollout import rollout_key
from locojax.runner import StepOutput, checkpoint_dir, checksum_due, run
from locojax.spec import RunSpec
from locojax.tasks import host_slice
from locojax.train import make_logprobs_fn


class COSession(TrainerSession):
    """This process's share of a CO run; every process of the job builds one."""

    def __init__(self, spec: RunSpec, *, resume: bool = False):
        num_hosts, host = jax.process_count(), jax.process_index()
        if spec.rollout.prompts_per_step % num_hosts:
            raise ValueError(f"rollout.prompts_per_step ({spec.rollout.prompts_per_step}) is not divisible by the "
                             f"{num_hosts} hosts of this job")
        super().__init__(spec, prepare_trainer(spec, jax.devices(), checkpoint_dir(spec), resume))
        self.host, self.num_hosts = host, num_hosts
        prompts_per_host = spec.rollout.prompts_per_step // num_hosts
        self.rows_per_host = prompts_per_host * spec.rollout.group_size
        self.runner = RolloutRunner(spec, self.trainer.policy, prompts_per_host, jax.local_devices())
        self.use_kl = spec.algo.kl_coef > 0
        if self.use_kl:  # the frozen reference is the starting policy (not a restored one), kept host-locally
            self.reference_params = to_local(self.trainer.reference_params, self.runner.replicated)
            self.reference_logprobs = make_logprobs_fn(self.trainer.policy.graphdef, train_temperature(spec))
        self.evaluator = None
        if spec.eval is not None:
            first, shard = host_slice(self.trainer.held_out, host, num_hosts)
            self.evaluator = Evaluator(spec, spec.eval, self.trainer.policy, shard,
                                       eval_rewards(spec.eval, self.trainer.task), first, jax.local_devices())
        self.pool = reward_pool()

    def evaluate(self, step: int, where: HostStatus) -> dict[str, float]:
        if self.evaluator is None or not evaluation_due(self.spec.eval, step):
            return {}
        where(step, "eval")
        return self.evaluator.timed(self.trainer.state.params)

    def step(self, step: int, timer: m.PhaseTimer, where: HostStatus) -> StepOutput:
        spec, trainer = self.spec, self.trainer
        where(step, "rollout")
        with timer.phase(m.TIME_ROLLOUT):
            examples = prompts_for(trainer.task, spec, step, self.host, self.num_hosts)
            with timer.device() as span:
                local_params = to_local(trainer.state.params, self.runner.replicated)
                tokens, mask, result = self.runner.sample(
                    local_params, examples, rollout_key(spec.seed, step), self.host * self.rows_per_host)
                span.ready(result)
            completions = self.runner.completions(result)
        rollout_s = timer.last_phase(m.TIME_ROLLOUT)
        where(step, "reward")
        rewards, per_fn, advantages = score_and_normalise(spec, trainer.task, examples, completions, self.pool, timer)
        piece = HostRollout(examples, tokens, mask, result, completions, rewards, per_fn, advantages)
        rows = piece.batch()
        where(step, "train")
        if self.use_kl:
            with timer.device(m.TIME_TRAIN) as span:
                rows["ref_logprobs"] = np.asarray(span.ready(self.reference_logprobs(
                    self.reference_params, rows["tokens"], rows["prompt_mask"], rows["completion_mask"])))
        with timer.device(m.TIME_TRAIN) as span:
            trainer.state, train_metrics = trainer.train_step(trainer.state, trainer.global_batch(rows))
            span.ready(trainer.state)
        record = {**piece.metrics(spec.rollout.group_size, rollout_s, trainer.policy.tokenizer.eos_id),
                  **train_metrics}
        if checksum_due(spec, step):
            record[CHECKSUM_KEY] = params_checksum(trainer.state.params)
        return StepOutput(record, int(rows["prompt_mask"].sum() + rows["completion_mask"].sum()))

    def gather(self, record):
        return m.gather_host_metrics(record)

    def final_evaluation(self, where: HostStatus) -> dict[str, float] | None:
        if self.evaluator is None:
            return None
        where(self.spec.steps, "eval")
        return self.evaluator.timed(self.trainer.state.params)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        super().close()


def run_co(spec: RunSpec, **options) -> RunResult:
    """Run (or resume) a CO run on this process's share of the hosts. Every process calls this."""
    return run(spec, COSession, **options)

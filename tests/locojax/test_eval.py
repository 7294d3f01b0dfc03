"""Held-out evaluation (locojax.evaluate, locojax.tasks.held_out): prompts never trained on, greedy
accuracy that is deterministic, pass@k >= accuracy, one aggregate whatever the host layout, and data
errors that read like spec errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from locojax import metrics as m
from locojax.spec import EvalSpec, RunSpec, SpecError, TaskSpec
from locojax.tasks import batch_indices, host_slice, load_task_data, make_task
from tests.locojax.test_co import locojax, tiny_spec, write_spec

EVEN_LENGTH = "tests.locojax.rewards_for_tests:even_length"
# The eval rewards here are the test rewards, which this process may import as an operator allows.
pytestmark = pytest.mark.usefixtures("test_rewards_allowed")


def eval_spec(tmp_path: Path, name: str, block: dict, **overrides) -> dict:
    """test_co's tiny CO spec with an eval block."""
    return {**tiny_spec(tmp_path, name, **overrides), "eval": block}


def trained_prompts(task, seed: int, steps: int, prompts_per_step: int) -> set[str]:
    """Every prompt the first `steps` batches of a run would train on."""
    return {task.example(int(i)).prompt
            for step in range(steps) for i in batch_indices(len(task), seed, step, prompts_per_step)}


def write_gsm8k(path: Path, questions: list[str]) -> Path:
    lines = [json.dumps({"question": q, "answer": f"{n}+1={n + 1}\n#### {n + 1}"}) for n, q in enumerate(questions)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- the split -----------------------------------------------------------------------------------

@pytest.mark.parametrize("task_spec", [TaskSpec(name="arith", difficulty=0), TaskSpec(name="arith", difficulty=2),
                                       TaskSpec(name="countdown", difficulty=1)])
def test_generated_held_out_prompts_are_never_trained_on(task_spec):
    data = load_task_data(task_spec, EvalSpec(prompts=64))
    held_out = {e.prompt for e in data.held_out}
    assert len(data.held_out) == len(held_out) == 64  # distinct prompts
    raw = make_task(task_spec)
    # By construction: held-out examples come from indices past the training range.
    assert all(int(e.uid.rsplit("-", 1)[1]) >= len(raw) for e in data.held_out)
    # And checked: 300 steps of 64 prompts (19,200 draws) never show a held-out prompt.
    assert not trained_prompts(data.train, 0, 300, 64) & held_out


def test_by_index_alone_arith_difficulty_0_would_train_on_held_out_prompts():
    """Why the training view also filters by text: difficulty 0 has ~10^4 distinct equations, so the
    raw task's training indices repeat held-out equations; the view replaces exactly those."""
    task_spec = TaskSpec(name="arith", difficulty=0)
    data = load_task_data(task_spec, EvalSpec(prompts=64))
    held_out = {e.prompt for e in data.held_out}
    raw = make_task(task_spec)
    assert trained_prompts(raw, 0, 300, 64) & held_out  # the raw task would leak
    indices = [int(i) for step in range(300) for i in batch_indices(len(raw), 0, step, 64)]
    replaced = [i for i in indices if raw.example(i).prompt in held_out]
    assert replaced and all(data.train.example(i).prompt not in held_out for i in replaced)
    kept = [i for i in indices[:500] if raw.example(i).prompt not in held_out]
    assert all(data.train.example(i) == raw.example(i) for i in kept)  # the rest is untouched


def test_file_split_holds_out_records_and_their_duplicates(tmp_path):
    questions = [f"What is {n} plus one?" for n in range(40)] + ["What is 3 plus one?"]  # one repeated question
    path = write_gsm8k(tmp_path / "train.jsonl", questions)
    data = load_task_data(TaskSpec(name="gsm8k", path=str(path)), EvalSpec(prompts=8))
    held_out = {e.prompt for e in data.held_out}
    assert len(held_out) == 8
    train = {data.train.example(i).prompt for i in range(len(data.train))}
    assert not train & held_out
    assert train | held_out == {e.prompt for e in (make_task(TaskSpec(name="gsm8k", path=str(path))).example(i)
                                                   for i in range(41))}
    assert not trained_prompts(data.train, 0, 50, 8) & held_out
    # The split does not depend on the run's seed: two seeds evaluate on the same prompts.
    again = load_task_data(TaskSpec(name="gsm8k", path=str(path)), EvalSpec(prompts=8))
    assert [e.uid for e in again.held_out] == [e.uid for e in data.held_out]


def test_an_eval_file_that_overlaps_the_training_file_is_removed_from_training(tmp_path):
    train_path = write_gsm8k(tmp_path / "train.jsonl", [f"Question {n}?" for n in range(20)])
    test_path = write_gsm8k(tmp_path / "test.jsonl", [f"Question {n}?" for n in range(15, 30)])  # 5 shared
    data = load_task_data(TaskSpec(name="gsm8k", path=str(train_path)), EvalSpec(prompts=100, path=str(test_path)))
    assert len(data.held_out) == 15  # all the eval file has
    train = {data.train.example(i).prompt for i in range(len(data.train))}
    assert len(data.train) == 15 and not train & {e.prompt for e in data.held_out}


def test_holding_out_more_than_there_is_names_eval_prompts(tmp_path):
    path = write_gsm8k(tmp_path / "train.jsonl", ["a?", "b?", "c?"])
    with pytest.raises(SpecError) as raised:
        load_task_data(TaskSpec(name="gsm8k", path=str(path)), EvalSpec(prompts=3))
    assert raised.value.errors == [("eval.prompts", "3 held-out prompts are every record of task.path (3 records); "
                                                    "ask for fewer or give eval.path")]


def test_host_slices_are_disjoint_and_cover_the_held_out_list():
    examples = list(range(10))
    slices = [host_slice(examples, host, 3) for host in range(3)]
    assert [start for start, _ in slices] == [0, 4, 7]
    assert [x for _, shard in slices for x in shard] == examples


# --- data errors read like spec errors ---------------------------------------------------------

@pytest.mark.parametrize(("content", "field", "needle"), [
    (None, "task.path", "file not found"),
    ('{"question": "a?", "answer": "#### 1"}\n{"question": "b?"}\n', "task.path", "line 2: field 'answer': missing"),
    ('{"question": "a?", "answer": "no number"}\n', "task.path", "line 1: field 'answer'"),
])
def test_task_data_errors_name_the_spec_field(tmp_path, content, field, needle):
    path = tmp_path / "data.jsonl"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(SpecError) as raised:
        load_task_data(TaskSpec(name="gsm8k", path=str(path)), None, "spec.yaml")
    assert raised.value.errors[0][0] == field
    assert needle in str(raised.value) and str(path) in str(raised.value)


def test_eval_file_errors_name_eval_path(tmp_path):
    train = write_gsm8k(tmp_path / "train.jsonl", ["a?", "b?"])
    with pytest.raises(SpecError) as raised:
        load_task_data(TaskSpec(name="gsm8k", path=str(train)), EvalSpec(path=str(tmp_path / "missing.jsonl")))
    assert raised.value.errors[0][0] == "eval.path"


def test_cli_prints_one_line_and_exits_2_for_a_bad_data_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a?", "answer": "#### 1"}\n{"question": "b?"}\n', encoding="utf-8")
    for path, needle in ((bad, "line 2: field 'answer': missing"), (tmp_path / "none.jsonl", "file not found")):
        spec = write_spec(tmp_path, {"name": "bad-data", "task": {"name": "gsm8k", "path": str(path)}})
        for command in (["train", str(spec)], ["eval", str(spec), "--checkpoint", str(tmp_path)]):
            done = locojax(*command)
            assert done.returncode == 2, done.stderr
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
            assert f"task.path: {path}" in lines[0] and needle in lines[0]


@pytest.mark.parametrize(("spec", "needle"), [
    ({"placement": {"mode": "sc", "hosts": 2}}, "eval applies to GRPO runs in CO mode only"),
    ({"placement": {"mode": "da", "hosts": 2}}, "eval applies to GRPO runs in CO mode only"),
    ({"kind": "sft"}, "eval applies to GRPO runs in CO mode only"),
    ({"placement": {"mode": "co", "hosts": 3}, "rollout": {"prompts_per_step": 3}}, "eval.prompts (64) must be"),
    ({"task": {"name": "arith"}, "eval": {"path": "x.jsonl"}}, "eval.path applies to file tasks"),
])
def test_eval_block_is_rejected_where_it_does_not_apply(spec, needle):
    from locojax.spec import parse_spec

    with pytest.raises(SpecError, match=re.escape(needle)):
        parse_spec({"name": "x", "eval": {}, **spec})


# --- the evaluator -------------------------------------------------------------------------------

def _evaluator(tmp_path, k: int, prompts: int = 16, devices=None):
    from locojax.evaluate import Evaluator
    from locojax.modes.common import load_policy

    spec = RunSpec.model_validate(eval_spec(tmp_path, "evaluator", {"prompts": prompts, "k": k,
                                                                      "reward": [EVEN_LENGTH]}))
    data = load_task_data(spec.task, spec.eval)
    policy = load_policy(spec)
    evaluator = Evaluator(spec, spec.eval, policy, data.held_out, spec.eval.reward, 0,
                          devices or jax.local_devices()[:1])
    return evaluator, policy


def test_greedy_evaluation_is_deterministic_and_pass_at_k_is_at_least_accuracy(tmp_path):
    evaluator, policy = _evaluator(tmp_path, k=4)
    first, second = evaluator(policy.params), evaluator(policy.params)
    assert first == second
    assert 0 < first.correct < first.prompts == 16  # a random model: even_length is a coin flip
    assert first.correct <= first.pass_correct <= first.prompts
    assert first.pass_correct > first.correct  # the 3 samples find answers greedy missed
    single, _ = _evaluator(tmp_path, k=1)
    assert single(policy.params) == type(first)(16, first.correct, first.correct)  # pass@1 is the accuracy
    metrics = first.metrics()
    assert metrics[m.EVAL_ACCURACY] == first.correct / 16 and metrics[m.EVAL_PASS_AT_K] == first.pass_correct / 16


def test_locojax_eval_on_a_hf_directory_reports_what_the_evaluator_computes(tmp_path):
    from locojax.model import create_model, get_preset
    from locojax.model.hf import save_hf_checkpoint

    save_hf_checkpoint(create_model(get_preset("tiny"), seed=11), tmp_path / "model")
    spec = eval_spec(tmp_path, "hf-eval", {"prompts": 16, "k": 4, "reward": [EVEN_LENGTH]})
    done = locojax("eval", str(write_spec(tmp_path, spec)), "--checkpoint", str(tmp_path / "model"))
    assert done.returncode == 0, done.stderr[-3000:]
    evaluator, policy = _evaluator(tmp_path, k=4)
    from locojax.modes.common import load_policy

    hf_policy = load_policy(RunSpec.model_validate({**spec, "model": {"preset": "tiny",
                                                                       "checkpoint": str(tmp_path / "model")}}))
    counts = evaluator(hf_policy.params)
    assert counts != evaluator(policy.params)  # another model (seed 11, not 3): the CLI really loaded it
    assert f"eval/accuracy {counts.correct / 16:.4f}  eval/pass@4 {counts.pass_correct / 16:.4f}" in done.stdout


def test_two_shards_sum_to_the_whole(tmp_path):
    """Hosts' counts aggregate by sums: shards of 16 prompts on 4 devices add up to one evaluator's."""
    from locojax.evaluate import Evaluator

    whole, policy = _evaluator(tmp_path, k=3)
    records = []
    for host in range(2):
        first, shard = host_slice(whole.examples, host, 2)
        part = Evaluator(whole_spec(tmp_path), whole_spec(tmp_path).eval, policy, shard, (EVEN_LENGTH,), first,
                         jax.local_devices())
        records.append(part(policy.params).metrics())
    combined = m.aggregate_hosts(records)
    expected = whole(policy.params).metrics()
    for key in (m.EVAL_PROMPTS, m.EVAL_CORRECT, m.EVAL_PASS_CORRECT, m.EVAL_ACCURACY, m.EVAL_PASS_AT_K):
        assert combined[key] == expected[key], key


def whole_spec(tmp_path) -> RunSpec:
    return RunSpec.model_validate(eval_spec(tmp_path, "evaluator", {"prompts": 16, "k": 3, "reward": [EVEN_LENGTH]}))


def test_correctness_is_the_task_s_own_reward_at_full_credit(tmp_path):
    """On a GSM8K-format file and on countdown, a completion is right exactly when the task's reward
    gives it full credit (the spec's training rewards play no part)."""
    from locojax.evaluate import Evaluator, eval_rewards
    from locojax.modes.common import load_policy

    path = write_gsm8k(tmp_path / "train.jsonl", [f"What is {n} plus one?" for n in range(12)])
    cases = [({"name": "gsm8k", "path": str(path)}, lambda e: [f"so\n#### {e.answer}", f"#### {int(e.answer) + 1}",
                                                                  e.answer]),
             ({"name": "countdown", "difficulty": 1}, lambda e: [e.reference, "<answer>1+1</answer>", ""])]
    for task, completions in cases:
        spec = RunSpec.model_validate({**tiny_spec(tmp_path, "right"), "task": {**task, "reward": [EVEN_LENGTH]},
                                       "eval": {"prompts": 4}})
        data = load_task_data(spec.task, spec.eval)
        evaluator = Evaluator(spec, spec.eval, load_policy(spec), data.held_out, eval_rewards(spec.eval, data.train),
                              0, jax.local_devices()[:1])
        assert evaluator.reward_names == (task["name"],)
        example = data.held_out[0]
        right = evaluator._right(completions(example), [example] * 3)
        assert right.tolist() == [True, False, False], task["name"]


def test_evaluations_are_due_every_n_steps_from_step_0():
    from locojax.evaluate import evaluation_due

    assert [s for s in range(7) if evaluation_due(EvalSpec(every=3), s)] == [0, 3, 6]
    assert [s for s in range(7) if evaluation_due(EvalSpec(every=0), s)] == [0]  # and after the last step


def test_demo_summary_reads_before_and_after_from_the_eval_records():
    from locojax.demo import eval_series, eval_summary

    records = [{"step": 0, "host": "all", m.REWARD_MEAN: 0.1, m.EVAL_ACCURACY: 0.25, m.EVAL_PASS_AT_K: 0.5},
               {"step": 0, "host": 0, m.EVAL_ACCURACY: 0.0, m.EVAL_PASS_AT_K: 0.0},
               {"step": 1, "host": "all", m.REWARD_MEAN: 0.2},
               {"step": 2, "host": "all", m.EVAL_ACCURACY: 0.5, m.EVAL_PASS_AT_K: 0.75}]
    assert eval_series(records) == ([0, 2], [0.25, 0.5], [0.5, 0.75])
    line = eval_summary(*eval_series(records), k=4)
    assert "before GRPO (step 0): accuracy 0.250, pass@4 0.500" in line
    assert "after (step 2): accuracy 0.500 (+0.250), pass@4 0.750" in line


def test_ratio_metrics_aggregate_as_sums_not_means():
    records = [{m.EVAL_CORRECT: 1.0, m.EVAL_PROMPTS: 1.0, m.EVAL_ACCURACY: 1.0},
               {m.EVAL_CORRECT: 1.0, m.EVAL_PROMPTS: 3.0, m.EVAL_ACCURACY: 1 / 3}]
    combined = m.aggregate_hosts(records)
    assert combined[m.EVAL_ACCURACY] == 0.5  # 2 of 4, not the mean of means (2/3)
    assert combined[m.EVAL_PROMPTS] == 4.0


# --- during a CO run -----------------------------------------------------------------------------

def _eval_rows(run_dir: Path, host="all") -> dict[int, dict]:
    return {r["step"]: r for r in m.read_jsonl(run_dir / "metrics.jsonl")
            if r["host"] == host and m.EVAL_ACCURACY in r}


EVAL_BLOCK = {"every": 2, "prompts": 8, "k": 3, "reward": [EVEN_LENGTH]}


@pytest.mark.slow
def test_co_run_records_eval_at_its_steps_and_after_the_last(tmp_path):
    from locojax.modes.co import run_co

    spec = RunSpec.model_validate(eval_spec(tmp_path, "co-eval", EVAL_BLOCK, steps=3))
    result = run_co(spec, console=False)
    rows = _eval_rows(tmp_path / "co-eval")
    assert sorted(rows) == [0, 2, 3]  # steps 0 and 2 start with one; one more after the last step
    assert all(row[m.EVAL_PROMPTS] == 8 and row[m.EVAL_CORRECT] <= row[m.EVAL_PASS_CORRECT] for row in rows.values())
    assert m.REWARD_MEAN in rows[0] and m.REWARD_MEAN not in rows[3]  # step 3 is the final evaluation's own record
    assert result.final_metrics[m.EVAL_ACCURACY] == rows[3][m.EVAL_ACCURACY]
    # The saved model evaluates to the run's final numbers.
    done = locojax("eval", str(write_spec(tmp_path, spec.model_dump(mode="json"))), "--checkpoint",
                   str(tmp_path / "co-eval" / "checkpoints"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"eval/accuracy {rows[3][m.EVAL_ACCURACY]:.4f}  eval/pass@3 {rows[3][m.EVAL_PASS_AT_K]:.4f}" in done.stdout


@pytest.mark.multiprocess
def test_two_hosts_report_the_same_eval_aggregate_as_one_host(tmp_path):
    two = write_spec(tmp_path, eval_spec(tmp_path, "eval-two-hosts", EVAL_BLOCK))
    one = write_spec(tmp_path, eval_spec(tmp_path, "eval-one-host", EVAL_BLOCK))
    done = locojax("launch", str(two), "--hosts", "2", "--devices-per-host", "1", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    done = locojax("launch", str(one), "--hosts", "1", "--devices-per-host", "2", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    two_rows, one_rows = _eval_rows(tmp_path / "eval-two-hosts"), _eval_rows(tmp_path / "eval-one-host")
    assert sorted(two_rows) == sorted(one_rows) == [0, 2, 3]
    keys = (m.EVAL_PROMPTS, m.EVAL_CORRECT, m.EVAL_PASS_CORRECT, m.EVAL_ACCURACY, m.EVAL_PASS_AT_K)
    for step in two_rows:
        assert {k: two_rows[step][k] for k in keys} == {k: one_rows[step][k] for k in keys}, step
        per_host = [_eval_rows(tmp_path / "eval-two-hosts", host)[step] for host in (0, 1)]
        assert [row[m.EVAL_PROMPTS] for row in per_host] == [4, 4]  # each host evaluated its own shard
        assert sum(row[m.EVAL_CORRECT] for row in per_host) == two_rows[step][m.EVAL_CORRECT]
    assert 0 < sum(row[m.EVAL_CORRECT] for row in two_rows.values()) < 8 * 3  # not all-wrong or all-right

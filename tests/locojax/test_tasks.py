"""Tasks: generated examples, local file loading (and its errors), deterministic host sharding."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from locojax.rewards import REWARDS
from locojax.spec import TaskSpec
from locojax.tasks import (
    TASKS,
    ArithTask,
    CountdownTask,
    DataFormatError,
    GSM8KTask,
    MathTask,
    batch_indices,
    global_batch,
    host_shard,
    make_task,
    repeat_examples,
    reward_names,
)


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


GSM8K_RECORDS = [
    {"question": f"Tom has {i} apples and buys {i + 1} more. How many?",
     "answer": f"He has {i}+{i + 1} = <<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1} apples.\n#### {2 * i + 1:,}"}
    for i in range(600, 612)
]


@pytest.fixture
def gsm8k_file(tmp_path):
    return write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_RECORDS)


# ---------------------------------------------------------------------------------------------
# Generated tasks


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_arith_reference_is_correct_and_in_gsm8k_form(difficulty):
    task = ArithTask(difficulty)
    strict = REWARDS.get("gsm8k")
    for i in range(200):
        example = task.example(i)
        assert example.reference.endswith(f"\n#### {example.answer}")
        assert strict(example.reference, example) == 1.0
        assert strict("#### 999999999", example) == 0.0
        # Every working line is true arithmetic.
        for line in example.reference.split("\n")[:-1]:
            left, right = line.split("=")
            a, op, b = re.fullmatch(r"(\d+)([-+*/])(\d+)", left).groups()
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b),
                    "/": int(a) // int(b)}[op] == int(right) >= 0
            assert op != "/" or int(a) % int(b) == 0


def test_arith_difficulty_1_is_short_for_the_demo_model():
    task = ArithTask(1)
    for i in range(500):
        example = task.example(i)
        assert len(example.prompt.encode()) <= 64 and len(example.reference.encode()) <= 16
        assert all(len(n) <= 2 for n in re.findall(r"\d+", example.prompt + example.reference))
        assert example.reference.count("\n") == 1  # one working line, one answer line
    assert {task.example(i).reference[2:3] for i in range(200)} & {"+", "-"}  # both operations appear


def test_arith_difficulty_0_is_a_bare_equation_with_a_gsm8k_answer():
    """The demo level: `45+14=` -> `#### 59`, so prompts and completions are a few tokens each."""
    task = ArithTask(0)
    strict = REWARDS.get("gsm8k")
    for i in range(500):
        example = task.example(i)
        a, op, b = re.fullmatch(r"(\d{1,2})([-+])(\d{1,2})=", example.prompt).groups()
        answer = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert 0 <= answer <= 99 and example.reference == f"#### {answer}" and example.answer == str(answer)
        assert strict(example.reference, example) == 1.0 and strict(f"#### {answer + 1}", example) == 0.0
        assert len(example.prompt.encode()) <= 6 and example.meta["difficulty"] == 0
    assert {task.example(i).prompt.strip("0123456789=") for i in range(200)} == {"+", "-"}


def test_difficulty_0_is_arith_only():
    from locojax.spec import SpecError, parse_spec

    assert parse_spec({"task": {"name": "arith", "difficulty": 0}}).task.difficulty == 0
    with pytest.raises(SpecError, match="difficulty 0 exists for arith only"):
        parse_spec({"task": {"name": "countdown", "difficulty": 0}})


def test_difficulty_grows():
    for task_class in (ArithTask, CountdownTask):
        mean_lengths = [sum(len(task_class(d).example(i).reference) for i in range(100)) for d in (1, 3, 5)]
        assert mean_lengths == sorted(mean_lengths) and mean_lengths[0] < mean_lengths[-1]


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_countdown_reference_solves_the_puzzle(difficulty):
    task = CountdownTask(difficulty)
    reward = REWARDS.get("countdown")
    for i in range(200):
        example = task.example(i)
        assert reward(example.reference, example) == 1.0
        assert 1 <= example.meta["target"] <= 999 and example.answer == str(example.meta["target"])
        assert " ".join(map(str, example.meta["numbers"])) in example.prompt
        assert REWARDS.get("format")(example.reference, example) == 1.0


def test_generated_examples_are_pure_functions_of_the_index():
    for task in (ArithTask(2), CountdownTask(2)):
        assert task.example(42) == type(task)(2).example(42)
        assert len({task.example(i).prompt for i in range(50)}) > 40


def test_bad_difficulty_and_index():
    with pytest.raises(ValueError, match="difficulty"):
        ArithTask(9)
    with pytest.raises(IndexError):
        ArithTask(1, size=10).example(10)


# ---------------------------------------------------------------------------------------------
# Batching and sharding


@pytest.mark.parametrize("num_hosts", [1, 2, 4])
def test_host_shards_are_disjoint_and_complete(gsm8k_file, num_hosts):
    task = GSM8KTask(gsm8k_file)  # 12 distinct examples: uids identify them
    for step in range(5):
        whole = global_batch(task, seed=3, step=step, prompts_per_step=8)
        shards = [host_shard(task, 3, step, 8, host, num_hosts) for host in range(num_hosts)]
        assert [e.uid for shard in shards for e in shard] == [e.uid for e in whole]  # union, in order
        assert len({e.uid for e in whole}) == 8  # disjoint (no example twice within a batch)
        assert all(len(shard) == 8 // num_hosts for shard in shards)


@pytest.mark.parametrize("num_hosts", [1, 2, 4])
def test_generated_task_shards_cover_the_global_batch(num_hosts):
    task = ArithTask(1)
    whole = global_batch(task, 0, 7, 32)
    union = [e for host in range(num_hosts) for e in host_shard(task, 0, 7, 32, host, num_hosts)]
    assert union == whole and len({e.uid for e in whole}) == 32


def test_batches_are_deterministic_and_vary_with_seed_and_step(gsm8k_file):
    task = GSM8KTask(gsm8k_file)
    assert global_batch(task, 0, 1, 4) == global_batch(GSM8KTask(gsm8k_file), 0, 1, 4)
    assert global_batch(task, 0, 1, 4) != global_batch(task, 0, 2, 4)
    assert batch_indices(10**6, 0, 5, 16).tolist() != batch_indices(10**6, 1, 5, 16).tolist()


def test_each_epoch_visits_every_example_once():
    size, per_step = 10, 5
    first_epoch = [int(i) for step in range(2) for i in batch_indices(size, 0, step, per_step)]
    second_epoch = [int(i) for step in range(2, 4) for i in batch_indices(size, 0, step, per_step)]
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(size))
    assert first_epoch != second_epoch  # reshuffled per epoch
    # An epoch that does not divide into batches drops its remainder rather than mix epochs.
    batches = [batch_indices(12, 0, step, 8).tolist() for step in range(4)]
    assert all(len(set(batch)) == 8 for batch in batches)
    # A batch larger than the task wraps into the next epoch.
    assert sorted(batch_indices(3, 0, 0, 6).tolist()) == [0, 0, 1, 1, 2, 2]


def test_host_shard_rejects_uneven_splits():
    with pytest.raises(ValueError, match="divisible"):
        host_shard(ArithTask(1), 0, 0, 6, 0, 4)
    with pytest.raises(ValueError, match="host must be"):
        host_shard(ArithTask(1), 0, 0, 8, 4, 4)


def test_repeat_examples():
    a, b = ArithTask(1).example(0), ArithTask(1).example(1)
    assert repeat_examples([a, b], 3) == [a, a, a, b, b, b]


# ---------------------------------------------------------------------------------------------
# File tasks


def test_gsm8k_file(gsm8k_file):
    task = GSM8KTask(gsm8k_file)
    assert len(task) == 12
    example = task.example(0)
    assert example.answer == "1201"  # "#### 1,201" with the comma dropped
    assert "<<" not in example.reference and example.reference.endswith("#### 1,201")
    assert example.prompt.startswith("Question: Tom has 600 apples") and "####" in example.prompt
    assert REWARDS.get("gsm8k")(example.reference, example) == 1.0


def test_gsm8k_parquet(tmp_path):
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.table({"question": [r["question"] for r in GSM8K_RECORDS],
                             "answer": [r["answer"] for r in GSM8K_RECORDS]}), path)
    assert GSM8KTask(str(path)).example(3) == GSM8KTask(
        write_jsonl(tmp_path / "same.jsonl", GSM8K_RECORDS)).example(3)


MATH_RECORDS = [
    {"problem": "What is 1/2 + 1/4?", "solution": r"We get $\frac{3}{4}$, so $\boxed{\frac{3}{4}}$."},
    {"problem": "Solve x+1=3.", "solution": r"x = \boxed{2}"},
    {"problem": "Name a day.", "solution": r"\boxed{\text{Monday}}"},
]


def test_math_jsonl_and_parquet(tmp_path):
    jsonl = MathTask(write_jsonl(tmp_path / "math.jsonl", MATH_RECORDS))
    path = tmp_path / "math.parquet"
    pq.write_table(pa.table({"problem": [r["problem"] for r in MATH_RECORDS],
                             "solution": [r["solution"] for r in MATH_RECORDS],
                             "source": ["x"] * 3}), path)  # extra columns are ignored
    parquet = MathTask(str(path))
    assert [e.answer for e in jsonl._examples] == [r"\frac{3}{4}", "2", r"\text{Monday}"]
    assert [parquet.example(i) for i in range(3)] == [jsonl.example(i) for i in range(3)]
    for i in range(3):
        assert REWARDS.get("math")(jsonl.example(i).reference, jsonl.example(i)) == 1.0


def test_math_skips_records_without_a_boxed_answer(tmp_path):
    records = MATH_RECORDS + [{"problem": "Prove it.", "solution": "Trivial."}]
    task = MathTask(write_jsonl(tmp_path / "math.jsonl", records))
    assert len(task) == 3 and task.skipped == 1


MALFORMED = [
    # (file lines, message parts)
    ([GSM8K_RECORDS[0], "{not json"], ["line 2", "not valid JSON"]),
    ([GSM8K_RECORDS[0], GSM8K_RECORDS[1], {"question": "q?"}], ["line 3", "'answer'", "missing"]),
    ([{"question": 7, "answer": "#### 1"}], ["line 1", "'question'", "must be a string"]),
    ([{"question": "  ", "answer": "#### 1"}], ["line 1", "'question'", "empty"]),
    ([{"question": "q", "answer": "it is 4"}], ["line 1", "'answer'", "#### <number>"]),
    ([{"question": "q", "answer": "#### four"}], ["line 1", "'answer'", "#### <number>"]),
    (["[1, 2]"], ["line 1", "JSON object"]),
]


@pytest.mark.parametrize("lines,parts", MALFORMED)
def test_malformed_gsm8k_file_names_file_line_and_field(tmp_path, lines, parts):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataFormatError) as error:
        GSM8KTask(path)
    for part in [path, *parts]:
        assert part in str(error.value)


def test_malformed_math_files(tmp_path):
    path = write_jsonl(tmp_path / "nobox.jsonl", [{"problem": "p", "solution": "no box"}] * 2)
    with pytest.raises(DataFormatError, match=r"line 1: field 'solution': no \\boxed"):
        MathTask(path)
    path = write_jsonl(tmp_path / "blank.jsonl", ["", MATH_RECORDS[0], "", {"problem": "p"}])
    with pytest.raises(DataFormatError, match="line 4: field 'solution': missing"):
        MathTask(path)

    table = tmp_path / "nocolumn.parquet"
    pq.write_table(pa.table({"problem": ["p"], "answer": ["a"]}), table)
    with pytest.raises(DataFormatError, match="field 'solution': missing column"):
        MathTask(str(table))
    table = tmp_path / "null.parquet"
    pq.write_table(pa.table({"problem": ["p", None], "solution": [r"\boxed{1}", r"\boxed{2}"]}), table)
    with pytest.raises(DataFormatError, match=r"null.parquet, row 2: field 'problem': missing"):
        MathTask(str(table))
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not parquet at all")
    with pytest.raises(DataFormatError, match="not a readable parquet"):
        MathTask(str(corrupt))
    with pytest.raises(DataFormatError, match="file not found"):
        MathTask(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataFormatError, match="no records"):
        MathTask(write_jsonl(tmp_path / "empty.jsonl", [""]))


# ---------------------------------------------------------------------------------------------
# Registry


def test_make_task_by_name(gsm8k_file):
    assert TASKS.names() == ["arith", "countdown", "gsm8k", "math"]
    task = make_task(TaskSpec(name="arith", difficulty=3))
    assert isinstance(task, ArithTask) and task.difficulty == 3
    assert reward_names(TaskSpec(name="arith"), task) == ("gsm8k",)
    assert reward_names(TaskSpec(name="arith", reward=["gsm8k", "format"]), task) == ("gsm8k", "format")
    assert len(make_task(TaskSpec(name="gsm8k", path=gsm8k_file))) == 12
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        make_task(TaskSpec(name="nope"))


def test_default_rewards_are_registered():
    for task in (ArithTask(1), CountdownTask(1)):
        assert all(name in REWARDS for name in task.default_rewards)
    assert all(name in REWARDS for cls in (GSM8KTask, MathTask) for name in cls.default_rewards)

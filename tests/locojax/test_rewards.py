"""Reward functions: a table of real-world answer formats per reward, and the scorer's contract."""

import concurrent.futures
import logging
import math

import numpy as np
import pytest

from locojax.rewards import REWARDS, allow_reward_modules, check_reward_names, resolve_reward, score
from locojax.rewards.countdown import EquationError, evaluate
from locojax.rewards.math import normalise
from locojax.tasks import ANSWER_TAG_FORMAT, BOXED_FORMAT, GSM8K_FORMAT, Example


def gsm8k_example(answer: str) -> Example:
    return Example(uid="g", prompt="", reference="", answer=answer, meta={"answer_format": GSM8K_FORMAT})


def math_example(answer: str) -> Example:
    return Example(uid="m", prompt="", reference="", answer=answer, meta={"answer_format": BOXED_FORMAT})


def countdown_example(numbers, target) -> Example:
    return Example(uid="c", prompt="", reference="", answer=str(target),
                   meta={"answer_format": ANSWER_TAG_FORMAT, "numbers": tuple(numbers), "target": target})


# (completion, ground truth, strict score, flexible score)
GSM8K_CASES = [
    ("12+5=17\n#### 17", "17", 1, 1),
    ("#### 17", "17", 1, 1),
    ("####17", "17", 1, 1),
    ("The answer is\n#### 1,234", "1234", 1, 1),
    ("#### $1,234.00", "1234", 1, 1),
    ("#### 1234.", "1234", 1, 1),  # trailing period
    ("#### 17.0", "17", 1, 1),
    ("#### 17.50", "17.5", 1, 1),
    ("#### -5", "-5", 1, 1),
    ("#### \u22125", "-5", 1, 1),  # Unicode minus
    ("#### -$5", "-5", 1, 1),
    ("#### $-5", "-5", 1, 1),
    ("#### 5", "-5", 0, 0),  # sign matters
    ("#### .5", "0.5", 1, 1),
    ("#### 18 apples", "18", 1, 1),
    ("She pays $18 in total.", "18", 0, 1),  # no #### line: flexible only
    ("18", "18", 0, 1),
    ("3+4=7 so 7*2=14, answer 14.", "14", 0, 1),
    ("59-45=14", "14", 0, 1),  # a binary minus is not a sign
    ("#### 14\n#### 15", "14", 1, 0),  # strict: the first ####; flexible: the last number
    ("#### 12\nwait, 13", "13", 0, 1),
    ("#### 1 234", "1234", 0, 0),  # a space is not a thousands separator
    ("####", "7", 0, 0),
    ("", "7", 0, 0),
    ("#### seven", "7", 0, 0),
    ("#### 100,000", "100000", 1, 1),
    ("#### 0", "0", 1, 1),
    ("The total is 1,000,000.", "1000000", 0, 1),
    ("#### 3/4", "0.75", 0, 0),  # a fraction is not GSM8K's answer format
    ("# 17", "17", 0, 1),
]


@pytest.mark.parametrize("completion,answer,strict,flexible", GSM8K_CASES)
def test_gsm8k(completion, answer, strict, flexible):
    example = gsm8k_example(answer)
    assert REWARDS.get("gsm8k")(completion, example) == strict
    assert REWARDS.get("gsm8k_flexible")(completion, example) == flexible


def test_gsm8k_table_is_big_enough():
    assert len(GSM8K_CASES) >= 25


# (completion, ground truth, score)
MATH_CASES = [
    (r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}", 1),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1),
    (r"\boxed{1/2}", r"\frac{1}{2}", 1),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1),
    (r"\boxed{\frac12}", r"\frac{1}{2}", 1),
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 1),
    (r"\boxed{0.6}", r"\frac{1}{2}", 0),
    (r"$\boxed{5}$.", "5", 1),
    (r"\boxed{5.}", "5", 1),
    (r"\boxed{5.0}", "5", 1),
    (r"\boxed{x=5}", "5", 1),
    (r"\boxed{6}", "5", 0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1),
    (r"\boxed{\pi/2}", r"\frac{\pi}{2}", 1),
    (r"\boxed{90^\circ}", "90", 1),
    (r"\boxed{90^{\circ}}", "90", 1),
    (r"\boxed{5\text{ cm}}", "5", 1),
    (r"\boxed{\text{(B)}}", r"\text{(B)}", 1),
    (r"\boxed{1,234}", "1234", 1),
    (r"\boxed{\left(1,2\right)}", "(1,2)", 1),
    (r"\boxed{(2,1)}", "(1,2)", 0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1),
    (r"\boxed{[1,2)}", "[1,2]", 0),
    (r"first \boxed{3} then \boxed{4}", "4", 1),  # the last box counts
    (r"first \boxed{4} then \boxed{3}", "4", 0),
    (r"\boxed 7", "7", 1),
    (r"\fbox{7}", "7", 1),
    ("7", "7", 0),  # no box, no answer
    (r"\boxed{\frac{1}{2}", r"\frac{1}{2}", 0),  # cut off inside the box
    (r"\boxed{}", "0", 0),
    (r"\boxed{Monday}", "Monday", 1),  # not maths: the normalised-string fallback
    (r"\boxed{\text{Monday}}", "Monday", 1),
    (r"\boxed{Tuesday}", "Monday", 0),
    (r"\boxed{-\frac{3}{4}}", "-0.75", 1),
    (r"\boxed{.5}", "0.5", 1),
]


@pytest.mark.parametrize("completion,answer,expected", MATH_CASES)
def test_math(completion, answer, expected):
    assert REWARDS.get("math")(completion, math_example(answer)) == expected


def test_math_table_is_big_enough():
    assert len(MATH_CASES) >= 25


def test_math_normalise():
    assert normalise(r" \left( \dfrac{1}{2} \right). ") == r"(\frac{1}{2})"
    assert normalise("3.00") == "3"


# (completion, numbers, target, score)
COUNTDOWN_CASES = [
    ("<answer>3*7+12</answer>", (3, 7, 12), 33, 1),
    ("<answer> 3 * 7 + 12 </answer>", (3, 7, 12), 33, 1),
    ("<answer>12+3*7</answer>", (3, 7, 12), 33, 1),  # precedence
    ("<answer>(12+3)*7</answer>", (3, 7, 12), 105, 1),
    ("<answer>12+3*7</answer>", (3, 7, 12), 105, 0),
    ("<answer>7+12</answer>", (3, 7, 12), 19, 1),  # not every number has to be used
    ("<answer>7+7+12</answer>", (3, 7, 12), 26, 0),  # 7 used twice
    ("<answer>7+7+12</answer>", (7, 7, 12), 26, 1),  # ... unless it was given twice
    ("<answer>8+12</answer>", (3, 7, 12), 20, 0),  # 8 was not given
    ("<answer>(8/3)*3</answer>", (8, 3, 3), 8, 1),  # exact fractions
    ("<answer>7/2+12</answer>", (2, 7, 12), 15, 0),  # 15.5
    ("<answer>7/(3-3)</answer>", (7, 3, 3), 1, 0),  # division by zero
    ("<answer>3*7+12=33</answer>", (3, 7, 12), 33, 1),  # a stated result is fine ...
    ("<answer>3*7+12=34</answer>", (3, 7, 12), 33, 0),  # ... if it is the target
    ("<answer>33</answer>", (3, 7, 12), 33, 0),
    ("<answer>__import__('os')</answer>", (3, 7, 12), 33, 0),  # never evaluated
    ("<answer>3**7</answer>", (3, 7, 12), 2187, 0),
    ("<answer>3 7 12</answer>", (3, 7, 12), 33, 0),
    ("<answer>(3*7+12</answer>", (3, 7, 12), 33, 0),
    ("<answer>3*7+12)</answer>", (3, 7, 12), 33, 0),
    ("3*7+12", (3, 7, 12), 33, 0),  # no tag
    ("<answer>3*7+12", (3, 7, 12), 33, 0),
    ("<answer>1+1</answer> ... <answer>3*7+12</answer>", (3, 7, 12), 33, 1),  # the last tag counts
    ("<answer>3\u00d77+12</answer>", (3, 7, 12), 33, 1),  # x sign
    ("<answer>12-(3-7)</answer>", (3, 7, 12), 16, 1),
    ("<answer>-3+7+12</answer>", (3, 7, 12), 16, 1),  # unary minus
    ("<answer>3.0*7+12</answer>", (3, 7, 12), 33, 0),
    ("<answer></answer>", (3, 7, 12), 33, 0),
    ("<answer>" + "(" * 150 + "3" + ")" * 150 + "</answer>", (3,), 3, 0),  # too long: rejected, not recursed
]


@pytest.mark.parametrize("completion,numbers,target,expected", COUNTDOWN_CASES)
def test_countdown(completion, numbers, target, expected):
    assert REWARDS.get("countdown")(completion, countdown_example(numbers, target)) == expected


def test_countdown_table_is_big_enough():
    assert len(COUNTDOWN_CASES) >= 25


def test_countdown_evaluate():
    value, used = evaluate("(1+2)*3-4/2")
    assert value == 7 and used == [1, 2, 3, 4, 2]
    with pytest.raises(EquationError):
        evaluate("2^3")


GSM, BOX, TAG = gsm8k_example("1"), math_example("1"), countdown_example((1,), 1)
# (completion, example, score)
FORMAT_CASES = [
    ("#### 17", GSM, 1),
    ("work\n#### 1,234", GSM, 1),
    ("#### -5", GSM, 1),
    ("#### $5", GSM, 1),
    ("####5", GSM, 1),
    ("#### .5", GSM, 1),
    ("#### ", GSM, 0),
    ("### 17", GSM, 0),
    ("17", GSM, 0),
    ("#### five", GSM, 0),
    (r"\boxed{5}", BOX, 1),
    (r"$\boxed{\frac{1}{2}}$", BOX, 1),
    (r"\boxed 5", BOX, 1),
    (r"\fbox{5}", BOX, 1),
    (r"\boxed{", BOX, 0),
    (r"\boxed{}", BOX, 0),
    ("5", BOX, 0),
    ("#### 5", BOX, 0),  # the wrong task's format
    ("<answer>1+2</answer>", TAG, 1),
    ("<answer>\n1+2\n</answer>", TAG, 1),
    ("think <answer>x</answer>", TAG, 1),  # format only: content is the other reward's job
    ("<answer></answer>", TAG, 0),
    ("<answer>1+2", TAG, 0),
    ("1+2</answer>", TAG, 0),
    ("<ANSWER>1+2</ANSWER>", TAG, 0),
    (r"\boxed{3}", TAG, 0),
]


@pytest.mark.parametrize("completion,example,expected", FORMAT_CASES)
def test_format(completion, example, expected):
    assert REWARDS.get("format")(completion, example) == expected


def test_format_table_is_big_enough():
    assert len(FORMAT_CASES) >= 25


# ---------------------------------------------------------------------------------------------
# score()


def _completions_and_examples(n: int):
    examples = [gsm8k_example(str(i)) for i in range(n)]
    completions = [f"#### {i if i % 3 else i + 1}" for i in range(n)]  # every third one wrong
    return completions, examples


def test_score_sums_rewards_per_sample():
    completions, examples = _completions_and_examples(70)  # spans three chunks
    total, per_fn = score(["gsm8k", "format"], completions, examples)
    expected_correct = np.array([0.0 if i % 3 == 0 else 1.0 for i in range(70)], np.float32)
    assert total.dtype == np.float32 and total.shape == (70,)
    np.testing.assert_array_equal(per_fn["gsm8k"], expected_correct)
    np.testing.assert_array_equal(per_fn["format"], np.ones(70, np.float32))
    np.testing.assert_array_equal(total, expected_correct + 1)


def test_score_with_a_thread_pool_matches_inline():
    completions, examples = _completions_and_examples(100)
    inline_total, inline = score(["gsm8k", "gsm8k_flexible"], completions, examples)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        pooled_total, pooled = score(["gsm8k", "gsm8k_flexible"], completions, examples, pool)
        empty_total, empty = score(["gsm8k"], [], [], pool)  # no samples: nothing to hand over, nothing scored
    assert empty_total.shape == (0,) and empty["gsm8k"].shape == (0,)
    np.testing.assert_array_equal(inline_total, pooled_total)
    for name in inline:
        np.testing.assert_array_equal(inline[name], pooled[name])


def test_math_reward_runs_off_the_main_thread():
    # math-verify's SIGALRM timeout is only allowed on the main thread; the reward must turn it off.
    examples = [math_example(r"\frac{1}{2}")] * 4
    completions = [r"\boxed{0.5}", r"\boxed{1/2}", r"\boxed{2}", r"\boxed{\frac{2}{4}}"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        total, _ = score(["math"], completions, examples, pool)
    np.testing.assert_array_equal(total, [1, 1, 0, 1])


def test_a_raising_reward_scores_zero_and_is_logged_once(monkeypatch, caplog):
    def flaky(completion, example):
        if completion == "boom":
            raise RuntimeError("reward bug")
        return math.nan if completion == "nan" else 1.0

    monkeypatch.setitem(REWARDS._items, "test_flaky", flaky)
    examples = [gsm8k_example("1")] * 4
    with caplog.at_level(logging.ERROR, logger="locojax.rewards"):
        total, per_fn = score(["test_flaky"], ["ok", "boom", "nan", "ok"], examples)
        score(["test_flaky"], ["boom"], examples[:1])
    np.testing.assert_array_equal(per_fn["test_flaky"], [1, 0, 0, 1])
    messages = [r.getMessage() for r in caplog.records if "test_flaky" in r.getMessage()]
    assert len(messages) == 1 and "2 of 4" in messages[0] and "reward bug" in messages[0]


def test_score_rejects_unknown_names_and_mismatched_lengths():
    with pytest.raises(KeyError, match="no_such_reward"):
        score(["no_such_reward"], ["x"], [gsm8k_example("1")])
    with pytest.raises(ValueError, match="2 completions but 1 examples"):
        score(["gsm8k"], ["x", "y"], [gsm8k_example("1")])


def test_score_with_no_rewards_is_zero():
    total, per_fn = score([], ["x"], [gsm8k_example("1")])
    assert per_fn == {} and total.tolist() == [0.0]


# The operator's allowlist for `package.module:function` rewards


@pytest.mark.parametrize("name", ["builtins:print", "shutil:rmtree", "pty:spawn", "os:system",
                                  "tests.locojax.rewards_for_tests:digit_fraction"])
def test_import_path_rewards_are_refused_without_an_allowlist(name):
    allow_reward_modules(())
    with pytest.raises(KeyError, match="not allowed by the operator"):
        resolve_reward(name)
    with pytest.raises(KeyError, match="not allowed by the operator"):
        score([name], ["x"], [gsm8k_example("1")])


def test_an_allowed_module_prefix_admits_its_modules_only(monkeypatch):
    import sys

    allow_reward_modules("tests.locojax")
    try:
        fn = resolve_reward("tests.locojax.rewards_for_tests:digit_fraction")
        assert fn("a1", gsm8k_example("1")) == 0.5
        # A prefix is a package boundary: `tests.locojax` does not admit `tests.locojaxx`.
        monkeypatch.delitem(sys.modules, "shutil", raising=False)
        for name in ("tests.locojaxx.evil:f", "tests:f", "shutil:rmtree"):
            with pytest.raises(KeyError, match="not allowed"):
                resolve_reward(name)
        assert "shutil" not in sys.modules  # refused before anything was imported
    finally:
        allow_reward_modules(())


def test_check_reward_names_reports_each_refused_index():
    refused = check_reward_names(["gsm8k", "builtins:exec", "no_such", "a.b:c", "../x:y"], ["a"])
    assert [index for index, _ in refused] == [1, 2, 4]
    assert "not allowed" in refused[0][1] and "unknown reward" in refused[1][1] and "import path" in refused[2][1]

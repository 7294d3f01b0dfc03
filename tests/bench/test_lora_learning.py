"""bench/lora_learning.py's selection logic, on this CPU without training: the learning-rate choice,
the test/validation split of the held-out prompts, and the lr-list parsing."""

from __future__ import annotations

import pytest

from bench.lora_learning import choose_lr, parse_lrs, split_eval_prompts
from locojax.spec import EvalSpec, TaskSpec
from locojax.tasks import load_task_data


def _run(lr, val_accuracy, status="succeeded"):
    return {"lr": lr, "status": status, "val_accuracy": val_accuracy}


def test_the_highest_validation_accuracy_wins_and_a_tie_goes_to_the_lower_rate():
    lr, why = choose_lr([_run(3e-4, 0.30), _run(1e-3, 0.35), _run(2e-3, 0.31)])
    assert lr == 1e-3 and "0.3500" in why and "0.0003: 0.3000" in why
    assert "tied" not in why
    lr, why = choose_lr([_run(2e-3, 0.35), _run(6e-4, 0.35), _run(1e-3, 0.20)])
    assert lr == 6e-4 and "tied with 0.002: the lower rate wins" in why


def test_a_failed_run_is_never_chosen_and_no_success_is_an_error():
    lr, why = choose_lr([_run(1e-3, None, "failed"), _run(2e-3, 0.10)])
    assert lr == 2e-3 and "failed" in why
    with pytest.raises(ValueError, match="no candidate run succeeded"):
        choose_lr([_run(1e-3, 0.9, "failed")])


def test_test_prompts_are_the_plain_held_out_set_and_validation_prompts_are_disjoint_from_it_and_training():
    task = TaskSpec.model_validate({"name": "arith", "difficulty": 0})
    both = load_task_data(task, EvalSpec(every=0, prompts=24, k=1))
    test, val = split_eval_prompts(both.held_out, 16, 8)
    plain = load_task_data(task, EvalSpec(every=0, prompts=16, k=1)).held_out
    assert [e.prompt for e in test] == [e.prompt for e in plain]  # what a run evaluating 16 prompts holds out
    held = {e.prompt for e in test} | {e.prompt for e in val}
    assert len(held) == 24
    assert not held & {both.train.example(i).prompt for i in range(5000)}  # training never shows them
    with pytest.raises(ValueError, match="expected 16 \\+ 4"):
        split_eval_prompts(both.held_out, 16, 4)


def test_lr_lists_parse_and_bad_ones_name_the_field():
    assert parse_lrs("3e-4, 1e-3,", "--lora-lrs") == [3e-4, 1e-3]
    for text, message in (("", "at least one"), ("1e-3,fast", "not a comma-separated"),
                          ("0,1e-3", "positive"), ("1e-3,1e-3", "repeats")):
        with pytest.raises(ValueError, match=message) as info:
            parse_lrs(text, "--lora-lrs")
        assert "--lora-lrs" in str(info.value)

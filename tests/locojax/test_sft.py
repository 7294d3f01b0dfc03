"""SFT as an ordinary run (`kind: sft`): spec rules, metrics/status/cancel/resume like CO, and an
exported model that a GRPO spec's `model.checkpoint` loads; the demo's two specs."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from locojax import metrics as m
from locojax.demo import demo_specs
from locojax.modes.common import load_policy
from locojax.modes.sft import export_dir, reference_batch, run_sft
from locojax.runner import run_mode
from locojax.spec import RunSpec, SpecError, load_spec, parse_spec
from locojax.tasks import make_task
from locojax.tokenizer import ByteTokenizer
from tests.locojax.test_co import ROOT, locojax, write_spec


def sft_spec(tmp_path: Path, name: str = "sft", **overrides) -> dict:
    spec = {
        "name": name, "kind": "sft", "seed": 1,
        "model": {"preset": "tiny"},
        "task": {"name": "arith", "difficulty": 0},
        "rollout": {"prompts_per_step": 8, "max_prompt_tokens": 8, "max_new_tokens": 8},
        "optim": {"lr": 3e-3, "warmup_steps": 0},
        "steps": 4,
        "checkpoint": {"every": 2, "keep": 3},
        "output_dir": str(tmp_path / name),
    }
    spec.update(overrides)
    return spec


def leaves(params) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def test_kind_defaults_to_grpo_and_sft_is_single_host():
    assert RunSpec().kind == "grpo"
    assert parse_spec({"kind": "sft"}).kind == "sft"
    with pytest.raises(SpecError, match=r"placement\.hosts must be 1 for an SFT run"):
        parse_spec({"kind": "sft", "placement": {"hosts": 2}, "rollout": {"prompts_per_step": 8}})
    with pytest.raises(SpecError, match=r"rollout\.prompts_per_step \(6\) is the SFT batch"):
        parse_spec({"kind": "sft", "placement": {"devices_per_host": 4}, "rollout": {"prompts_per_step": 6}})
    with pytest.raises(SpecError, match="kind"):
        parse_spec({"kind": "ppo"})


def test_reference_batch_teaches_reference_and_eos_after_the_left_padded_prompt():
    task = make_task(parse_spec({"task": {"name": "arith", "difficulty": 0}}).task)
    examples = [task.example(i) for i in range(4)]
    tokenizer = ByteTokenizer()
    batch = reference_batch(examples, tokenizer, 8, 8)
    for row, example in enumerate(examples):
        prompt = batch["tokens"][row, :8][batch["prompt_mask"][row]]
        assert tokenizer.decode(prompt) == example.prompt and prompt[0] == tokenizer.bos_id
        completion = batch["tokens"][row, 8:][batch["completion_mask"][row]]
        assert tokenizer.decode(completion[:-1]) == example.reference and completion[-1] == tokenizer.eos_id


@pytest.mark.slow
def test_sft_run_reports_like_any_run_and_exports_a_model_grpo_loads(tmp_path):
    spec = parse_spec(sft_spec(tmp_path))
    result = run_mode(spec, console=False)  # dispatches on kind
    out = tmp_path / "sft"
    assert result.status == "succeeded" and result.steps_done == 4 and result.last_checkpoint_step == 4
    rows = m.read_jsonl(out / "metrics.jsonl")
    assert [(r["step"], r["host"]) for r in rows] == [(s, h) for s in range(4) for h in (0, m.ALL_HOSTS)]
    for row in rows:
        assert row[m.TIME_STEP] > 0 and row[m.TIME_TRAIN] > 0 and row[m.OPTIM_LR] == pytest.approx(3e-3)
    losses = [r[m.LOSS_SFT] for r in rows if r["host"] == m.ALL_HOSTS]
    assert losses[-1] < losses[0] - 0.5, losses  # from ~ln(384) = 5.95 the first updates drop it fast
    assert json.loads((out / "hosts" / "host0.json").read_text())["phase"] == "export"
    assert json.loads((out / "result.json").read_text())["status"] == "succeeded"

    # A GRPO spec naming the export starts from exactly the trained params (the step-4 checkpoint's).
    assert export_dir(spec) == out / "model"
    grpo = parse_spec({**sft_spec(tmp_path, "grpo"), "kind": "grpo", "model": {"preset": "tiny",
                                                                                "checkpoint": str(out / "model")}})
    from locojax.checkpoint import load_params

    trained = load_params(out / "checkpoints", load_policy(spec).params, 4)
    for a, b in zip(leaves(load_policy(grpo).params), leaves(trained), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_sft_stops_on_the_cancel_file_and_resumes_exactly(tmp_path):
    straight = parse_spec(sft_spec(tmp_path, "straight"))
    run_sft(straight, console=False)

    cancelled = parse_spec(sft_spec(tmp_path, "cancelled"))
    cancel = tmp_path / "cancel"
    cancel.touch()
    result = run_sft(cancelled, console=False, cancel_file=cancel)
    # Stopped at the first step boundary, saved where it stopped, and exported nothing: a queued GRPO
    # run must not start from an unfinished warm start.
    assert (result.status, result.steps_done, result.last_checkpoint_step) == ("cancelled", 1, 1)
    assert not export_dir(cancelled).exists()
    assert json.loads((tmp_path / "cancelled" / "hosts" / "host0.json").read_text())["step"] == 0

    cancel.unlink()
    result = run_sft(cancelled, console=False, resume=True)
    assert (result.status, result.steps_done) == ("succeeded", 4)
    steps = [r["step"] for r in m.read_jsonl(tmp_path / "cancelled" / "metrics.jsonl") if r["host"] == m.ALL_HOSTS]
    assert steps == [0, 1, 2, 3]
    a = load_policy(parse_spec({**sft_spec(tmp_path), "model": {"checkpoint": str(export_dir(straight))}}))
    b = load_policy(parse_spec({**sft_spec(tmp_path), "model": {"checkpoint": str(export_dir(cancelled))}}))
    for x, y in zip(leaves(a.params), leaves(b.params), strict=True):
        np.testing.assert_array_equal(x, y)


def test_host_command_refuses_an_sft_spec_on_several_hosts(tmp_path):
    path = write_spec(tmp_path, sft_spec(tmp_path))
    done = locojax("host", str(path), "--process-id", "0", "--num-processes", "2", "--coordinator", "127.0.0.1:1")
    assert done.returncode == 2 and "placement.hosts must be 1" in done.stderr
    assert not (tmp_path / "sft").exists()  # nothing was written


def test_train_rejects_an_sft_spec_with_two_hosts_naming_the_field(tmp_path):
    path = write_spec(tmp_path, sft_spec(tmp_path, placement={"hosts": 2}))
    done = locojax("train", str(path), "--quiet")
    assert done.returncode == 2 and "placement.hosts" in done.stderr


def test_demo_specs_are_an_sft_run_and_a_grpo_run_from_its_export(tmp_path):
    sft, grpo = demo_specs(tmp_path)
    assert (sft.kind, grpo.kind) == ("sft", "grpo")
    assert grpo.model.checkpoint == str(export_dir(sft)) == str(tmp_path / "sft" / "model")
    assert sft.output_dir != grpo.output_dir
    assert (sft.model.preset, grpo.model.preset, sft.task, grpo.task.name) == ("small", "small", grpo.task, "arith")
    assert grpo.algo.kl_coef == 0 and grpo.placement.mode == "co" and sft.placement.hosts == 1


def test_example_demo_specs_match_demo_specs():
    sft, grpo = demo_specs(Path("runs/demo"))
    assert load_spec(ROOT / "examples" / "demo-sft.yaml") == sft
    assert load_spec(ROOT / "examples" / "demo-grpo.yaml") == grpo

"""The CLI and the API refuse exactly the same bad specs with the same (field, message) pairs: both
validate through `RunSpec` (its mode checks included) and `locojax.rewards.unknown_names`. The API
names a field `spec.<path>` (the spec is the request body's `spec`), the CLI `<path>`; an error of the
whole spec is `spec` on both."""

from __future__ import annotations

import re

import pytest
import typer
import yaml
from typer.testing import CliRunner

from locojax import commands
from locojax.contract import EXIT_SPEC_ERROR
from locojax.spec import RunSpec
from tests.server.helpers import assert_error

BAD_SPECS = {
    "unknown task": {"task": {"name": "no-such-task"}},
    "unknown reward": {"task": {"name": "arith", "reward": ["format", "no_such_reward"]}},
    "bad algo.loss": {"algo": {"loss": "no-such-loss"}},
    "bad algo.name": {"algo": {"name": "no-such-estimator"}},
    "DA on one host": {"placement": {"mode": "da", "hosts": 1}},
    "SFT on two hosts": {"kind": "sft", "placement": {"hosts": 2}},
    "unknown placement.mode": {"placement": {"mode": "xx"}},
}

# Where a field path starts in the CLI's one-line refusal ("...: <field>: <message>; <field>: ..."):
# `spec` or a top-level RunSpec field, then dotted parts.
_FIELD = re.compile(r"(?:^|: |; )((?:spec|{})(?:\.\w+)*): ".format("|".join(map(re.escape, RunSpec.model_fields))))


def _cli_errors(output: str) -> set[tuple[str, str]]:
    line = output.strip()
    starts = list(_FIELD.finditer(line))
    assert starts, line
    pairs = [(here.group(1), line[here.end():after.start() if after is not None else len(line)])
             for here, after in zip(starts, [*starts[1:], None])]
    # The pairs account for the whole refusal after its prefix ("invalid <file>: " or "<file>: refused: ").
    assert line.endswith("; ".join(f"{field}: {message}" for field, message in pairs)), line
    return set(pairs)


def _cli() -> typer.Typer:
    app = typer.Typer()
    commands.register(app)
    return app


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_the_cli_and_the_api_refuse_a_bad_spec_alike(case, client, submitter, tmp_path):
    spec = {"name": "refused", **BAD_SPECS[case]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    done = CliRunner().invoke(_cli(), ["train", str(path), "--quiet"])
    assert done.exit_code == EXIT_SPEC_ERROR, done.output
    cli = _cli_errors(done.stderr)

    error = assert_error(client.post("/api/v1/runs", json={"spec": spec}, headers=submitter), 422)
    api = {(item["field"].removeprefix("spec."), item["message"]) for item in error["details"]}
    assert cli == api

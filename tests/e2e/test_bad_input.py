"""Malformed run specs and metric batches are refused naming the problem and write nothing; a stateful
fuzzer over the whole API gets no 5xx. (Scenarios in tests/e2e/bad_input.py, shared with the bench.)"""

from __future__ import annotations

import json

import pytest

from tests.e2e.infra import Stack
from tests.e2e.scenarios import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.postgres, pytest.mark.redis]


def test_malformed_run_specs_are_refused_naming_the_field_and_write_nothing(stack: Stack):
    result = run(stack, "bad_run_specs")
    assert result["passed"], json.dumps(result, indent=1)
    assert result["details"]["cases"] >= 30 and result["details"]["rejected"] == result["details"]["cases"]


def test_malformed_metric_batches_are_refused_without_a_partial_write(stack: Stack):
    result = run(stack, "bad_metric_batches")
    assert result["passed"], json.dumps(result, indent=1)


def test_a_stateful_fuzzer_gets_no_server_error(stack: Stack):
    result = run(stack, "stateful_fuzz")
    assert result["passed"], json.dumps(result, indent=1)

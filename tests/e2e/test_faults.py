"""Faults while runs train: a killed engine process, a killed worker, a Redis restart, a PostgreSQL
outage, a killed API. Each run ends SUCCEEDED with every step's metrics stored (none lost, none stale,
every written value received by the API: reposts are counted, not failed), nothing queued lost and
no process left behind. (Scenarios in tests/e2e/faults.py, shared with the bench.)"""

from __future__ import annotations

import json

import pytest

from tests.e2e.faults import FAULTS
from tests.e2e.infra import Stack
from tests.e2e.scenarios import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.postgres, pytest.mark.redis]


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_is_survived(stack: Stack, name: str):
    result = run(stack, name)
    assert result["passed"], json.dumps(result, indent=1)
    assert result["metrics_lost"] == 0 and result["values_reposted"] >= 0
    assert result["recover_s"] is not None

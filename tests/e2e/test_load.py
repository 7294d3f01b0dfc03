"""50 concurrent clients against the API while a run trains: no request fails, nothing is lost.
(Scenario in tests/e2e/load.py, shared with the bench, which runs it for 60 s.)"""

from __future__ import annotations

import json

import pytest

from tests.e2e.infra import Stack
from tests.e2e.scenarios import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.postgres, pytest.mark.redis]

# The bench runs 60 s; the suite keeps to its time budget with a shorter window of the same mix.
DURATION_S = 20.0


def test_fifty_clients_while_a_run_trains(stack: Stack):
    result = run(stack, "load", clients=50, duration_s=DURATION_S)
    assert result["passed"], json.dumps(result, indent=1)
    assert result["details"]["errors"] == 0 and result["details"]["requests"] > 0

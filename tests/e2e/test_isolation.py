"""Issue 17's isolation probes, each tried live against the running stack (scenario in tests/e2e/isolation.py,
shared with bench/reliability.py)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.infra import Stack
from tests.e2e.scenarios import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.postgres, pytest.mark.redis]


def test_isolation(stack: Stack):
    result = run(stack, "isolation")
    assert result["passed"], json.dumps(result, indent=1)
    details = result["details"]
    assert details["isolation_tried"] >= 15 and details["isolation_blocked"] == details["isolation_tried"]

"""Issue #18's attacks, each tried live against the running stack (scenario in tests/e2e/attacks.py,
shared with bench/reliability.py)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.infra import Stack
from tests.e2e.scenarios import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.postgres, pytest.mark.redis]


def test_attacks(stack: Stack):
    result = run(stack, "attacks")
    assert result["passed"], json.dumps(result, indent=1)
    assert result["details"]["attacks_tried"] >= 20

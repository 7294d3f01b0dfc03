"""Auth on every route, scopes, secrets, CSRF and injection, against the running API process.
(Scenarios in tests/e2e/security.py, shared with the bench.)"""

from __future__ import annotations

import json

import pytest

from tests.e2e.infra import Stack
from tests.e2e.scenarios import run
from tests.e2e.security import SECURITY

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.postgres, pytest.mark.redis]


@pytest.mark.parametrize("name", list(SECURITY))
def test_security(stack: Stack, name: str):
    result = run(stack, name)
    assert result["passed"], json.dumps(result, indent=1)

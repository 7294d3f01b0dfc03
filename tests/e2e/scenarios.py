"""Every reliability scenario by name, in the order the bench runs them; the tests in this package and
bench/reliability.py call the same functions, so the tests assert exactly what the bench reports.

Groups: `bad_input` (counted in bad_inputs_rejected), `security`, `fault` (counted in faults_survived),
`load` (load_errors), `attack` (attacks_tried, attacks_blocked), `isolation` (isolation_tried,
isolation_blocked). Each scenario takes the `Stack` (and, for load, its size) and returns the dict
described in tests/e2e/outcome.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.e2e.attacks import attacks
from tests.e2e.bad_input import bad_metric_batches, bad_run_specs, stateful_fuzz
from tests.e2e.faults import FAULTS
from tests.e2e.infra import Stack
from tests.e2e.isolation import isolation
from tests.e2e.load import load
from tests.e2e.security import SECURITY

Scenario = Callable[..., dict[str, Any]]

SCENARIOS: dict[str, tuple[str, Scenario]] = {
    "bad_run_specs": ("bad_input", bad_run_specs),
    "bad_metric_batches": ("bad_input", bad_metric_batches),
    "stateful_fuzz": ("bad_input", stateful_fuzz),
    **{name: ("security", scenario) for name, scenario in SECURITY.items() if name != "secrets_stay_secret"},
    **{name: ("fault", scenario) for name, scenario in FAULTS.items()},
    "load": ("load", load),
    "attacks": ("attack", attacks),
    "isolation": ("isolation", isolation),
    # Last: by then every other scenario has written to the logs it searches.
    "secrets_stay_secret": ("security", SECURITY["secrets_stay_secret"]),
}


def run(stack: Stack, name: str, **kwargs: Any) -> dict[str, Any]:
    """One scenario, after checking that the plane is whole (every process up, every host ONLINE)."""
    stack.wait_healthy()
    return SCENARIOS[name][1](stack, **kwargs)

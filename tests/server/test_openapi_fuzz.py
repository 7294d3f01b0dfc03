"""Property-based tests of the whole API from its own OpenAPI document (schemathesis): no 5xx, and every
response (status, content type, headers, body) as documented. In-process over ASGI, as an admin, one
test per operation and backend.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from sqlalchemy import text
from schemathesis.specs.openapi.checks import positive_data_acceptance

from server.app import create_app
from server.settings import Settings

pytestmark = pytest.mark.slow


def _operation_labels() -> list[str]:
    # The document depends on code only, so an app that never connects anywhere can describe it.
    document = create_app(Settings(database_url="sqlite://", broker_url="memory://"), plugins=False).openapi()
    return [f"{method.upper()} {path}" for path, operations in document["paths"].items() for method in operations]


_schemas: dict[str, object] = {}


@pytest.fixture
def fresh_tokens(backend):
    """The fuzzer may revoke any token it can name (DELETE /tokens/{id}); start the next test clean."""
    yield
    with backend.db.engine.begin() as connection:
        connection.execute(text("DELETE FROM api_tokens"))
    backend.tokens = None


@pytest.mark.parametrize("label", _operation_labels())
def test_operation_conforms_to_its_openapi(backend, fresh_tokens, tokens, label):
    if backend.name not in _schemas:
        _schemas[backend.name] = schemathesis.openapi.from_asgi("/openapi.json", backend.app)
    schema = _schemas[backend.name]
    operation = schema.find_operation_by_label(label)
    assert operation is not None, label
    headers = tokens.headers("admin")

    @given(case=operation.as_strategy())
    @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case):
        # Every check but "schema-valid data must be accepted": some rules are deliberately beyond what
        # JSON Schema says (cursors minted by the server, catalog names, cross-field RunSpec rules, paths
        # inside the allowed roots), so a schema-valid request may still earn a 422 naming the field.
        case.call_and_validate(headers=headers, excluded_checks=[positive_data_acceptance])

    check()

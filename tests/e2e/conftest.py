"""One private PostgreSQL, one private Redis and one control plane (API + 3 workers) for the whole
package: starting them is the slow part, and every scenario leaves the plane whole (or fails). Package
scope, not session: the plane stops after the package's last test, instead of idling beside the rest
of the suite on the same cores."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.infra import Stack, Unavailable


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    try:
        plane = Stack.start(tmp_path_factory.mktemp("reliability"))
    except Unavailable as exc:
        pytest.skip(str(exc))
    yield plane
    plane.close()
    assert [name for name, process in plane.plane.processes.items() if process.poll() is None] == []
    assert plane.engine_processes() == []

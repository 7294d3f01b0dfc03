"""The boundaries DESIGN §3 draws, checked on the code: what imports JAX, where mode branches may live,
what placement may import, and that the registries and the spec's published names agree."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("locojax", "server", "worker", "web")


@pytest.mark.parametrize("module", ["locojax.contract", "locojax.modes", "locojax.spec", "locojax.client",
                                    "server.app", "worker.app"])
def test_the_light_modules_do_not_import_jax(module):
    code = f"import sys, {module}; assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_contract_imports_nothing_but_the_standard_library():
    tree = ast.parse((ROOT / "locojax" / "contract.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


# A comparison of a mode (a variable, attribute or mapping value whose name ends in "mode") with a
# literal mode name, either way round, or a membership test of one in a literal collection.
_MODE_NAME = r"""['"](?:co|sc|da|sft)['"]"""
MODE_BRANCH = re.compile(
    rf"""mode['"]?\]?\)?\s*(?:==|!=)\s*{_MODE_NAME}"""
    rf"""|{_MODE_NAME}\s*(?:==|!=)\s*[\w.\[\]'"()]*mode\b"""
    rf"""|mode['"]?\]?\)?\s+(?:not\s+)?in\s*[(\[{{]\s*{_MODE_NAME}""")


def test_the_mode_branch_pattern_catches_the_usual_spellings():
    for line in ('if mode == "co":', 'if run.mode != "da":', 'x = placement.mode == "sc" and y',
                 'if mode in ("co", "sc"):', 'if spec.placement.mode not in ["da"]:', "if 'da' == run.mode:",
                 'if spec["placement"]["mode"] == "da":', 'if row.get("mode") == "co":'):
        assert MODE_BRANCH.search(line), line
    for line in ('if kind == "sft":', 'mode = MODES.get(name)', 'if e.placement.mode == mode:'):
        assert not MODE_BRANCH.search(line), line


def test_no_mode_branches_outside_the_modes_package():
    """What a mode means is its ModeDef (locojax.modes) and its cost entry (placement.cost_model.MODE_COSTS);
    code elsewhere asks those, it does not test the mode's name."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if relative.parts[:2] == ("locojax", "modes"):
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if MODE_BRANCH.search(line.split("#")[0]):
                    found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_placement_imports_nothing_from_the_modes():
    offending = {str(path.relative_to(ROOT)): sorted(name for name in _imports(path) if name.startswith("locojax.modes"))
                 for path in (ROOT / "locojax" / "placement").rglob("*.py")}
    assert not {path: names for path, names in offending.items() if names}


def test_every_mode_has_its_layout_cost_entry_and_published_name():
    from locojax.modes import KIND_MODES, MODES
    from locojax.placement.cost_model import MODE_COSTS
    from locojax.spec import Mode, PlacementSpec
    from server.models import HostRole

    placement_modes = [name for name in MODES if name not in KIND_MODES.values()]
    assert sorted(typing.get_args(Mode)) == placement_modes  # what a spec may name is what is registered
    for name in MODES:
        mode = MODES.get(name)
        assert mode.cost_entry is None or mode.cost_entry in MODE_COSTS, name
        layout = mode.layout(PlacementSpec.model_construct(mode=name, hosts=4, devices_per_host=1))
        assert layout.hosts == 4 and len(layout.roles) >= 1
        assert set(layout.host_of) <= set(range(layout.hosts))  # every process on a host it reserved
        assert {HostRole(role) for role in layout.roles}  # roles the control plane records
        assert mode.session_class().__name__.endswith("Session")
    assert sorted(MODES.get(n).cost_entry for n in placement_modes) == sorted(MODE_COSTS)


def test_the_spec_names_exactly_what_the_algorithm_registries_hold():
    from locojax.algo import ADVANTAGES, LOSS_AGGREGATIONS, POLICY_LOSSES
    from locojax.spec import AlgoSpec

    def published(field: str) -> list[str]:
        return sorted(typing.get_args(AlgoSpec.model_fields[field].annotation))

    assert published("name") == ADVANTAGES.names()
    assert published("loss") == POLICY_LOSSES.names()
    assert published("loss_agg") == LOSS_AGGREGATIONS.names()


def test_the_dashboard_charts_only_metrics_the_contract_defines():
    from locojax.contract import METRICS
    from web.charts import RUN_CHART_KEYS

    assert set(RUN_CHART_KEYS) <= set(METRICS)


def test_the_web_layer_reads_and_writes_only_through_the_services():
    found = []
    for path in sorted((ROOT / "web").rglob("*.py")):
        relative = path.relative_to(ROOT)
        for name in _imports(path):
            if name == "sqlalchemy" or (name.startswith("sqlalchemy.") and name not in ("sqlalchemy.orm", "sqlalchemy.exc")):
                found.append(f"{relative}: imports {name}")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bsession\.(get|scalar|scalars|execute|add|delete|query)\(", line):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_services_import_no_cycle():
    """A service imports the services it builds on, never one that builds on it (also not inside a function)."""
    services = ROOT / "server" / "services"
    graph = {path.stem: {name.split(".")[2] for name in _imports(path) if name.startswith("server.services.")}
             for path in services.glob("*.py")}
    for path in services.glob("*.py"):  # `from server.services import a, b as c`
        tree = ast.parse(path.read_text(encoding="utf-8"))
        graph[path.stem] |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                             and node.module == "server.services" for alias in node.names}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt}))
                   for nxt in graph.get(start, ()))

    cycles = sorted(name for name in graph if reaches(name, name, {name}))
    assert not cycles, {name: sorted(graph[name]) for name in cycles}


def test_only_the_settings_read_the_environment_on_the_control_plane():
    reads = re.compile(r"\bos\.environ\b|\bgetenv\(|\benvvar=|\benviron\.get\(")
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for package in ("server", "web") for path in sorted((ROOT / package).rglob("*.py"))
             if path.relative_to(ROOT) != Path("server/settings.py")
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if reads.search(line.split("#")[0])]
    assert not found, "\n".join(found)

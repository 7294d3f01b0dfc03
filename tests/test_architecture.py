"""The boundaries DESIGN §3 draws, checked on the code: what imports JAX, where mode branches may live,
what placement may import, and that the registries and the spec's published names agree."""

from __future__ import annotations

import ast
import os
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


MODE_NAMES = frozenset({"co", "sc", "da", "sft"})
# Something that holds a mode or a spec's kind: a name or attribute (`mode`, `run.mode`,
# `placement_mode`, `spec.kind`) or a mapping key (`spec["placement"]["mode"]`, `row.get("mode")`).
_MODE_HOLDER = re.compile(r"(?:^|_)(?:mode|kind)$")


def _names_a_mode(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and _MODE_HOLDER.search(sub.id):
            return True
        if isinstance(sub, ast.Attribute) and _MODE_HOLDER.search(sub.attr):
            return True
        if isinstance(sub, ast.Constant) and sub.value in ("mode", "kind"):
            return True
    return False


def _mode_constants(node: ast.AST) -> set[str]:
    """The mode names `node` spells: a string constant, or those in a literal tuple, list or set."""
    if isinstance(node, ast.Constant) and node.value in MODE_NAMES:
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {elt.value for elt in node.elts if isinstance(elt, ast.Constant) and elt.value in MODE_NAMES}
    return set()


def _case_constants(pattern: ast.AST) -> set[str]:
    return {sub.value.value for sub in ast.walk(pattern) if isinstance(sub, ast.MatchValue)
            and isinstance(sub.value, ast.Constant) and sub.value.value in MODE_NAMES}


def mode_branches(source: str) -> list[tuple[int, str]]:
    """Where `source` decides by a mode's name: a comparison of a literal mode name (or a literal
    collection of them) with something holding a mode or kind, either way round and however reached
    (`mode.name == "co"`, `run.mode.value != "da"`, `"sc" in (mode,)`, `spec.kind == "sft"`); a `match`
    with a case on a mode name; a dict literal keyed by two or more mode names (dispatch by name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for index, operand in enumerate(operands):
                if _mode_constants(operand) and any(_names_a_mode(other) for other_index, other in enumerate(operands)
                                                    if other_index != index):
                    found.append((node.lineno, "compares a mode's name"))
                    break
        elif isinstance(node, ast.Match):
            if any(_case_constants(case.pattern) for case in node.cases):
                found.append((node.lineno, "matches on a mode's name"))
        elif isinstance(node, ast.Dict):
            keys = {key.value for key in node.keys if isinstance(key, ast.Constant) and key.value in MODE_NAMES}
            if len(keys) >= 2:
                found.append((node.lineno, f"a dict keyed by mode names {sorted(keys)}"))
    return found


@pytest.mark.parametrize("source", [
    'if mode == "co": pass', 'if run.mode != "da": pass', 'x = placement.mode == "sc" and y',
    'if mode in ("co", "sc"): pass', 'if spec.placement.mode not in ["da"]: pass', "if 'da' == run.mode: pass",
    'if spec["placement"]["mode"] == "da": pass', 'if row.get("mode") == "co": pass', 'if kind == "sft": pass',
    'if spec.kind == "sft": pass', 'if mode.name == "co": pass', 'if run.mode.value == "da": pass',
    'if run.mode.lower() == "sc": pass', 'if "da" in (mode,): pass', 'ok = placement_mode == "co"',
    'match mode:\n    case "sc":\n        pass', 'match run.mode:\n    case "co" | "da":\n        pass',
    'order = {"co": 0, "da": 1, "sc": 2}[mode]', 'handlers = {"co": run_co, "sc": run_sc}',
])
def test_the_mode_branch_check_catches_the_usual_spellings(source):
    assert mode_branches(source), source


@pytest.mark.parametrize("source", [
    'mode = MODES.get(name)', 'if e.placement.mode == mode: pass', 'if MODE_COSTS.get(mode).rollout_groups: pass',
    'spec = {"kind": "sft", "placement": {"mode": "co"}}', 'if name == "co": pass', 'x = {"co": 1}',
    'match command:\n    case "train":\n        pass',
])
def test_the_mode_branch_check_leaves_mode_agnostic_code_alone(source):
    assert not mode_branches(source), source


def test_no_mode_branches_outside_the_modes_package():
    """What a mode means is its ModeDef (locojax.modes) and its cost entry (placement.cost_model.MODE_COSTS);
    code elsewhere asks those, it does not test the mode's name (nor `kind`: kind `sft` is the sft mode)."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if relative.parts[:2] == ("locojax", "modes"):
                continue
            found += [f"{relative}:{line}: {what}" for line, what in mode_branches(path.read_text(encoding="utf-8"))]
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


@pytest.mark.parametrize("name, hosts", [("co", 1), ("co", 2), ("co", 4), ("sc", 1), ("sc", 2), ("sc", 4), ("da", 2),
                                         ("da", 4), ("sft", 1)])
def test_every_process_of_a_modes_layout_gets_a_command_line_the_cli_accepts(name, hosts):
    """The host worker starts `locojax <mode.command(...)>` for each process of the layout: each line must
    name a command of the CLI with options that command parses (click parses, nothing runs). Every
    attempt carries its secret (server.services.scheduling)."""
    import typer.main

    from locojax.cli import app
    from locojax.modes import MODES, EngineStart
    from locojax.spec import PlacementSpec

    mode = MODES.get(name)
    layout = mode.layout(PlacementSpec.model_construct(mode=name, hosts=hosts, devices_per_host=2))
    cli = typer.main.get_command(app)
    for index, role in enumerate(layout.roles):
        for options in ({}, {"resume": True, "reward_modules": ("a.b", "c"), "ray_address": "r:1",
                             "compilation_cache": "/var/cache/locojax"}):
            start = EngineStart(spec_path="spec.yaml", role=role, process_index=index, num_processes=len(layout.roles),
                                devices_per_host=2, cancel_file="/c", secret_file="/s", node_address="10.0.0.2",
                                coordinator="10.0.0.1:1234" if len(layout.roles) > 1 else None, **options)
            argv = mode.command(start)
            command = cli.get_command(None, argv[0])
            assert command is not None, (name, role, argv)
            command.make_context(argv[0], list(argv[1:]))  # raises on an option the command does not take
            if options and argv[0] != "ray-node":  # every process that compiles shares the host's folder
                assert argv[argv.index("--compilation-cache") + 1] == "/var/cache/locojax", argv


def test_the_worker_asks_the_mode_what_each_process_runs():
    """worker/ starts the command line a mode's `command` gives; it never branches on a mode's roles."""
    found = [f"{path.relative_to(ROOT)}: imports {alias.name}" for path in sorted((ROOT / "worker").rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.ImportFrom) and node.module == "locojax.modes"
             for alias in node.names if alias.name.startswith("ROLE_")]
    assert not found, "\n".join(found)


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


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` that can run: all but the bodies of `if TYPE_CHECKING:` (annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def module_imports(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of `package` (a directory under `root`) -> the package's modules it imports, counting
    imports written inside functions, not those under `if TYPE_CHECKING:`. An import counts as the deepest
    module it names (`from a.b import c`: `a.b.c` when that is a module, else `a.b`)."""
    paths = {}
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in paths.items():
        own_package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = []
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package, `level - 1` packages up
                    base = ".".join(own_package[:len(own_package) - node.level + 1] + ([base] if base else []))
                targets += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base for alias in node.names]
        graph[name] = set()
        for target in targets:
            while target and target not in paths:  # `import a.b.c` of an attribute path, or another package
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that depend on each other in a loop: each strongly connected set of two or more
    (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph.get(module, ())):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == module:
                    break
            if len(members) > 1:
                loops.append(sorted(members))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(loops)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_loop_in_a_package(package):
    """A module imports only downward: when two modules need each other, the shared part moves down into
    a third (STYLE 13). An import inside a function hides a loop from Python, not from this check."""
    graph = module_imports(ROOT, package)
    loops = import_loops(graph)
    assert not loops, "\n".join(
        "loop: " + "; ".join(f"{module} -> {', '.join(sorted(graph[module] & set(loop)))}" for module in loop)
        for loop in loops)


def test_the_loop_check_counts_imports_inside_functions_and_not_type_checking_ones(tmp_path):
    files = {
        "__init__.py": "",
        "a.py": "from synth import b\n",
        "b.py": "def late():\n    from synth.sub.c import helper\n",
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import thing\n",  # closes synth.a -> synth.b -> synth.sub.c -> synth.a
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from synth import e\n",
        "e.py": "import synth.d\n",  # d and e meet only in annotations: no loop
        "f.py": "import jax.numpy\nfrom synth import sub\n",
    }
    for relative, text in files.items():
        (tmp_path / "synth" / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "synth" / relative).write_text(text)
    graph = module_imports(tmp_path, "synth")
    assert graph["synth.f"] == {"synth.sub"} and graph["synth.d"] == set() and graph["synth.e"] == {"synth.d"}
    assert import_loops(graph) == [["synth.a", "synth.b", "synth.sub.c"]]


LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def test_the_import_contracts_hold():
    """pyproject.toml's [tool.importlinter] contracts: the worker is imported by none of the engine,
    server and web; the engine imports neither of those; the engine's own layers."""
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_the_import_contracts_see_an_import_inside_a_function(tmp_path):
    (tmp_path / "synth").mkdir()
    (tmp_path / "synth" / "__init__.py").write_text("")
    (tmp_path / "synth" / "high.py").write_text("from synth import low\n")
    (tmp_path / "synth" / "low.py").write_text("def late():\n    from synth import high\n")
    config = tmp_path / ".importlinter"
    config.write_text("[importlinter]\nroot_package = synth\n\n[importlinter:contract:layers]\nname = layers\n"
                      "type = layers\nlayers =\n    synth.high\n    synth.low\n")
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", str(config)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    assert "synth.low is not allowed to import synth.high" in done.stdout


def test_modes_errors_come_from_their_shared_module():
    """What a mode raises for the CLI lives in locojax/modes/errors.py: no part imports an error from a
    mode's implementation file."""
    found = [f"{path.relative_to(ROOT)}: {alias.name} from {node.module}"
             for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("locojax.modes.")
             and node.module != "locojax.modes.errors"
             for alias in node.names if alias.name.endswith("Error")]
    assert not found, "\n".join(found)


# The one module of each part that reads the environment: the control plane's settings, and the host
# worker's command line (a host agent: it cannot use the server's settings, which hold the database's).
ENVIRONMENT_READERS = {Path("server/settings.py"), Path("worker/cli.py")}


def test_only_the_settings_read_the_environment_on_the_control_plane():
    reads = re.compile(r"\bos\.environ\b|\bgetenv\(|\benvvar=|\benviron\.get\(")
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for package in ("server", "web", "worker") for path in sorted((ROOT / package).rglob("*.py"))
             if path.relative_to(ROOT) not in ENVIRONMENT_READERS
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if reads.search(line.split("#")[0])]
    assert not found, "\n".join(found)

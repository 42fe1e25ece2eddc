"""What the operator package may import from the learner's: grpo_trainer.contract, nothing else.

The operator runs without torch, TRL or vLLM; what it needs of the pods' side (exit codes, the run config, the
/progress report, metric names, the launch argv, reward names) comes through the contract module, so a change on
the pods' side that the operator depends on is a change there.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from grpo_trainer import contract
from tests.support.paths import REPO

PACKAGE = REPO / "operator" / "grpo_operator"
CONTRACT = "grpo_trainer.contract"


def trainer_imports(source: str) -> list[str]:
    """The grpo_trainer modules a source file imports, function-level imports included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "grpo_trainer"]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("grpo_trainer"):
            if node.module == "grpo_trainer":  # `from grpo_trainer import contract`
                found += [f"grpo_trainer.{alias.name}" for alias in node.names]
            else:
                found.append(node.module)
    return found


def test_the_operator_imports_the_trainer_package_through_its_contract_only():
    outside = {f"{path.relative_to(PACKAGE)}: {module}" for path in sorted(PACKAGE.rglob("*.py"))
               for module in trainer_imports(path.read_text()) if module != CONTRACT}
    assert not outside


@pytest.mark.parametrize(("source", "module"), [
    ("from grpo_trainer.launch import learner_argv", "grpo_trainer.launch"),
    ("import grpo_trainer.rollout", "grpo_trainer.rollout"),
    ("from grpo_trainer import rewards", "grpo_trainer.rewards"),
    ("def f():\n    from grpo_trainer.store_uri import parse_uri\n", "grpo_trainer.store_uri"),
])
def test_an_import_around_the_contract_is_found(source, module):
    assert trainer_imports(source) == [module]


def test_every_name_the_contract_passes_on_is_there():
    for names in contract._OWNERS.values():
        for name in names:
            assert getattr(contract, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nothing_of_the_kind'"):
        contract.nothing_of_the_kind  # noqa: B018 - the lookup is what is tested


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, str], packages: set[str]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in the file (TYPE_CHECKING and function-level imports
    too: a cycle through either still couples the two modules). `from . import x` counts as importing `x`, and a
    module's own parent packages are not counted (Python imports them first anyway)."""
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        base = name.split(".") if name in packages else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom):
                prefix = base[:len(base) - node.level + 1] if node.level else []
                target = ".".join(prefix + ([node.module] if node.module else []))
                deps |= {f"{target}.{alias.name}" if f"{target}.{alias.name}" in sources else target
                         for alias in node.names}
            elif isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names}
        graph[name] = {dep for dep in deps if dep in sources and dep != name and not name.startswith(f"{dep}.")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's cycles, as its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while (top := stack.pop()) != node:
                component.append(top)
            if component:
                found.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_operator_package_has_no_import_cycle():
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    packages = {name for name, path in paths.items() if path.name == "__init__.py"}
    assert cycles(import_graph({name: path.read_text() for name, path in paths.items()}, packages)) == []


def _package_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    packages = {name for name, path in paths.items() if path.name == "__init__.py"}
    return import_graph({name: path.read_text() for name, path in paths.items()}, packages)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def test_the_command_line_is_imported_by_itself_alone():
    """cli/ is the outermost layer: the core and the adapters (local/, cluster/) do not import it (what they share
    with it, the exit codes, is at the package root)."""
    inward = sorted(f"{name} -> {dep}" for name, deps in _package_graph().items()
                    if not _within(name, "grpo_operator.cli") for dep in deps if _within(dep, "grpo_operator.cli"))
    assert inward == []


@pytest.mark.parametrize("adapter", ["grpo_operator.cluster", "grpo_operator.local"])
def test_an_adapter_is_imported_by_the_command_line_alone(adapter):
    """The core (status/, the builders, the engine) imports neither adapter, and the adapters not each other: only
    the command line, which wires them, does."""
    outside = sorted(f"{name} -> {dep}" for name, deps in _package_graph().items()
                     if not _within(name, adapter) and not _within(name, "grpo_operator.cli")
                     for dep in deps if _within(dep, adapter))
    assert outside == []


def test_a_cycle_through_a_type_checking_import_is_found():
    sources = {"p": "", "p.a": "from .b import B\n",
               "p.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
               "p.c": "from . import a\n"}
    assert cycles(import_graph(sources, {"p"})) == [["p.a", "p.b"]]


def test_every_import_within_the_package_names_a_module_that_is_there():
    """Function-level imports included: a module moved leaves no import that fails only when its command runs."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    packages = {name for name, path in paths.items() if path.name == "__init__.py"}
    missing = []
    for name, path in sorted(paths.items()):
        base = name.split(".") if name in packages else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                if target not in paths:
                    missing.append(f"{name}: {target}")
            elif isinstance(node, ast.ImportFrom | ast.Import):
                modules = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                missing += [f"{name}: {module}" for module in modules
                            if module and module.startswith("grpo_operator.") and module not in paths]
    assert missing == []

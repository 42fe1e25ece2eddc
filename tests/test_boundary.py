"""The two packages' import boundaries: what the operator may import from the pods' package, a contract that imports
nothing else, and no import cycle in either package.

The operator runs without torch, TRL or vLLM; what it needs of the pods' side (exit codes, the run config, the
/progress report, metric names, the launch argv, reward names) comes from `grpo_trainer.contract`, so a change on the
pods' side that the operator depends on is a change there. A few operator modules run trainer code on purpose
(`grporun local` checks user code and probes its servers; `grporun export` exports a model): they are listed, with
the trainer modules each may import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

OPERATOR = REPO / "operator" / "grpo_operator"
TRAINER = REPO / "trainer_image" / "grpo_trainer"
CONTRACT = "grpo_trainer.contract"
#: Operator module -> the trainer modules outside the contract it imports, because it runs trainer code on purpose.
TRAINER_CODE_IN_THE_OPERATOR = {
    # `grporun local`: user rewards, tools and environment factories imported before minutes of server start-up.
    "grpo_operator.local.plan": {"grpo_trainer.learner.rewards", "grpo_trainer.agentic.tools"},
    # `grporun local`: a local rollout server's liveness, by the pod's own generation probe.
    "grpo_operator.local.rollout_restarts": {"grpo_trainer.server.health"},
    # `grporun export`: the learner's export, again, from a local run's checkpoint.
    "grpo_operator.cli.export_command": {"grpo_trainer.storage.reexport", "grpo_trainer.storage.model_export"},
}
#: What the contract may import besides the standard library and itself.
CONTRACT_DEPENDENCIES = {"pydantic"}


def _is_trainer_module(name: str) -> bool:
    path = TRAINER.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def trainer_imports(source: str) -> list[str]:
    """The grpo_trainer modules a source file imports, function-level imports included; `from package import name`
    counts as importing the module `package.name` where there is one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "grpo_trainer"]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("grpo_trainer"):
            modules = [f"{node.module}.{alias.name}" for alias in node.names]
            if node.module == "grpo_trainer":  # `from grpo_trainer import contract`
                found += modules
            else:
                found += [module for module in modules if _is_trainer_module(module)] or [node.module]
    return found


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path) -> tuple[dict[str, Path], set[str]]:
    """Every module of `package` by its dotted name, and which of them are packages."""
    paths = {_module_name(path, package): path for path in package.rglob("*.py")}
    return paths, {name for name, path in paths.items() if path.name == "__init__.py"}


def test_the_operator_imports_the_trainer_package_through_its_contract_only():
    paths, _ = _modules(OPERATOR)
    outside: dict[str, set[str]] = {}
    for name, path in sorted(paths.items()):
        for module in trainer_imports(path.read_text()):
            if module != CONTRACT and not module.startswith(f"{CONTRACT}."):
                outside.setdefault(name, set()).add(module)
    # Equal, not a subset: an entry the operator no longer needs leaves the list.
    assert outside == TRAINER_CODE_IN_THE_OPERATOR


@pytest.mark.parametrize(("source", "module"), [
    ("from grpo_trainer.learner.gang import gang_exit_code", "grpo_trainer.learner.gang"),
    ("import grpo_trainer.server.main", "grpo_trainer.server.main"),
    ("from grpo_trainer.learner import rewards", "grpo_trainer.learner.rewards"),
    ("def f():\n    from grpo_trainer.storage.object_store import upload_folder\n",
     "grpo_trainer.storage.object_store"),
])
def test_an_import_around_the_contract_is_found(source, module):
    assert trainer_imports(source) == [module]


def _external_imports(source: str) -> set[str]:
    """The top-level names of the absolute imports in a source file (relative ones stay in the package)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").split(".")[0])
    return found


def test_the_contract_imports_nothing_outside_itself():
    """A leaf: the standard library, pydantic and its own modules (relative imports), nothing else: no torch for
    the operator, and no trainer module that would hand the operator its behaviour."""
    contract = TRAINER / "contract"
    allowed = set(sys.stdlib_module_names) | CONTRACT_DEPENDENCIES
    beyond = {f"{path.name}: {module}" for path in sorted(contract.rglob("*.py"))
              for module in _external_imports(path.read_text()) if module not in allowed}
    escaping = [f"{path.name}: level {node.level}" for path in sorted(contract.rglob("*.py"))
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level > 1]
    assert not beyond and not escaping


def test_the_contract_hands_on_nothing_it_does_not_own():
    """No module-level `__getattr__` in the contract: every name there is defined there, so the import graph sees
    what depends on what and a name has its type."""
    forwarding = [path.name for path in sorted((TRAINER / "contract").rglob("*.py"))
                  for node in ast.parse(path.read_text()).body
                  if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"]
    assert forwarding == []


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


def package_cycles(package: Path) -> list[list[str]]:
    paths, packages = _modules(package)
    return cycles(import_graph({name: path.read_text() for name, path in paths.items()}, packages))


def test_the_operator_package_has_no_import_cycle():
    assert package_cycles(OPERATOR) == []


def _operator_graph() -> dict[str, set[str]]:
    paths, packages = _modules(OPERATOR)
    return import_graph({name: path.read_text() for name, path in paths.items()}, packages)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def test_the_command_line_is_imported_by_itself_alone():
    """cli/ is the outermost layer: the core and the adapters (local/, cluster/) do not import it (what they share
    with it, the exit codes, is at the package root)."""
    inward = sorted(f"{name} -> {dep}" for name, deps in _operator_graph().items()
                    if not _within(name, "grpo_operator.cli") for dep in deps if _within(dep, "grpo_operator.cli"))
    assert inward == []


@pytest.mark.parametrize("adapter", ["grpo_operator.cluster", "grpo_operator.local"])
def test_an_adapter_is_imported_by_the_command_line_alone(adapter):
    """The core (status/, the builders, the engine) imports neither adapter, and the adapters not each other: only
    the command line, which wires them, does."""
    outside = sorted(f"{name} -> {dep}" for name, deps in _operator_graph().items()
                     if not _within(name, adapter) and not _within(name, "grpo_operator.cli")
                     for dep in deps if _within(dep, adapter))
    assert outside == []


def test_the_trainer_package_has_no_import_cycle():
    """Function-level imports count as much as module-level ones: a lazy import only hides a cycle from Python."""
    assert package_cycles(TRAINER) == []


def test_a_cycle_through_a_type_checking_import_is_found():
    sources = {"p": "", "p.a": "from .b import B\n",
               "p.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
               "p.c": "from . import a\n"}
    assert cycles(import_graph(sources, {"p"})) == [["p.a", "p.b"]]


def test_a_cycle_through_a_function_level_import_in_a_subpackage_is_found():
    sources = {"p": "", "p.q": "", "p.q.a": "from ..b import B\n",
               "p.b": "def f():\n    from .q.a import A\n", "p.c": "from .q import a\n"}
    assert cycles(import_graph(sources, {"p", "p.q"})) == [["p.b", "p.q.a"]]


@pytest.mark.parametrize("package", [OPERATOR, TRAINER], ids=["operator", "trainer"])
def test_every_import_within_the_package_names_a_module_that_is_there(package):
    """Function-level imports included (and the other package's modules it names): a module moved leaves no import
    that fails only when its command runs."""
    paths, packages = _modules(package)
    everywhere = {**_modules(OPERATOR)[0], **_modules(TRAINER)[0]}
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
                            if module and module.startswith(("grpo_operator.", "grpo_trainer."))
                            and module not in everywhere]
    assert missing == []

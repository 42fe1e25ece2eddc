"""No constructor in either package takes more than MAX_PARAMETERS parameters unless a `# more than 8: <why>` comment
beside it says why. A long parameter list is usually values that travel together and want a dataclass of their own.

Constructors are `__init__` methods (less `self`), dataclasses (their init fields, inherited ones included) and
pydantic models (their fields, inherited ones included). The comment goes on the `def`/`class` line, the lines of
the signature, or the line above (a decorator counts as part of the header)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from tests.support.paths import REPO

MAX_PARAMETERS = 8
REASON = re.compile(r"#\s*more than 8:\s*\S")
PACKAGES = (REPO / "operator" / "grpo_operator", REPO / "trainer_image" / "grpo_trainer")
#: Bases whose subclasses' fields are their constructor's parameters.
MODEL_BASES = {"BaseModel", "WireModel"}


@dataclass(frozen=True)
class Constructor:
    where: str  # path:line
    name: str
    parameters: int
    explained: bool


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def _init_false(value: ast.expr | None) -> bool:
    return (isinstance(value, ast.Call) and getattr(value.func, "attr", getattr(value.func, "id", "")) == "field"
            and any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                    for k in value.keywords))


def _own_fields(node: ast.ClassDef) -> list[str]:
    fields = []
    for statement in node.body:
        if not isinstance(statement, ast.AnnAssign) or not isinstance(statement.target, ast.Name):
            continue
        if "ClassVar" in ast.unparse(statement.annotation) or statement.target.id.startswith("__"):
            continue
        if statement.target.id.startswith("_") and not _is_dataclass(node):  # pydantic private attributes
            continue
        if not _init_false(statement.value):
            fields.append(statement.target.id)
    return fields


def _base_names(node: ast.ClassDef) -> list[str]:
    return [base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "") for base in node.bases]


def _explained(lines: list[str], first: int, last: int) -> bool:
    """A reason on lines first..last (1-based, inclusive), or on the line above them."""
    return any(REASON.search(line) for line in lines[max(first - 2, 0):last])


def constructors() -> list[Constructor]:
    classes: dict[str, ast.ClassDef] = {}
    sources: dict[int, tuple[str, list[str]]] = {}
    for root in PACKAGES:
        for path in sorted(root.rglob("*.py")):
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, node)
                    sources[id(node)] = (f"{path.relative_to(REPO)}", text.splitlines())

    def fields(node: ast.ClassDef, seen: frozenset[str] = frozenset()) -> tuple[list[str], bool]:
        """(the init fields, whether it is a model or dataclass at all) through the bases defined here."""
        own, is_model = _own_fields(node), _is_dataclass(node) or bool(MODEL_BASES & set(_base_names(node)))
        inherited: list[str] = []
        for base in _base_names(node):
            if base in classes and base not in seen:
                base_fields, base_is_model = fields(classes[base], seen | {node.name})
                inherited += base_fields
                is_model = is_model or base_is_model
        return [*inherited, *(f for f in own if f not in inherited)], is_model

    found = []
    for node in classes.values():
        path, lines = sources[id(node)]
        header_first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        header_last = node.body[0].lineno - 1 if node.body else node.lineno
        init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if init is not None:
            arguments = init.args
            count = len(arguments.posonlyargs) + len(arguments.args) - 1 + len(arguments.kwonlyargs)
            count += (arguments.vararg is not None) + (arguments.kwarg is not None)
            signature_last = init.body[0].lineno - 1
            found.append(Constructor(f"{path}:{init.lineno}", f"{node.name}.__init__", count,
                                     _explained(lines, init.lineno, signature_last)
                                     or _explained(lines, header_first, header_last)))
            continue
        names, is_model = fields(node)
        if is_model:
            found.append(Constructor(f"{path}:{node.lineno}", node.name, len(names),
                                     _explained(lines, header_first, header_last)))
    return found


def test_the_audit_sees_both_kinds_of_constructor():
    names = {c.name for c in constructors()}
    assert {"RolloutProgress.__init__", "RunRef", "GRPORunSpec"} <= names


def test_no_constructor_takes_more_than_eight_parameters_without_a_reason():
    unexplained = [f"{c.where} {c.name}: {c.parameters} parameters" for c in constructors()
                   if c.parameters > MAX_PARAMETERS and not c.explained]
    assert not unexplained, (
        f"constructors over {MAX_PARAMETERS} parameters with no `# more than 8: <why>` beside them "
        "(group the values that travel together into a dataclass, or say why not):\n" + "\n".join(unexplained))

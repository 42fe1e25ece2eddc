"""What the operator package may import from the learner's: grpo_trainer.contract, nothing else.

The operator runs without torch, TRL or vLLM; what it needs of the pods' side (exit codes, the run config, the
/progress report, metric names, the launch argv, reward names) comes through the contract module, so a change on
the pods' side that the operator depends on is a change there.
"""

from __future__ import annotations

import ast

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

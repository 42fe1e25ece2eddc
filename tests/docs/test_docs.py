"""The repository stands alone: its docs map every module, and nothing points outside it or at how it was built."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.support.paths import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"
CHECKED = ["operator", "trainer_image", "tests", "bench", "charts", "crds", "README.md", "docs"]
# Pointers outside the repository and words about how it was built. Written so that this file matches nothing.
STRAY = re.compile(r"LEARNER\.md|OPERATOR\.md|ARCHITECTURE\.md|\.\./shared|issue [0-9]|the seed[']s|T:[0-9]|W:[0-9]")


def _tracked(*paths: str) -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--", *paths], cwd=REPO, capture_output=True, text=True, check=True)
    return [line for line in listed.stdout.splitlines() if (REPO / line).is_file()]


def python_modules() -> list[str]:
    """Dotted names of every Python module the operator and the trainer ship."""
    modules = []
    for path in _tracked("operator", "trainer_image"):
        if path.endswith(".py"):
            parts = path.split("/")[1:]
            parts[-1] = parts[-1].removesuffix(".py")
            if parts[-1] == "__init__" and len(parts) > 2:
                parts = parts[:-1]
            modules.append(".".join(parts))
    return sorted(set(modules) - {"grpo_operator.__init__", "grpo_trainer.__init__"})


def test_the_module_map_names_every_module():
    text = ARCHITECTURE.read_text()
    missing = [module for module in python_modules() if f"`{module}`" not in text]
    assert not missing, f"docs/architecture.md does not map: {', '.join(missing)}"


def test_the_module_map_names_no_module_that_is_gone():
    named = set(re.findall(r"`(grpo_(?:operator|trainer)(?:\.\w+)+)`", ARCHITECTURE.read_text()))
    modules = set(python_modules())
    # A name may also be a module's attribute (`grpo_trainer.contract.config.RunConfig`): its module must exist.
    gone = [name for name in named if not any(name == m or name.startswith(m + ".") for m in modules)]
    assert not gone, f"docs/architecture.md names modules that do not exist: {', '.join(sorted(gone))}"


TRAINER = REPO / "trainer_image" / "grpo_trainer"
SECTION = re.compile(r"^### .*\(`(trainer_image/grpo_trainer/(?:\w+/)?)`\)$")


def _map_sections() -> dict[str, set[str]]:
    """The trainer's part of the module map: the folder each `### ... (`folder/`)` heading names -> the modules its
    table lists."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in ARCHITECTURE.read_text().splitlines():
        if line.startswith("#"):
            match = SECTION.match(line)
            current = match[1] if match else None
            if current is not None:
                sections[current] = set()
        elif current is not None and (row := re.match(r"\| `(grpo_trainer(?:\.\w+)*)` \|", line)):
            sections[current].add(row[1])
    return sections


def _room_folder(module: str) -> str:
    """The folder of the room a trainer module sits in: its subpackage of grpo_trainer, or the package itself."""
    room = module.split(".")[1]
    return f"trainer_image/grpo_trainer/{room}/" if (TRAINER / room / "__init__.py").is_file() else \
        "trainer_image/grpo_trainer/"


def test_the_module_map_has_a_section_per_room_listing_its_modules():
    """One section per room of the trainer (a subpackage of grpo_trainer, and the package's own top), each module in
    the section of its room, and no section for a room that is gone."""
    sections = _map_sections()
    rooms = {f"trainer_image/grpo_trainer/{path.parent.name}/" for path in TRAINER.glob("*/__init__.py")}
    assert set(sections) == rooms | {"trainer_image/grpo_trainer/"}
    misplaced = [module for module in python_modules() if module.startswith("grpo_trainer.")
                 and module not in sections[_room_folder(module)]]
    assert not misplaced, f"docs/architecture.md lists these outside their room's section: {', '.join(misplaced)}"


@pytest.mark.parametrize("path", _tracked(*CHECKED))
def test_nothing_points_outside_the_repository(path):
    text = (REPO / path).read_text(errors="replace")
    lines = enumerate(text.splitlines(), 1)
    hits = [f"{path}:{number}: {line.strip()}" for number, line in lines if STRAY.search(line)]
    assert not hits, "\n".join(hits)


# --------------------------------------------------------------------------------------------------------------------
# The front door and the pages it links to: one page owns each subject, and the others link to it.
# --------------------------------------------------------------------------------------------------------------------
README = REPO / "README.md"
README_LIMIT_BYTES = 10_000
PAGES = ["README.md", "charts/grpo-operator/README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_the_readme_fits_on_two_screens_and_opens_with_the_two_commands():
    text = README.read_text()
    assert len(text.encode()) <= README_LIMIT_BYTES
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "demo"], ["make", "test"]]


def test_the_readme_shows_the_ending_the_code_prints():
    from grpo_operator.api import Reason
    from grpo_operator.local.console import final_summary

    ending = final_summary({
        "phase": "Succeeded", "message": "the learner reached the epoch bound and exited 0",
        "conditions": [{"type": "Succeeded", "status": "True", "reason": Reason.EPOCH_BOUND_REACHED}],
        "progress": {"epoch": 12, "epochs": 12, "groupsConsumed": 192, "groupsTotal": 192, "groupsTrained": 192,
                     "groupsDropped": 0, "globalStep": 59, "rewardMean": 0.388},
    })
    assert ending in README.read_text()


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_anchor_resolves(page):
    path = REPO / page
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
            broken.append(target)
    assert not broken, f"{page}: broken links: {', '.join(broken)}"


def _learner_exit_codes() -> list[int]:
    from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG, EXIT_PREEMPTED, EXIT_STALLED

    return [EXIT_STALLED, EXIT_PREEMPTED, EXIT_INVALID_CONFIG]


def _reasons() -> set[str]:
    from grpo_operator.api import Reason

    return {value for name, value in vars(Reason).items() if name.isupper()}


def _values_keys() -> set[str]:
    import yaml

    return set(yaml.safe_load((REPO / "charts" / "grpo-operator" / "values.yaml").read_text()))


def _lines(text: str) -> list[str]:
    return text.splitlines()


def _paragraphs(text: str) -> list[str]:
    return [" ".join(block.split()) for block in re.split(r"\n\s*\n", text)]


def _names_exit_codes(line: str) -> bool:
    return sum(bool(re.search(rf"(?<![\d.]){code}(?![\d.])", line)) for code in _learner_exit_codes()) >= 2


def _lists_reasons(paragraph: str) -> bool:
    return len(set(re.findall(r"`(\w+)`", paragraph)) & _reasons()) >= 8


def _is_values_row(line: str) -> bool:
    row = re.match(r"\| `(\w+)[.`]", line)
    return row is not None and row.group(1) in _values_keys()


# fact -> (the page that owns it, the unit it is written in, does a unit restate it?). A page may mention an exit
# code or a reason in passing; a line naming several exit codes, a paragraph listing the reasons, or a row of the
# chart's values table is the fact itself.
CANONICAL = {
    "the learner's exit codes": ("docs/architecture.md", _lines, _names_exit_codes),
    "the condition reasons": ("docs/operator.md", _paragraphs, _lists_reasons),
    "the chart's values": ("charts/grpo-operator/README.md", _lines, _is_values_row),
}


@pytest.mark.parametrize("fact", sorted(CANONICAL))
def test_a_fact_lives_in_its_own_page_only(fact):
    owner, units, restates = CANONICAL[fact]
    assert any(map(restates, units((REPO / owner).read_text()))), f"{owner} no longer holds {fact}"
    elsewhere = [f"{page} ({unit[:60]}...)" for page in PAGES if page != owner
                 for unit in units((REPO / page).read_text()) if restates(unit)]
    assert not elsewhere, f"{fact} belongs to {owner} alone (link to it); restated in {'; '.join(elsewhere)}"


def test_the_cli_page_shows_the_exit_codes_the_code_uses():
    from grpo_operator.exit_codes import MEANINGS, ExitCode

    rows = re.findall(r"^\| `(\d+)` \| (.+) \|$", (REPO / "docs" / "cli.md").read_text(), re.M)
    assert rows == [(str(int(code)), MEANINGS[code]) for code in ExitCode]

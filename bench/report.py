"""Figures as text (median and min-max), the machine header, and BENCHMARKS.md's per-section splicing."""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


class SectionUnavailable(Exception):
    """A section that cannot run here (a missing venv, a component not built yet); the reason goes in the report."""


@dataclass
class Context:
    """What every section gets: where to put scratch files, the tiny model, how many repetitions to run, and the
    options of the sections that take some (section name -> its options)."""

    scratch: Path
    quick: bool = False
    options: dict[str, dict] = field(default_factory=dict)

    def reps(self, full: int, quick: int = 2) -> int:
        return quick if self.quick else full

    @property
    def model_dir(self) -> str:
        """The tiny model, from the tests' cache of tiny models (built there once per recipe)."""
        from tests.support import tiny_models

        return str(tiny_models.cached(tiny_models.POLICY))


def spread(values: Sequence[float], fmt: str = "{:.3g}", unit: str = "") -> str:
    """'median (min-max)' of the values, or the value alone when there is one; NaNs (a figure a run could not give)
    are left out, and none left is 'n/a'."""
    values = sorted(value for value in values if not math.isnan(value))
    if not values:
        return "n/a"
    median = fmt.format(statistics.median(values))
    if len(values) == 1 or values[0] == values[-1]:
        return f"{median}{unit}"
    return f"{median}{unit} ({fmt.format(values[0])}–{fmt.format(values[-1])})"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): with few samples an interpolated p95 would invent a value."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _rollout_vllm_version(root: Path) -> str:
    """vLLM lives in its own venv (.venv-rollout); read its dist-info rather than importing it here."""
    found = sorted((root / ".venv-rollout").glob("lib/python*/site-packages/vllm*.dist-info/METADATA"))
    for metadata in found:
        text = metadata.read_text(errors="replace")
        name = re.search(r"^Name: (.+)$", text, re.M)
        version = re.search(r"^Version: (.+)$", text, re.M)
        if name and version:
            return f"{name.group(1).strip()} {version.group(1).strip()} (.venv-rollout)"
    return "not installed (.venv-rollout missing)"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024**2:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def machine(root: Path) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = [
        ("CPU", f"{_cpu_model()}, {cores} cores usable"),
        ("memory", _memory_gib()),
        ("load average at start (1 min)", f"{load:.2f}"),
        ("OS / Python", f"{platform.platform()} / {platform.python_version()}"),
        ("torch", _version("torch")),
        ("trl", _version("trl")),
        ("transformers", _version("transformers")),
        ("accelerate", _version("accelerate")),
        ("kopf", _version("kopf")),
        ("vLLM", _rollout_vllm_version(root)),
    ]
    return table(["", ""], rows)


# ------------------------------------------------------------------------------------------------ BENCHMARKS.md
def _markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def section_body(document: str, name: str) -> str | None:
    """The text between section `name`'s markers, or None when the document has no such section."""
    begin, end = _markers(name)
    found = re.search(re.escape(begin) + r"\n?(.*?)\n?" + re.escape(end), document, re.S)
    return found.group(1).strip() if found else None


def splice(document: str, name: str, body: str) -> str:
    """Replace section `name` of the document (between its markers), or append it."""
    begin, end = _markers(name)
    block = f"{begin}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(document):
        return pattern.sub(lambda _: block, document, count=1)
    return document.rstrip() + "\n\n" + block + "\n"

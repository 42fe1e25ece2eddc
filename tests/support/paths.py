"""Where things are, for tests and benchmarks."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
MANIFEST_FIXTURES = FIXTURES / "manifests"
# A vLLM-shaped server run as a script, so a test can SIGSTOP or kill its process.
COMPLETIONS_SERVER = REPO / "tests" / "support" / "servers" / "completions_server.py"


def make_variable(name: str) -> str:
    """A `NAME := value` set in the Makefile (versions and paths the set-up and the images must agree on)."""
    return re.search(rf"^{name} :?= *(\S+)$", (REPO / "Makefile").read_text(), re.M)[1]

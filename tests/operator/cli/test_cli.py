"""`grporun` itself: `--version`, an example in every command's help, the exit codes listed, one voice for problems
(stderr, one line) whatever the command."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from grpo_operator import cli
from grpo_operator.exit_codes import MEANINGS, ExitCode

GRPORUN = [sys.executable, "-m", "grpo_operator.cli"]


def test_version_prints_the_installed_distribution_version(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"grporun {importlib.metadata.version('grpo-operator')}"


@pytest.mark.parametrize("command", [None, *cli.SUBCOMMANDS])
def test_every_help_shows_examples_and_the_exit_codes(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"] if command else ["--help"])
    text = capsys.readouterr().out
    examples = text.split("examples:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert examples and all(line.strip().startswith(f"grporun {command or ''}".strip()) for line in examples)
    assert all(f"{int(code):<4} {MEANINGS[code]}" in text for code in ExitCode)
    assert "`" not in text.split("\n\n", 2)[1]  # the description is plain text, not Markdown


def test_every_exit_code_has_its_meaning():
    assert set(MEANINGS) == set(ExitCode)


def test_a_usage_mistake_exits_2_on_stderr_in_every_command():
    for argv in (["local"], ["validate"], ["render"], ["nope"], ["operator"]):
        result = subprocess.run([*GRPORUN, *argv], capture_output=True, text=True, timeout=120)
        assert (result.returncode, result.stdout) == (ExitCode.USAGE, ""), argv
        assert result.stderr.strip() and "Traceback" not in result.stderr, argv

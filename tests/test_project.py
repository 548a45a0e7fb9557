"""Project-level checks: CI runs the README's test command, and the code type-checks and
lints clean (mypy --strict, ruff)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```sh\n(.+?)\n```", text)


def test_readme_has_exactly_the_run_and_test_commands() -> None:
    """Two set-up commands: one that runs prefixpin serve, one that runs pytest."""
    commands = readme_commands()
    assert any(c.rstrip().endswith("prefixpin serve") for c in commands)
    assert any(c.rstrip().endswith("pytest") for c in commands)


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run contains the README's test command verbatim."""
    test_command = next(c for c in readme_commands() if c.rstrip().endswith("pytest"))
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_ruff_is_clean() -> None:
    """ruff check passes on the whole tree."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_is_clean() -> None:
    """mypy --strict (configured in pyproject.toml) passes on code, tests and bench."""
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr

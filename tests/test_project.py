"""Project-level checks: CI runs the README's test command, the code type-checks and
lints clean (mypy --strict, ruff), and the wheel holds the product and nothing of the
tests (the test rig is tests/rig/, which product code never imports)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
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


PACKAGES = ("core", "proxy", "adapters", "fingerprint")


def test_the_wheel_holds_the_packages_and_no_test_rig(tmp_path: Path) -> None:
    """The wheel, built offline from a copy of the tree (tests/ and bench/ included, so
    leaving them out is the packaging's doing): the four packages under the one import name
    ``prefixpin``, the default model's fetch, and no test rig, fake, tests or benches.
    Installed, it puts exactly one top-level package where it goes, and that one runs."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", "test-artifacts",
        ".*_cache", ".hypothesis"))
    assert (source / "tests" / "rig").is_dir()
    assert (source / "bench").is_dir()
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(tmp_path / "dist"), "."],
        cwd=source, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "dist").glob("prefixpin-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(
        ".dist-info")}
    assert tops == {"prefixpin"}
    assert {f"prefixpin/{package}/__init__.py" for package in PACKAGES} <= set(names)
    assert "prefixpin/proxy/models.py" in names  # prefixpin serve's default model fetch
    parts = {part.removesuffix(".py") for name in names for part in name.split("/")}
    test_weight = {"rig", "tests", "bench", "fakes", "fake_ollama", "faults"}
    assert not parts & test_weight, sorted(parts & test_weight)

    site = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert {entry.name for entry in site.iterdir() if not entry.name.endswith(
        ".dist-info") and entry.name != "bin"} == {"prefixpin"}
    # PYTHONPATH comes before this venv's editable finder: the wheel's copy is the one run.
    ran = subprocess.run(
        [sys.executable, "-c", "import prefixpin.proxy.cli as cli; print(cli.__file__)"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True,
        text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert Path(ran.stdout.strip()).is_relative_to(site)


def test_product_code_never_imports_tests_or_bench() -> None:
    """No module of the four packages imports tests (the rig among them) or bench."""
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: {module}"
                              for module in modules
                              if module.split(".")[0] in ("tests", "bench")]
    assert not offenders, offenders


def test_the_dockerfile_copies_exactly_the_packages() -> None:
    """The image installs from the packages alone (no tests, rig or benches), all of them."""
    copied = re.findall(r"^COPY (\S+) \./\1$", (ROOT / "Dockerfile").read_text(), re.M)
    assert sorted(copied) == sorted([*PACKAGES, "prefixpin"])


def test_the_coverage_gate_is_configured(pytestconfig: object) -> None:
    """Every run measures line+branch coverage of the real package folders (pytest-cov, from
    addopts), and a run of the whole suite is gated (tests/coverage_gate.py, registered by
    tests/conftest.py): overall, and higher for fingerprint/, the SSE/NDJSON framing (every
    client codec that streams SSE or NDJSON among them) and proxy/paths.py."""
    import tomllib

    import pytest

    from tests.coverage_gate import AREAS, PLUGIN_NAME

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(r.startswith("pytest-cov") for r in project["project"][
        "optional-dependencies"]["test"])
    addopts = project["tool"]["pytest"]["ini_options"]["addopts"].split()
    assert "--cov" in addopts
    assert "--no-cov" not in addopts
    run = project["tool"]["coverage"]["run"]
    assert run["branch"] is True
    assert set(PACKAGES) <= set(run["source"])  # the real folders, not prefixpin/'s links
    assert isinstance(pytestconfig, pytest.Config)
    assert pytestconfig.pluginmanager.has_plugin(PLUGIN_NAME)

    gates = {area.name: area for area in AREAS}
    overall = gates.pop("overall")
    assert overall.include == ()
    assert overall.gate >= 80
    assert set(gates) == {"fingerprint", "sse/ndjson codecs", "proxy/paths.py"}
    for area in gates.values():
        assert area.gate > overall.gate, area
        for pattern in area.include:
            assert list(ROOT.glob(pattern)), f"{area.name}: {pattern} matches no file"
    streaming = {f"proxy/codecs/{path.name}" for path in (ROOT / "proxy" / "codecs").glob("*.py")
                 if re.search(r"^\s+media_type = (SSE|NDJSON)_MEDIA_TYPE$",
                              path.read_text(), re.M)}
    assert streaming, "no SSE/NDJSON codec found under proxy/codecs"
    codecs = set(gates["sse/ndjson codecs"].include)
    assert {"core/sse.py", "core/ndjson.py"} | streaming <= codecs, streaming - codecs

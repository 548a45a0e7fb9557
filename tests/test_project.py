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

import httpx
import pytest

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
    assert "prefixpin/proxy/engine/models.py" in names  # prefixpin serve's default model fetch
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


def test_no_symbolic_link_is_tracked() -> None:
    """Git for Windows checks links out as text files: the tree holds none."""
    staged = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    links = [line.split("\t", 1)[1] for line in staged if line.startswith("120000 ")]
    assert not links, links


def test_the_build_names_every_package() -> None:
    """The build's package mapping (pyproject.toml) names every folder of the four that is a
    package, under prefixpin, and nothing else."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"prefixpin": "prefixpin", **{
        f"prefixpin.{package}": package for package in PACKAGES}}
    folders = {"prefixpin"} | {
        "prefixpin." + ".".join(init.parent.relative_to(ROOT).parts)
        for package in PACKAGES for init in (ROOT / package).rglob("__init__.py")}
    assert sorted(setuptools["packages"]) == sorted(folders)


def _install(source: Path, site: Path) -> None:
    """``pip install SOURCE`` (a tree or an sdist) into ``site``, offline, with this
    venv's build backend."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def _modules(site: Path) -> set[str]:
    return {str(path.relative_to(site)) for path in (site / "prefixpin").rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}


def _serves(site: Path, cwd: Path) -> None:
    """The installed console script answers --help, and ``serve`` relays a chat completion
    from a fake llama-server (PYTHONPATH: the install comes before this venv's own)."""
    from tests.fakes.fake_llama import FakeLlamaServer
    from tests.fakes.servers import serve_in_thread
    from tests.rig.replica_process import run_replica

    env = {**os.environ, "PYTHONPATH": str(site)}
    script = site / "bin" / "prefixpin"
    helped = subprocess.run([str(script), "--help"], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr
    assert "serve" in helped.stdout
    with serve_in_thread(FakeLlamaServer().app()) as engine, run_replica(
            [engine], cwd / "serve.log", program=[str(script)], cwd=cwd, env=env,
            args=["--log-level", "warning"], operator=False) as proxy:
        answer = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_a_checkout_without_symlinks_installs_and_serves(tmp_path: Path) -> None:
    """A clone made as Git for Windows makes one (``core.symlinks=false``; it holds the last
    commit) installs with ``pip install .``, and its ``prefixpin`` runs and serves. The
    sdist built from it, offline, installs the same modules as the tree."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "-c", "core.symlinks=false", "clone", "-q", str(ROOT), str(clone)],
                   check=True, capture_output=True, timeout=120)
    site = tmp_path / "site"
    _install(clone, site)
    assert {"prefixpin/proxy/cli.py", "prefixpin/core/sse.py", "prefixpin/adapters/__init__.py",
            "prefixpin/fingerprint/__init__.py"} <= _modules(site)
    _serves(site, tmp_path)

    built = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools.build_meta import build_sdist; "
         "print(build_sdist(sys.argv[1]))", str(tmp_path / "sdist")],
        cwd=clone, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    sdist = tmp_path / "sdist" / built.stdout.split()[-1]
    from_sdist = tmp_path / "from-sdist"
    _install(sdist, from_sdist)
    assert _modules(from_sdist) == _modules(site)


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
    client codec that streams SSE or NDJSON among them) and proxy/listen/paths.py."""
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
    # the real folders (the editable view's links resolve to them)
    assert set(PACKAGES) <= set(run["source"])
    assert isinstance(pytestconfig, pytest.Config)
    assert pytestconfig.pluginmanager.has_plugin(PLUGIN_NAME)

    gates = {area.name: area for area in AREAS}
    overall = gates.pop("overall")
    assert overall.include == ()
    assert overall.gate >= 80
    assert set(gates) == {"fingerprint", "sse/ndjson codecs", "proxy/listen/paths.py"}
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

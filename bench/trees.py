"""A proxy arm run from another source tree, beside this tree's, in one bench run.

``--before-tree PATH`` (``bench/overhead.py``, ``bench/affinity_latency.py``) adds arms that
run the proxy's CLI from PATH, e.g. a ``git worktree`` of an older commit::

    git worktree add /tmp/pp-before 783c80c
    python bench/overhead.py --before-tree /tmp/pp-before

Both trees' arms run with this venv's interpreter, in their own process, with
``cwd=TREE`` and ``PYTHONPATH=TREE``: the tree's packages shadow the editable install (its
import finder comes after ``sys.path``). A tree names them ``prefixpin.proxy``, ... or, before
they installed under one name, ``proxy``, ...: ``Tree.package`` says which. Which code an
arm runs is checked before the run, not assumed: the same interpreter, environment and
working directory import the CLI and report its file, which must lie inside the tree
(recorded in the result with the tree's commit and whether it had local changes).

A tree may run on another interpreter (``python``: a venv made from another Python, with
the proxy's dependencies installed), e.g. to measure what the interpreter's build costs
(``bench/load.py --proxy-python``); it then runs with ``PYTHONPATH=TREE`` too, so that it
imports the tree's code whatever that venv holds, and the interpreter's version and build
(``proxy.speed.interpreter``) are recorded beside the commit.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent  # this tree's root

# What an arm's interpreter imports, and its build (``proxy.speed.interpreter``; {} for a tree
# older than that module).
_PROBE = """\
import importlib, json, sys
cli = importlib.import_module("{package}proxy.cli")
adapters = importlib.import_module("{package}adapters")
build = {{}}
# Where a tree keeps it: proxy/speed/ now, proxy/listen/ or proxy/ in older trees.
for room in ("proxy.speed", "proxy.listen", "proxy"):
    try:
        build = importlib.import_module(
            "{package}" + room + ".interpreter").interpreter_build().fields()
        break
    except ImportError:
        pass
try:  # (an older tree's compiled relay, where it was built)
    compiled = importlib.import_module("{package}core.compiled_relay").available()
except ImportError:
    compiled = False
print(cli.__file__); print(adapters.__file__); print(sys.executable)
print(json.dumps(build)); print(json.dumps(compiled))
"""


@dataclass(frozen=True, slots=True)
class Tree:
    """Where a proxy arm's code comes from."""

    root: Path
    shadow: bool  # run with PYTHONPATH=root (another tree), else as installed (this tree)
    python: str = sys.executable  # the interpreter the arm runs on

    @classmethod
    def this(cls, python: str | None = None) -> Tree:
        if python is None:
            return cls(HERE, shadow=False)
        return cls(HERE, shadow=True, python=_interpreter(python))

    @classmethod
    def other(cls, path: Path, python: str | None = None) -> Tree:
        root = path.resolve()
        if not (root / "proxy" / "cli.py").is_file():  # every tree keeps its folders
            raise SystemExit(f"--before-tree {path}: no proxy/cli.py there")
        if root == HERE:
            raise SystemExit(f"--before-tree {path} is this tree")
        return cls(root, shadow=True, python=sys.executable if python is None
                   else _interpreter(python))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.shadow:
            env["PYTHONPATH"] = str(self.root)
        return env

    @property
    def package(self) -> str:
        """The prefix the tree's modules are imported under: "prefixpin." or, for a tree
        older than the one import name, ""."""
        return "prefixpin." if (self.root / "prefixpin" / "__init__.py").is_file() else ""

    def serve(self) -> list[str]:
        return [self.python, "-m", f"{self.package}proxy.cli", "serve"]

    def popen_kwargs(self) -> dict[str, Any]:
        return {"env": self.env(), "cwd": str(self.root)}

    def describe(self) -> dict[str, Any]:
        """The tree's commit and the files its arm really imports (checked)."""
        probe = subprocess.run([self.python, "-c", _PROBE.format(package=self.package)],
                               capture_output=True, text=True, check=True,
                               **self.popen_kwargs())
        cli, adapters, executable, build, compiled = probe.stdout.splitlines()[:5]
        for module in (cli, adapters):
            if not Path(module).resolve().is_relative_to(self.root):
                raise SystemExit(f"an arm meant to run {self.root} imports {module}")
        return {"root": str(self.root), "commit": _git(self.root, "rev-parse", "HEAD"),
                # Uncommitted changes to the product code the arm ran (other work in the tree).
                "local_changes": _git(self.root, "status", "--porcelain", "--", "proxy",
                                      "core", "adapters", "fingerprint").splitlines(),
                "proxy_cli": cli, "adapters": adapters,
                "python": {"executable": executable, **json.loads(build)},
                # Whether the tree relays in C (an older tree, with core/_relay.c built):
                # this tree and any tree since its removal relay in Python.
                "compiled_relay": json.loads(compiled)}


def interpreter_line(python: dict[str, Any]) -> str:
    """The proxy's interpreter and its build, as ``proxy.speed.interpreter`` reads it."""
    if not python.get("version"):
        return f"interpreter {python.get('executable', '?')}"
    flags = [flag for flag, on in (("--enable-optimizations", python.get("enable_optimizations")),
                                   ("--with-lto", python.get("with_lto"))) if on]
    return (f"interpreter {python['executable']}: {python.get('implementation', 'CPython')} "
            f"{python['version']}, {python.get('libpython', '?')} libpython, configured "
            + (" ".join(flags) if flags else "without --enable-optimizations or --with-lto"))


def tree_line(described: dict[str, Any]) -> str:
    """A described tree (``Tree.describe``) in a line: where it is, its commit, its local
    product changes, its relay, the interpreter it ran on."""
    relay = "compiled" if described.get("compiled_relay") else "Python"
    return (f"{described['root']} (commit {described['commit'][:9]}, uncommitted product "
            f"changes: {len(described['local_changes'])}, {relay} relay); "
            + interpreter_line(described.get("python") or {}))


def _interpreter(python: str) -> str:
    """An interpreter given by path, checked to run (not resolved: a venv's ``python`` is a
    link, and the venv is what it is run as)."""
    path = Path(python).absolute()
    if not os.access(path, os.X_OK) or path.is_dir():
        raise SystemExit(f"interpreter {python}: not an executable file")
    return str(path)


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def cpu_seconds(pid: int) -> float | None:
    """CPU time a process has used so far, every thread's (``/proc/PID/task/*/schedstat``,
    nanoseconds; None where the kernel does not say). Unlike latency, a process's own CPU
    time per request barely moves when the machine is busy with other work."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def cpu_per_request_us(start: dict[str, float | None], end: dict[str, float | None],
                       requests: dict[str, int]) -> dict[str, float]:
    """Per process: microseconds of its CPU time per request it served in the window."""
    out = {}
    for name, before in start.items():
        after = end.get(name)
        if before is not None and after is not None and requests.get(name):
            out[name] = round((after - before) / requests[name] * 1e6, 1)
    return out


def rotated(order: list[str], index: int) -> list[str]:
    """Round ``index``'s order: every arm takes every position equally often."""
    shift = index % len(order)
    return order[shift:] + order[:shift]


def paired_median_ms(after: list[float], before: list[float]) -> dict[str, float]:
    """Median of the per-round differences after - before (seconds in, ms out), with a 95%
    distribution-free interval (order statistics of the sign test). The two arms of a round
    ran seconds apart, so the pairing cancels most of the machine's drift."""
    diffs = sorted((a - b) * 1000 for a, b in zip(after, before, strict=True))
    n = len(diffs)
    half = 0.98 * n ** 0.5  # 1.96 * sqrt(n) / 2
    low = max(0, int(n / 2 - half))
    high = min(n - 1, int(n / 2 + half))
    return {"median_ms": round(statistics.median(diffs), 3), "ci95_low_ms": round(diffs[low], 3),
            "ci95_high_ms": round(diffs[high], 3)}


def operator_url(url: str) -> str:
    """Where ``prefixpin serve --port P`` serves its views (``/sessions``, ``/metrics``)
    without ``--admin-listen``: its operator listener on loopback, port ``P + 1``. Trees from
    before the two listeners served them on ``P`` itself."""
    base, port = url.rsplit(":", 1)
    return f"{base}:{int(port) + 1}"

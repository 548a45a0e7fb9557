"""bench/trees.py: the arm order, the paired figure, and which code a tree's arm imports."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bench.load_versus import file_name, name_of, tree_of
from bench.trees import (
    HERE,
    Tree,
    cpu_per_request_us,
    cpu_seconds,
    interpreter_line,
    paired_median_ms,
    rotated,
    tree_line,
)


def test_rotated_puts_every_arm_in_every_position() -> None:
    order = ["direct", "proxy", "floor", "before"]
    rounds = [rotated(order, index) for index in range(len(order))]
    assert rounds[1] == ["proxy", "floor", "before", "direct"]
    for position in range(len(order)):
        assert sorted(r[position] for r in rounds) == sorted(order)


def test_paired_median_is_the_median_of_per_round_differences() -> None:
    after = [0.010, 0.011, 0.030, 0.012, 0.013]
    before = [0.009, 0.010, 0.001, 0.011, 0.012]  # one round where after was descheduled
    paired = paired_median_ms(after, before)
    assert paired["median_ms"] == pytest.approx(1.0)
    assert paired["ci95_low_ms"] <= paired["median_ms"] <= paired["ci95_high_ms"]


def test_this_tree_imports_its_own_proxy() -> None:
    described = Tree.this().describe()
    assert Path(described["proxy_cli"]).resolve() == HERE / "proxy" / "cli.py"


def test_another_tree_needs_a_proxy_package(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no proxy/cli\.py"):
        Tree.other(tmp_path)
    with pytest.raises(SystemExit, match="this tree"):
        Tree.other(HERE)


def test_another_tree_shadows_the_installed_package(tmp_path: Path) -> None:
    for package in ("proxy", "adapters"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "proxy" / "cli.py").write_text("")
    described = Tree.other(tmp_path).describe()
    assert described["proxy_cli"] == str(tmp_path.resolve() / "proxy" / "cli.py")
    assert described["commit"] == ""  # not a git checkout


def test_a_tree_says_whether_it_relays_in_c(tmp_path: Path) -> None:
    """A tree without core/_relay.c built (every tree since its removal) relays in Python;
    an older tree that had it built says so (its arm's figures are the compiled relay's)."""
    for package in ("proxy", "adapters"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "proxy" / "cli.py").write_text("")
    bare = Tree.other(tmp_path).describe()
    assert bare["compiled_relay"] is False
    assert "Python relay" in tree_line(bare)
    assert "compiled relay" in tree_line({**bare, "compiled_relay": True})


def test_cpu_per_request_skips_processes_the_kernel_did_not_report() -> None:
    assert cpu_seconds(os.getpid()) is not None  # this process: /proc answers
    per = cpu_per_request_us({"proxy": 1.0, "before": None}, {"proxy": 1.5, "before": 2.0},
                             {"proxy": 500, "before": 500})
    assert per == {"proxy": 1000.0}


def test_a_tree_on_a_named_interpreter_imports_the_trees_code() -> None:
    """``--proxy-python``: the arm runs on that interpreter with PYTHONPATH=the tree (the
    venv it comes from may hold its own copy of the package), and its build is recorded.
    (This venv's python, named, stands in for another venv's: a link elsewhere would not
    be a venv.)"""
    python = Path(sys.executable)
    tree = Tree.this(str(python))
    assert tree.serve()[0] == str(python)
    assert tree.env()["PYTHONPATH"] == str(HERE)
    described = tree.describe()
    assert Path(described["proxy_cli"]).resolve() == HERE / "proxy" / "cli.py"
    assert described["python"]["executable"] == str(python)
    assert described["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    line = interpreter_line(described["python"])
    assert line.startswith(f"interpreter {python}: CPython ")
    assert described["python"]["libpython"] in line
    assert tree_line(described) == (
        f"{HERE} (commit {described['commit'][:9]}, uncommitted product changes: "
        f"{len(described['local_changes'])}, "
        f"{'compiled' if described['compiled_relay'] else 'Python'} relay); {line}")


def test_an_interpreter_that_is_not_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not an executable file"):
        Tree.this(str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="not an executable file"):
        Tree.this(str(tmp_path))


def test_interpreter_line_names_the_configure_flags() -> None:
    assert interpreter_line({"executable": "/x/python", "version": "3.11.2",
                             "libpython": "static", "enable_optimizations": False,
                             "with_lto": False}) == (
        "interpreter /x/python: CPython 3.11.2, static libpython, configured without "
        "--enable-optimizations or --with-lto")
    assert interpreter_line({"executable": "/y/python", "version": "3.12.1",
                             "libpython": "shared", "enable_optimizations": True,
                             "with_lto": True}).endswith(
        "shared libpython, configured --enable-optimizations --with-lto")
    # A tree older than the interpreter's module reports no build.
    assert interpreter_line({"executable": "/z/python"}) == "interpreter /z/python"


def test_versus_arms_name_their_interpreter() -> None:
    assert name_of(".") == HERE.name
    assert name_of(f".@{sys.executable}") == f"{HERE.name}@{sys.executable}"
    assert tree_of(".") == Tree.this()
    assert tree_of(f".@{sys.executable}").python == sys.executable
    assert "/" not in file_name(name_of(f".@{sys.executable}"))

"""bench/trees.py: the arm order, the paired figure, and which code a tree's arm imports."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.trees import (
    HERE,
    Tree,
    cpu_per_request_us,
    cpu_seconds,
    paired_median_ms,
    rotated,
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


def test_cpu_per_request_skips_processes_the_kernel_did_not_report() -> None:
    assert cpu_seconds(os.getpid()) is not None  # this process: /proc answers
    per = cpu_per_request_us({"proxy": 1.0, "before": None}, {"proxy": 1.5, "before": 2.0},
                             {"proxy": 500, "before": 500})
    assert per == {"proxy": 1000.0}

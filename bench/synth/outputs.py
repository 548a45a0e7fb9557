"""Tool calls and the results a coding agent's tools would return for them.

Each ``draw_*`` function returns ``(arguments, result_text, module)`` for one tool call,
with the result grown line by line to roughly ``target_chars`` (file reads, grep hits, pytest logs,
git output), because tool results dominate an agent's prompt.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from itertools import count
from typing import Any

from bench.synth.project import Module, Project

Drawn = tuple[dict[str, Any], str, Module]
"""(tool-call arguments, tool result text, the module the call is about)."""


def _fill(lines: Iterator[str], target_chars: int) -> str:
    """Join lines until the text reaches target_chars (always at least one line)."""
    out: list[str] = []
    size = 0
    for line in lines:
        out.append(line)
        size += len(line) + 1
        if size >= target_chars:
            break
    return "\n".join(out)


def _numbered(lines: list[str], start: int) -> Iterator[str]:
    for offset, line in enumerate(lines):
        yield f"{start + offset:6d}\t{line}"


def _cycle(rng: random.Random, lines: list[str]) -> Iterator[str]:
    while True:
        yield from lines
        lines = lines[:]
        rng.shuffle(lines)


def draw_read(rng: random.Random, project: Project, target_chars: int) -> Drawn:
    module = project.module(rng)
    source = module.lines()
    for other in rng.sample(project.modules, len(project.modules)):
        source.extend(other.lines()[20:])  # a long file: keep going past its own end
    offset = 1 if rng.random() < 0.6 else rng.randrange(20, 60)
    text = _fill(_numbered(source[offset - 1:], offset), target_chars)
    args: dict[str, Any] = {"path": f"/home/dev/{project.name}/{module.path}"}
    if offset > 1:
        args.update(offset=offset, limit=text.count("\n") + 1)
    return args, text, module


def draw_grep(rng: random.Random, project: Project, target_chars: int) -> Drawn:
    module = project.module(rng)
    function = rng.choice(module.functions)
    hits = _grep_hits(rng, project, function.name)
    summary = "\n(results truncated; narrow the pattern to see more)"
    text = _fill(hits, max(target_chars - len(summary), 1)) + summary
    return {"pattern": rf"\b{function.name}\(", "include": "*.py"}, text, module


def _grep_hits(rng: random.Random, project: Project, name: str) -> Iterator[str]:
    while True:
        module = project.module(rng)
        line_no = rng.randrange(12, 240)
        code = rng.choice([line for line in module.lines() if line.startswith("    ")] or [""])
        yield f"{module.path}:{line_no}:    result = {name}({code.strip()[:48]!r})"
        test = project.test_path(module)
        yield f"{test}:{rng.randrange(8, 160)}:    assert {name}(sample) == expected"


def draw_pytest(rng: random.Random, project: Project, target_chars: int) -> Drawn:
    module = project.module(rng)
    function = rng.choice(module.functions)
    failing = rng.random() < 0.6
    command = f"python -m pytest {project.test_path(module)} -x -q"
    header = [
        "=" * 29 + " test session starts " + "=" * 30,
        "platform linux -- Python 3.11.9, pytest-8.3.3, pluggy-1.5.0",
        f"rootdir: /home/dev/{project.name}", "configfile: pyproject.toml",
        f"collected {rng.randrange(18, 90)} items", "",
    ]
    progress = [f"{project.test_path(m)} {'.' * rng.randrange(4, 14)}" for m in project.modules]
    if failing:
        body = _failure_report(rng, module, function.name)
        tail = [f"FAILED {project.test_path(module)}::test_{function.name} - KeyError: 'amount'",
                f"1 failed, {rng.randrange(10, 60)} passed in {rng.uniform(0.4, 3.0):.2f}s"]
    else:  # a verbose passing run: one line per test
        body = [f"{project.test_path(m)}::test_{f.name} PASSED" for m in project.modules
                for f in m.functions]
        tail = [f"{rng.randrange(20, 90)} passed in {rng.uniform(0.4, 3.0):.2f}s"]
    exit_line = f"\n\nexit code: {1 if failing else 0}"
    fixed = "\n".join(header + progress) + "\n" + "\n".join(tail) + exit_line
    middle = _fill(_cycle(rng, body), target_chars - len(fixed))
    text = "\n".join([*header, *progress, middle, *tail]) + exit_line
    return {"command": command, "description": "Run the module's tests"}, text, module


def _failure_report(rng: random.Random, module: Module, name: str) -> list[str]:
    lines = ["", "=" * 35 + " FAILURES " + "=" * 35,
             "_" * 20 + f" test_{name} " + "_" * 20, "", f"    def test_{name}(tmp_path):"]
    lines += [f">       result = {name}(tmp_path / 'sample.toml')", "", f"{module.path}:"
              f"{rng.randrange(30, 200)}: in {name}"]
    for function in module.functions:
        lines += [f"    {line.strip()}" for line in function.lines()[1:4]]
        lines.append(f"{module.path}:{rng.randrange(30, 200)}: in {function.name}")
    lines += ["E   KeyError: 'amount'", ""]
    return lines


def draw_git(rng: random.Random, project: Project, target_chars: int) -> Drawn:
    module = project.module(rng)
    diff = [f"diff --git a/{module.path} b/{module.path}", "index 3f1c2ab..9e04d71 100644",
            f"--- a/{module.path}", f"+++ b/{module.path}"]
    hunk = 40
    for function in module.functions:
        lines = function.lines()
        diff.append(f"@@ -{hunk},{len(lines)} +{hunk},{len(lines) + 1} @@")
        diff += [f" {line}" for line in lines[:2]]
        diff += [f"-{lines[2]}", f"+{lines[2]}  # normalized", *(f" {line}" for line in lines[3:])]
        hunk += len(lines) + rng.randrange(3, 20)
    text = _fill(_cycle(rng, diff), target_chars)
    arguments = {"command": f"git diff -- {module.path}", "description": "Show the pending change"}
    return arguments, text, module


def draw_glob(rng: random.Random, project: Project, target_chars: int) -> Drawn:
    def paths() -> Iterator[str]:
        for index in count():
            module = project.modules[index % len(project.modules)]
            depth = index // len(project.modules)
            yield module.path if depth == 0 else module.path.replace(
                ".py", f"_{rng.choice(('v2', 'compat', 'legacy', 'util'))}{depth}.py")
            yield project.test_path(module)
    return {"pattern": "**/*.py"}, _fill(paths(), target_chars), project.module(rng)


def draw_edit(rng: random.Random, project: Project, target_chars: int) -> Drawn:
    module = project.module(rng)
    function = rng.choice(module.functions)
    old = function.lines()[2]
    new = old + "  # guard against missing keys"
    start = rng.randrange(30, 120)
    snippet = _fill(_numbered(module.lines()[20:] + function.lines() * 4, start), target_chars)
    text = (f"Applied 1 edit to /home/dev/{project.name}/{module.path}.\n"
            "Here is a snippet of the edited file:\n" + snippet)
    return {"path": f"/home/dev/{project.name}/{module.path}", "old_string": old,
            "new_string": new}, text, module


DRAWERS: dict[str, tuple[str, Callable[[random.Random, Project, int], Drawn]]] = {
    "read": ("read", draw_read),
    "grep": ("grep", draw_grep),
    "pytest": ("bash", draw_pytest),
    "git": ("bash", draw_git),
    "glob": ("glob", draw_glob),
    "edit": ("edit", draw_edit),
}
"""Kind of call -> (tool name, drawer). Two kinds of bash call, as agents use it both ways."""

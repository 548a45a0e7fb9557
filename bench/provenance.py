"""RUN.md: the exact command, the machine and the versions behind a result directory."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.report import summary_block

_PACKAGES = ("prefixpin", "httpx", "matplotlib", "starlette", "uvicorn")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def package_versions() -> dict[str, str]:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def git_revision(repo: Path) -> str:
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--",
                                "bench", "proxy", "adapters"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no commit yet)"
    return head + (" (with uncommitted changes)" if dirty else "")


def host_lines(*, dated: bool = True, shared: bool = False) -> list[str]:
    """A RUN.md's date, machine and Python lines (``shared``: the machine line says that
    other work may share it)."""
    machine = (f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), {memory_gib()} RAM, "
               f"{platform.system()} {platform.release()}"
               + ("; other work may share it" if shared else ""))
    python = (f"- python {platform.python_version()}; "
              + ", ".join(f"{k} {v}" for k, v in package_versions().items()))
    date = f"- date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}"
    return [date, machine, python] if dated else [machine, python]


def run_md(*, command: str, scenario: str, summary_md: str, engine_props: dict[str, Any],
           llama_argv: list[str] | None, notes: list[str], repo: Path) -> str:
    props = engine_props
    settings = props.get("default_generation_settings", {})
    lines = [
        f"# Run: {scenario}", "",
        "```", command, "```", "",
        *host_lines(),
        f"- repository: {git_revision(repo)}",
        f"- llama-server build_info: {props.get('build_info', 'unknown')}; model "
        f"{Path(str(props.get('model_path', 'unknown'))).name}; {props.get('total_slots')} slots "
        f"of {settings.get('n_ctx', '?')} tokens",
    ]
    if llama_argv:
        lines.append(f"- llama-server started by the harness: `{' '.join(llama_argv)}`")
    lines += [f"- {note}" for note in notes]
    lines += ["", summary_block(summary_md), "",
              "Per-turn figures: `table.md`; rows: `rows.jsonl`; plot: `ttft.png`.", ""]
    return "\n".join(lines)

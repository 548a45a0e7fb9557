"""Figures read back from running processes' Prometheus expositions, for tests and benches."""

from __future__ import annotations

import re
from collections.abc import Iterable

import httpx

from tests.rig.llama_process import LlamaServerProcess


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of ``url``'s ``/metrics`` (0 when absent): the labels must match exactly,
    in any order."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    head = f"{name}{{{wanted}}} " if wanted else f"{name} "
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(head):
            return float(line.split()[-1])
    return 0.0


def prefilled(engines: Iterable[LlamaServerProcess]) -> float:
    """The prompt tokens the engines processed so far (llama-server's own counter)."""
    total = 0.0
    for engine in engines:
        text = httpx.get(f"{engine.url}/metrics", timeout=10).text
        match = re.search(r"^llamacpp:prompt_tokens_total\s+(\S+)$", text, re.MULTILINE)
        assert match, text
        total += float(match.group(1))
    return total

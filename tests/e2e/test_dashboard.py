"""The Grafana dashboard only asks for metrics that prefixpin and llama-server export.

Every PromQL expression in ``deploy/grafana/prefixpin.json`` is parsed with a real PromQL
parser (promql-parser, Prometheus 2.45 grammar) and each metric it selects must appear in
a live scrape: prefixpin's ``/metrics`` after one real request through it (so its
histograms have samples) and llama-server's own ``/metrics`` (started with --metrics).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import ProxyRunner
from tests.e2e.helpers import stream_chat
from tests.rig.llama_process import LlamaServerProcess

pytestmark = pytest.mark.llama

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "prefixpin.json"
# Grafana's own interval variables, which Grafana replaces before Prometheus sees a query.
GRAFANA_VARIABLES = re.compile(r"\$(__rate_interval|__interval|__range)\b|\$\{(__\w+)\}")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                              "_created"),
            "gauge": ("",), "summary": ("_sum", "_count", "_created", ""), "untyped": ("",)}


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) for every query of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in panels(board["panels"])
            for t in p.get("targets", [])]


def selected_metrics(expression: str) -> list[str | None]:
    tree = promql_parser.parse(GRAFANA_VARIABLES.sub("1m", expression))
    names: list[str | None] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.append(node.name)

    promql_parser.walk(tree, visit)
    return names


def exported(text: str) -> set[str]:
    """Every series name an exposition offers: the samples present, and for a family
    declared without samples yet (a labelled counter nothing incremented), the names its
    type gives it."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def test_every_dashboard_query_parses_and_names_exported_metrics(
        llama: LlamaServerProcess, run_proxy: ProxyRunner) -> None:
    body = {"messages": [{"role": "user", "content": "Say hello in three words."}],
            "max_tokens": 4, "temperature": 0, "stream_options": {"include_usage": True}}
    with run_proxy() as url:
        assert stream_chat(url, body).status == 200
        proxy_text = httpx.get(f"{url.admin}/metrics", timeout=10).text
    llama_text = httpx.get(f"{llama.url}/metrics", timeout=10).text
    proxy_names, llama_names = exported(proxy_text), exported(llama_text)
    # The request went through: histograms have samples, not just declarations.
    assert "prefixpin_cached_tokens_bucket" in {s.name for f in text_string_to_metric_families(
        proxy_text) for s in f.samples}
    assert any(name.startswith("llamacpp:") for name in llama_names)

    queries = dashboard_queries()
    assert len(queries) >= 20
    referenced: set[str] = set()
    for title, expression in queries:
        names = selected_metrics(expression)  # raises on a PromQL syntax error
        assert names, f"{title}: {expression!r} selects no metric"
        assert None not in names, f"{title}: {expression!r} has a selector without a name"
        for name in names:
            assert name is not None
            owner = proxy_names if name.startswith("prefixpin_") else llama_names
            assert name in owner, f"{title}: {name} is not exported ({expression!r})"
            referenced.add(name)
    # Both sides are on the dashboard.
    assert any(n.startswith("llamacpp:") for n in referenced)
    assert any(n.startswith("prefixpin_") for n in referenced)


def test_a_bad_metric_name_is_caught() -> None:
    """The check above can fail: a typo'd name parses but is not exported."""
    names = selected_metrics("sum(rate(prefixpin_cached_tokenz_sum[$__rate_interval]))")
    assert names == ["prefixpin_cached_tokenz_sum"]
    assert "prefixpin_cached_tokenz_sum" not in exported(
        "# TYPE prefixpin_cached_tokens histogram\nprefixpin_cached_tokens_sum 1.0\n")
    with pytest.raises(ValueError, match="parenthesis"):
        selected_metrics("sum(rate(prefixpin_cached_tokens_sum[$__rate_interval])")

"""The hostile-load bench (``bench/hostile.py``, issue 33) at a tiny size, and the flood check.

Each test runs the bench as a script (its own fake engine, proxy and attacker processes, on
loopback) and reads the ``result.json`` it writes. The latency figures of a tiny run on a
shared machine are noise, so the first test asserts what does not depend on timing: every
healthy stream complete and in order, each attacker answered as the proxy's limits say, the
proxy's refusal counter agreeing, the connection limit a 503, the proxy up at the end.

The flood tests assert the relay flood finding's property: one engine stream flooding
(48 MiB of token events as fast as they are read) must neither stall the proxy's other
streams nor grow its memory with the flood. The issue's figure is 50 ms of added p99; on a
noisy two-core CI machine the client, the fake and the proxy share the cores and a stall of
tens of ms comes and goes, so these tests assert what a correct relay meets with a wide
margin there: no other stream silent for more than 250 ms longer than in the same floods
sent straight to the fake (the ``direct_flood`` arm: what the machine itself costs), and the
proxy's peak RSS over the flood round under 24 MiB above its RSS before it, while 48 MiB and
more flood through. The 50 ms figure is the bench's (``added p99 ... ≤ 50 ms`` in RUN.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

STALL_BOUND_MS = 250.0
FLOOD_MIB = 48
RSS_GROWTH_BOUND_MIB = 24.0


def run_bench(out: Path, *args: str) -> dict[str, Any]:
    """``bench/hostile.py`` with ``args``; its result (a run whose targets are not all met
    exits 1 and still writes it)."""
    done = subprocess.run([sys.executable, "bench/hostile.py", "--model", "none",
                           "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    result = out / "result.json"
    assert result.is_file(), f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return dict(json.loads(result.read_text()))


def test_a_tiny_hostile_run_serves_every_healthy_stream_and_answers_every_attacker(
        tmp_path: Path) -> None:
    result = run_bench(
        tmp_path, "--healthy", "8", "--idle", "20", "--slowloris", "4", "--floods", "1",
        "--oversized", "5", "--flood-mib", "2", "--events", "50", "--waves", "2",
        "--rounds", "1", "--head-timeout", "1", "--max-connections", "64",
        "--past-limit", "8", "--no-direct-floods")
    assert set(result["arms"]) == {"direct", "calm", "hostile", "direct_attacked"}
    for arm, figures in result["arms"].items():
        assert figures["streams"] == 16, arm
        assert figures["streams_failed"] == 0, (arm, figures["first_failure"])
        assert (figures["lost"], figures["duplicated"], figures["reordered"]) == (0, 0, 0), arm
    assert result["healthy_intact"]
    # The machine's share, with the proxy off the healthy streams' path, and the hostile
    # arm against it: reported beside the verdict's figures.
    first = result["added"]["first_event_p99"]
    assert first["hostile_over_attacked_ms"] == round(
        result["arms"]["hostile"]["first_event_p99_ms"]
        - result["arms"]["direct_attacked"]["first_event_p99_ms"], 1)
    assert "machine_ms" in first
    answers = result["answers"]
    # Every kind attacked and answered as its limit says: a 408 at the head deadline for
    # the idle and slowloris connections, 413 for the bodies, 431 for the head, and the
    # flood read to its end.
    expected = {"idle": "408", "slowloris": "408", "flood": "200", "body_size": "413",
                "json_values": "413", "head_size": "431", "body_streamed": "413",
                "body_chunks": "413"}
    assert {kind: row["expected"] for kind, row in answers.items()
            if kind != "counter_agrees"} == expected
    for kind, row in answers.items():
        if kind == "counter_agrees":
            assert all(agreed["ok"] for agreed in row.values()), row
            assert set(row) == {"head_timeout", "body_size", "json_values", "head_size",
                                "body_chunks"}
        else:
            assert row["ok"], (kind, row)
    limit = result["limit_phase"]
    assert limit["answers"].get("503", 0) >= 8, limit
    assert limit["refusals"].get("connections", 0) >= 8, limit
    assert limit["while_held"]["operator_healthz"] == 200
    assert limit["tenant_healthz_after"] == 200
    assert result["end"] == {**result["end"], "tenant_healthz": 200, "operator_healthz": 200,
                             "proxy_process_alive": True}


@pytest.fixture(scope="module")
def flood_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """16 healthy streams with one flood client (48 MiB streams, a second apart: each
    session keeps its reply's text, a megabyte or two, so the round's growth counts the
    floods that finish in it, three or four here) and nothing
    else; the floods straight to the fake too, for the machine's own cost. What the tests
    take for granted is checked here (a failure here is an error, never an expected
    failure): every stream served, the floods through."""
    result = run_bench(
        tmp_path_factory.mktemp("flood"), "--healthy", "16", "--idle", "0", "--slowloris",
        "0", "--floods", "1", "--oversized", "0", "--flood-mib", str(FLOOD_MIB),
        "--flood-gap", "1.0", "--events", "50", "--waves", "2", "--rounds", "1",
        "--past-limit", "0", "--direct-floods", "--no-direct-attacked",
        # Every flood read to its end: the default --max-reply-events would cut it short.
        "--proxy-arg=--max-reply-events=1000000")
    arms = result["arms"]
    for arm in ("direct", "calm", "hostile", "direct_flood"):
        assert arms[arm]["streams_failed"] == 0, (arm, arms[arm]["first_failure"])
    assert result["healthy_intact"]
    flood = result["answers"]["flood"]
    assert flood["ok"], flood
    assert flood["mib_read"] >= FLOOD_MIB, flood
    assert result["floods_without_proxy"]["complete"] >= 1
    assert result["end"]["tenant_healthz"] == 200
    return result


def test_a_flooding_stream_does_not_stall_the_other_streams(flood_run: dict[str, Any]) -> None:
    arms = flood_run["arms"]
    machine = arms["direct_flood"]["stall_max_ms"]
    assert arms["hostile"]["stall_max_ms"] - machine <= STALL_BOUND_MS, (
        arms["hostile"]["stall_max_ms"], machine)
    assert (arms["hostile"]["first_event_p99_ms"] - arms["direct_flood"]["first_event_p99_ms"]
            <= STALL_BOUND_MS)


def test_a_flooding_stream_leaves_the_proxys_memory_flat(flood_run: dict[str, Any]) -> None:
    """Found by this test (issue 33): a reply was kept whole while it streamed (about
    1.3 KiB of Python objects per 250-byte event), so a flood grew the proxy's memory
    five times the flood. Past --keep-reply-events the log now lets go of what its client
    read (``proxy.pipeline.generation``)."""
    growth = flood_run["memory"]["round_growth_max_mib"]["hostile"]
    assert growth <= RSS_GROWTH_BOUND_MIB, (growth, flood_run["arms"]["hostile"]["rss"])

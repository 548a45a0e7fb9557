"""Sending a turn: TTFT across resends, and the per-turn medians of the report.

The runner is exercised against a real (tiny, local) HTTP server that withholds its first
token for a while, the way llama-server does during a prefill, and counts connections.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from bench.clients.base import Request, chat_body
from bench.index import build as build_index
from bench.report import main as report_main
from bench.report import render, summarize, summary_block, write_rows
from bench.runner import send_turn


@dataclass
class SlowServer:
    """Streams one SSE answer after ``delay_s`` of silence; counts what it saw."""

    delay_s: float
    connections: int = 0
    disconnected_early: int = 0
    bodies: list[bytes] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        self.bodies.append(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"connection: close\r\n\r\n: ping\n\n")
        await writer.drain()
        try:
            await asyncio.wait_for(reader.read(1), timeout=self.delay_s)
            self.disconnected_early += 1  # EOF before the answer: the client gave up
            writer.close()
            return
        except TimeoutError:
            pass
        chunk = {"choices": [{"delta": {"content": "ok"}}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 10,
                                          "prompt_tokens_details": {"cached_tokens": 4}}}
        for event in (chunk, usage):
            writer.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()


@asynccontextmanager
async def serving(server: SlowServer) -> AsyncIterator[str]:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    async with listener:
        yield f"http://127.0.0.1:{port}"


def _request(timeout_s: float | None, attempts: int) -> Request:
    body = chat_body([{"role": "user", "content": "hi"}], [])
    return Request(session="s", step=0, body=body, headers={}, claims_rewrite=False,
                   first_token_timeout_s=timeout_s, max_attempts=attempts)


async def _send(server: SlowServer, request: Request) -> tuple[float | None, int]:
    async with serving(server) as url, httpx.AsyncClient() as client:
        turn = await send_turn(client, url, request)
        await asyncio.sleep(0.05)  # let the server notice the last disconnect
    return turn.ttft_s, len(turn.attempts)


def test_a_timed_out_client_closes_and_resends_the_identical_body() -> None:
    """Two attempts give up after 0.1 s, the third waits; TTFT counts all three."""
    server = SlowServer(delay_s=0.3)
    ttft, attempts = asyncio.run(_send(server, _request(timeout_s=0.1, attempts=3)))
    assert attempts == 3
    assert server.connections == 3
    assert server.disconnected_early == 2
    assert len(set(server.bodies)) == 1
    assert ttft is not None
    assert ttft >= 0.1 + 0.1 + 0.3


def test_a_comment_does_not_satisfy_the_first_token_timeout() -> None:
    """The server's ': ping' arrives at once, yet the client still times out."""
    server = SlowServer(delay_s=0.3)
    _, attempts = asyncio.run(_send(server, _request(timeout_s=0.1, attempts=2)))
    assert attempts == 2


def test_a_fast_answer_is_not_resent() -> None:
    """A first token inside the timeout ends the turn after one attempt."""
    server = SlowServer(delay_s=0.05)
    ttft, attempts = asyncio.run(_send(server, _request(timeout_s=1.0, attempts=3)))
    assert (attempts, server.connections) == (1, 1)
    assert ttft is not None
    assert 0.05 <= ttft < 1.0


def _row(arm: str, rep: int, seq: int, ttft: float, wall: float = 1.0) -> dict[str, object]:
    return {"arm": arm, "rep": rep, "seq": seq, "session": "s", "step": seq, "rewrote": False,
            "ttft_ms": ttft, "prompt_tokens": 100, "cached_tokens": 50, "prefill_ms": 1.0,
            "attempts": 1, "engine_prompt_tokens": 10, "rep_wall_ms": wall}


def test_report_sums_per_turn_medians_not_means() -> None:
    """An outlier rep moves a mean but not the median of a turn."""
    walls = {0: 1000.0, 1: 3000.0, 2: 2000.0}
    rows = [_row("a", rep, seq, ttft, walls[rep]) for rep, seq, ttft in [
        (0, 0, 100), (1, 0, 110), (2, 0, 9000), (0, 1, 10), (1, 1, 12), (2, 1, 11)]]
    rows += [_row("b", rep, seq, 50) for rep in range(3) for seq in range(2)]
    summaries = summarize(rows)
    assert summaries["a"].summed_ttft_ms == pytest.approx(110 + 11)
    assert summaries["a"].summed_prefill_ms == pytest.approx(2.0)
    assert summaries["a"].wall_ms == 2000
    assert summaries["b"].summed_ttft_ms == 100
    assert summaries["a"].engine_prompt_tokens == 20
    assert summaries["a"].reuse == pytest.approx(0.5)


def test_flat_line_ratio_only_for_one_session() -> None:
    """last / second turn TTFT is reported for a session, not across interleaved ones."""
    rows = [_row("a", 0, seq, ttft) for seq, ttft in enumerate([900.0, 100.0, 150.0])]
    assert summarize(rows)["a"].flatness == pytest.approx(1.5)
    rows[2]["session"] = "other"
    assert summarize(rows)["a"].flatness is None


def test_previous_prompt_reuse_is_per_session_and_names_the_worst_turn() -> None:
    """Cached tokens over the same session's previous prompt, capped at 1: a turn that
    adds a lot is not held against the cache; a turn that lost part of the history is."""
    rows = [_row("a", 0, seq, 100.0) for seq in range(4)]
    for row, session, prompt, cached in zip(rows, ["s", "t", "s", "t"], [100, 80, 150, 120],
                                            [0, 0, 120, 60], strict=True):
        row.update(session=session, prompt_tokens=prompt, cached_tokens=cached)
    assert summarize(rows)["a"].kept_min == pytest.approx(60 / 80)
    rows[3]["cached_tokens"] = 100
    assert summarize(rows)["a"].kept_min == 1.0
    assert summarize(rows[:2])["a"].kept_min is None  # no session has a second turn


def test_a_failed_turn_does_not_break_the_medians() -> None:
    """A turn with no TTFT in one rep takes the median of the reps that answered."""
    rows = [_row("a", 0, 0, 100.0), _row("a", 1, 0, 300.0), _row("a", 2, 0, 200.0)]
    rows[1]["ttft_ms"] = None
    assert summarize(rows)["a"].summed_ttft_ms == pytest.approx(150.0)


def test_results_render_from_rows_and_rerender_run_md(tmp_path: Path) -> None:
    """table.md, ttft.png and RUN.md's summary come from rows.jsonl and can be redone."""
    rows = [dict(_row(arm, rep, seq, 100.0 * (seq + 1)), baseline="a")
            for arm in ("a", "b") for rep in range(2) for seq in range(3)]
    write_rows(tmp_path / "rows.jsonl", rows)
    table = render(tmp_path, "demo")
    assert "| a | 2 | 0.60 | 1.00 |" in table
    assert (tmp_path / "ttft.png").read_bytes().startswith(b"\x89PNG")
    old = summary_block("# title\n\nold summary")
    (tmp_path / "RUN.md").write_text(f"# Run\n\n{old}\n\nafter\n")
    assert report_main([str(tmp_path)]) == 0
    run_md = (tmp_path / "RUN.md").read_text()
    assert "| b | 2 | 0.60 | 1.00 |" in run_md
    assert "old summary" not in run_md
    assert run_md.endswith("\n\nafter\n")


def test_results_index_has_one_line_per_scenario_and_arm(tmp_path: Path) -> None:
    """bench/results/README.md lists every arm of every result directory."""
    for scenario in ("one", "two"):
        (tmp_path / scenario).mkdir()
        rows = [dict(_row(arm, 0, seq, 100.0), baseline="a")
                for arm in ("a", "b") for seq in range(2)]
        write_rows(tmp_path / scenario / "rows.jsonl", rows)
    (tmp_path / "parking").mkdir()
    write_rows(tmp_path / "parking" / "rows.jsonl", [{"arm": "alone", "prefilled": 3}])
    text = build_index(tmp_path)
    assert "parking" not in text  # another bench's rows are not replay rows
    assert text.count("| [one](one/table.md) |") == 2
    assert "| [two](two/table.md) | b | 0.2 | 1.00 | 50% | 20 | 50% | 0 of 2 |" in text

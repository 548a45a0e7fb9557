"""The real agent CLIs (OpenCode, Claude Code, Codex: ``tests.rig.agents``, pinned) through
prefixpin in front of a real llama-server, each driven headless for a session of three
turns (``tests.rig.agent_clis``): every follow-up turn reuses all of its previous prompt.

Each CLI speaks its own API: OpenCode chat completions, Claude Code Anthropic Messages
(``/v1/messages``), Codex OpenAI Responses (``/v1/responses``). A turn may send more than
its main request (OpenCode's first turn also asks for a title, a shorter side history
under the same session id); the main request is the turn's longest prompt. The figures
are the proxy's own, from its ``request`` log lines (``proxy.ops.logs``), and the engine's
``llamacpp:prompt_tokens_total`` for what it prefilled per turn.

The engine's answers are capped (``ENGINE_CAP_ARGS``: greedy, a few words, a natural
stop), or SmolLM2 would ramble up to the 32k tokens each CLI asks for. Its 8k context per
slot holds each CLI's first prompt (OpenCode ~2,200 tokens with the title request's ~590
on the other slot, Claude Code ~4,100, Codex ~4,600).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.listen.http_limits import http_options
from prefixpin.proxy.settings import Settings
from tests.fakes.servers import ServedURL, serve_proxy
from tests.rig.agent_clis import CLIS, ENGINE_CAP_ARGS, AgentSession, Cli
from tests.rig.agents import require_agent
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.scrape import prefilled

pytestmark = [pytest.mark.llama, pytest.mark.slow]

Json = dict[str, Any]
SLACK = 32  # tokens a follow-up may re-read: the template's turn boundary, at most
PROMPTS = ("Say hello.", "Now say goodbye.", "Thanks, that is all.")
TURN_TIMEOUT_S = 300.0  # a cold ~4k-token prefill takes 20 s on 2 idle cores; minutes when shared


@dataclass(frozen=True, slots=True)
class TurnFigures:
    number: int
    seconds: float
    engine_prefill: float  # what llama-server computed during the turn, all requests
    requests: list[Json]  # the proxy's request log lines of the turn, in order

    @property
    def main(self) -> Json:
        return max(self.requests, key=lambda r: r["prompt_tokens"] or 0)

    def summary(self) -> str:
        each = ", ".join(f"{r['prompt_tokens']}/{r['cached_tokens']} ({r['prefill_ms']} ms)"
                         for r in self.requests)
        return (f"turn {self.number}: {len(self.requests)} request(s) prompt/cached [{each}], "
                f"engine prefill {self.engine_prefill:.0f}, CLI {self.seconds:.1f} s")


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaServerProcess]:
    """This module's llama-server: 2 slots of 8k (SmolLM2's trained context; llama-server
    caps a bigger slot to it), answers capped."""
    with run_llama_server("smollm2", slots=2, ctx_per_slot=8192,
                          extra=ENGINE_CAP_ARGS) as handle:
        yield handle


@pytest.fixture
def proxy(engine: LlamaServerProcess) -> Iterator[ServedURL]:
    """prefixpin under a real uvicorn in front of ``engine``, whose slots start empty."""
    for slot in range(2):
        httpx.post(f"{engine.url}/slots/{slot}", params={"action": "erase"}, json={},
                   timeout=30).raise_for_status()
    with serve_proxy(create_apps(Settings(upstream=engine.url)), **http_options()) as url:
        yield url


def request_lines(caplog: pytest.LogCaptureFixture) -> list[Json]:
    return [dict(getattr(r, "fields", {})) for r in caplog.records
            if r.getMessage() == "request"]


def run_turns(cli: Cli, url: str, engine: LlamaServerProcess, root: Path,
              caplog: pytest.LogCaptureFixture, turns: int) -> list[TurnFigures]:
    session = AgentSession(cli, url, root, executable=require_agent(cli),
                           timeout=TURN_TIMEOUT_S)
    return [one_turn(session, number, prompt, engine, caplog)
            for number, prompt in enumerate(PROMPTS[:turns], 1)]


def one_turn(session: AgentSession, number: int, prompt: str, engine: LlamaServerProcess,
             caplog: pytest.LogCaptureFixture) -> TurnFigures:
    cli = session.cli
    seen = len(request_lines(caplog))
    before = prefilled([engine])
    turn = session.turn(prompt).check()
    deadline = time.monotonic() + 5  # the proxy logs a request once it has settled
    while len(request_lines(caplog)) == seen and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    lines = request_lines(caplog)[seen:]
    assert lines, f"{cli} turn {number}: no request reached the proxy\n{turn.stderr[-2000:]}"
    for line in lines:
        assert line["outcome"] == "ok", line
    return TurnFigures(number, turn.seconds, prefilled([engine]) - before, lines)


@pytest.mark.parametrize("cli", CLIS)
def test_each_follow_up_turn_reuses_its_whole_previous_prompt(
        cli: Cli, engine: LlamaServerProcess, proxy: ServedURL, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """Three turns of one session through prefixpin: each follow-up's main request has all
    of the previous main prompt cached (up to ``SLACK``), in the same proxy session, and
    the engine prefills only what is new (plus any side request's prompt)."""
    caplog.set_level(logging.INFO, "prefixpin")
    turns = run_turns(cli, proxy, engine, tmp_path, caplog, turns=3)
    report = f"{cli}: " + "; ".join(t.summary() for t in turns)
    print(report)
    print(f"{cli} main request lines:", *(t.main for t in turns), sep="\n  ")
    assert turns[0].main["prompt_tokens"] > 1000, report  # the CLI's real system prompt
    for before, after in itertools.pairwise(turns):
        assert after.main["prompt_tokens"] > before.main["prompt_tokens"], report
        assert after.main["cached_tokens"] >= before.main["prompt_tokens"] - SLACK, report
        assert after.main["session"] == before.main["session"], report
        new = after.main["prompt_tokens"] - before.main["prompt_tokens"]
        side = sum(r["prompt_tokens"] for r in after.requests if r is not after.main)
        assert after.engine_prefill <= new + SLACK + side, report


def test_one_persons_three_agents_with_their_own_dummy_keys_share_one_engine(
        engine: LlamaServerProcess, proxy: ServedURL, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """One person's OpenCode, Claude Code and Codex, each with a dummy key of its own, take
    turns on llama-server at its default flags (its host cache shared by all slots) through
    prefixpin with no tenants configured: all answered, one namespace, and every
    follow-up reads all of its previous prompt from cache (three sessions, two slots)."""
    caplog.set_level(logging.INFO, "prefixpin")
    keys = {"opencode": "opencode-dummy", "claude": "sk-ant-dummy", "codex": "codex-dummy"}
    sessions = [AgentSession(cli, proxy, tmp_path / cli, executable=require_agent(cli),
                             timeout=TURN_TIMEOUT_S, key=keys[cli]) for cli in CLIS]
    turns: dict[Cli, list[TurnFigures]] = {cli: [] for cli in CLIS}
    for number, prompt in enumerate(PROMPTS[:2], 1):
        for session in sessions:
            turns[session.cli].append(one_turn(session, number, prompt, engine, caplog))
    report = "; ".join(f"{cli}: " + ", ".join(t.summary() for t in figures)
                       for cli, figures in turns.items())
    print(report)
    assert {line.get("namespace") for line in request_lines(caplog)} == {"anon"}, report
    for first, second in turns.values():
        assert second.main["cached_tokens"] >= first.main["prompt_tokens"] - SLACK, report
        assert second.main["session"] == first.main["session"], report

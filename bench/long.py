"""One agent session growing past 150k tokens: the proxy's own CPU per turn against the
prompt's length, beside the same session sent straight to an identical engine.

    python -m bench.long [--target-tokens 150000] [--min-messages 200] [--tool-chars N]
                         [--user-every 4] [--max-tokens 8] [--proxy-cwd PATH]
                         [--proxy-arg ARG ...] [--label NAME] [--compare OTHER/result.json]
                         [--thinking] [--out bench/results/long]
    python -m bench.long --render RUN/result.json [--compare OTHER/result.json] --out DIR

Engines: two identical llama-servers (the rig's, at their default flags plus
``--slot-save-path``, one slot of 262,144 tokens, ``-n 16``) on the rig's tiny random-weight
``qwen35-long`` (Qwen3.5's hybrid architecture and chat template, declaring a 262k training
context; the text is noise, the cache mechanics and the template are real). Arm ``direct``
talks to engine A; arm ``prefixpin`` to ``prefixpin serve --upstream B --park-dir <B's
--slot-save-path>`` at its defaults, run from this tree or ``--proxy-cwd``'s (another
checkout or worktree: ``python -m prefixpin.proxy.cli serve`` with ``cwd`` and
``PYTHONPATH`` there, see ``bench/trees.py``).

The session is shaped like a coding agent's: a ~2k-token system prompt, five function tools
with JSON schemas in every request, a task, then per turn the assistant's reply as the
engine streamed it (content and reasoning) with one to three synthetic tool calls appended
(read_file, grep, run_command) and the tools' results (numbered file lines, grep hits, test
logs, diffs: seeded pseudo-random text, mixed sizes around ``--tool-chars``), and every
``--user-every``-th turn a user message instead. Requests are OpenAI
``/v1/chat/completions``, streamed with usage, ``temperature: 0``, ``max_tokens`` small, no
session header (implicit identity). Each arm keeps its own history (its own replies); both
get the same requests otherwise, turn by turn, the arm that goes first alternating, each
request sent once both engines are idle (the proxy works on its engine after a turn).
Growth stops once a prompt reaches ``--target-tokens`` and the history holds
``--min-messages``. Without ``--tool-chars``, the mean tool result is sized so that both
happen together: what the target leaves after the first prompt and the turns' fixed parts,
over the tool results the planned turns carry, in characters at the tokenizer's measured
characters per token.

Short follow-ups: when the prompt first reaches ~3k tokens, and again at the end, eight turns
that add a user message of a few dozen tokens (the engine's part held small). A new session
with the long history: the proxy restarted, the final history sent once more with one user
message added; it knows no session. Both arms then go to the fast fake llama-server
(``bench/fast_engine.py``, declaring the same model: the proxy reads its tokenizer and memory
kind), which answers at once: the CPU to the first event is the proxy's own work (a
restarted proxy reads no slot it knows nothing about from cache, so on engine B it would
wait for the whole history's prefill). Thinking is off in the template
(``chat_template_kwargs``; ``--thinking`` turns it on): with it, each user turn re-reads the
tool turns since the last one (Qwen3.5 drops their reasoning), in both arms alike.

Per turn and arm: time to the first event carrying output (TTFT; the first ``data:`` event
too), prompt, cached and prefilled tokens; for prefixpin its CPU, every thread's
(``/proc/PID/task/*/schedstat``, ns), read just before the request is sent, when the first
output event arrives (``cpu_to_first_event_ms``) and 0.5 s after the stream ends
(``cpu_whole_turn_ms``), and what it spent between its turns. Turns are grouped by prompt
tokens into bands; per band the medians of the CPU figures and of the added TTFT (prefixpin
minus direct, the same turn). ``--out`` gets ``result.json``, ``RUN.md`` and
``cpu_vs_tokens.png``; the band table is printed; a line per turn goes to stderr.
``--compare`` puts another run's result (e.g. the tree before a change) beside this one in
the tables and the plot.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import numpy as np

from bench.provenance import cpu_model
from bench.sse_clock import SSEDecoder, SSEEvent, carries_output
from bench.trees import HERE, Tree
from tests.fakes.servers import free_port
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.replica_process import ReplicaProcess, start_replica
from tests.rig.tiny_models import ensure_tiny_model

Json = dict[str, Any]

MODEL = "qwen35-long"
CTX_PER_SLOT = 262_144
ENGINE_EXTRA = ("-n", "16")  # the engine's own cap on a reply, under the request's
SEED = 150
SETTLE_S = 0.5  # after a stream ends, before the whole turn's CPU is read
RESTART_SETTLE_S = 2.0  # a restarted proxy's start-up work, before the new session's request
EARLY_TOKENS = 3_000  # the early follow-ups start once a prompt reaches this
FOLLOW_UPS = 8
USER_EVERY = 4  # every fourth growth turn adds a user message instead of tool results
TASK_WORDS = 120
USER_WORDS = 70
FOLLOW_UP_WORDS = 25
SYSTEM_CHARS = 8_500  # ~2k tokens of instructions
MIN_TOOL_CHARS = 200
# Tool calls per tool turn and their shares: mostly one, sometimes a few at once.
CALLS = ((1, 0.5), (2, 0.35), (3, 0.15))
MEAN_CALLS = sum(count * share for count, share in CALLS)
# What a turn adds besides its tool results or user text (measured on qwen35-long's
# template): the reply and its reasoning, each call's markup and arguments, the markers.
TOOL_TURN_TOKENS = 85
CALL_TOKENS = 70  # each further call in the same turn
USER_TURN_TOKENS = 40
TOKENS_PER_WORD = 0.75  # the user messages' words (SmolLM2's tokenizer, these words)
ARMS = ("direct", "prefixpin")
BANDS: tuple[tuple[int | None, str], ...] = (
    (10_000, "<10k"), (25_000, "10-25k"), (50_000, "25-50k"), (75_000, "50-75k"),
    (100_000, "75-100k"), (125_000, "100-125k"), (None, "125k+"))
JSON_HEADERS = {"content-type": "application/json"}
IDLE_POLL_S = 0.05
TIMEOUT_S = 900.0  # per request: a cold prefill of the whole history on two cores
# A new connection per request, both arms: llama-server drops a keep-alive connection idle for
# 5 s, and a request sent as it does fails; a connection's setup is cheap and the same each turn.
LIMITS = httpx.Limits(max_keepalive_connections=0)


# ------------------------------------------------------------------------- the proxy's CPU

def schedstat_ns(pid: int, proc: Path = Path("/proc")) -> int:
    """CPU time ``pid`` has used so far, in ns: the first field of every thread's
    ``task/*/schedstat`` (exact, where ``stat``'s utime and stime count clock ticks). A thread
    that ends between the listing and its read is left out."""
    total = 0
    for task in (proc / str(pid) / "task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def stat_cpu_s(pid: int) -> float:
    """utime + stime from ``/proc/PID/stat``: coarse, but it keeps the time of threads that
    have ended (a check on the schedstat sum)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------- bands and medians

def band_of(tokens: int) -> str:
    for upper, name in BANDS:
        if upper is None or tokens < upper:
            return name
    raise AssertionError("the last band has no upper bound")


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def added_ttft_ms(turn: Json) -> float | None:
    mine, theirs = turn["prefixpin"].get("ttft_ms"), turn["direct"].get("ttft_ms")
    return None if mine is None or theirs is None else mine - theirs


def added_past_prompt_ms(turn: Json) -> float | None:
    """The added TTFT less what the two engines' own prompt evaluations differ by: each
    arm's TTFT minus its engine's ``prompt_ms``. Two llama-server processes on one machine
    evaluate prompts a few percent apart, either way from one run to the next, and at
    150k tokens a few percent is hundreds of milliseconds."""
    mine, theirs = turn["prefixpin"], turn["direct"]
    figures = (mine.get("ttft_ms"), mine.get("prompt_ms"), theirs.get("ttft_ms"),
               theirs.get("prompt_ms"))
    if any(figure is None for figure in figures):
        return None
    my_ttft, my_prompt, their_ttft, their_prompt = figures
    return float((my_ttft - my_prompt) - (their_ttft - their_prompt))


def summarize(turns: list[Json]) -> Json:
    """The medians a group of turns is reported by."""
    return {
        "turns": len(turns),
        "prompt_tokens_median": median([t["prefixpin"].get("prompt_tokens") for t in turns]),
        "cpu_to_first_event_ms": median([t["prefixpin"].get("cpu_to_first_event_ms")
                                         for t in turns]),
        "cpu_whole_turn_ms": median([t["prefixpin"].get("cpu_whole_turn_ms") for t in turns]),
        "added_ttft_ms": median([added_ttft_ms(t) for t in turns]),
        "added_past_prompt_ms": median([added_past_prompt_ms(t) for t in turns]),
        "direct_ttft_ms": median([t["direct"].get("ttft_ms") for t in turns]),
        "prefixpin_ttft_ms": median([t["prefixpin"].get("ttft_ms") for t in turns]),
        "direct_prefilled": median([t["direct"].get("prefilled_tokens") for t in turns]),
        "prefixpin_prefilled": median([t["prefixpin"].get("prefilled_tokens") for t in turns]),
    }


def with_bands(result: Json) -> Json:
    """A recorded run with its bands computed again from its turns (a run recorded before
    a figure was added to them gets it)."""
    return {**result, "bands": bands(result.get("turns") or [])}


def through_prefixpin(turn: Json) -> bool:
    return turn.get("route") != "straight to B"


def bands(turns: list[Json]) -> list[Json]:
    """Per band of prompt tokens (prefixpin's prompt), in band order, the bands with turns
    (prefixpin's arm through prefixpin)."""
    grouped: dict[str, list[Json]] = {name: [] for _, name in BANDS}
    for turn in filter(through_prefixpin, turns):
        tokens = turn["prefixpin"].get("prompt_tokens")
        if tokens is not None:
            grouped[band_of(tokens)].append(turn)
    return [{"band": name, **summarize(group)} for name, group in grouped.items() if group]


# ------------------------------------------------------------------------- the session's text

IDENTS = ("session", "slot", "prefix", "cache", "token", "engine", "request", "stream",
          "lease", "park", "anchor", "opening", "history", "message", "reply", "usage",
          "timing", "metric", "budget", "window", "state", "config", "handle", "lane",
          "replica", "index", "record", "result", "client", "server", "event", "chunk",
          "buffer", "prompt", "tool", "schema", "digest", "snapshot", "queue", "worker")
VERBS = ("load", "save", "find", "build", "parse", "check", "send", "read", "write",
         "update", "restore", "evict", "match", "render", "count", "split", "merge", "close",
         "open", "wait")
MODULES = ("proxy/relay", "proxy/placement", "core/sse", "core/tokens", "adapters/openai",
           "fingerprint/chain", "proxy/parking", "proxy/settings", "core/history",
           "adapters/anthropic", "proxy/admission", "core/render")
CODE_LINES = (
    "def {v}_{a}(self, {b}: {A}) -> {B} | None:",
    '    """{V} the {a} of a {b}, or None when the {c} is gone."""',
    "    if {b} is None:",
    "        return None",
    "    {a} = self._{b}s.get({c}_id)",
    "    for {c} in {a}.{b}s:",
    "        total += len({c}.{d}) * {n}",
    "    return {A}({b}={b}, {c}={n})",
    "",
    "class {A}{B}:",
    "    {a}: {A}",
    "    {b}_s: float = {f}",
    '        raise ValueError(f"{a} {{{b}!r}} has no {c}")',
    "        await self._{a}.{v}({b}, timeout={f})",
    '    logger.debug("%s {v} %d {a}s", {b}, len({c}s))',
    "from prefixpin.{m} import {A}, {v}_{b}",
    "    # {V} before the {a}: the {b} may change while the {c} waits.",
    "    self._{a}[{b}.key] = {c}",
    "    with self._{a}_lock:",
    "        assert {a} >= 0, {b}",
    "    {a}_{b} = [{c} for {c} in {d}s if {c}.{v}ed]",
    "",
)
INSTRUCTIONS = (
    "Read a file before you edit it, and keep the edit to the lines the task needs.",
    "Run the tests that cover a change before you say it is done; quote the failing line.",
    "Prefer the project's own helpers to new ones; search for a {a} helper first.",
    "Never print secrets, tokens or credentials, even when a {b} file holds them.",
    "When a command fails, read its output to the end before you change anything.",
    "Keep answers short: say what changed, where, and what you checked.",
    "Use grep to find every caller of a {v} function before you change its signature.",
    "Do not reformat code you do not change; the reviewer reads the diff.",
    "A {a} that crosses a process boundary must be serializable; check its fields.",
    "Ask the user before deleting files or rewriting history in the repository.",
    "Explain a {b} limit where it is set, in one comment that says why.",
    "When two tools could do the job, use the one that reads less of the {c}.",
    "Type every new function completely; the project runs the strict type checker.",
    "Tests must not sleep to wait for a {a}; wait on the event that signals it.",
)


def words(rng: random.Random, count: int) -> str:
    picked = [rng.choice(IDENTS if i % 3 else VERBS) for i in range(count)]
    return " ".join(picked)


def fill(template: str, rng: random.Random) -> str:
    a, b, c, d = (rng.choice(IDENTS) for _ in range(4))
    v = rng.choice(VERBS)
    return template.format(a=a, b=b, c=c, d=d, v=v, A=a.capitalize(), B=b.capitalize(),
                           V=v.capitalize(), m=rng.choice(MODULES).replace("/", "."),
                           n=rng.randint(1, 4096), f=round(rng.uniform(0.05, 30.0), 2))


def system_prompt(seed: int, chars: int = SYSTEM_CHARS) -> str:
    """An agent's instructions: numbered rules under headings, about ``chars`` long."""
    rng = random.Random(seed)
    lines = ["You are a coding agent working in the user's repository through the tools "
             "below. Follow these instructions exactly."]
    section = 0
    while sum(len(line) + 1 for line in lines) < chars:
        section += 1
        lines += ["", f"# {section}. When you {rng.choice(VERBS)} a {rng.choice(IDENTS)}"]
        lines += [f"{k}. " + fill(rng.choice(INSTRUCTIONS), rng) for k in range(1, 9)]
    return "\n".join(lines)


def tool(name: str, description: str, properties: Json, required: list[str]) -> Json:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


TOOLS: tuple[Json, ...] = (
    tool("read_file", "Read a file of the repository, with line numbers.",
         {"path": {"type": "string", "description": "path from the repository root"},
          "offset": {"type": "integer", "description": "first line (1-based)"},
          "limit": {"type": "integer", "description": "lines to read"}}, ["path"]),
    tool("grep", "Search file contents with a regular expression.",
         {"pattern": {"type": "string"}, "path": {"type": "string"},
          "include": {"type": "string", "description": "glob of files to search"}},
         ["pattern"]),
    tool("run_command", "Run a shell command in the repository and return its output.",
         {"command": {"type": "string"},
          "timeout": {"type": "integer", "description": "seconds"}}, ["command"]),
    tool("edit_file", "Replace one exact string in a file.",
         {"path": {"type": "string"}, "old_string": {"type": "string"},
          "new_string": {"type": "string"}}, ["path", "old_string", "new_string"]),
    tool("list_files", "List files under a directory matching a glob.",
         {"path": {"type": "string"}, "pattern": {"type": "string"}}, ["path"]),
)


@dataclass(frozen=True, slots=True)
class ToolStep:
    """One tool call the assistant makes and what the tool answers."""

    call: Json  # an OpenAI ``tool_calls`` entry
    result: str


# Each kind's share of the calls and its size range, as a multiple of the mean: file reads
# are the big ones, greps the small ones. KIND_MEAN makes the sizes average the mean.
KINDS: tuple[tuple[str, float, float, float], ...] = (
    ("read_file", 0.4, 1.0, 2.6), ("grep", 0.3, 0.2, 0.8), ("run_command", 0.3, 0.3, 1.5))
KIND_MEAN = sum(share * (low + high) / 2 for _, share, low, high in KINDS)


def lines_until(chars: int, make: Callable[[int], str]) -> str:
    out: list[str] = []
    size, number = 0, 0
    while size < chars:
        number += 1
        line = make(number)
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)


def read_result(rng: random.Random, chars: int) -> tuple[Json, str]:
    path = f"src/prefixpin/{rng.choice(MODULES)}.py"
    start = rng.randint(1, 400)
    text = lines_until(chars, lambda k: f"{start + k - 1:>6}\t{fill(rng.choice(CODE_LINES), rng)}")
    return {"path": path, "offset": start, "limit": text.count("\n") + 1}, text


def grep_result(rng: random.Random, chars: int) -> tuple[Json, str]:
    pattern = f"{rng.choice(VERBS)}_{rng.choice(IDENTS)}"

    def hit(_: int) -> str:
        line = fill(rng.choice(CODE_LINES), rng).strip() or "pass"
        return f"src/prefixpin/{rng.choice(MODULES)}.py:{rng.randint(1, 900)}:{line}"

    return {"pattern": pattern, "path": "src", "include": "*.py"}, lines_until(chars, hit)


def command_result(rng: random.Random, chars: int) -> tuple[Json, str]:
    module = rng.choice(MODULES)
    if rng.random() < 0.5:
        def test(k: int) -> str:
            name = f"test_{rng.choice(VERBS)}_{rng.choice(IDENTS)}_{k}"
            verdict = "FAILED" if rng.random() < 0.05 else "PASSED"
            return f"tests/{module}_test.py::{name} {verdict} [{min(99, k):>3}%]"

        body = lines_until(chars, test)
        return ({"command": f"pytest -q tests/{module}_test.py", "timeout": 300},
                body + f"\n{body.count('PASSED')} passed in {rng.uniform(0.5, 40):.2f}s")

    def diff(k: int) -> str:
        if k % 12 == 1:
            return f"@@ -{rng.randint(1, 900)},7 +{rng.randint(1, 900)},9 @@"
        return rng.choice("+- ") + fill(rng.choice(CODE_LINES), rng)

    return ({"command": f"git diff -- src/prefixpin/{module}.py", "timeout": 30},
            f"diff --git a/src/prefixpin/{module}.py b/src/prefixpin/{module}.py\n"
            + lines_until(chars, diff))


RESULTS: dict[str, Callable[[random.Random, int], tuple[Json, str]]] = {
    "read_file": read_result, "grep": grep_result, "run_command": command_result}


def tool_step(seed: int, turn: int, mean_chars: int, index: int = 0) -> ToolStep:
    """Turn ``turn``'s ``index``-th tool call and its result: a pure function of its
    arguments."""
    rng = random.Random((seed * 1_000_003 + turn) * 8 + index)
    draw, kind = rng.random(), KINDS[-1]
    for candidate in KINDS:
        if draw < candidate[1]:
            kind = candidate
            break
        draw -= candidate[1]
    name, _, low, high = kind
    chars = max(MIN_TOOL_CHARS // 2, round(mean_chars * rng.uniform(low, high) / KIND_MEAN))
    arguments, result = RESULTS[name](rng, chars)
    call = {"id": f"call_{turn:04d}_{index}_{rng.randrange(16**8):08x}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}
    return ToolStep(call, result)


def tool_turn(seed: int, turn: int, mean_chars: int) -> list[ToolStep]:
    """The calls the assistant makes at once on turn ``turn`` (agents read several files in
    one go), each with its result."""
    draw, calls = random.Random(seed * 65_537 + turn).random(), CALLS[-1][0]
    for count, share in CALLS:
        if draw < share:
            calls = count
            break
        draw -= share
    return [tool_step(seed, turn, mean_chars, index) for index in range(calls)]


def user_text(seed: int, turn: int, count: int) -> str:
    rng = random.Random(seed * 7_919 + turn)
    module = rng.choice(MODULES)
    return (f"Now {rng.choice(VERBS)} the {rng.choice(IDENTS)} handling in {module}.py: "
            + words(rng, count) + ". Run its tests when you are done.")


def planned_tool_chars(target_tokens: int, first_prompt_tokens: int, min_messages: int,
                       chars_per_token: float, user_every: int) -> int:
    """The mean tool result (characters) that reaches ``target_tokens`` at about
    ``min_messages``: what the target leaves after the first prompt, the turns' fixed parts
    and the user messages, over the tool results of the growth turns that fill the
    messages the follow-ups leave."""
    follow_ups = 2 * FOLLOW_UPS  # each adds two messages: the reply and a user message
    cycle_messages = (user_every - 1) * (1 + MEAN_CALLS) + 2  # user_every growth turns
    growth = max(1.0, (min_messages - 2 - 2 * follow_ups) / cycle_messages * user_every)
    tool_turns = growth * (user_every - 1) / user_every
    fixed = (tool_turns * (TOOL_TURN_TOKENS + (MEAN_CALLS - 1) * CALL_TOKENS)
             + (growth - tool_turns) * (USER_TURN_TOKENS + USER_WORDS * TOKENS_PER_WORD)
             + follow_ups * (USER_TURN_TOKENS + FOLLOW_UP_WORDS * TOKENS_PER_WORD))
    left = target_tokens - first_prompt_tokens - fixed
    return max(MIN_TOOL_CHARS, round(left / (tool_turns * MEAN_CALLS) * chars_per_token))


# ------------------------------------------------------------------------- the schedule

@dataclass(frozen=True, slots=True)
class Step:
    phase: str  # growth, follow-up-early, follow-up-final
    kind: str  # tool: a tool call and its result; user: a user message


@dataclass(slots=True)
class Schedule:
    """What the next turn adds, from the last prompt's size and the history's length."""

    target_tokens: int
    min_messages: int
    user_every: int
    early: int = 0
    growth: int = 0
    final: int = 0

    def next(self, prompt_tokens: int, messages: int) -> Step | None:
        if self.early < FOLLOW_UPS and (self.early or prompt_tokens >= EARLY_TOKENS):
            self.early += 1
            return Step("follow-up-early", "user")
        if prompt_tokens < self.target_tokens or messages < self.min_messages:
            self.growth += 1
            return Step("growth", "user" if self.growth % self.user_every == 0 else "tool")
        if self.final < FOLLOW_UPS:
            self.final += 1
            return Step("follow-up-final", "user")
        return None


# ------------------------------------------------------------------------- one streamed turn

@dataclass(slots=True)
class StreamReader:
    """What a streamed chat completion said and when (seconds from the request's start)."""

    decoder: SSEDecoder = field(default_factory=SSEDecoder)
    first_data_s: float | None = None
    first_output_s: float | None = None
    end_s: float = 0.0
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    usage: Json | None = None
    timings: Json | None = None
    error: str | None = None

    def feed(self, chunk: bytes, elapsed: float) -> None:
        for event in self.decoder.feed(chunk):
            self._event(event, elapsed)

    def close(self, elapsed: float) -> None:
        for event in self.decoder.flush():
            self._event(event, elapsed)
        self.end_s = elapsed

    def _event(self, event: SSEEvent, elapsed: float) -> None:
        if event.comment_only or event.data.strip() == "[DONE]":
            return
        if self.first_data_s is None:
            self.first_data_s = elapsed
        try:
            chunk = json.loads(event.data)
        except ValueError:
            self.error = f"not JSON: {event.data[:120]!r}"
            return
        if not isinstance(chunk, dict):
            return
        if "error" in chunk:
            self.error = json.dumps(chunk["error"])[:300]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        if carries_output(chunk) and self.first_output_s is None:
            self.first_output_s = elapsed
        for choice in chunk.get("choices") or []:
            delta = (choice.get("delta") if isinstance(choice, dict) else None) or {}
            self.content.append(str(delta.get("content") or ""))
            self.reasoning.append(str(delta.get("reasoning_content") or ""))

    def figures(self) -> Json:
        usage, timings = self.usage or {}, self.timings or {}
        prompt = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens",
                                                                timings.get("cache_n"))
        ttft = self.first_output_s if self.first_output_s is not None else self.first_data_s
        return {"ttft_ms": ms(ttft if ttft is not None else self.end_s),
                "first_data_ms": ms(self.first_data_s), "total_ms": ms(self.end_s),
                "prompt_tokens": prompt, "cached_tokens": cached,
                "prefilled_tokens": prompt - cached if prompt is not None
                and cached is not None else None,
                "prompt_ms": timings.get("prompt_ms"), "error": self.error}


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def ns_ms(nanoseconds: int) -> float:
    return round(nanoseconds / 1e6, 3)


@dataclass(slots=True)
class Arm:
    """One arm's side of the session: where it sends, whose CPU it reads, its history."""

    name: str
    client: httpx.Client
    pid: int | None  # the proxy's process; None: nothing to measure
    history: list[Json]
    content: str = ""  # its last reply, as streamed
    reasoning: str = ""
    cpu_after_ns: int | None = None  # the proxy's CPU after its last turn settled


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=TIMEOUT_S, limits=LIMITS)


def request_body(arm: Arm, max_tokens: int, thinking: bool = False) -> bytes:
    # Serialized before the clock starts: the client's own work is not the proxy's.
    # Thinking off by default: Qwen3.5's template renders a turn's reasoning until the next
    # user message, so with it every user turn re-reads the tool turns since the last one
    # (both arms alike), which at 150k tokens on two cores is most of the run's time.
    return json.dumps({"model": MODEL, "messages": arm.history, "tools": list(TOOLS),
                       "stream": True, "stream_options": {"include_usage": True},
                       "max_tokens": max_tokens, "temperature": 0,
                       "chat_template_kwargs": {"enable_thinking": thinking}}).encode()


def send(arm: Arm, body: bytes) -> Json:
    """One streamed request; the proxy's CPU read around it (prefixpin's arm)."""
    pid, reader = arm.pid, StreamReader()
    before = schedstat_ns(pid) if pid is not None else 0
    at_data = at_output = None
    started = time.perf_counter()
    with arm.client.stream("POST", "/v1/chat/completions", content=body,
                           headers=JSON_HEADERS) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{arm.name}: HTTP {response.status_code}: "
                               f"{response.read()[:300]!r}")
        for chunk in response.iter_raw():
            reader.feed(chunk, time.perf_counter() - started)
            if pid is not None and at_output is None:
                if at_data is None and reader.first_data_s is not None:
                    at_data = schedstat_ns(pid)
                if reader.first_output_s is not None:
                    at_output = schedstat_ns(pid)
    reader.close(time.perf_counter() - started)
    arm.content, arm.reasoning = "".join(reader.content), "".join(reader.reasoning)
    figures = reader.figures()
    if pid is not None:
        time.sleep(SETTLE_S)  # the work after the last byte (bookkeeping, parking ahead)
        after = schedstat_ns(pid)
        first = at_output if at_output is not None else at_data
        figures |= {
            "cpu_to_first_event_ms": ns_ms(first - before) if first is not None else None,
            "cpu_to_first_data_ms": ns_ms(at_data - before) if at_data is not None else None,
            "cpu_whole_turn_ms": ns_ms(after - before),
            # its work while the other arm ran or the client built the next request
            "cpu_between_ms": ns_ms(before - arm.cpu_after_ns)
            if arm.cpu_after_ns is not None else None}
        arm.cpu_after_ns = after
    return figures


# ------------------------------------------------------------------------- growing the session

def assistant_message(arm: Arm, calls: list[Json]) -> Json:
    """The reply as the engine streamed it, with the agent's tool calls appended."""
    message: Json = {"role": "assistant", "content": arm.content}
    if arm.reasoning:
        message["reasoning_content"] = arm.reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def extend(arms: list[Arm], step: Step, turn: int, mean_chars: int) -> Json:
    """Append the step's messages to every arm's history; what was added."""
    if step.kind == "tool":
        actions = tool_turn(SEED, turn, mean_chars)
        results = [{"role": "tool", "tool_call_id": action.call["id"], "content": action.result}
                   for action in actions]
        for arm in arms:
            arm.history += [assistant_message(arm, [action.call for action in actions]),
                            *(dict(result) for result in results)]
        return {"tool": ",".join(action.call["function"]["name"] for action in actions),
                "added_chars": sum(len(action.result) for action in actions)}
    size = USER_WORDS if step.phase == "growth" else FOLLOW_UP_WORDS
    text = user_text(SEED, turn, size)
    for arm in arms:
        arm.history += [assistant_message(arm, []), {"role": "user", "content": text}]
    return {"tool": None, "added_chars": len(text)}


@dataclass(slots=True)
class Session:
    """Both arms, the engines behind them, the reply cap."""

    arms: list[Arm]
    engines: tuple[str, ...]
    max_tokens: int
    thinking: bool = False
    b_direct: httpx.Client | None = None  # engine B itself (``--b-direct-every``)


def busy(engine: str) -> bool:
    slots = httpx.get(f"{engine}/slots", timeout=TIMEOUT_S)
    return slots.status_code == 200 and any(slot.get("is_processing") for slot in slots.json())


def wait_idle(engines: tuple[str, ...]) -> float:
    """Wait until no engine is processing, and return the ms waited: the proxy works on its
    engine after a turn (anchoring, parking ahead), and a request sent meanwhile would
    share the cores with that work."""
    started = time.monotonic()
    while any(busy(engine) for engine in engines):
        if time.monotonic() - started > TIMEOUT_S:
            raise RuntimeError(f"an engine stayed busy for {TIMEOUT_S:.0f} s")
        time.sleep(IDLE_POLL_S)
    return round((time.monotonic() - started) * 1000, 1)


def play(session: Session, turn: int, b_direct: bool = False) -> Json:
    """Both arms' turn, in an order that alternates; with ``b_direct``, prefixpin's arm sent
    straight to engine B (prefixpin does not see it: its next request adds two turns)."""
    arms = session.arms
    order = arms if turn % 2 == 0 else arms[::-1]
    record: Json = {"turn": turn, "messages": len(arms[0].history), "first": order[0].name}
    for arm in order:
        waited = wait_idle(session.engines)
        sender = arm
        if arm.name == "prefixpin" and b_direct and session.b_direct is not None:
            sender = dataclasses.replace(arm, client=session.b_direct, pid=None)
            record["route"] = "straight to B"
        record[arm.name] = send(sender, request_body(arm, session.max_tokens, session.thinking))
        arm.content, arm.reasoning = sender.content, sender.reasoning
        record[arm.name]["idle_wait_ms"] = waited
    return record


def progress(record: Json) -> None:
    direct, mine = record["direct"], record["prefixpin"]
    waited = (direct["idle_wait_ms"] or 0) + (mine["idle_wait_ms"] or 0)
    print(f"turn {record['turn']:>3} {record['phase']:<15} {record['kind']:<4} "
          f"msgs {record['messages']:>3} prompt {mine['prompt_tokens'] or 0:>7,} | direct "
          f"ttft {direct['ttft_ms']:>7.0f} ms prefilled {direct['prefilled_tokens']} | "
          f"prefixpin ttft {mine['ttft_ms']:>7.0f} ms prefilled {mine['prefilled_tokens']} "
          f"cpu first {mine.get('cpu_to_first_event_ms')} "
          f"turn {mine.get('cpu_whole_turn_ms')} ms | "
          f"idle wait {waited / 1000:.1f} s", file=sys.stderr, flush=True)


def checked(record: Json) -> int:
    """The turn's prompt tokens; a turn without them (an error) stops the run."""
    for name in ARMS:
        figures = record[name]
        if figures["error"] or figures["prompt_tokens"] is None:
            raise RuntimeError(f"turn {record['turn']}, {name}: {figures['error']} "
                               f"(prompt tokens {figures['prompt_tokens']})")
    return int(record["direct"]["prompt_tokens"])


def grow(session: Session, args: argparse.Namespace, size_tools: Callable[[int], int],
         turns: list[Json]) -> None:
    """The session, turn by turn, into ``turns`` (kept when a turn fails); the mean tool
    result is sized from the first prompt."""
    schedule = Schedule(args.target_tokens, args.min_messages, args.user_every)
    record = play(session, 0) | {"phase": "growth", "kind": "task", "tool": None,
                                 "added_chars": 0}
    turns.append(record)
    progress(record)
    mean_chars = size_tools(checked(record))
    for turn in range(1, args.max_turns + 1):
        step = schedule.next(checked(turns[-1]), len(session.arms[0].history))
        if step is None:
            break
        added = extend(session.arms, step, turn, mean_chars)
        b_direct = bool(args.b_direct_every) and step.phase == "growth" and (
            turn % args.b_direct_every == 0)
        record = play(session, turn, b_direct) | {"phase": step.phase, "kind": step.kind,
                                                  **added}
        turns.append(record)
        progress(record)


# ------------------------------------------------------------------------- processes

@dataclass(slots=True)
class Proxy:
    """How to start ``prefixpin serve`` in front of engine B, again after a restart."""

    tree: Tree
    upstream: str
    park_dir: Path
    log: Path
    extra: list[str]

    def start(self) -> ReplicaProcess:
        # A tree from before the operator listener serves its views on its one port.
        operator = "--admin-listen" in (self.tree.root / "proxy" / "cli.py").read_text()
        return start_replica([self.upstream], self.log, program=self.tree.serve()[:-1],
                             cwd=self.tree.root, env=self.tree.env(), operator=operator,
                             args=["--park-dir", str(self.park_dir), *self.extra])

    def argv(self) -> list[str]:
        return ["python", "-m", f"{self.tree.package}proxy.cli", "serve", "--upstream", "B",
                "--park-dir", "<B's --slot-save-path>", *self.extra]


@contextlib.contextmanager
def engines(model: Path, tmp: Path, b_first: bool = False
            ) -> Iterator[tuple[LlamaServerProcess, LlamaServerProcess]]:
    """Engines A and B, A started first unless ``b_first`` (``--b-first``: the two
    processes of one machine differ by a few percent in prompt speed, and the order they
    start in is the one thing that tells them apart)."""
    names = ("b", "a") if b_first else ("a", "b")
    with contextlib.ExitStack() as stack:
        started = {name: stack.enter_context(run_llama_server(
            model, slots=1, ctx_per_slot=CTX_PER_SLOT, slot_save_path=tmp / f"slots-{name}",
            extra=ENGINE_EXTRA)) for name in names}
        yield started["a"], started["b"]


def make_dirs(tmp: Path) -> None:
    for name in ("a", "b"):
        (tmp / f"slots-{name}").mkdir(parents=True, exist_ok=True)


def chars_per_token(engine: str, mean_chars: int = 4_000) -> float:
    """The tokenizer's characters per token on tool results like the session's."""
    sample = "\n".join(tool_step(SEED + 1, turn, mean_chars).result for turn in range(8))
    tokens = httpx.post(f"{engine}/tokenize", json={"content": sample}, timeout=60)
    tokens.raise_for_status()
    return len(sample) / len(tokens.json()["tokens"])


@contextlib.contextmanager
def fast_fake(model: Path) -> Iterator[str]:
    """The fast fake llama-server (``bench/fast_engine.py``: it answers at once) declaring
    ``model``, whose tokenizer and memory kind the proxy then reads as from engine B."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(HERE / "bench" / "fast_engine.py"), "--port", str(port),
         "--slots", "1", "--n-ctx", str(CTX_PER_SLOT), "--model", str(model), "--words", "4",
         "--token-delay-ms", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _answers(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fast fake engine did not start")
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def new_session(session: Session, proxy: Proxy, replica: ReplicaProcess, turn: int,
                model: Path) -> tuple[Json, ReplicaProcess]:
    """The final history sent once more, a user message added, to a restarted proxy: it
    knows no session. Its CPU to the first event is the proxy's own work for a new
    session arriving with a long history, so both arms go to the fast fake engine (the
    same model declared), which answers at once: on engine B the restarted proxy, which
    reads no slot it knows nothing about from cache, would wait for the whole history's
    prefill (tens of minutes at 150k tokens on two cores) and its idle CPU meanwhile."""
    replica.stop()
    direct, mine = (next(arm for arm in session.arms if arm.name == name) for name in ARMS)
    kept = direct.client
    with fast_fake(model) as fake:
        fresh = dataclasses.replace(proxy, upstream=fake).start()
        try:
            time.sleep(RESTART_SETTLE_S)
            mine.client.close()
            direct.client, mine.client = client(fake), client(fresh.url)
            mine.pid, mine.cpu_after_ns = fresh.process.pid, None
            added = extend(session.arms, Step("new-session", "user"), turn, 0)
            record: Json = {"turn": turn, "messages": len(direct.history), "first": mine.name,
                            "phase": "new-session", "kind": "user", **added}
            for arm in (mine, direct):
                record[arm.name] = send(arm, request_body(arm, session.max_tokens,
                                                          session.thinking))
                record[arm.name]["idle_wait_ms"] = 0.0
            checked(record)
        finally:
            direct.client.close()
            direct.client = kept
            fresh.stop()
    return record, fresh


# ------------------------------------------------------------------------- the report

def follow_ups(turns: list[Json]) -> Json:
    return {phase.removeprefix("follow-up-"): summarize([t for t in turns
                                                         if t["phase"] == phase])
            for phase in ("follow-up-early", "follow-up-final")}


def machine() -> Json:
    return {"nproc": len(os.sched_getaffinity(0)),  # what `nproc` prints
            "cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
            "python": platform.python_version(), "platform": platform.platform(),
            "load_average": os.getloadavg()}


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def runs_of(result: Json, other: Json | None) -> list[Json]:
    return [result] if other is None else [result, other]


BAND_FIELDS = (("cpu_to_first_event_ms", "CPU to first event ms"),
               ("cpu_whole_turn_ms", "CPU per turn ms"),
               ("added_ttft_ms", "added TTFT ms"),
               ("added_past_prompt_ms", "added TTFT past the engines' prompt time ms"))


def band_table(runs: list[Json]) -> str:
    """Per band: turns and median prompt, then each figure for every run side by side."""
    names = [run["label"] for run in runs]
    turns = "turns" if len(runs) == 1 else f"turns ({' / '.join(names)})"
    head = ["band", turns, "median prompt"] + [
        f"{title} ({name})" if len(runs) > 1 else title
        for _, title in BAND_FIELDS for name in names] + ["direct TTFT ms"]
    by_run = [{row["band"]: row for row in run["bands"]} for run in runs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, band in BANDS:
        rows = [table.get(band) for table in by_run]
        first = next((row for row in rows if row), None)
        if first is None:
            continue
        cells = [band, "/".join(fmt(row["turns"]) if row else "-" for row in rows),
                 fmt(first["prompt_tokens_median"], 0)]
        cells += [fmt(row.get(key)) if row else "-" for key, _ in BAND_FIELDS for row in rows]
        lines.append("| " + " | ".join([*cells, fmt(first["direct_ttft_ms"])]) + " |")
    return "\n".join(lines)


def group_table(runs: list[Json]) -> str:
    head = ["run", "group", "turns", "median prompt", "CPU to first event ms",
            "CPU per turn ms", "direct TTFT ms", "prefixpin TTFT ms", "added TTFT ms",
            "prefilled direct / prefixpin"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        groups = {**run["follow_ups"], "new session": run.get("new_session_summary")}
        for name, row in groups.items():
            if not row or not row["turns"]:
                continue
            lines.append("| " + " | ".join([
                run["label"], name, fmt(row["turns"]), fmt(row["prompt_tokens_median"], 0),
                fmt(row["cpu_to_first_event_ms"]), fmt(row["cpu_whole_turn_ms"]),
                fmt(row["direct_ttft_ms"]), fmt(row["prefixpin_ttft_ms"]),
                fmt(row["added_ttft_ms"]),
                f"{fmt(row['direct_prefilled'], 0)} / {fmt(row['prefixpin_prefilled'], 0)}"])
                + " |")
    return "\n".join(lines)


def render(result: Json, other: Json | None) -> str:
    runs = runs_of(result, other)
    setup, session = result["setup"], result["session"]
    proxy = setup["proxy_tree"]
    lines = [
        f"# Long session: the proxy's CPU per turn up to {session['final_prompt_tokens']:,} "
        "tokens", "", f"**{result['label']}**", "", "```", result["command"], "```", "",
        f"- date: {result['date']}; run {result['runtime_s']:.0f} s",
        f"- machine: nproc {result['machine']['nproc']}, {result['machine']['cpu_model']}; "
        "load average " + ", ".join(f"{load:.2f}" for load in result["machine"]["load_average"])
        + " at the end",
        f"- engines: two llama-servers, `llama-server {' '.join(setup['engine_args'][4:])}` "
        f"(at nice 10, the rig's), model {setup['model']}; engine "
        f"{setup.get('started_first', 'A')} started first",
        f"- proxy: `{' '.join(setup['proxy_argv'])}` from {proxy['root']} (commit "
        f"{proxy['commit'][:9] or 'none: not a git checkout'}, uncommitted product changes: "
        f"{len(proxy['local_changes'])})",
        f"- session: {session['turns']} turns, {session['messages']} messages, "
        f"{session['final_prompt_tokens']:,} prompt tokens at the end; system prompt "
        f"{setup['system_chars']:,} chars, {len(setup['tools'])} tools; tool results of "
        f"{setup['tool_chars']:,} chars on average ({setup['tool_chars_source']}; "
        f"{setup['chars_per_token']:.2f} chars a token); calls per tool turn "
        + ", ".join(f"{n}: {share:.0%}" for n, share in setup["calls_per_tool_turn"].items())
        + f"; a user message every {setup['user_every']} "
        f"growth turns; replies of at most {setup['max_tokens']} tokens; thinking "
        f"{'on' if setup.get('thinking') else 'off'}",
        "- CPU: the proxy's threads (`/proc/PID/task/*/schedstat`) from just before the "
        "request to the first output event, and to 0.5 s after the stream's end; TTFT: "
        "the first event carrying output; added TTFT: prefixpin minus direct, same turn",
    ]
    if other is not None:
        lines.append(f"- compared with: {other['label']} ({other['command']})")
    lines += ["", "## By prompt length (medians)", "", band_table(runs), "",
              "## Short follow-ups and a new session", "",
              f"{FOLLOW_UPS} follow-ups of ~{FOLLOW_UP_WORDS} words at ~{EARLY_TOKENS:,} tokens "
              "(early) and at the final length; the new session: the proxy restarted, the "
              "final history sent once with a user message added, both arms to the fast fake "
              "engine (it answers at once: the proxy's own work, not a 150k-token prefill).",
              "", group_table(runs),
              "", "## Checks", ""]
    for key, value in result["checks"].items():
        lines.append(f"- {key}: {value}")
    if result.get("error"):
        lines += ["", f"**The run stopped early:** {result['error']}"]
    lines += ["", "![CPU against prompt tokens](cpu_vs_tokens.png)", ""]
    return "\n".join(lines)


def plot(path: Path, runs: list[Json]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 2]})
    for index, run in enumerate(runs):
        turns = [t for t in run["turns"] if t["prefixpin"].get("prompt_tokens") is not None]
        tokens = [t["prefixpin"]["prompt_tokens"] / 1000 for t in turns]
        color = f"C{index}"
        top.scatter(tokens, [t["prefixpin"].get("cpu_whole_turn_ms") for t in turns],
                    color=color, marker="x", s=14, alpha=0.6,
                    label=f"{run['label']}: whole turn")
        top.scatter(tokens, [t["prefixpin"].get("cpu_to_first_event_ms") for t in turns],
                    color=color, s=10, label=f"{run['label']}: to first event")
        bottom.scatter(tokens, [added_ttft_ms(t) for t in turns], color=color, s=10,
                       label=run["label"])
    top.set_ylabel("prefixpin CPU (ms)")
    top.set_title("The proxy's CPU per turn as one session grows")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    top.legend()
    bottom.axhline(0, color="grey", linewidth=0.8)
    bottom.set_yscale("symlog", linthresh=100)  # a few stalls of seconds beside +-100 ms
    bottom.set_ylabel("added TTFT (ms, prefixpin - direct)")
    bottom.set_xlabel("prompt tokens (thousands)")
    bottom.grid(alpha=0.3)
    bottom.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def cpu_fit(turns: list[Json]) -> str:
    """The proxy's CPU to the first event against the prompt's length and the time it
    waited for that event (least squares over turns 1..): its per-token cost apart from
    what it spends per second of an engine's prefill."""
    rows = [(t["prefixpin"]["prompt_tokens"] / 1000, t["prefixpin"]["ttft_ms"] / 1000,
             t["prefixpin"]["cpu_to_first_event_ms"]) for t in turns[1:]
            if t["prefixpin"].get("cpu_to_first_event_ms") is not None]
    if len(rows) < 4:
        return "too few turns"
    design = np.array([[1.0, k, w] for k, w, _ in rows])
    coef, *_ = np.linalg.lstsq(design, np.array([cpu for *_, cpu in rows]), rcond=None)
    return (f"{coef[0]:.2f} ms + {coef[1]:.3f} ms per 1k prompt tokens + {coef[2]:.2f} ms "
            "per second of TTFT")


def checks(turns: list[Json], pid_cpu: Json) -> Json:
    # From turn 1: the proxy saves the first prompt's opening on its own, outside any usage.
    prefilled = {name: sum(t[name].get("prefilled_tokens") or 0 for t in turns[1:])
                 for name in ARMS}
    waits = [t[name].get("idle_wait_ms") or 0.0 for t in turns for name in ARMS]
    return {"engine prefilled tokens over the session from turn 1 (direct, prefixpin)":
            f"{prefilled['direct']:,}, {prefilled['prefixpin']:,}",
            "the first proxy's CPU, schedstat sum vs /proc/PID/stat at its stop (s)":
            f"{pid_cpu.get('schedstat_s')}, {pid_cpu.get('stat_s')}",
            "CPU between its turns, median ms (work outside the turn windows)":
            median([t["prefixpin"].get("cpu_between_ms") for t in turns]),
            "CPU to the first event, least squares": cpu_fit(turns),
            "waited for the engines to go idle before a request (the proxy's work on its "
            "engine after a turn), total s": round(sum(waits) / 1000, 1),
            "engine B's prompt time over A's, median of turns prefilling 1k+ tokens: "
            "through prefixpin, straight to B (--b-direct-every)": prompt_time_ratios(turns)}


def prompt_time_ratios(turns: list[Json]) -> str:
    """B's ``prompt_ms`` over A's for the same tokens, by how B's request went: with turns
    sent straight to B, what prefixpin costs the engine itself, apart from the two
    processes' own difference."""
    ratios: dict[bool, list[float | None]] = {True: [], False: []}
    for turn in turns:
        mine, theirs = turn["prefixpin"], turn["direct"]
        if (mine.get("prompt_ms") and theirs.get("prompt_ms")
                and (theirs.get("prefilled_tokens") or 0) >= 1000
                and mine.get("prefilled_tokens") == theirs.get("prefilled_tokens")):
            ratios[through_prefixpin(turn)].append(mine["prompt_ms"] / theirs["prompt_ms"])
    return ", ".join(f"{median(ratios[way])} ({len(ratios[way])} turns)" for way in (True, False))


def final_cpu(pid: int) -> Json:
    try:
        return {"schedstat_s": round(schedstat_ns(pid) / 1e9, 3),
                "stat_s": round(stat_cpu_s(pid), 3)}
    except OSError:
        return {}


# ------------------------------------------------------------------------- main

def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-tokens", type=int, default=150_000)
    parser.add_argument("--min-messages", type=int, default=200)
    parser.add_argument("--tool-chars", type=int,
                        help="mean tool result size (default: planned from the target)")
    parser.add_argument("--user-every", type=int, default=USER_EVERY,
                        help="every Nth growth turn adds a user message (the others tool "
                             "results)")
    parser.add_argument("--max-tokens", type=int, default=8, help="reply cap per request")
    parser.add_argument("--thinking", action="store_true",
                        help="the template's thinking on (every user turn then re-reads the "
                             "tool turns since the last one, in both arms)")
    parser.add_argument("--max-turns", type=int, default=600, help="a bound on the run")
    parser.add_argument("--proxy-cwd", type=Path,
                        help="run `prefixpin serve` from this checkout (e.g. a worktree)")
    parser.add_argument("--proxy-arg", action="append", default=[],
                        help="one more `prefixpin serve` argument (repeat)")
    parser.add_argument("--label", help="what this run is (e.g. before, after)")
    parser.add_argument("--no-proxy", action="store_true",
                        help="both arms direct, to engines A and B: the rig's own difference")
    parser.add_argument("--b-direct-every", type=int, default=0, metavar="N",
                        help="send every Nth growth turn of prefixpin's arm straight to engine "
                             "B: its prompt time through prefixpin and not, one engine")
    parser.add_argument("--b-first", action="store_true",
                        help="start engine B (prefixpin's) before engine A (direct's)")
    parser.add_argument("--compare", type=Path, help="another run's result.json to show beside")
    parser.add_argument("--render", type=Path,
                        help="run nothing: write this recorded result.json's report again "
                             "(with --compare, beside another)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/long"))
    return parser.parse_args(argv)


def tree_of(path: Path | None) -> Tree:
    if path is None or path.resolve() == HERE:
        return Tree.this()
    return Tree.other(path)


@dataclass(slots=True)
class Run:
    """What one run measured, and what it ran."""

    turns: list[Json] = field(default_factory=list)
    new: Json | None = None
    error: str | None = None
    tool_chars: int = 0
    chars_per_token: float = 0.0
    engine_argv: list[str] = field(default_factory=list)
    proxy_argv: list[str] = field(default_factory=list)
    first_proxy_cpu: Json = field(default_factory=dict)


def opening() -> list[Json]:
    return [{"role": "system", "content": system_prompt(SEED)},
            {"role": "user", "content": user_text(SEED, 0, TASK_WORDS)}]


def run(args: argparse.Namespace, tree: Tree, model: Path, logs: Path) -> Run:
    """Both engines and the proxy up, the session played; a failed turn ends it early."""
    done = Run()
    with tempfile.TemporaryDirectory(prefix="prefixpin-long-slots-") as name:
        tmp = Path(name)
        make_dirs(tmp)
        with engines(model, tmp, args.b_first) as (engine_a, engine_b):
            done.engine_argv = list(engine_b.args)
            done.chars_per_token = chars_per_token(engine_a.url)
            proxy = Proxy(tree, engine_b.url, tmp / "slots-b", logs / "prefixpin.log",
                          list(args.proxy_arg))
            if args.no_proxy:
                return play_both_direct(args, done, (engine_a.url, engine_b.url))
            done.proxy_argv = proxy.argv()
            replica = proxy.start()
            arms = [Arm("direct", client(engine_a.url),
                        None, opening()),
                    Arm("prefixpin", client(replica.url),
                        replica.process.pid, opening())]

            session = Session(arms, (engine_a.url, engine_b.url), args.max_tokens,
                              args.thinking, client(engine_b.url))
            try:
                grow(session, args, tool_sizer(args, done), done.turns)
                done.first_proxy_cpu = final_cpu(replica.process.pid)
                done.new, replica = new_session(session, proxy, replica, len(done.turns),
                                                model)
                progress(done.new)
            except (RuntimeError, httpx.HTTPError) as exc:
                done.error = f"{type(exc).__name__}: {exc}"
                print(f"stopped: {done.error}", file=sys.stderr)
            finally:
                replica.stop()
                for arm in arms:
                    arm.client.close()
                # The rig's engine logs go with its temporary directory: keep them.
                for engine, label in ((engine_a, "a"), (engine_b, "b")):
                    shutil.copy(engine.log_path, logs / f"llama-server-{label}.log")
    return done


def tool_sizer(args: argparse.Namespace, done: Run) -> Callable[[int], int]:
    """The mean tool result from the first prompt (``--tool-chars``, else planned to reach
    the target), recorded in ``done``."""
    def size_tools(first_prompt: int) -> int:
        done.tool_chars = args.tool_chars or planned_tool_chars(
            args.target_tokens, first_prompt, args.min_messages, done.chars_per_token,
            args.user_every)
        return done.tool_chars

    return size_tools


def play_both_direct(args: argparse.Namespace, done: Run, urls: tuple[str, str]) -> Run:
    """``--no-proxy``: the second arm sends to engine B itself, so the "added" TTFT is
    the rig's own difference between its two engines (no proxy CPU is read)."""
    arms = [Arm("direct", client(urls[0]), None, opening()),
            Arm("prefixpin", client(urls[1]), None, opening())]

    try:
        grow(Session(arms, urls, args.max_tokens, args.thinking), args, tool_sizer(args, done),
             done.turns)
    except (RuntimeError, httpx.HTTPError) as exc:
        done.error = f"{type(exc).__name__}: {exc}"
    finally:
        for arm in arms:
            arm.client.close()
    return done


def default_label(described: Json) -> str:
    changes = len(described["local_changes"])
    return (f"tree at {described['commit'][:7] or described['root']}"
            + (f", {changes} uncommitted product changes" if changes else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    other = with_bands(json.loads(args.compare.read_text())) if args.compare else None
    if args.render is not None:  # a recorded run, its report written again
        return report(with_bands(json.loads(args.render.read_text())), other, args.out)
    began = time.monotonic()
    tree = tree_of(args.proxy_cwd)
    described = tree.describe()
    model = ensure_tiny_model(MODEL)
    logs = Path(tempfile.mkdtemp(prefix="prefixpin-long-"))
    done = run(args, tree, model, logs)
    turns = done.turns
    final: Json = turns[-1] if turns else {"prefixpin": {}, "messages": 0}
    result: Json = {
        "label": args.label or default_label(described),
        "command": "python " + shlex.join(sys.argv),
        "date": f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        "runtime_s": round(time.monotonic() - began, 1), "machine": machine(),
        "setup": {"model": str(model), "engine_args": done.engine_argv,
                  "proxy_argv": done.proxy_argv, "proxy_tree": described,
                  "started_first": "B" if args.b_first else "A",
                  "target_tokens": args.target_tokens, "min_messages": args.min_messages,
                  "tool_chars": done.tool_chars,
                  "tool_chars_source": "--tool-chars" if args.tool_chars else "planned",
                  "chars_per_token": round(done.chars_per_token, 3),
                  "max_tokens": args.max_tokens, "user_every": args.user_every,
                  "thinking": args.thinking,
                  "calls_per_tool_turn": dict(CALLS),
                  "system_chars": len(system_prompt(SEED)),
                  "tools": [t["function"]["name"] for t in TOOLS], "logs": str(logs)},
        "session": {"turns": len(turns), "messages": final["messages"],
                    "final_prompt_tokens": final["prefixpin"].get("prompt_tokens") or 0},
        "bands": bands(turns), "follow_ups": follow_ups(turns), "new_session": done.new,
        "new_session_summary": summarize([done.new]) if done.new else None,
        "checks": checks(turns, done.first_proxy_cpu), "error": done.error, "turns": turns,
    }
    report(result, other, args.out)
    print(f"logs in {logs}")
    return 1 if done.error else 0


def report(result: Json, other: Json | None, out: Path) -> int:
    """``result.json``, ``RUN.md`` and the plot in ``out``; the band table printed."""
    runs = runs_of(result, other)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "RUN.md").write_text(render(result, other))
    plot(out / "cpu_vs_tokens.png", runs)
    print(band_table(runs))
    print(f"\nwrote {out}/RUN.md, result.json, cpu_vs_tokens.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

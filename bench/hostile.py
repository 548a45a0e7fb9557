"""Hostile load: healthy streams through one proxy process while attackers hold connections,
send heads a few bytes a second, flood, and send oversized requests (issue 33).

    python bench/hostile.py [--healthy 256] [--idle 1000] [--slowloris 100] [--floods 10]
                            [--oversized 20] [--flood-mib 16] [--rounds 2] [--waves 3]
                            [--head-timeout 5] [--max-connections 2048] [--past-limit 64]
                            [--no-direct-floods] [--no-direct-attacked]
                            [--out bench/results/hostile]

One fast fake llama-server (``bench/fast_engine.py``) and one prefixpin process in front of
it (``python -m prefixpin.proxy.cli serve --upstream URL --port P --head-timeout S
--max-connections N``, the rest at its defaults), as
``bench/load.py`` starts them, on loopback. The healthy streams are ``bench/load.py``'s:
``--healthy`` stream slots, each running ``--waves`` requests back to back on a keep-alive
connection, started staggered over one stream's length, every event of every stream
checked (no loss, repeat or reordering, ``[DONE]`` at the end). Five arms, each round
running them in turn (the order flipped every round, same processes, same machine phase):

- ``direct``: the healthy streams straight to the fake (the added-latency baseline);
- ``calm``: the healthy streams through the proxy, nothing else;
- ``hostile``: the same through the proxy while, from a process of their own
  (``bench/hostile.py attack``), started before the round and stopped after it:
  ``--idle`` connections that send nothing, ``--slowloris`` connections that send a
  request head ``--slowloris-bytes`` every ``--slowloris-interval`` seconds (a head that
  never ends), ``--floods`` clients each asking for a stream whose engine answer floods
  (``"flood": true`` in the body: the fake writes ``--flood-mib`` MiB of token events as
  fast as they are read), one at a time, ``--flood-gap`` seconds apart, and ``--oversized``
  clients each sending, every ``--oversized-gap`` seconds, one of: a body declared over
  ``--max-body`` (``body_size``), a chunked body streamed past it (``body_streamed``), a
  body of more than ``--max-json-values`` values (``json_values``), a request head over
  64 KiB (``head_size``), a chunked body of one-byte chunks past ``--max-body-chunks``
  (``body_chunks``). The attackers keep the pressure up: a connection the proxy answers
  (a 408 at ``--head-timeout``) is opened again at once;
- ``direct_flood`` (unless ``--no-direct-floods``): the healthy streams and the flood
  clients, both straight to the fake: what the floods cost on this machine (the fake's
  writes, the reader's reads, the cores they take) without the proxy;
- ``direct_attacked`` (unless ``--no-direct-attacked``): the healthy streams straight to
  the fake while the attackers attack the proxy, as in ``hostile``: what the attack costs
  the healthy streams' client and the fake on these shared cores when the proxy is not on
  their path (the machine's share of ``hostile``'s added latency, reported beside it).

After the rounds, the connection limit: ``--max-connections`` + ``--past-limit``
connections opened at once to the tenant listener (the healthy clients idle), the answers
counted (a 503 past the limit), the operator listener's ``/healthz`` asked meanwhile, then
all closed and the tenant listener's ``/healthz`` asked again.

Reported: per arm every healthy stream's integrity; the healthy streams' added p99 first
event and last byte (the proxy arm's percentile minus the direct arm's), with and without
the attackers, and their ratio (target: within 2x; taken against at least 1 ms) and
against the issue's 50 ms; beside them (report only) the hostile arm against
``direct_attacked`` instead of ``direct``, the machine's share left out; the longest
silence of each healthy stream between two reads after its first (a stall: a token is
due every ``--token-delay-ms``); how each attacker was answered, as the attackers saw it
and as the proxy counted it (``prefixpin_limit_refusals_total{limit}`` on its operator
listener, ``port + 1``); the proxy's RSS before each round and its peak over it
(``VmHWM``, reset before it through ``/proc/PID/clear_refs``), the run's peak and the RSS
after the run; the proxy up and answering ``/healthz`` at the end. RUN.md and result.json
go to ``--out``.

The process's file-descriptor soft limit is raised to what the run needs (the proxy and the
attackers inherit it); past the hard limit the run stops at once and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime as dt
import functools
import gc
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.fast_engine import Job
from bench.load import (
    HOST,
    IDLE,
    Client,
    Plan,
    Setup,
    Stream,
    engines,
    fake_stats,
    integrity,
    percentile,
    proc_status,
    proxy_log_counts,
    request_of,
    resolve_model,
    run_async,
    run_round,
    write_results,
)
from bench.trees import Tree, tree_line
from prefixpin.proxy.listen.http_limits import MAX_HEAD_BYTES
from prefixpin.proxy.settings import Settings

T = TypeVar("T")

ARMS = ("direct", "calm", "hostile")
DIRECT_FLOOD = "direct_flood"  # the healthy streams and the floods, both to the fake
DIRECT_ATTACKED = "direct_attacked"  # the healthy streams to the fake, the proxy attacked
# The proxy's defaults: what the oversized payloads exceed.
DEFAULT_MAX_BODY: int = Settings.model_fields["max_body_bytes"].default
DEFAULT_MAX_JSON_VALUES: int = Settings.model_fields["max_json_values"].default
DEFAULT_MAX_BODY_CHUNKS: int = Settings.model_fields["max_body_chunks"].default
OVERSIZED_KINDS = ("body_size", "json_values", "head_size", "body_streamed", "body_chunks")
# What each attacker's answer must be; the proxy's refusal counter's label for it.
EXPECTED = {"idle": ("408", "head_timeout"), "slowloris": ("408", "head_timeout"),
            "flood": ("200", None), "body_size": ("413", "body_size"),
            "body_streamed": ("413", "body_size"), "json_values": ("413", "json_values"),
            "head_size": ("431", "head_size"), "body_chunks": ("413", "body_chunks")}
FLOOD_END = b"data: [DONE]\n\n\r\n0\r\n\r\n"
REFUSALS = re.compile(r'^prefixpin_limit_refusals_total\{limit="([^"]+)"\} ([0-9.e+]+)$', re.M)
# The bounds.
TARGET_RATIO = 2.0
TARGET_ADDED_MS = 50.0
RATIO_FLOOR_MS = 1.0  # the least added latency a ratio is taken against


# ---------------------------------------------------------------------------------- attackers

@dataclass(slots=True)
class AttackConfig:
    """What the attacker process does (``bench/hostile.py attack CONFIG-JSON``)."""

    port: int
    idle: int = 0
    slowloris: int = 0
    floods: int = 0
    oversized: int = 0
    flood_tokens: int = 80_000
    flood_gap_s: float = 1.0
    slowloris_bytes: int = 4
    slowloris_interval_s: float = 1.0
    oversized_gap_s: float = 1.0
    oversized_kinds: tuple[str, ...] = OVERSIZED_KINDS  # the oversized clients' kinds, in turn
    max_body: int = DEFAULT_MAX_BODY
    max_json_values: int = DEFAULT_MAX_JSON_VALUES
    answer_timeout_s: float = 30.0


@dataclass(slots=True)
class KindStats:
    """What one kind of attacker saw: its attempts and the proxy's answers."""

    attempts: int = 0
    answers: collections.Counter[str] = field(default_factory=collections.Counter)
    open_at_stop: int = 0  # unanswered when the attack stopped
    bytes: int = 0  # a flood's bytes read, a slowloris' or an upload's bytes sent
    complete: int = 0  # floods read to their [DONE] and last chunk
    seconds: list[float] = field(default_factory=list)  # each flood's, first byte to last

    def report(self) -> dict[str, Any]:
        out = asdict(self)
        out["answers"] = dict(self.answers)
        out["seconds"] = [round(s, 3) for s in self.seconds]
        return out


def status_of(data: bytes) -> str:
    """The status code of an HTTP/1.1 answer's first bytes, or what came instead."""
    if not data:
        return "closed"
    if data.startswith(b"HTTP/1.") and len(data) >= 12:
        return data[9:12].decode("latin-1")
    return "garbage"


async def read_status(reader: asyncio.StreamReader) -> str:
    """Read until the status line is in (or the connection ends): its code, ``closed``
    (an end without an answer) or ``reset``."""
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = await reader.read(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        return status_of(data) if data else "reset"
    return status_of(data)


async def first_of(task: asyncio.Future[T], stop: asyncio.Future[Any],
                   seconds: float | None = None) -> bool:
    """Wait for ``task`` or ``stop`` (or ``seconds``): whether ``task`` is done."""
    await asyncio.wait({task, stop}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    return task.done()


class Attack:
    """The attackers of one hostile round, in the attacker process."""

    def __init__(self, config: AttackConfig) -> None:
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.stopping: asyncio.Future[None] = self.loop.create_future()
        self.stats = {kind: KindStats() for kind in ("idle", "slowloris", "flood",
                                                      *OVERSIZED_KINDS)}
        self.opened = collections.Counter[str]()  # first connections up, per kind
        self.all_opened = asyncio.Event()
        c = config
        self.payloads = {
            "body_size": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
                          b"content-type: application/json\r\ncontent-length: %d\r\n\r\n"
                          % (c.max_body + 1)) + b" " * 65536,
            "json_values": request_of(b"[" + b"0," * c.max_json_values + b"0]", close=True),
            "head_size": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nx-big: "
                          + b"a" * (MAX_HEAD_BYTES + 1024) + b"\r\ncontent-length: 2\r\n\r\n{}"),
        }
        lines = b"".join(b"x-slow-%d: %d\r\n" % (i, i) for i in range(20_000))
        self.slow_head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
                          b"content-type: application/json\r\n" + lines)

    async def run(self, ready: Callable[[], None], stopped: Awaitable[Any]) -> dict[str, Any]:
        c = self.config
        tasks = [asyncio.ensure_future(self.idle(i)) for i in range(c.idle)]
        tasks += [asyncio.ensure_future(self.slowloris(i)) for i in range(c.slowloris)]
        tasks += [asyncio.ensure_future(self.flood(i)) for i in range(c.floods)]
        tasks += [asyncio.ensure_future(self.oversized(i)) for i in range(c.oversized)]
        self.count_opened(None)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(30):
                await self.all_opened.wait()
        ready()
        await stopped
        self.stopping.set_result(None)
        _, pending = await asyncio.wait(tasks, timeout=20) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise cast(BaseException, task.exception())
        return {"config": asdict(c), "unfinished_tasks": len(pending),
                "kinds": {kind: stats.report() for kind, stats in self.stats.items()}}

    def count_opened(self, kind: str | None) -> None:
        """An attacker of ``kind`` is up (its first connection made, or tried): ``ready``
        once every idle, slowloris and flood attacker is."""
        if kind is not None:
            self.opened[kind] += 1
        c, opened = self.config, self.opened
        if (opened["idle"] >= c.idle and opened["slowloris"] >= c.slowloris
                and opened["flood"] >= c.floods):
            self.all_opened.set()

    async def connect(self, kind: str, first: bool) -> tuple[asyncio.StreamReader,
                                                             asyncio.StreamWriter] | None:
        """A connection for an attacker of ``kind`` (``first``: its first, counted for
        ``ready``)."""
        stats = self.stats[kind]
        stats.attempts += 1
        try:
            return await asyncio.open_connection(HOST, self.config.port)
        except OSError:
            stats.answers["connect_error"] += 1
            return None
        finally:
            if first:
                self.count_opened(kind)

    async def pause(self, seconds: float) -> None:
        await asyncio.wait({self.stopping}, timeout=seconds)

    async def idle(self, i: int) -> None:
        """A connection that sends nothing; answered, it is opened again."""
        await asyncio.sleep(i % 100 * 0.002)  # not a thousand SYNs in one burst
        stats = self.stats["idle"]
        async for reader, writer in self.connections("idle"):
            answer = asyncio.ensure_future(read_status(reader))
            await first_of(answer, self.stopping)
            await self.settle(stats, answer, writer)

    async def connections(self, kind: str
                          ) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        """An attacker's connections, one after another, until the round stops (a refused
        connect is tried again a moment later)."""
        first = True
        while not self.stopping.done():
            pair = await self.connect(kind, first)
            first = False
            if pair is None:
                await self.pause(0.1)
                continue
            yield pair

    async def slowloris(self, i: int) -> None:
        """A request head a few bytes at a time that never ends; answered, again."""
        c = self.config
        stats = self.stats["slowloris"]
        await asyncio.sleep(c.slowloris_interval_s * i / max(1, c.slowloris))
        async for reader, writer in self.connections("slowloris"):
            answer = asyncio.ensure_future(read_status(reader))
            sent = 0
            while not answer.done() and not self.stopping.done() and sent < len(self.slow_head):
                piece = self.slow_head[sent:sent + c.slowloris_bytes]
                writer.write(piece)
                sent += len(piece)
                stats.bytes += len(piece)
                await first_of(answer, self.stopping, c.slowloris_interval_s)
            await self.settle(stats, answer, writer)

    async def settle(self, stats: KindStats, answer: asyncio.Future[str],
                     writer: asyncio.StreamWriter) -> None:
        """An attacker's connection done with: its answer counted (or that it was still
        open when the round stopped), closed, and a moment before the next."""
        if answer.done():
            stats.answers[answer.result()] += 1
        else:
            answer.cancel()
            stats.open_at_stop += 1
        writer.close()
        await self.pause(0.05)

    async def flood(self, i: int) -> None:
        """Flooding streams, one at a time, ``flood_gap_s`` apart; each read to its end."""
        c = self.config
        stats = self.stats["flood"]
        await asyncio.sleep(0.05 * i)
        n = 0
        while not self.stopping.done():
            n += 1
            body = json.dumps({"messages": [{"role": "user", "content": f"flood {i} {n}"}],
                               "max_tokens": c.flood_tokens, "stream": True,
                               "flood": True}).encode()
            stats.attempts += 1
            if n == 1:
                self.count_opened("flood")
            try:
                transport, reader = await self.loop.create_connection(FloodReader, HOST, c.port)
            except OSError:
                stats.answers["connect_error"] += 1
                await self.pause(0.1)
                continue
            transport.write(request_of(body, close=True))
            try:
                async with asyncio.timeout(c.answer_timeout_s + 60):
                    await reader.done
            except TimeoutError:
                stats.answers["timeout"] += 1
            transport.close()
            stats.answers[status_of(reader.head)] += 1
            stats.bytes += reader.bytes
            if reader.done.done() and reader.done.result():
                stats.complete += 1
                stats.seconds.append(reader.last - reader.first)
            await self.pause(c.flood_gap_s)

    async def oversized(self, i: int) -> None:
        """One kind of oversized request, again every ``oversized_gap_s``."""
        c = self.config
        kind = c.oversized_kinds[i % len(c.oversized_kinds)]
        stats = self.stats[kind]
        await asyncio.sleep(c.oversized_gap_s * i / max(1, c.oversized))
        async for reader, writer in self.connections(kind):
            answer = asyncio.ensure_future(read_status(reader))
            try:
                if kind == "body_streamed":
                    await self.stream_body(writer, answer, stats)
                elif kind == "body_chunks":
                    await self.stream_chunks(writer, answer, stats)
                else:
                    writer.write(self.payloads[kind])
                    await writer.drain()
            except OSError:
                pass  # the proxy answered and closed mid-upload: the answer says what
            try:
                async with asyncio.timeout(c.answer_timeout_s):
                    stats.answers[await answer] += 1
            except TimeoutError:
                stats.answers["no answer"] += 1
            writer.close()
            await self.pause(c.oversized_gap_s)

    async def stream_body(self, writer: asyncio.StreamWriter, answer: asyncio.Future[str],
                          stats: KindStats) -> None:
        """A chunked body, no length declared, 64 KiB chunks until the proxy answers (or
        well past ``max_body``)."""
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
                     b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = b"10000\r\n" + b" " * 65536 + b"\r\n"
        sent = 0
        while not answer.done() and sent <= self.config.max_body + (4 << 20):
            writer.write(piece)
            sent += 65536
            stats.bytes += 65536
            await writer.drain()


    async def stream_chunks(self, writer: asyncio.StreamWriter, answer: asyncio.Future[str],
                            stats: KindStats) -> None:
        """A chunked body of one-byte chunks (each costs the proxy's parser a callback),
        8,192 chunks a write, until the proxy answers (or well past the default
        ``--max-body-chunks``)."""
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
                     b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = b"1\r\n \r\n" * 8192
        sent = 0
        while not answer.done() and sent <= 4 * DEFAULT_MAX_BODY_CHUNKS:
            writer.write(piece)
            sent += 8192
            stats.bytes += len(piece)
            await writer.drain()


class FloodReader(asyncio.Protocol):
    """A flooding stream's reader: its bytes counted, its end found, nothing parsed."""

    def __init__(self) -> None:
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.bytes = 0
        self.head = b""
        self.tail = b""
        self.first = self.last = 0.0

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self.bytes:
            self.first = now
        self.last = now
        self.bytes += len(data)
        if len(self.head) < 16:
            self.head += data[:16]
        self.tail = (self.tail + data[-64:])[-64:]
        if self.tail.endswith(FLOOD_END) and not self.done.done():
            self.done.set_result(True)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(False)


def attacker_main(config_json: str) -> int:
    """The attacker process: ``ready`` on stdout once its connections are up, then attacks
    until a line (or the end) on stdin, then its report, one JSON line."""
    config = AttackConfig(**json.loads(config_json))

    async def attack() -> dict[str, Any]:
        loop = asyncio.get_running_loop()

        def ready() -> None:
            print("ready", flush=True)

        stopped = loop.run_in_executor(None, sys.stdin.readline)
        return await Attack(config).run(ready, stopped)

    report = run_async(attack())
    print(json.dumps(report), flush=True)
    return 0


class Attackers:
    """The attacker process of one hostile round, seen from the bench."""

    def __init__(self, config: AttackConfig, log: Path, nice: int = 0) -> None:
        niced = ["nice", "-n", str(nice)] if nice else []
        with open(log, "ab") as stderr:
            self.proc = subprocess.Popen(
                [*niced, sys.executable, str(Path(__file__).resolve()), "attack",
                 json.dumps(asdict(config))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            self.proc.kill()
            raise RuntimeError(f"the attackers did not start: {line[:300]!r} (exit "
                               f"{self.proc.wait()})")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(b"stop\n")
        self.proc.stdin.close()
        line = self.proc.stdout.readline()
        self.proc.stdout.close()
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        if code != 0 or not line:
            raise RuntimeError(f"the attackers failed (exit {self.proc.returncode}): see "
                               "attack-*.log in the logs' folder")
        return cast(dict[str, Any], json.loads(line))


# ---------------------------------------------------------------------------------- the client

class GapClient(Client):
    """``bench/load.py``'s client, also recording each response's longest silence between
    two reads (its first read on: the wait for the first is the first event's latency): a
    stall of the stream."""

    def __init__(self, gaps: list[float]) -> None:
        super().__init__()
        self.gaps = gaps
        self.last_read = 0.0
        self.max_gap = 0.0

    def send(self, request: bytes, result: Stream, start: float) -> asyncio.Future[None]:
        self.last_read, self.max_gap = 0.0, 0.0
        return super().send(request, result, start)

    def data_received(self, data: bytes) -> None:
        if self.future is not None:
            now = time.perf_counter()
            if self.last_read:
                self.max_gap = max(self.max_gap, now - self.last_read)
            self.last_read = now
            super().data_received(data)
            if self.state == IDLE:  # the response ended in this read
                self.gaps.append(self.max_gap)
        else:
            super().data_received(data)


class RssSampler:
    """The proxy's RSS over a round: its peak (``VmHWM``, reset at the start through
    ``/proc/PID/clear_refs`` where the kernel allows it: None where not) and ``VmRSS``
    every ``period_s`` (in the client's loop); and its loop's thread's time on a core and
    waiting for one (``/proc/PID/schedstat``: when the processes of a run want more cores
    than the machine has, the proxy's loop waits its turn, and every stream with it)."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        self.pid, self.period_s = pid, period_s
        self.samples: list[int] = []
        self.sched = (0.0, 0.0)
        self.task: asyncio.Task[None] | None = None
        self.peak_reset = False

    def start(self) -> None:
        """Before the round (before its attackers start)."""
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            self.peak_reset = True
        except OSError:
            self.peak_reset = False
        self.samples = [proc_status(self.pid)["VmRSS"]]
        self.sched = schedstat(self.pid)
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self.samples.append(proc_status(self.pid)["VmRSS"])

    async def stop(self) -> dict[str, Any]:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        status = proc_status(self.pid)
        self.samples.append(status["VmRSS"])
        peak = status["VmHWM"] if self.peak_reset else max(self.samples)
        on_core, waited = (after - before for after, before in zip(schedstat(self.pid),
                                                                  self.sched, strict=True))
        return {"loop_on_core_s": round(on_core, 2), "loop_waited_for_core_s": round(waited, 2),
                "start_mib": mib(self.samples[0]), "peak_mib": mib(peak),
                "peak_from": "VmHWM" if self.peak_reset else "samples",
                "sampled_max_mib": mib(max(self.samples)), "end_mib": mib(self.samples[-1]),
                "growth_mib": mib(peak - self.samples[0])}


def schedstat(pid: int) -> tuple[float, float]:
    """The process's main thread (the proxy's loop): seconds on a core, and seconds
    runnable but waiting for one."""
    on_core, waiting, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    return int(on_core) / 1e9, int(waiting) / 1e9


def alive(pid: int) -> bool:
    """Whether a process runs (not gone, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def mib(kib: float) -> float:
    return round(kib / 1024, 1)


def refusals(admin_port: int) -> dict[str, float]:
    """``prefixpin_limit_refusals_total`` by limit, from the proxy's operator listener."""
    text = httpx.get(f"http://{HOST}:{admin_port}/metrics", timeout=10).text
    return {limit: float(value) for limit, value in REFUSALS.findall(text)}


def healthz(port: int) -> int | str:
    try:
        return httpx.get(f"http://{HOST}:{port}/healthz", timeout=10).status_code
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------------- the rounds

@dataclass(slots=True)
class Round:
    arm: str
    index: int
    streams: list[Stream]
    gaps: list[float]
    wall_s: float
    rss: dict[str, Any]
    attack: dict[str, Any] | None = None
    refusals: dict[str, float] | None = None


@dataclass(slots=True)
class Run:
    """What the bench needs of its options."""

    plan: Plan
    rounds: int
    attack: AttackConfig
    max_connections: int
    past_limit: int
    logs: Path
    direct_floods: bool = False  # the direct_flood arm too
    attackers_nice: int = 0  # the attacker process's niceness (0: as the bench's own)
    direct_attacked: bool = False  # the direct_attacked arm too

    @property
    def arms(self) -> tuple[str, ...]:
        return (*ARMS, *((DIRECT_FLOOD,) if self.direct_floods else ()),
                *((DIRECT_ATTACKED,) if self.direct_attacked else ()))


async def measure(run: Run, ports: dict[str, int], pids: dict[str, int]) -> dict[str, Any]:
    plan = run.plan
    admin = ports["proxy"] + 1
    warm = Plan(min(16, plan.streams), 1, 4, plan.token_delay_ms, together=True,
                fresh=False, timeout_s=plan.timeout_s)
    for arm in ("direct", "proxy"):
        await run_round(ports[arm], warm, warm.requests(f"warm-{arm}", 0))
    await asyncio.sleep(0.5)
    status = proc_status(pids["proxy"])
    # VmHWM before the rounds reset it: start-up's peak (the tokenizer's load) and warm-up.
    memory: dict[str, Any] = {"rss_idle_mib": mib(status["VmRSS"]),
                              "startup_peak_mib": mib(status["VmHWM"])}
    stats_before = fake_stats(ports["direct"])
    records: list[Round] = []
    loop = asyncio.get_running_loop()
    for index in range(1, run.rounds + 1):
        for arm in (run.arms if index % 2 else run.arms[::-1]):
            attackers = None
            counted: dict[str, float] = {}
            sampler = RssSampler(pids["proxy"])
            sampler.start()
            if arm in ("hostile", DIRECT_ATTACKED):
                counted = refusals(admin)
                attackers = Attackers(run.attack, run.logs / f"attack-{arm}-{index}.log",
                                      run.attackers_nice)
                await loop.run_in_executor(None, attackers.wait_ready)
            elif arm == DIRECT_FLOOD:
                floods = AttackConfig(port=ports["direct"], floods=run.attack.floods,
                                      flood_tokens=run.attack.flood_tokens,
                                      flood_gap_s=run.attack.flood_gap_s)
                attackers = Attackers(floods, run.logs / f"attack-direct-{index}.log",
                                      run.attackers_nice)
                await loop.run_in_executor(None, attackers.wait_ready)
            port = ports["direct" if arm in ("direct", DIRECT_FLOOD, DIRECT_ATTACKED)
                         else "proxy"]
            gaps: list[float] = []
            gc.collect()
            gc.disable()  # the client's own collector stays out of the timings
            started = time.perf_counter()
            try:
                streams = await run_round(port, plan, plan.requests(arm, index),
                                          functools.partial(GapClient, gaps))
            except BaseException:
                if attackers is not None:
                    attackers.kill()
                raise
            wall = time.perf_counter() - started
            gc.enable()
            record = Round(arm, index, streams, gaps, wall, {})
            if attackers is not None:
                record.attack = await loop.run_in_executor(None, attackers.stop)
            if arm in ("hostile", DIRECT_ATTACKED):
                await asyncio.sleep(0.3)  # the refusals of the last moment are counted
                after = refusals(admin)
                record.refusals = {k: after[k] - counted.get(k, 0.0) for k in after
                                   if after[k] != counted.get(k, 0.0)}
            await asyncio.sleep(0.5)
            record.rss = await sampler.stop()
            records.append(record)
    memory["stats"] = {k: v - stats_before.get(k, 0) for k, v in fake_stats(ports["direct"]).items()
                       if isinstance(v, int | float) and k not in ("pid", "max_rss_kib")}
    limit = await limit_phase(ports["proxy"], admin, run.max_connections, run.past_limit)
    await asyncio.sleep(1.0)
    status = proc_status(pids["proxy"])
    memory["rss_after_mib"] = mib(status["VmRSS"])
    # The rounds reset VmHWM (where the kernel lets them): the peak is the largest of theirs,
    # the limit phase's and start-up's.
    memory["peak_mib"] = max([mib(status["VmHWM"]), memory["startup_peak_mib"],
                              *(r.rss["peak_mib"] for r in records)])
    end = {"tenant_healthz": healthz(ports["proxy"]), "operator_healthz": healthz(admin),
           "refusals_total": refusals(admin)}
    return {"records": records, "memory": memory, "limit": limit, "end": end}


async def limit_phase(port: int, admin: int, max_connections: int,
                      extra: int) -> dict[str, Any] | None:
    """``max_connections + extra`` connections at once to the tenant listener: the
    answers within a second (a 503 past the limit), both listeners' /healthz while they
    are held, the tenant's again after they closed."""
    if extra <= 0:
        return None
    loop = asyncio.get_running_loop()
    before = await loop.run_in_executor(None, refusals, admin)
    pairs: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    answers: collections.Counter[str] = collections.Counter()
    for _ in range(max_connections + extra):
        try:
            pairs.append(await asyncio.open_connection(HOST, port))
        except OSError as exc:
            answers[f"connect_error {type(exc).__name__}"] += 1

    async def answer(reader: asyncio.StreamReader) -> str:
        try:
            async with asyncio.timeout(0.5):
                return await read_status(reader)
        except TimeoutError:
            return "held open"

    for result in await asyncio.gather(*(answer(r) for r, _ in pairs)):
        answers[result] += 1
    held = {"operator_healthz": await loop.run_in_executor(None, healthz, admin),
            "tenant_healthz": await loop.run_in_executor(None, healthz, port)}
    for _, writer in pairs:
        writer.close()
    await asyncio.sleep(1.0)
    after = await loop.run_in_executor(None, refusals, admin)
    return {"opened": max_connections + extra, "max_connections": max_connections,
            "answers": dict(answers), "while_held": held,
            "tenant_healthz_after": await loop.run_in_executor(None, healthz, port),
            "refusals": {k: after[k] - before.get(k, 0.0) for k in after
                         if after[k] != before.get(k, 0.0)}}


# ---------------------------------------------------------------------------------- figures

def arm_figures(records: list[Round]) -> dict[str, Any]:
    streams = [s for r in records for s in r.streams]
    ok = [s for s in streams if not s.failed]
    gaps = [g for r in records for g in r.gaps]
    ms = 1000.0
    out: dict[str, Any] = integrity(streams)
    out["events_per_stream"] = sorted({len(s.seqs) for s in ok})
    for name, key in (("first_event", "first_event_s"), ("last_byte", "last_byte_s")):
        values = [getattr(s, key) or 0.0 for s in ok]
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            out[f"{name}_{label}_ms"] = round(percentile(values, q) * ms, 1)
    out["stall_p99_ms"] = round(percentile(gaps, 0.99) * ms, 1)
    out["stall_max_ms"] = round(max(gaps, default=0.0) * ms, 1)
    out["round_wall_s"] = [round(r.wall_s, 2) for r in records]
    out["rss"] = [r.rss for r in records]
    return out


def attack_totals(records: list[Round]) -> dict[str, Any]:
    """The attackers' reports over the hostile rounds, summed per kind, and the proxy's
    refusal counts over the same rounds."""
    kinds: dict[str, dict[str, Any]] = {}
    counted: collections.Counter[str] = collections.Counter()
    for record in records:
        if record.attack is None or record.arm != "hostile":
            continue
        for kind, seen in record.attack["kinds"].items():
            total = kinds.setdefault(kind, {"attempts": 0, "answers": collections.Counter(),
                                            "open_at_stop": 0, "bytes": 0, "complete": 0,
                                            "seconds": []})
            for key in ("attempts", "open_at_stop", "bytes", "complete"):
                total[key] += seen[key]
            total["answers"].update(seen["answers"])
            total["seconds"] += seen["seconds"]
        for limit, value in (record.refusals or {}).items():
            counted[limit] += int(value)
    for total in kinds.values():
        total["answers"] = dict(total["answers"])
        seconds = total.pop("seconds")
        if seconds:
            total["flood_seconds_p50"] = round(percentile(seconds, 0.5), 3)
            total["flood_seconds_max"] = round(max(seconds), 3)
    return {"kinds": kinds, "refusals_counted": dict(counted)}


def answered_as_expected(attack: dict[str, Any], config: AttackConfig) -> dict[str, Any]:
    """Per attacker kind: whether every answer was the expected one (``open_at_stop``, a
    connection the proxy had not answered yet when the round ended, aside), and whether
    the proxy's counter agrees with what the attackers saw."""
    checks: dict[str, Any] = {}
    sent = {"idle": config.idle, "slowloris": config.slowloris, "flood": config.floods}
    kinds = config.oversized_kinds
    per_kind = collections.Counter(kinds[i % len(kinds)] for i in range(config.oversized))
    for kind, (status, _limit) in EXPECTED.items():
        seen = attack["kinds"].get(kind)
        clients = sent.get(kind, per_kind.get(kind, 0))
        if not clients or seen is None:
            continue
        answers = seen["answers"]
        others = {k: v for k, v in answers.items() if k != status}
        row: dict[str, Any] = {"clients": clients, "expected": status,
                               "answered": answers.get(status, 0), "other_answers": others,
                               "unanswered_at_stop": seen["open_at_stop"]}
        if kind == "flood":
            row["complete"] = seen["complete"]
            row["mib_read"] = round(seen["bytes"] / 2**20, 1)
            ok = not others and seen["complete"] == answers.get(status, 0) > 0
        else:
            ok = not others and answers.get(status, 0) > 0
        row["ok"] = ok
        checks[kind] = row
    counted = attack["refusals_counted"]
    seen_by_limit: collections.Counter[str] = collections.Counter()
    for kind, (_status, limit) in EXPECTED.items():
        if limit is not None and kind in checks:
            seen_by_limit[limit] += checks[kind]["answered"]
    # The proxy's count may exceed what the attackers read: a refusal written as an
    # attacker gave up (the round's end) is counted but not read.
    checks["counter_agrees"] = {limit: {"attackers_read": n, "proxy_counted": counted.get(limit, 0),
                                        "ok": counted.get(limit, 0) >= n}
                                for limit, n in seen_by_limit.items()}
    return checks


def summarise(run: Run, measured: dict[str, Any]) -> dict[str, Any]:
    records: list[Round] = measured["records"]
    arms = {arm: arm_figures([r for r in records if r.arm == arm]) for arm in run.arms}
    result: dict[str, Any] = {"arms": arms}
    lengths = {n for a in arms.values() for n in a["events_per_stream"]}
    intact = all(a[k] == 0 for a in arms.values()
                 for k in ("lost", "duplicated", "reordered", "streams_failed"))
    result["healthy_intact"] = intact and len(lengths) == 1
    added: dict[str, Any] = {}
    for name in ("first_event", "last_byte"):
        for q in ("p50", "p99"):
            direct = arms["direct"][f"{name}_{q}_ms"]
            calm = round(arms["calm"][f"{name}_{q}_ms"] - direct, 1)
            hostile = round(arms["hostile"][f"{name}_{q}_ms"] - direct, 1)
            added[f"{name}_{q}"] = {"calm_ms": calm, "hostile_ms": hostile,
                                    "ratio": ratio(hostile, calm)}
    added["stall_p99"] = {"direct_ms": arms["direct"]["stall_p99_ms"],
                          "calm_ms": arms["calm"]["stall_p99_ms"],
                          "hostile_ms": arms["hostile"]["stall_p99_ms"]}
    if DIRECT_ATTACKED in arms:
        # The proxy's own share under attack: the hostile arm against the direct one under
        # the same attack, not against the calm direct one.
        for name in ("first_event", "last_byte"):
            attacked = arms[DIRECT_ATTACKED][f"{name}_p99_ms"]
            row = added[f"{name}_p99"]
            row["machine_ms"] = round(attacked - arms["direct"][f"{name}_p99_ms"], 1)
            row["hostile_over_attacked_ms"] = own = round(
                arms["hostile"][f"{name}_p99_ms"] - attacked, 1)
            row["ratio_over_attacked"] = ratio(own, row["calm_ms"])
    result["added"] = added
    if DIRECT_FLOOD in arms:
        flooded, direct = arms[DIRECT_FLOOD], arms["direct"]
        floods = [r.attack["kinds"]["flood"] for r in records
                  if r.arm == DIRECT_FLOOD and r.attack is not None]
        result["floods_without_proxy"] = {
            "first_event_p99_added_ms": round(flooded["first_event_p99_ms"]
                                              - direct["first_event_p99_ms"], 1),
            "last_byte_p99_added_ms": round(flooded["last_byte_p99_ms"]
                                            - direct["last_byte_p99_ms"], 1),
            "stall_p99_ms": flooded["stall_p99_ms"],
            "floods": sum(f["attempts"] for f in floods),
            "complete": sum(f["complete"] for f in floods),
            "mib_read": round(sum(f["bytes"] for f in floods) / 2**20, 1)}
    attack = attack_totals(records)
    result["attack"] = attack
    result["answers"] = answered_as_expected(attack, run.attack)
    result["limit_phase"] = measured["limit"]
    result["memory"] = measured["memory"]
    growth = {arm: max((r.rss["growth_mib"] for r in records if r.arm == arm), default=0.0)
              for arm in ("calm", "hostile")}
    result["memory"]["round_growth_max_mib"] = growth
    result["end"] = measured["end"]
    result["attack_refusal_rounds"] = [r.refusals for r in records if r.arm == "hostile"]
    return result


def ratio(value: float, base: float) -> float:
    """``value / base``, the base at least ``RATIO_FLOOR_MS`` (an added latency at or below
    zero, the proxy arm as fast as direct within the noise, gives no ratio otherwise)."""
    return round(value / max(base, RATIO_FLOOR_MS), 2)


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    def check(name: str, bound: str, measured: Any, met: bool | None) -> dict[str, Any]:
        verdict = "report only" if met is None else ("met" if met else "not met")
        return {"target": name, "bound": bound, "measured": measured, "verdict": verdict}

    arms, added = result["arms"], result["added"]
    out = [check(f"every healthy stream complete and in order ({', '.join(arms)})",
                 "no loss, repeat, reordering or failure",
                 ", ".join(f"{arm}: {a['streams']} streams, {a['events_checked']} events, "
                           f"{a['lost']}/{a['duplicated']}/{a['reordered']} lost/dup/reord, "
                           f"{a['streams_failed']} failed" for arm, a in arms.items()),
                 result["healthy_intact"])]
    for name, label in (("first_event", "first event"), ("last_byte", "last byte")):
        row = added[f"{name}_p99"]
        floor = row["calm_ms"]
        out.append(check(f"added p99 {label} with the attackers, against without",
                         f"≤ {TARGET_RATIO:g}x", f"{row['hostile_ms']} ms against {floor} ms "
                         f"({row['ratio']}x)",
                         row["ratio"] <= TARGET_RATIO))
        out.append(check(f"added p99 {label} with the attackers", f"≤ {TARGET_ADDED_MS:g} ms",
                         f"{row['hostile_ms']} ms", row["hostile_ms"] <= TARGET_ADDED_MS))
    for name, label in (("first_event", "first event"), ("last_byte", "last byte")):
        row = added[f"{name}_p99"]
        if "machine_ms" in row:
            out.append(check(
                f"p99 {label}: what the attack adds with the proxy off the healthy streams' "
                "path (direct_attacked minus direct), and the hostile arm against "
                "direct_attacked, against the calm arm's added", "-",
                f"+{row['machine_ms']} ms; {row['hostile_over_attacked_ms']} ms against "
                f"{row['calm_ms']} ms ({row['ratio_over_attacked']}x)", None))
    alone = result.get("floods_without_proxy")
    if alone is not None:
        out.append(check("what the floods alone cost the healthy streams without the proxy "
                         "(direct_flood arm minus direct: first event / last byte p99, stall "
                         "p99)", "-", f"+{alone['first_event_p99_added_ms']} / "
                         f"+{alone['last_byte_p99_added_ms']} ms, stall "
                         f"{alone['stall_p99_ms']} ms ({alone['complete']} floods, "
                         f"{alone['mib_read']} MiB)", None))
    stall = added["stall_p99"]
    out.append(check("healthy streams' p99 longest silence between reads (direct / calm / "
                     "hostile)", "-", f"{stall['direct_ms']} / {stall['calm_ms']} / "
                     f"{stall['hostile_ms']} ms (max {arms['hostile']['stall_max_ms']} ms)",
                     None))
    for kind, row in result["answers"].items():
        if kind == "counter_agrees":
            agree = all(r["ok"] for r in row.values())
            out.append(check("the proxy's refusal counter covers what the attackers read",
                             "counted ≥ read", ", ".join(
                                 f"{limit}: {r['proxy_counted']} ≥ {r['attackers_read']}"
                                 for limit, r in row.items()), agree))
            continue
        extra = (f", {row['complete']} complete, {row['mib_read']} MiB read"
                 if kind == "flood" else "")
        clients = f"{row['clients']} client" + ("s" if row["clients"] != 1 else "")
        out.append(check(f"{kind} ({clients}) answered {row['expected']}",
                         f"every answer {row['expected']}",
                         f"{row['answered']} x {row['expected']}, others {row['other_answers']}"
                         f", unanswered at the round's end {row['unanswered_at_stop']}{extra}",
                         row["ok"]))
    limit = result["limit_phase"]
    if limit is not None:
        refused = limit["answers"].get("503", 0)
        expected_min = limit["opened"] - limit["max_connections"]
        out.append(check(f"{limit['opened']} connections at once against --max-connections "
                         f"{limit['max_connections']}", f"≥ {expected_min} answered 503, the "
                         "operator listener up meanwhile",
                         f"{limit['answers']}; operator /healthz "
                         f"{limit['while_held']['operator_healthz']} while held, tenant "
                         f"/healthz {limit['tenant_healthz_after']} after",
                         refused >= expected_min
                         and limit["while_held"]["operator_healthz"] == 200
                         and limit["tenant_healthz_after"] == 200))
    memory = result["memory"]
    out.append(check("proxy RSS: idle / largest growth in a calm round / in a hostile round "
                     "/ peak (VmHWM) / after the run", "-",
                     f"{memory['rss_idle_mib']} / +{memory['round_growth_max_mib']['calm']} / "
                     f"+{memory['round_growth_max_mib']['hostile']} / {memory['peak_mib']} / "
                     f"{memory['rss_after_mib']} MiB", None))
    end = result["end"]
    out.append(check("the proxy up at the end", "/healthz 200 on both listeners",
                     f"tenant {end['tenant_healthz']}, operator {end['operator_healthz']}",
                     end["tenant_healthz"] == 200 and end["operator_healthz"] == 200))
    return out


# ---------------------------------------------------------------------------------- report

def render(result: dict[str, Any]) -> str:
    setup, machine, arms = result["setup"], result["machine"], result["arms"]
    a = result["attack_config"]
    lines = [
        "# Hostile load: healthy streams through one proxy under attack (issue 33)", "",
        f"**{result['label']}**", "", "```", result["command"], "```", "",
        f"- date: {result['date']}; full run {result['runtime_s']:.0f} s",
        f"- machine: {machine['cpus']} CPUs, python {machine['python']}, "
        f"{machine['platform']}; load average {machine['load_average_start'][0]:.2f} at "
        f"start, {machine['load_average_end'][0]:.2f} at end (the client, the attackers, "
        "the fake and the proxy share the cores"
        + (f"; the attackers at nice {result['attackers_nice']})" if result["attackers_nice"]
           else ")"),
        f"- proxy: `{' '.join(setup['proxy_cmd'])}` from {tree_line(setup['tree'])}; the "
        "rest at its defaults, logs at info into a file",
        f"- fake: `bench/fast_engine.py`, model_path {setup['model']}; "
        f"{setup['slots']} slots",
        f"- healthy: {result['plan']['streams']} stream slots x {result['plan']['waves']} "
        f"requests back to back, {result['plan']['events']} tokens "
        f"{result['plan']['token_delay_ms']} ms apart each, staggered; {result['rounds']} "
        "rounds per arm, the arms in turn (order flipped every round)",
        f"- attackers (their own process, up before each hostile round, stopped after it): "
        f"{a['idle']} idle connections, {a['slowloris']} slowloris ({a['slowloris_bytes']} "
        f"bytes every {a['slowloris_interval_s']} s), {a['floods']} flood clients "
        f"({a['flood_tokens']} token events ≈ {result['flood_mib']} MiB a stream, "
        f"{a['flood_gap_s']} s apart), {a['oversized']} oversized clients (kinds in turn: "
        f"{', '.join(a['oversized_kinds'])}; every {a['oversized_gap_s']} s); answered, they "
        "come again",
        "- added = the arm's percentile minus the direct arm's; stall = a stream's longest "
        "silence between two reads (tokens are due every "
        f"{result['plan']['token_delay_ms']} ms)", "",
        "## Targets", "", "| target | bound | measured | verdict |", "|---|---|---|---|",
    ]
    for row in result["targets"]:
        lines.append(f"| {row['target']} | {row['bound']} | {row['measured']} | "
                     f"**{row['verdict']}** |")
    lines += ["", "## Healthy streams", "",
              "| arm | streams | events | lost / dup / reord | failed | first event p50 / p99 "
              "(ms) | last byte p50 / p99 (ms) | stall p99 / max (ms) | round walls (s) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for arm, f in arms.items():
        lines.append(f"| {arm} | {f['streams']} | {f['events_checked']} | {f['lost']} / "
                     f"{f['duplicated']} / {f['reordered']} | {f['streams_failed']} | "
                     f"{f['first_event_p50_ms']} / {f['first_event_p99_ms']} | "
                     f"{f['last_byte_p50_ms']} / {f['last_byte_p99_ms']} | "
                     f"{f['stall_p99_ms']} / {f['stall_max_ms']} | {f['round_wall_s']} |")
    lines += ["", "| added (ms) | without attackers | with | ratio |", "|---|---|---|---|"]
    for key in ("first_event_p50", "first_event_p99", "last_byte_p50", "last_byte_p99"):
        row = result["added"][key]
        lines.append(f"| {key.replace('_', ' ')} | {row['calm_ms']} | {row['hostile_ms']} | "
                     f"{row['ratio']} |")
    lines += ["", "## Attackers", "",
              "| kind | clients | expected | answered so | other answers | unanswered at the "
              "round's end | ok |", "|---|---|---|---|---|---|---|"]
    for kind, row in result["answers"].items():
        if kind == "counter_agrees":
            continue
        lines.append(f"| {kind} | {row['clients']} | {row['expected']} | {row['answered']} | "
                     f"{row['other_answers'] or '-'} | {row['unanswered_at_stop']} | "
                     f"{'yes' if row['ok'] else '**no**'} |")
    flood = result["attack"]["kinds"].get("flood")
    if flood:
        lines += ["", f"- floods: {flood['attempts']} streams, {flood['complete']} read to "
                  f"their end, {round(flood['bytes'] / 2**20, 1)} MiB through the proxy; a "
                  f"flood's time p50 {flood.get('flood_seconds_p50', '-')} s, max "
                  f"{flood.get('flood_seconds_max', '-')} s"]
    lines += [f"- the proxy's refusals counted over the hostile rounds "
              f"(`prefixpin_limit_refusals_total`): {result['attack']['refusals_counted']}; "
              f"per round: {result['attack_refusal_rounds']}"]
    limit = result["limit_phase"]
    if limit is not None:
        lines += ["", "## The connection limit", "",
                  f"- {limit['opened']} connections at once (--max-connections "
                  f"{limit['max_connections']}): answers within 0.5 s {limit['answers']}; "
                  f"counted {limit['refusals']}",
                  f"- while they were held: operator /healthz "
                  f"{limit['while_held']['operator_healthz']}, tenant /healthz "
                  f"{limit['while_held']['tenant_healthz']} (a new connection past the "
                  f"limit); after they closed: tenant /healthz {limit['tenant_healthz_after']}"]
    memory = result["memory"]
    lines += ["", "## Proxy memory", "",
              f"- RSS idle after the warm-up {memory['rss_idle_mib']} MiB (start-up's peak "
              f"{memory['startup_peak_mib']} MiB); peak over the run (VmHWM) "
              f"{memory['peak_mib']} MiB; after the run (the limit phase and a second "
              f"after it) {memory['rss_after_mib']} MiB",
              "- per proxy round (MiB: RSS before it, before its attackers start / peak "
              "(VmHWM reset then) / RSS after it): " + "; ".join(
                  f"{arm} {r['start_mib']} / {r['peak_mib']} / {r['end_mib']}"
                  for arm in ("calm", "hostile") for r in arms[arm]["rss"]),
              "- the proxy's loop thread per round (s on a core / s runnable but waiting "
              "for a core, `/proc/PID/schedstat`): " + "; ".join(
                  f"{arm} {r['loop_on_core_s']} / {r['loop_waited_for_core_s']}"
                  for arm in ("calm", "hostile") for r in arms[arm]["rss"]),
              f"- proxy log: {result['proxy_log']}", "", "Raw figures: `result.json`.", ""]
    return "\n".join(lines)


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = ["", f"== {result['label']}", ""]
    for row in result["targets"]:
        lines.append(f"  [{row['verdict']:>11}] {row['target']}: {row['measured']} "
                     f"(bound {row['bound']})")
    return lines


# ---------------------------------------------------------------------------------- main

def token_event_bytes(model: str) -> int:
    """The wire bytes of one of the fake's token events (a five-digit token, chunk-framed)."""
    job = Job(cast(Any, None), None, 1, 1, 1, model, "length")
    frame = job.word % 12345
    return len(b"%x\r\n%b\r\n" % (len(frame), frame))


def raise_fd_limit(needed: int) -> int:
    """The soft limit of open files raised to ``needed`` (children inherit it); past the
    hard limit, a clear stop."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed or soft == resource.RLIM_INFINITY:
        return soft
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(f"bench/hostile.py needs {needed} open files per process; the hard "
                         f"limit is {hard} (raise it: ulimit -Hn, or run smaller: --idle, "
                         "--max-connections)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return needed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--healthy", type=int, default=256, help="healthy stream slots")
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--slowloris", type=int, default=100)
    parser.add_argument("--floods", type=int, default=10)
    parser.add_argument("--oversized", type=int, default=20)
    parser.add_argument("--flood-mib", type=float, default=16.0, help="per flooding stream")
    parser.add_argument("--flood-gap", type=float, default=1.0,
                        help="seconds between a flood client's streams")
    parser.add_argument("--slowloris-bytes", type=int, default=4)
    parser.add_argument("--slowloris-interval", type=float, default=1.0)
    parser.add_argument("--oversized-gap", type=float, default=1.0)
    parser.add_argument("--oversized-kinds", type=lambda text: tuple(text.split(",")),
                        default=OVERSIZED_KINDS,
                        help=f"the oversized clients' kinds, in turn (default: all, "
                             f"{','.join(OVERSIZED_KINDS)})")
    parser.add_argument("--events", type=int, default=100, help="tokens per healthy stream")
    parser.add_argument("--token-delay-ms", type=float, default=20.0)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per arm")
    parser.add_argument("--timeout", type=float, default=120.0, help="per healthy stream, s")
    parser.add_argument("--head-timeout", type=float, default=5.0,
                        help="the proxy's --head-timeout (its default, 30 s, outlasts a "
                             "round: the idle and slowloris clients would not be answered)")
    parser.add_argument("--max-connections", type=int, default=2048,
                        help="the proxy's --max-connections (2048: its default)")
    parser.add_argument("--past-limit", type=int, default=64,
                        help="connections past --max-connections in the limit phase (0: "
                             "no limit phase)")
    parser.add_argument("--max-body", type=int, default=None,
                        help="the proxy's --max-body (default: its own, 32 MiB)")
    parser.add_argument("--max-json-values", type=int, default=None,
                        help="the proxy's --max-json-values (default: its own, 2,000,000)")
    parser.add_argument("--direct-floods", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="a fourth arm: the healthy streams and the floods, both straight "
                             "to the fake (what the floods cost on this machine without the "
                             "proxy)")
    parser.add_argument("--direct-attacked", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="an arm with the healthy streams straight to the fake while the "
                             "attackers attack the proxy (what the attack costs on this "
                             "machine with the proxy off their path)")
    parser.add_argument("--attackers-nice", type=int, default=0,
                        help="run the attacker process at this niceness: on a small box it "
                             "stands for attackers on other machines, whose own CPU is not "
                             "taken from the proxy's cores (0: the bench's own)")
    parser.add_argument("--model", default="auto",
                        help="the model path the fake declares: auto (SmolLM2 when cached), "
                             "none, or a path")
    parser.add_argument("--proxy-arg", action="append", default=[],
                        help="an extra `prefixpin serve` argument (repeat)")
    parser.add_argument("--label", help="what this run is (the RUN.md heading)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/hostile"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["attack"]:
        return attacker_main(argv[1])
    args = build_parser().parse_args(argv)
    began = time.monotonic()
    load_start = os.getloadavg()
    max_body = args.max_body or DEFAULT_MAX_BODY
    max_json_values = args.max_json_values or DEFAULT_MAX_JSON_VALUES
    attackers = args.idle + args.slowloris + args.floods + args.oversized
    needed = (2 * (args.healthy + attackers) + args.max_connections + args.past_limit + 1024)
    fd_limit = raise_fd_limit(needed)
    model = resolve_model(args.model)
    event_bytes = token_event_bytes(model)
    flood_tokens = max(1, int(args.flood_mib * 2**20 / event_bytes))
    tree = Tree.this()
    described = tree.describe()
    label = args.label or (f"tree at {described['commit'][:7]}"
                           + (f", {len(described['local_changes'])} uncommitted product "
                              "changes" if described["local_changes"] else ""))
    proxy_args = ["--head-timeout", f"{args.head_timeout:g}",
                  "--max-connections", str(args.max_connections),
                  *(["--max-body", str(args.max_body)] if args.max_body else []),
                  *(["--max-json-values", str(args.max_json_values)]
                    if args.max_json_values else []),
                  *args.proxy_arg]
    logs = Path(tempfile.mkdtemp(prefix="prefixpin-hostile-"))
    setup = Setup(model, tree, proxy_args, 2.0, logs)
    plan = Plan(args.healthy, args.waves, args.events, args.token_delay_ms, together=False,
                fresh=False, timeout_s=args.timeout)
    slots = args.healthy + args.floods
    with engines(setup, "hostile", slots, plan) as (ports, pids, proxy_log):
        config = AttackConfig(
            port=ports["proxy"], idle=args.idle, slowloris=args.slowloris, floods=args.floods,
            oversized=args.oversized, flood_tokens=flood_tokens, flood_gap_s=args.flood_gap,
            slowloris_bytes=args.slowloris_bytes,
            slowloris_interval_s=args.slowloris_interval, oversized_gap_s=args.oversized_gap,
            oversized_kinds=args.oversized_kinds,
            max_body=max_body, max_json_values=max_json_values)
        run = Run(plan, args.rounds, config, args.max_connections, args.past_limit, logs,
                  args.direct_floods, args.attackers_nice, args.direct_attacked)
        measured = run_async(measure(run, ports, pids))
        measured["end"]["proxy_process_alive"] = alive(pids["proxy"])
    result = summarise(run, measured)
    result.update({
        "command": "python " + shlex.join(["bench/hostile.py", *argv]), "label": label,
        "date": f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "load_average_start": load_start,
                    "load_average_end": os.getloadavg(), "fd_soft_limit": fd_limit},
        "setup": {"proxy_cmd": ["python", "-m", "prefixpin.proxy.cli", "serve", "--upstream",
                                "URL", "--port", "P", *proxy_args],
                  "tree": described, "model": model, "slots": slots, "logs": str(logs)},
        "plan": {"streams": plan.streams, "waves": plan.waves, "events": plan.events,
                 "token_delay_ms": plan.token_delay_ms},
        "rounds": args.rounds, "attack_config": asdict(config),
        "attackers_nice": args.attackers_nice,
        "flood_mib": round(flood_tokens * event_bytes / 2**20, 1),
        "proxy_log": proxy_log_counts(proxy_log),
    })
    result["targets"] = verdicts(result)
    result["runtime_s"] = round(time.monotonic() - began, 1)
    write_results(args.out, result, render(result), summary_lines(result), logs)
    return 0 if all(row["verdict"] != "not met" for row in result["targets"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Load: up to 256 concurrent streams through one proxy process, side by side with direct,
measuring the proxy and not the fake (issue 18).

A fast fake llama-server (``bench/fast_engine.py``: raw asyncio on uvloop, its frames
pre-rendered, one shared ticker; its own process, as many slots as streams) serves both
arms; prefixpin runs in its own process in front of it (``python -m prefixpin.proxy.cli serve
--upstream URL --port P``, i.e. ``prefixpin serve``, features at their defaults, logs at
info into a file), ready once ``/healthz`` says 200 with its upstream ``ok``. The fake's
``/props`` names a real GGUF (SmolLM2, when cached: ``--model``), so the proxy reads its
tokenizer and fingerprints every request as it does beside a local llama-server.

    python bench/load.py [--streams 32,64,128,256] [--events 100] [--token-delay-ms 20]
                         [--rounds 3] [--waves 3] [--start staggered|together]
                         [--burst-streams 64] [--out bench/results/load] [--label TEXT]
                         [--tree PATH] [--profile [--profile-level 256]]

Per level (fresh processes), rounds alternate direct / proxy (the order flips every
round). In a round each of the N streams runs ``--waves`` requests back to back on one
keep-alive connection, the first ones started ``--start staggered`` over one stream's
length (so N streams are open at once for most of the round, and a new request arrives
whenever one ends) or all ``together``. Every request is a conversation of its own (nothing
is joined in flight) asking for progress and usage, so every engine event reaches the
client: a progress event, the role chunk, ``--events`` tokens ``--token-delay-ms`` apart,
the finish and usage chunks, ``[DONE]``.

The client is cheap too: raw asyncio protocols on uvloop, its own chunked-encoding and SSE
parser. Per stream it checks that the events' indexes run 0, 1, ..., n-1 with no gap,
repeat or inversion (a token event's from its text, `` w<k>``: the fake's token events have
llama-server's shape; the others' from their ``seq``), that n is the same for every
stream and arm, and that the stream ends with ``[DONE]``. Per level it reports:

- the proxy's CPU per relayed event: its ``/proc/PID/stat`` utime + stime (every thread)
  over the proxy rounds (each read after a short settle, so the work after the last byte
  is counted), divided by the events the client checked; the same for the fake (over every
  round, both arms' events) and for the client (``getrusage``), whose costs must stay far
  below the proxy's for the figure to mean anything;
- added latency: the proxy arm's percentile minus the direct arm's, for the first data
  event (the progress event: the whole request path) and the last byte of a stream;
- the proxy's RSS after each proxy round (``VmRSS``) and its peak (``VmHWM``);
- with ``--start together``, each wave's first events apart, and per proxy round what the
  proxy spent from its first wave's first request to that wave's last first event: its CPU
  (``/proc``, sampled every 5 ms: a clock tick's precision), per stream, and how busy that
  kept it (near 1: the wave waited on the proxy's one core).

The burst section (``--burst-streams``, 0: off) starts 64 streams at once on fresh
connections, distinct prompts, ``--burst-events`` tokens, ``--burst-rounds`` rounds per arm:
the per-request path (parsing, identity, planning, the lease, the first write) under a
burst. The summary prints the issue's targets and a verdict for each; RUN.md and
result.json are written to ``--out``.

``--profile`` runs one level (``--profile-level``, default the largest) with ``py-spy
record`` attached to the proxy process during the measured rounds (``--nonblocking``):
a flamegraph SVG, the raw collapsed stacks and a table of the top self-time frames under
``OUT/profile/``. It leaves RUN.md and result.json alone (a sampled proxy is not the
baseline). ``--tree PATH`` runs the proxy from another source tree (``bench/trees.py``),
e.g. a ``git worktree`` of the commit a baseline is taken at.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime as dt
import gc
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar, cast

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.trees import Tree, tree_line

# An event's index in its stream: a token's text " w<k>" (index k + 2), else its "seq".
SEQ = re.compile(rb'"content":" w(\d+)"|"seq":\s*(\d+)')
CONTENT_LENGTH = re.compile(rb"content-length:\s*(\d+)")
HOST = "127.0.0.1"
FAST_ENGINE = Path(__file__).with_name("fast_engine.py")

# The targets, checked at TARGET_STREAMS streams of 1000/TARGET_DELAY_MS events/s.
TARGET_STREAMS = 256
TARGET_DELAY_MS = 20.0
TARGET_CPU_US = 50.0
TARGET_ADDED_MS = 50.0
FAKE_BUDGET_US = 10.0  # the fake must cost well below the proxy's target
BURST_BEFORE_MS = 231.0  # the figure: 64 at once, added p99 first event
PREVIOUS = ("Previous numbers (the bench before this one: uvicorn fake "
            "`tests.fakes.fake_llama`, all streams at once, fresh connections, 2026-11-29): "
            "the proxy spent 250-440 µs of CPU per relayed event; added p99 first event "
            "+324 ms at 32 streams and +5.6 s at 256 (last byte +305 ms and +5.5 s); the fake "
            "itself cost 73-103 µs per event on the same two cores.")

T = TypeVar("T")


# ---------------------------------------------------------------------------------- client

@dataclass(slots=True)
class Stream:
    """What the client saw of one stream."""

    wave: int = 0  # its place among its slot's requests (0: the first)
    status: int = 0
    seqs: list[int] = field(default_factory=list)
    done: bool = False
    comments: int = 0  # SSE comments (the proxy's first byte, heartbeats)
    first_event_s: float | None = None
    last_byte_s: float = 0.0
    error: str | None = None
    started_s: float = 0.0  # time.perf_counter() as it began (a new connection first)

    def problems(self) -> dict[str, int]:
        """Lost, duplicated and reordered events, from the sequence numbers alone."""
        seen = set(self.seqs)
        expected = max(self.seqs) + 1 if self.seqs else 0
        return {
            "lost": expected - len(seen),
            "duplicated": len(self.seqs) - len(seen),
            "reordered": sum(1 for a, b in zip(self.seqs, self.seqs[1:], strict=False)
                             if b < a),
        }

    @property
    def failed(self) -> bool:
        return self.error is not None or self.status != 200 or not self.done


HEAD, SIZE, DATA, TRAILER, BODY, IDLE = range(6)


class Client(asyncio.Protocol):
    """One keep-alive connection: requests in turn, each response parsed as it arrives
    (chunked transfer encoding, then SSE events), timestamps taken per read."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.pending = b""
        self.state = IDLE
        self.size = 0
        self.result = Stream()
        self.start = 0.0
        self.future: asyncio.Future[None] | None = None
        self.closed = False
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.future is not None and not self.future.done():
            self.future.set_exception(ConnectionError(f"connection lost: {exc}"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def send(self, request: bytes, result: Stream, start: float) -> asyncio.Future[None]:
        assert self.transport is not None
        assert self.state == IDLE
        self.result, self.start, self.state, self.pending = result, start, HEAD, b""
        self.future = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.future

    def data_received(self, data: bytes) -> None:
        if self.future is None:
            return
        now = time.perf_counter()
        self.buffer += data
        try:
            self._parse(now)
        except ValueError as exc:
            if not self.future.done():
                self.future.set_exception(exc)
            self.close()

    def _parse(self, now: float) -> None:
        buffer, pos, result = self.buffer, 0, self.result
        while True:
            state = self.state
            if state == SIZE:
                end = buffer.find(b"\r\n", pos)
                if end < 0:
                    break
                size = int(bytes(buffer[pos:end]).split(b";", 1)[0], 16)
                pos = end + 2
                if size == 0:
                    self.state = TRAILER
                else:
                    self.size, self.state = size, DATA
            elif state == DATA:
                end = pos + self.size
                if len(buffer) < end + 2:
                    break
                self._payload(bytes(buffer[pos:end]), now)
                pos = end + 2
                self.state = SIZE
            elif state == HEAD:
                end = buffer.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                head = bytes(buffer[pos:end]).lower()
                pos = end + 4
                result.status = int(head.split(b" ", 2)[1])
                if b"\r\nconnection: close" in head:
                    self.keep_alive = False
                if b"\r\ntransfer-encoding: chunked" in head:
                    self.state = SIZE
                else:
                    match = CONTENT_LENGTH.search(head)
                    if match is None:
                        raise ValueError(f"neither chunked nor sized: {head[:200]!r}")
                    self.size, self.state = int(match.group(1)), BODY
            elif state == BODY:
                if len(buffer) - pos < self.size:
                    break
                body = bytes(buffer[pos:pos + self.size])
                pos += self.size
                result.error = f"status {result.status}, not a stream: {body[:200]!r}"
                self._finish(now)
            elif state == TRAILER:
                end = buffer.find(b"\r\n", pos)
                if end < 0:
                    break
                line_empty = end == pos
                pos = end + 2
                if line_empty:
                    self._finish(now)
            else:  # IDLE: bytes nobody asked for
                if pos < len(buffer):
                    raise ValueError(f"unexpected bytes: {bytes(buffer[pos:pos + 100])!r}")
                break
        del buffer[:pos]

    def _payload(self, payload: bytes, now: float) -> None:
        data = self.pending + payload if self.pending else payload
        result, start = self.result, 0
        while True:
            end = data.find(b"\n\n", start)
            if end < 0:
                break
            if data.startswith(b"data: ", start):
                if result.first_event_s is None:
                    result.first_event_s = now - self.start
                if end - start == 12 and data.startswith(b"data: [DONE]", start):
                    result.done = True
                else:
                    match = SEQ.search(data, start, end)
                    if match is None:
                        raise ValueError(f"an event without a sequence number: "
                                         f"{data[start:min(end, start + 200)]!r}")
                    token, seq = match.groups()
                    result.seqs.append(int(token) + 2 if token is not None else int(seq))
            elif data.startswith(b":", start):
                result.comments += 1
            start = end + 2
        self.pending = data[start:]

    def _finish(self, now: float) -> None:
        self.result.last_byte_s = now - self.start
        self.state = IDLE
        if self.future is not None and not self.future.done():
            self.future.set_result(None)
        self.future = None


def request_of(body: bytes, *, close: bool) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
            b"content-type: application/json\r\n%bcontent-length: %d\r\n\r\n%b"
            % (b"connection: close\r\n" if close else b"", len(body), body))


def body_of(arm: str, round_: int, stream: int, wave: int, events: int, pad: str) -> bytes:
    """A conversation of its own per stream, wave and round: nothing is shared or joined."""
    return json.dumps({
        "messages": [{"role": "system", "content": "You answer load tests." + pad},
                     {"role": "user",
                      "content": f"{arm} round {round_} stream {stream} wave {wave}"}],
        "max_tokens": events, "stream": True, "return_progress": True,
        "stream_options": {"include_usage": True}}).encode()


async def worker(port: int, requests: list[bytes], start_at: float, results: list[Stream],
                 timeout_s: float, fresh: bool,
                 client_factory: Callable[[], Client] = Client) -> None:
    """One stream slot: its requests back to back on one keep-alive connection (a fresh
    connection per request with ``fresh``); ``client_factory`` makes its connections'
    protocol (``Client`` or a subclass that records more)."""
    loop = asyncio.get_running_loop()
    delay = start_at - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
    client: Client | None = None
    for wave, request in enumerate(requests):
        start = time.perf_counter()
        result = Stream(wave=wave, started_s=start)
        results.append(result)
        try:
            async with asyncio.timeout(timeout_s):
                if client is None or client.closed or not client.keep_alive:
                    if client is not None:
                        client.close()
                    _, client = await loop.create_connection(client_factory, HOST, port)
                await client.send(request, result, start)
        except (OSError, TimeoutError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            result.last_byte_s = result.last_byte_s or time.perf_counter() - start
            if client is not None:
                client.close()
            client = None
        if fresh and client is not None:
            client.close()
            client = None
    if client is not None:
        client.close()


@dataclass(frozen=True, slots=True)
class Plan:
    """The shape of one round."""

    streams: int
    waves: int
    events: int
    token_delay_ms: float
    together: bool
    fresh: bool
    timeout_s: float
    pad: str = ""

    @property
    def stream_s(self) -> float:
        return self.events * self.token_delay_ms / 1000

    def requests(self, arm: str, round_: int) -> list[list[bytes]]:
        return [[request_of(body_of(arm, round_, i, w, self.events, self.pad), close=self.fresh)
                 for w in range(self.waves)] for i in range(self.streams)]


async def run_round(port: int, plan: Plan, requests: list[list[bytes]],
                    client_factory: Callable[[], Client] = Client) -> list[Stream]:
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.02
    span = 0.0 if plan.together else plan.stream_s
    per_worker: list[list[Stream]] = [[] for _ in requests]
    await asyncio.gather(*(worker(port, reqs, start + span * i / len(requests), per_worker[i],
                                  plan.timeout_s, plan.fresh, client_factory)
                           for i, reqs in enumerate(requests)))
    return [s for streams in per_worker for s in streams]


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    """On uvloop when it is installed: the client must cost little per event."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


# ---------------------------------------------------------------------------------- processes

def free_ports(count: int = 1) -> int:
    """A free loopback port whose ``count - 1`` successors are free too (the proxy's
    operator listener takes port + 1)."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            base: int = sock.getsockname()[1]
        try:
            with contextlib.ExitStack() as stack:
                for offset in range(1, count):
                    other = stack.enter_context(socket.socket())
                    other.bind((HOST, base + offset))
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (``/proc/PID/stat``)."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def process(args: list[str], ready: str, log: IO[bytes],
            **popen: Any) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``args``; ready when ``ready`` answers 200 (and, for the proxy's /healthz,
    says its upstream is ok)."""
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, **popen)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{args} exited with {proc.returncode} (log: {log.name})")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = httpx.get(ready, timeout=2)
                if response.status_code == 200 and (
                        not ready.endswith("/healthz")
                        or (response.json().get("upstream") or {}).get("status") == "ok"):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{args} did not get ready (log: {log.name})")
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def fake_stats(port: int) -> dict[str, Any]:
    return cast(dict[str, Any], httpx.get(f"http://{HOST}:{port}/fast/stats", timeout=5).json())


@dataclass(slots=True)
class Setup:
    """What every level shares: how the processes are started."""

    model: str
    tree: Tree
    proxy_args: list[str]
    tick_ms: float
    logs: Path
    seq_in_tokens: bool = False  # the fake's token events with a "seq" field (not llama's)

    def fake_cmd(self, port: int, slots: int, plan: Plan) -> list[str]:
        return [sys.executable, str(FAST_ENGINE), "--port", str(port), "--slots", str(slots),
                "--words", str(plan.events), "--token-delay-ms", str(plan.token_delay_ms),
                "--tick-ms", str(self.tick_ms), "--model", self.model,
                *(["--seq-in-tokens"] if self.seq_in_tokens else [])]

    def proxy_cmd(self, fake_port: int, port: int) -> list[str]:
        return [*self.tree.serve(), "--upstream", f"http://{HOST}:{fake_port}", "--port",
                str(port), *self.proxy_args]


@contextlib.contextmanager
def engines(setup: Setup, name: str, slots: int,
            plan: Plan) -> Iterator[tuple[dict[str, int], dict[str, int], Path]]:
    """The fake and the proxy for one level: (ports by arm, pids by process, proxy log)."""
    fake_port, proxy_port = free_ports(), free_ports(2)
    fake_log = setup.logs / f"{name}-fake.log"
    proxy_log = setup.logs / f"{name}-proxy.log"
    with open(fake_log, "wb") as flog, open(proxy_log, "wb") as plog, \
            process(setup.fake_cmd(fake_port, slots, plan),
                    f"http://{HOST}:{fake_port}/health", flog) as fake, \
            process(setup.proxy_cmd(fake_port, proxy_port),
                    f"http://{HOST}:{proxy_port}/healthz", plog,
                    **setup.tree.popen_kwargs()) as proxy:
        yield ({"direct": fake_port, "proxy": proxy_port},
               {"fake": fake.pid, "proxy": proxy.pid}, proxy_log)


# ---------------------------------------------------------------------------------- a level

@dataclass(slots=True)
class Round:
    arm: str
    index: int
    streams: list[Stream]
    wall_s: float
    cpu_s: dict[str, float]  # proxy, fake, client: each process's own CPU over the round
    # The proxy's CPU over the round's first ``CPU_TRACE_S``: (time.perf_counter(), seconds)
    proxy_cpu_trace: tuple[tuple[float, float], ...] = ()


CPU_TRACE_S = 2.0  # how long into a together round the proxy's CPU is sampled
CPU_TRACE_EVERY_S = 0.005  # /proc's figure moves by clock ticks (10 ms): finer adds nothing


async def trace_cpu(pid: int, into: list[tuple[float, float]], *, for_s: float = CPU_TRACE_S,
                    every_s: float = CPU_TRACE_EVERY_S) -> None:
    """``pid``'s CPU seconds (``cpu_seconds``) every ``every_s`` for ``for_s``."""
    end = time.perf_counter() + for_s
    while (now := time.perf_counter()) < end:
        into.append((now, cpu_seconds(pid)))
        await asyncio.sleep(every_s)


def first_wave_cost(streams: list[Stream], trace: tuple[tuple[float, float], ...]
                    ) -> dict[str, Any] | None:
    """What the proxy spent while a together round's first wave waited for its first
    events: its CPU from the wave's first request to its last first event, per stream.
    ``busy`` near 1 says the wave waited on the proxy's CPU (a core's worth), not on
    anything else. None when the trace does not span the window."""
    wave = [s for s in streams if s.wave == 0 and not s.failed and s.first_event_s is not None]
    if not wave:
        return None
    begin = min(s.started_s for s in wave)
    end = max(s.started_s + (s.first_event_s or 0.0) for s in wave)
    before = [cpu for at, cpu in trace if at <= begin]
    after = [cpu for at, cpu in trace if at >= end]
    if not before or not after:
        return None
    window_s, cpu_s = end - begin, after[0] - before[-1]
    return {"streams": len(wave), "window_ms": round(window_s * 1000, 1),
            "proxy_cpu_ms": round(cpu_s * 1000, 1),
            "cpu_us_per_stream": round(cpu_s / len(wave) * 1e6, 1),
            "busy": round(cpu_s / window_s, 2) if window_s > 0 else None}


async def measure(ports: dict[str, int], pids: dict[str, int], plan: Plan, rounds: int,
                  warm: Plan, settle_s: float,
                  on_measuring: list[Any] | None = None) -> tuple[list[Round], dict[str, Any]]:
    """Warm both paths, then ``rounds`` rounds per arm, the order flipping every round."""
    for arm, port in ports.items():  # connections, code paths, slots
        await run_round(port, warm, warm.requests(f"warm-{arm}", 0))
    await asyncio.sleep(settle_s)
    memory: dict[str, Any] = {"rss_idle_kib": proc_status(pids["proxy"])["VmRSS"],
                              "rss_after_round_kib": []}
    if on_measuring:
        for callback in on_measuring:
            callback()
    records: list[Round] = []
    arms = list(ports)
    for index in range(1, rounds + 1):
        for arm in (arms if index % 2 else arms[::-1]):
            requests = plan.requests(arm, index)
            gc.collect()
            gc.disable()  # the client's own collector stays out of the timings
            before = {"proxy": cpu_seconds(pids["proxy"]), "fake": cpu_seconds(pids["fake"]),
                      "client": own_cpu_seconds()}
            trace: list[tuple[float, float]] = []
            # Traced in both arms, the client's reads of /proc alike: only the proxy's counts.
            tracer = (asyncio.create_task(trace_cpu(pids["proxy"], trace))
                      if plan.together else None)
            started = time.perf_counter()
            streams = await run_round(ports[arm], plan, requests)
            wall = time.perf_counter() - started
            if tracer is not None:
                tracer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tracer
            await asyncio.sleep(settle_s)  # the proxy's work after the last byte counts
            after = {"proxy": cpu_seconds(pids["proxy"]), "fake": cpu_seconds(pids["fake"]),
                     "client": own_cpu_seconds()}
            gc.enable()
            records.append(Round(arm, index, streams, wall,
                                 {k: after[k] - before[k] for k in before}, tuple(trace)))
            if arm == "proxy":
                memory["rss_after_round_kib"].append(proc_status(pids["proxy"])["VmRSS"])
    memory["peak_kib"] = proc_status(pids["proxy"])["VmHWM"]
    return records, memory


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def integrity(streams: list[Stream]) -> dict[str, Any]:
    problems = {"lost": 0, "duplicated": 0, "reordered": 0}
    for stream in streams:
        for name, value in stream.problems().items():
            problems[name] += value
    failed = [s for s in streams if s.failed]
    return {
        "streams": len(streams), "events_checked": sum(len(s.seqs) for s in streams),
        **problems, "streams_failed": len(failed),
        "statuses": dict(collections.Counter(s.status for s in streams)),
        "sse_comments": sum(s.comments for s in streams),
        "first_failure": next((s.error or f"status {s.status}, done={s.done}"
                               for s in failed), None),
    }


def latency(by_arm: dict[str, list[Stream]]) -> dict[str, float]:
    ms, out = 1000.0, {}
    for name, key in (("first_event", "first_event_s"), ("last_byte", "last_byte_s")):
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            values = {arm: [getattr(s, key) or 0.0 for s in streams if not s.failed]
                      for arm, streams in by_arm.items()}
            direct = percentile(values["direct"], q) * ms
            proxy = percentile(values["proxy"], q) * ms
            out[f"{name}_{label}_direct_ms"] = round(direct, 1)
            out[f"{name}_{label}_proxy_ms"] = round(proxy, 1)
            out[f"{name}_{label}_added_ms"] = round(proxy - direct, 1)
    return out


def first_event_by_wave(by_arm: dict[str, list[Stream]]) -> list[dict[str, Any]]:
    """Each arm's first event per wave (the requests each slot sent first, second, ...):
    p0 near p99 means a wave's first events all left together, at the end of its work."""
    rows = []
    for arm, streams in by_arm.items():
        waves: dict[int, list[float]] = collections.defaultdict(list)
        for stream in streams:
            if not stream.failed and stream.first_event_s is not None:
                waves[stream.wave].append(stream.first_event_s * 1000)
        rows += [{"arm": arm, "wave": wave, "p0_ms": round(min(values), 1),
                  "p50_ms": round(percentile(values, 0.5), 1),
                  "p99_ms": round(percentile(values, 0.99), 1)}
                 for wave, values in sorted(waves.items())]
    return rows


def proxy_log_counts(path: Path) -> dict[str, Any]:
    """The proxy's JSON log lines by level and event, and its request outcomes."""
    levels: collections.Counter[str] = collections.Counter()
    outcomes: collections.Counter[str] = collections.Counter()
    notable: collections.Counter[str] = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        levels[record.get("level", "?")] += 1
        if record.get("event") == "request":
            outcomes[str(record.get("outcome"))] += 1
        elif record.get("level") in ("warning", "error"):
            notable[str(record.get("event"))] += 1
    return {"levels": dict(levels), "request_outcomes": dict(outcomes),
            "warnings_and_errors": dict(notable)}


def summarise(plan: Plan, records: list[Round], memory: dict[str, Any],
              stats: tuple[dict[str, Any], dict[str, Any]], log: dict[str, Any]) -> dict[str, Any]:
    by_arm: dict[str, list[Stream]] = {"direct": [], "proxy": []}
    for record in records:
        by_arm[record.arm] += record.streams
    result: dict[str, Any] = {
        "streams": plan.streams, "waves": plan.waves, "start": "together" if plan.together
        else "staggered", "fresh_connections": plan.fresh,
        "rounds_per_arm": len(records) // 2, "tokens_per_stream": plan.events,
        "token_delay_ms": plan.token_delay_ms,
    }
    for arm, streams in by_arm.items():
        result[arm] = integrity(streams)
    lengths = {len(s.seqs) for streams in by_arm.values() for s in streams if not s.failed}
    result["events_per_stream"] = sorted(lengths)
    ok = all(result[arm][k] == 0 for arm in by_arm
             for k in ("lost", "duplicated", "reordered", "streams_failed"))
    result["verdict"] = "ok" if ok and len(lengths) == 1 else "FAILED"
    result.update(latency(by_arm))
    result["first_event_by_wave"] = first_event_by_wave(by_arm)
    costs = [first_wave_cost(r.streams, r.proxy_cpu_trace) for r in records if r.arm == "proxy"]
    result["first_wave_proxy_cpu"] = [c for c in costs if c is not None]
    cpu = {name: round(sum(r.cpu_s["proxy"] for r in records if r.arm == arm), 3)
           for name, arm in (("proxy", "proxy"), ("proxy_during_direct", "direct"))}
    cpu["fake"] = round(sum(r.cpu_s["fake"] for r in records), 3)
    cpu["client"] = round(sum(r.cpu_s["client"] for r in records), 3)
    result["cpu_s"] = cpu
    via_proxy = max(1, result["proxy"]["events_checked"])
    both = max(1, via_proxy + result["direct"]["events_checked"])
    result["proxy_cpu_us_per_event"] = round(cpu["proxy"] / via_proxy * 1e6, 1)
    result["proxy_cpu_us_per_request"] = round(cpu["proxy"] / max(1, len(by_arm["proxy"]))
                                               * 1e6, 1)
    result["fake_cpu_us_per_event"] = round(cpu["fake"] / both * 1e6, 2)
    result["client_cpu_us_per_event"] = round(cpu["client"] / both * 1e6, 2)
    walls = {arm: [r.wall_s for r in records if r.arm == arm] for arm in by_arm}
    result["round_wall_s"] = {arm: [round(w, 2) for w in values] for arm, values in walls.items()}
    result["proxy_events_per_s"] = round(via_proxy / max(1e-9, sum(walls["proxy"])))
    result["proxy_rss_idle_mib"] = round(memory["rss_idle_kib"] / 1024, 1)
    result["proxy_rss_after_each_round_mib"] = [round(r / 1024, 1)
                                                for r in memory["rss_after_round_kib"]]
    result["proxy_peak_rss_mib"] = round(memory["peak_kib"] / 1024, 1)
    before, after = stats
    result["fake_counters"] = {
        "events_written": after["events"] - before["events"],
        "socket_writes": after["writes"] - before["writes"],
        "streams": after["streams_done"] - before["streams_done"],
        "streams_cancelled": after["streams_cancelled"] - before["streams_cancelled"],
        # What the proxy (and the client) asked the engine over the measured rounds.
        "requests": {k: v - before["requests"].get(k, 0) for k, v in after["requests"].items()
                     if v - before["requests"].get(k, 0) and k != "GET /fast/stats"},
    }
    result["proxy_log"] = log
    return result


def run_level(setup: Setup, plan: Plan, rounds: int, name: str,
              profile_dir: Path | None = None, profile_rate: int = 100) -> dict[str, Any]:
    warm = Plan(min(16, plan.streams), 1, 4, plan.token_delay_ms, together=True,
                fresh=plan.fresh, timeout_s=plan.timeout_s, pad=plan.pad)
    with engines(setup, name, plan.streams, plan) as (ports, pids, proxy_log):
        samplers: list[subprocess.Popen[bytes]] = []
        stats_before: dict[str, Any] = {}

        def measuring() -> None:  # after the warm-up, before the first measured round
            stats_before.update(fake_stats(ports["direct"]))
            if profile_dir is not None:
                samplers.extend(start_py_spy(pids["proxy"], profile_dir, profile_rate))

        records, memory = run_async(measure(ports, pids, plan, rounds, warm, settle_s=0.5,
                                            on_measuring=[measuring]))
        stats_after = fake_stats(ports["direct"])
        for sampler in samplers:
            sampler.send_signal(signal.SIGINT)
        for sampler in samplers:
            try:
                sampler.wait(60)
            except subprocess.TimeoutExpired:
                sampler.kill()
    return summarise(plan, records, memory, (stats_before, stats_after),
                     proxy_log_counts(proxy_log))


# ---------------------------------------------------------------------------------- profile

def py_spy() -> str:
    found = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    return found


def start_py_spy(pid: int, out: Path, rate: int) -> list[subprocess.Popen[bytes]]:
    """Two samplers on the proxy, without stopping it: a flamegraph and the raw stacks."""
    out.mkdir(parents=True, exist_ok=True)
    samplers = []
    for fmt, name in (("flamegraph", "flamegraph.svg"), ("raw", "stacks.txt")):
        log = open(out / f"py-spy-{fmt}.log", "wb")  # noqa: SIM115 (lives with the sampler)
        samplers.append(subprocess.Popen(
            [py_spy(), "record", "--pid", str(pid), "--rate", str(rate), "--nonblocking",
             "--format", fmt, "--output", str(out / name)], stdout=log, stderr=log))
    time.sleep(1.0)  # attached before the first measured round
    return samplers


PRODUCT = re.compile(r"\((?:prefixpin/)?(?:proxy|core|adapters|fingerprint)/")
ROOT = re.compile(r"^(?:_run_module_as_main|Thread\._bootstrap|<module>) \(")
WAITING = re.compile(r"^(?:EpollSelector|_PollLikeSelector|PollSelector)\.select \(selectors\.py")


def top_frames(stacks: Path, n: int = 15) -> dict[str, Any]:
    """From py-spy's raw (collapsed) stacks: self time per frame (the leaf of each sample)
    and per function, and inclusive time per function of the product (proxy/, core/,
    adapters/, fingerprint/). A sample whose leaf is the loop's ``select`` is the loop
    waiting for I/O or for a core (py-spy takes a runnable thread for a busy one): the
    percentages are given of all samples and of the others (``busy``)."""
    by_line: collections.Counter[str] = collections.Counter()
    by_function: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = waiting = partial = 0
    for line in stacks.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = stack.split(";") if stack else ["(no frame: the stack could not be read)"]
        if not ROOT.match(frames[0]):
            partial += samples
        if WAITING.match(frames[-1]):
            waiting += samples
        by_line[frames[-1]] += samples
        by_function[_function_of(frames[-1])] += samples
        for function in {_function_of(f) for f in frames if PRODUCT.search(f)}:
            inclusive[function] += samples
    busy = max(1, total - waiting)

    def table(counter: collections.Counter[str], rows: int) -> list[dict[str, Any]]:
        return [{"frame": frame, "samples": count,
                 "percent": round(100 * count / max(1, total), 2),
                 "percent_of_busy": (None if WAITING.match(frame)
                                     else round(100 * count / busy, 2))}
                for frame, count in counter.most_common(rows)]

    return {"samples": total, "waiting_in_select": waiting, "partial_stacks": partial,
            "self_by_line": table(by_line, n), "self_by_function": table(by_function, n),
            "inclusive_by_product_function": table(inclusive, 25)}


def _function_of(frame: str) -> str:
    """``name (path/file.py:123)`` -> ``name (path/file.py)``."""
    return re.sub(r":\d+\)$", ")", frame)


def render_profile(level: dict[str, Any], top: dict[str, Any], command: str,
                   label: str) -> str:
    lines = [f"# Profile: the proxy under py-spy at {level['streams']} streams", "",
             f"**{label}**", "", "```", command, "```", "",
             f"- {top['samples']} samples of the proxy process (`py-spy record --nonblocking`, "
             "idle samples left out), over the measured rounds of both arms (the proxy idles "
             "during direct rounds)",
             f"- {top['waiting_in_select']} of them in the event loop's `select` (epoll_wait: "
             "the poll's kernel time, or the thread runnable and waiting for a core, which "
             "py-spy counts as busy); \"% busy\" leaves them out",
             f"- this level under the sampler: {level['proxy_cpu_us_per_event']} µs of proxy "
             f"CPU per event, added p99 first event {level['first_event_p99_added_ms']} ms, "
             f"last byte {level['last_byte_p99_added_ms']} ms, verdict {level['verdict']} "
             "(the samplers share the two cores: not the baseline)",
             f"- {top.get('partial_stacks', 0)} samples have a stack py-spy could not follow "
             "to its thread's root (read while the loop switched coroutines): their self "
             "time counts, but the inclusive figures below leave them out (an undercount)",
             "- `flamegraph.svg`: the flamegraph; `stacks.txt`: py-spy's raw collapsed stacks "
             "(one line per stack: frames root first, `;`-separated, then the sample count)",
             ""]
    for key, title in (("self_by_line", "Top self-time frames (function, file:line)"),
                       ("self_by_function", "Top self time by function"),
                       ("inclusive_by_product_function",
                        "Inclusive time of the product's functions")):
        lines += [f"## {title}", "", "| # | frame | samples | % of samples | % busy |",
                  "|---|---|---|---|---|"]
        for i, row in enumerate(top[key], 1):
            frame = row["frame"].replace("|", "\\|")
            busy = "-" if row["percent_of_busy"] is None else row["percent_of_busy"]
            lines.append(f"| {i} | `{frame}` | {row['samples']} | {row['percent']} | {busy} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- report

def verdicts(levels: list[dict[str, Any]], burst: dict[str, Any] | None) -> list[dict[str, Any]]:
    at = next((r for r in levels if r["streams"] == TARGET_STREAMS
               and r["token_delay_ms"] == TARGET_DELAY_MS), None)

    def check(name: str, target: str, value: Any, met: bool | None) -> dict[str, Any]:
        verdict = "not measured" if met is None else ("met" if met else "not met")
        return {"target": name, "bound": target, "measured": value, "verdict": verdict}

    out = []
    if at is None:
        for name in ("proxy CPU per relayed event", "added p99 first event",
                     "added p99 last byte"):
            out.append(check(f"{name} at {TARGET_STREAMS} streams x 50 events/s", "-",
                             None, None))
    else:
        ok = at["verdict"] == "ok"
        cpu = at["proxy_cpu_us_per_event"]
        out.append(check(f"proxy CPU per relayed event at {TARGET_STREAMS} streams, every "
                         "event checked", f"≤ {TARGET_CPU_US:g} µs", f"{cpu} µs",
                         ok and cpu <= TARGET_CPU_US))
        for key, name in (("first_event", "first event"), ("last_byte", "last byte")):
            value = at[f"{key}_p99_added_ms"]
            out.append(check(f"added p99 {name} at {TARGET_STREAMS} streams x 50 events/s",
                             f"≤ {TARGET_ADDED_MS:g} ms", f"{value} ms",
                             ok and value <= TARGET_ADDED_MS))
    all_ok = all(r["verdict"] == "ok" for r in levels) and (
        burst is None or burst["verdict"] == "ok")
    checked = sum(r["direct"]["events_checked"] + r["proxy"]["events_checked"] for r in levels)
    out.append(check("no event lost, duplicated or reordered, [DONE] on every stream, the "
                     "same n every stream and arm", "every level",
                     f"{checked} events checked", all_ok))
    if at is not None:
        fake = at["fake_cpu_us_per_event"]
        out.append(check(f"the fake's CPU per event at {TARGET_STREAMS} streams (the bench "
                         "measures the proxy)", f"≤ {FAKE_BUDGET_US:g} µs", f"{fake} µs",
                         fake <= FAKE_BUDGET_US))
    if burst is not None:
        out.append(check(f"burst: {burst['streams']} streams at once, added p99 first event "
                         f"(report only; {BURST_BEFORE_MS:g} ms in the issue)", "-",
                         f"{burst['first_event_p99_added_ms']} ms", None))
    return out


def render(result: dict[str, Any]) -> str:
    levels, burst, machine = result["levels"], result.get("burst"), result["machine"]
    setup = result["setup"]
    lines = [
        "# Load: concurrent streams through one proxy process (issue 18)", "",
        f"**{result['label']}**", "",
        "```", result["command"], "```", "",
        f"- date: {result['date']}; full run {result['runtime_s']:.0f} s",
        f"- machine: {machine['cpus']} CPUs, python {machine['python']} (the bench's: the "
        f"fake's and the client's), {machine['platform']}; "
        f"load average {machine['load_average_start'][0]:.2f} at start, "
        f"{machine['load_average_end'][0]:.2f} at end (the client, the fake and the proxy "
        "share the cores)",
        f"- proxy: `{' '.join(setup['proxy_cmd'])}` from {tree_line(setup['tree'])}; "
        "features at their defaults, logs at info into a file",
        f"- fake: `bench/fast_engine.py` ({'uvloop' if setup['uvloop'] else 'asyncio'}), "
        f"/props model_path {setup['model']} (implicit identity "
        f"{'on' if setup['implicit_identity'] else 'off'} in the proxy); as many slots as "
        f"streams; ticker {setup['tick_ms']} ms; token events "
        + ("with a `seq` field (`--seq-in-tokens`: not llama-server's shape)"
           if setup.get("seq_in_tokens") else "in llama-server's shape"),
        f"- per level: {levels[0]['rounds_per_arm'] if levels else '-'} rounds per arm, "
        "alternating direct / proxy (order flipped every round), fresh processes; each "
        f"stream slot runs {levels[0]['waves'] if levels else '-'} requests back to back on "
        f"a keep-alive connection, first ones {levels[0]['start'] if levels else '-'} over "
        f"one stream's length; {levels[0]['tokens_per_stream'] if levels else '-'} tokens "
        f"{levels[0]['token_delay_ms'] if levels else '-'} ms apart per stream",
        "- added = proxy percentile minus direct percentile over every stream of the level; "
        "CPU per event = the process's utime + stime over the rounds / events the client "
        "checked (the fake's and the client's: both arms' events)",
        "- RSS: the peak (VmHWM) includes start-up (the tokenizer's load); what serving "
        "adds is in the after-round figures",
        "- `--start together` gives the previous bench's shape (every stream of a wave at "
        "once); `--profile` writes `profile/` beside this file (py-spy on the proxy)",
        f"- {PREVIOUS}", "",
        "## Targets", "",
        "| target | bound | measured | verdict |", "|---|---|---|---|",
    ]
    for row in result["targets"]:
        lines.append(f"| {row['target']} | {row['bound']} | {row['measured'] or '-'} | "
                     f"**{row['verdict']}** |")
    lines += [
        "", "## Levels", "",
        "| streams | verdict | events checked | lost / dup / reord | proxy µs/event | "
        "fake µs/event | client µs/event | first event added p50 / p99 (ms) | last byte "
        "added p50 / p99 (ms) | direct first event p99 / last byte p99 (ms) | proxy RSS idle "
        "/ after rounds / peak (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in levels:
        checked = r["direct"]["events_checked"] + r["proxy"]["events_checked"]
        bad = "/".join(str(r["direct"][k] + r["proxy"][k])
                       for k in ("lost", "duplicated", "reordered"))
        lines.append(
            f"| {r['streams']} | {r['verdict']} | {checked} | {bad} | "
            f"{r['proxy_cpu_us_per_event']} | {r['fake_cpu_us_per_event']} | "
            f"{r['client_cpu_us_per_event']} | "
            f"{r['first_event_p50_added_ms']} / {r['first_event_p99_added_ms']} | "
            f"{r['last_byte_p50_added_ms']} / {r['last_byte_p99_added_ms']} | "
            f"{r['first_event_p99_direct_ms']} / {r['last_byte_p99_direct_ms']} | "
            f"{r['proxy_rss_idle_mib']} / {max(r['proxy_rss_after_each_round_mib'] or [0])} / "
            f"{r['proxy_peak_rss_mib']} |")
    if burst is not None:
        lines += ["", f"## Burst: {burst['streams']} streams at once", "",
                  f"- {burst['rounds_per_arm']} rounds per arm, alternating; every stream on a "
                  f"fresh connection, a distinct conversation, {burst['tokens_per_stream']} "
                  f"tokens {burst['token_delay_ms']} ms apart; verdict **{burst['verdict']}**; "
                  f"proxy CPU {burst['proxy_cpu_us_per_request']} µs per request "
                  f"({burst['proxy_cpu_us_per_event']} µs per event)", "",
                  "| latency (ms) | direct | proxy | added |", "|---|---|---|---|"]
        lines += _latency_rows(burst)
    for r in levels:
        lines += ["", f"## {r['streams']} streams", "",
                  f"- events per stream (progress, role, tokens, finish, usage): "
                  f"{r['events_per_stream']}; verdict **{r['verdict']}**; the proxy relayed "
                  f"{r['proxy_events_per_s']} events/s over its rounds", "",
                  "| arm | streams | events checked | lost | duplicated | reordered | failed | "
                  "statuses |", "|---|---|---|---|---|---|---|---|"]
        for arm in ("direct", "proxy"):
            a = r[arm]
            lines.append(f"| {arm} | {a['streams']} | {a['events_checked']} | {a['lost']} | "
                         f"{a['duplicated']} | {a['reordered']} | {a['streams_failed']} | "
                         f"{a['statuses']} |")
        lines += ["", "| latency (ms) | direct | proxy | added |", "|---|---|---|---|"]
        lines += _latency_rows(r)
        lines += ["", "| first event by wave (ms) | p0 | p50 | p99 |", "|---|---|---|---|"]
        lines += [f"| {w['arm']}, wave {w['wave']} | {w['p0_ms']} | {w['p50_ms']} | "
                  f"{w['p99_ms']} |" for w in r.get("first_event_by_wave", [])]
        if r.get("first_wave_proxy_cpu"):
            lines += ["", "| proxy round: wave 0 until its last first event | window (ms) | "
                      "proxy CPU (ms) | per stream (µs) | busy |", "|---|---|---|---|---|"]
            lines += [f"| round {i} | {c['window_ms']} | {c['proxy_cpu_ms']} | "
                      f"{c['cpu_us_per_stream']} | {c['busy']} |"
                      for i, c in enumerate(r["first_wave_proxy_cpu"], 1)]
        counters = r["fake_counters"]
        lines += [
            "",
            f"- CPU seconds over the rounds: {r['cpu_s']} (proxy: its rounds; "
            "proxy_during_direct: its background work while the direct arm ran)",
            f"- proxy RSS: {r['proxy_rss_idle_mib']} MiB idle after warm-up; after each proxy "
            f"round {r['proxy_rss_after_each_round_mib']} MiB; peak (VmHWM) "
            f"{r['proxy_peak_rss_mib']} MiB",
            f"- round wall times (s): {r['round_wall_s']}",
            f"- the fake wrote {counters['events_written']} events in "
            f"{counters['socket_writes']} socket writes; requests it served over the rounds: "
            f"{counters['requests']}",
            f"- proxy log: {r['proxy_log']}",
        ]
    lines += ["", "Raw figures: `result.json`.", ""]
    return "\n".join(lines)


def _latency_rows(r: dict[str, Any]) -> list[str]:
    rows = []
    for name in ("first_event", "last_byte"):
        for q in ("p50", "p99"):
            rows.append(f"| {name.replace('_', ' ')} {q} | {r[f'{name}_{q}_direct_ms']} | "
                        f"{r[f'{name}_{q}_proxy_ms']} | {r[f'{name}_{q}_added_ms']} |")
    return rows


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The short table printed at the end of a run."""
    lines = ["", f"== {result['label']}", "",
             f"{'streams':>7} {'verdict':>7} {'proxy us/ev':>11} {'fake us/ev':>10} "
             f"{'client us/ev':>12} {'+first p50/p99 ms':>18} {'+last p50/p99 ms':>17} "
             f"{'peak RSS MiB':>12}"]
    for r in result["levels"]:
        first = f"{r['first_event_p50_added_ms']} / {r['first_event_p99_added_ms']}"
        last = f"{r['last_byte_p50_added_ms']} / {r['last_byte_p99_added_ms']}"
        lines.append(f"{r['streams']:>7} {r['verdict']:>7} {r['proxy_cpu_us_per_event']:>11} "
                     f"{r['fake_cpu_us_per_event']:>10} {r['client_cpu_us_per_event']:>12} "
                     f"{first:>18} {last:>17} {r['proxy_peak_rss_mib']:>12}")
    burst = result.get("burst")
    if burst is not None:
        lines.append(f"burst {burst['streams']} at once: first event added p50 "
                     f"{burst['first_event_p50_added_ms']} ms, p99 "
                     f"{burst['first_event_p99_added_ms']} ms (issue: {BURST_BEFORE_MS:g} ms); "
                     f"verdict {burst['verdict']}")
    lines += ["", "targets:"]
    for row in result["targets"]:
        lines.append(f"  [{row['verdict']:>12}] {row['target']}: {row['measured']} "
                     f"(bound {row['bound']})")
    return lines


# ---------------------------------------------------------------------------------- main

def write_results(out: Path, result: dict[str, Any], run_md: str, summary: list[str],
                  logs: Path) -> None:
    """A bench's result.json and RUN.md into ``out``, and its summary to the terminal."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "RUN.md").write_text(run_md)
    print("\n".join(summary))
    print(f"\nwrote {out / 'RUN.md'} and result.json; process logs in {logs}")


def resolve_model(name: str) -> str:
    if name == "none":
        return "fast-model.gguf"
    if name != "auto":
        return name
    from prefixpin.proxy.engine.models import DEFAULT_MODEL, model_path

    path = model_path(DEFAULT_MODEL)
    return str(path) if path.is_file() else "fast-model.gguf"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="32,64,128,256",
                        help="concurrent streams; a comma-separated list sweeps levels")
    parser.add_argument("--events", type=int, default=100, help="tokens per stream")
    parser.add_argument("--token-delay-ms", type=float, default=TARGET_DELAY_MS)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per arm")
    parser.add_argument("--waves", type=int, default=3,
                        help="requests each stream slot runs back to back in a round")
    parser.add_argument("--start", choices=("staggered", "together"), default="staggered")
    parser.add_argument("--timeout", type=float, default=120.0, help="per stream, seconds")
    parser.add_argument("--prompt-bytes", type=int, default=0,
                        help="pad every system prompt by this many bytes")
    parser.add_argument("--burst-streams", type=int, default=64, help="0: no burst section")
    parser.add_argument("--burst-events", type=int, default=4)
    parser.add_argument("--burst-rounds", type=int, default=10)
    parser.add_argument("--burst-only", action="store_true", help="only the burst section")
    parser.add_argument("--model", default="auto",
                        help="the model path the fake declares: auto (SmolLM2 when cached), "
                             "none, or a path")
    parser.add_argument("--tick-ms", type=float, default=2.0,
                        help="the fake's ticker: a token is written at most this late")
    parser.add_argument("--seq-in-tokens", action="store_true",
                        help='the fake\'s token events with a "seq" field (its shape before '
                             "2026-12-02; no engine sends one)")
    parser.add_argument("--proxy-arg", action="append", default=[],
                        help="an extra `prefixpin serve` argument (repeat)")
    parser.add_argument("--tree", type=Path, help="run the proxy from this source tree")
    parser.add_argument("--proxy-python", help="run the proxy on this interpreter (a venv's "
                        "python with the proxy's dependencies; the fake and the client stay "
                        "on this one)")
    parser.add_argument("--label", help="what this run is (the RUN.md heading)")
    parser.add_argument("--profile", action="store_true",
                        help="one level with py-spy on the proxy; writes OUT/profile/ only")
    parser.add_argument("--profile-level", type=int, help="streams (default: the largest)")
    parser.add_argument("--profile-rate", type=int, default=100, help="samples per second")
    parser.add_argument("--out", type=Path, default=Path("bench/results/load"))
    args = parser.parse_args()
    began = time.monotonic()
    load_start = os.getloadavg()
    levels = [int(n) for n in str(args.streams).split(",") if n]
    tree = (Tree.other(args.tree, args.proxy_python) if args.tree
            else Tree.this(args.proxy_python))
    described = tree.describe()
    label = args.label or (f"tree at {described['commit'][:7]}"
                           + (f", {len(described['local_changes'])} uncommitted product "
                              "changes" if described["local_changes"] else ""))
    pad = (" " + "lorem " * (args.prompt_bytes // 6 + 1))[:args.prompt_bytes]
    logs = Path(tempfile.mkdtemp(prefix="prefixpin-load-"))
    setup = Setup(resolve_model(args.model), tree, list(args.proxy_arg), args.tick_ms, logs,
                  args.seq_in_tokens)
    command = "python " + shlex.join(sys.argv)

    def plan_of(streams: int) -> Plan:
        return Plan(streams, args.waves, args.events, args.token_delay_ms,
                    together=args.start == "together", fresh=False, timeout_s=args.timeout,
                    pad=pad)

    if args.profile:
        level = args.profile_level or max(levels)
        out = args.out / "profile"
        if out.exists():
            shutil.rmtree(out)
        profiled = run_level(setup, plan_of(level), args.rounds, f"profile-{level}", out,
                             args.profile_rate)
        top = top_frames(out / "stacks.txt")
        (out / "summary.json").write_text(json.dumps(
            {"command": command, "label": label, "level": profiled, "top": top},
            indent=2) + "\n")
        (out / "README.md").write_text(render_profile(profiled, top, command, label))
        print(render_profile(profiled, top, command, label))
        return 0 if profiled["verdict"] == "ok" else 1

    runs = [] if args.burst_only else [run_level(setup, plan_of(n), args.rounds, f"level-{n}")
                                       for n in levels]
    burst = None
    if args.burst_streams:
        burst_plan = Plan(args.burst_streams, 1, args.burst_events, args.token_delay_ms,
                          together=True, fresh=True, timeout_s=args.timeout, pad=pad)
        burst = run_level(setup, burst_plan, args.burst_rounds, "burst")
    result: dict[str, Any] = {
        "command": command, "label": label,
        "date": f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "load_average_start": load_start,
                    "load_average_end": os.getloadavg()},
        "setup": {"proxy_cmd": ["python", "-m", "prefixpin.proxy.cli", "serve", "--upstream", "URL",
                                "--port", "P", *setup.proxy_args],
                  "tree": described, "model": setup.model,
                  "implicit_identity": Path(setup.model).is_file(),
                  "uvloop": _has_uvloop(), "tick_ms": setup.tick_ms,
                  "seq_in_tokens": setup.seq_in_tokens, "logs": str(logs)},
        "previous": PREVIOUS, "levels": runs, "burst": burst,
    }
    result["targets"] = verdicts(runs, burst)
    result["runtime_s"] = round(time.monotonic() - began, 1)
    write_results(args.out, result, render(result), summary_lines(result), logs)
    failed = any(r["verdict"] != "ok" for r in runs) or (burst is not None
                                                         and burst["verdict"] != "ok")
    return 1 if failed else 0


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())

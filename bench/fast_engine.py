"""A fast fake llama-server for load benches: raw asyncio (uvloop when installed), no
framework, its events pre-rendered, so that what a load bench measures is the proxy in
front of it and not the fake (``bench/load.py``).

    python bench/fast_engine.py --port P [--slots 256] [--words 100]
                                [--token-delay-ms 20] [--tick-ms 2] [--model PATH]

It answers what prefixpin reads to take it for a llama-server with ``--slots`` slots
(shapes as the real server's, checked against the rig's binary): ``/health``, ``/props``
(``total_slots``, ``build_info``, ``model_path``, the chat template), ``/v1/models``,
``/slots`` (``is_processing``, ``id_task``, ``n_prompt_tokens``), ``/metrics`` (with the
``Process-Start-Time-Unix`` header), ``/tokenize``, ``/apply-template``, ``/slots/N``
actions (501 as a server without ``--slot-save-path``: parking stays off), ``/api/version``
(404, as llama-server: not Ollama).

``POST /v1/chat/completions`` with ``stream: true`` answers as llama-server does, in
chunked transfer encoding on a keep-alive connection: at once a ``prompt_progress`` event,
then every ``--token-delay-ms`` one token (the first one in the same write as the role
chunk, as the real server does), after the last token the finish chunk and the usage chunk
(``timings`` on it: the proxy always asks ``stream_options.include_usage``) in one write,
``data: [DONE]`` and the last chunk. ``max_tokens`` (else ``--words``) tokens. A request
with ``"flood": true`` in its body floods instead (``bench/hostile.py``): its tokens, the
same events, are written as fast as the reader takes them, a batch of about 64 KiB per
turn of the loop while the connection's transport accepts more (asyncio's flow control:
paused when its buffer is full, resumed when it drains), so that a flood costs the fake
what its reader lets through and the other streams' ticker keeps its schedule. Every event
has its index in its stream (progress 0, role 1, tokens 2.., finish, usage), so a client
can check that none was lost, duplicated or reordered: the token events in their text
(token k says `` w<k>``, its index k + 2), the others in a ``"seq"`` field. A token event
has llama-server's shape (its fields, in its order, compact): the same bytes around a new
text each time but for ``created``, the second it was made (a counter in every one would
be a shape no engine sends, and costs a proxy that reads a stream's token events by their
sameness); ``--seq-in-tokens`` puts ``"seq"`` in them too (the shape this fake had
before).

Cheap on purpose: a stream's frames are rendered once, as bytes templates that only take
the sequence number; one shared ticker (``--tick-ms``) writes the token of every stream
that is due, its schedule absolute (token k of a stream at start + k * delay, no drift); a
pinned slot that is busy queues the request as llama-server does. ``GET /fast/stats`` gives
its own counters (events, writes, requests per path) and CPU seconds, so a bench can check
that the fake costs far less per event than the proxy it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import heapq
import json
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

JsonHandler = Callable[["Engine", "Connection", bytes, bytes], None]

CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                 "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
BUILD = "b1-fast"
SERVER_HEAD = b"Server: llama.cpp\r\nAccess-Control-Allow-Origin: \r\n"
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\n" + SERVER_HEAD + b"X-Accel-Buffering: no\r\n"
               b"Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
               b"Keep-Alive: timeout=5, max=100\r\n\r\n")
LAST_CHUNK = b"0\r\n\r\n"
FLOOD_BATCH = 64 * 1024  # a flooding stream's bytes per write (per turn of the loop)
REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 411: b"Length Required",
           501: b"Not Implemented"}


@dataclass(slots=True)
class Config:
    slots: int = 256
    words: int = 100
    token_delay_s: float = 0.02
    tick_s: float = 0.002
    n_ctx: int = 4096
    model: str = "fast-model.gguf"
    cache_ram: int | None = None  # declared in /props when set (MiB)
    seq_in_tokens: bool = False  # a "seq" field in every token event too


@dataclass(slots=True)
class Slot:
    id: int
    busy: bool = False
    id_task: int = -1
    n_prompt_tokens: int = 0
    waiting: collections.deque[Job] = field(default_factory=collections.deque)


def chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(payload), payload)


class Job:
    """One streamed generation: its frames as templates that take the sequence number."""

    __slots__ = ("cancelled", "conn", "created", "envelope", "finish_reason", "flood",
                 "flood_parked", "head", "index", "model", "prompt_tokens", "seq", "slot",
                 "start", "tail", "task", "word", "words")

    def __init__(self, conn: Connection, slot: Slot | None, words: int, prompt_tokens: int,
                 task: int, model: str, finish_reason: str, *, seq: bool = False) -> None:
        self.conn, self.slot, self.words, self.prompt_tokens = conn, slot, words, prompt_tokens
        self.index = 0  # tokens written
        self.seq = seq
        self.start = 0.0
        self.cancelled = False
        self.flood = False  # tokens as fast as the reader takes them (``Engine.flood``)
        self.flood_parked = False  # waiting for the transport to resume writing
        self.finish_reason = finish_reason
        self.task, self.model = task, model
        self.render(int(time.time()))

    def render(self, created: int) -> None:
        """The stream's frames with ``created`` (llama-server stamps each event with the
        second it was made: a token's bytes change with it, once a second)."""
        self.created = created
        envelope = (f'"created":{created},"id":"chatcmpl-fast{self.task}","model":'
                    f'{json.dumps(self.model)},"system_fingerprint":"{BUILD}",'
                    f'"object":"chat.completion.chunk"')
        self.envelope = envelope.encode()
        # %d: the token's number (its text, " w<k>"), and with ``seq`` the event's seq.
        self.word = (('data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":'
                      '" w%d"}}],' + envelope.replace("%", "%%")
                      + (',"seq":%d' if self.seq else "") + '}\n\n').encode())
        role = ('data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":'
                '"assistant","content":null}}],' + envelope)
        prompt_tokens = self.prompt_tokens
        self.head = (role + f',"prompt_progress":{{"total":{prompt_tokens},"cache":0,'
                     f'"processed":{prompt_tokens},"time_ms":0}},"seq":0}}\n\n').encode()
        self.tail = (role + ',"seq":1}\n\n').encode()  # the role chunk, before token 0
        # (the finish and usage chunks are rendered once, at the end: see ``finish``)

    def first_write(self) -> bytes:
        return chunk(self.head)

    def finish(self, elapsed_s: float) -> bytes:
        words, prompt, envelope = self.words, self.prompt_tokens, self.envelope + b","
        predicted_ms = max(elapsed_s * 1000, 0.001)
        usage = {"completion_tokens": words, "prompt_tokens": prompt,
                 "total_tokens": words + prompt, "prompt_tokens_details": {"cached_tokens": 0}}
        timings = {"cache_n": 0, "prompt_n": prompt, "prompt_ms": 0.001,
                   "prompt_per_token_ms": 0.001 / max(1, prompt),
                   "prompt_per_second": prompt * 1e6, "predicted_n": words,
                   "predicted_ms": round(predicted_ms, 3),
                   "predicted_per_token_ms": round(predicted_ms / max(1, words), 3),
                   "predicted_per_second": round(words / predicted_ms * 1000, 3)}
        finish = (b'data: {"choices":[{"finish_reason":"%b","index":0,"delta":{}}],%b'
                  b'"seq":%d}\n\n' % (self.finish_reason.encode(), envelope, words + 2))
        last = (b'data: {"choices":[],%b"usage":%b,"timings":%b,"seq":%d}\n\n'
                % (envelope, _compact(usage), _compact(timings), words + 3))
        role = self.tail if self.index == 0 else b""  # no token: the role chunk comes here
        return chunk(role + finish + last) + chunk(b"data: [DONE]\n\n") + LAST_CHUNK


def _compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class Engine:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.slots = [Slot(i) for i in range(config.slots)]
        self.unpinned: collections.deque[Job] = collections.deque()
        self.start_us = time.monotonic_ns() // 1000  # as llama-server: ggml_time_us() at start
        self.tasks = 0
        self.prompt_tokens_total = 0
        self.events = 0  # JSON events written (seq'd), not counting [DONE]
        self.tokens = 0
        self.writes = 0
        self.streams_started = 0
        self.streams_done = 0
        self.streams_cancelled = 0
        self.requests: collections.Counter[str] = collections.Counter()
        # The ticker: tick number -> the jobs due at it; a heap of the tick numbers pending.
        self.buckets: dict[int, list[Job]] = {}
        self.pending_ticks: list[int] = []
        self.timer: asyncio.TimerHandle | None = None
        self.timer_tick = -1

    # ------------------------------------------------------------------ the ticker

    def schedule(self, job: Job, due: float) -> None:
        tick = -int(-due // self.config.tick_s)  # ceil: never early
        bucket = self.buckets.get(tick)
        if bucket is None:
            bucket = self.buckets[tick] = []
            heapq.heappush(self.pending_ticks, tick)
        bucket.append(job)
        self.arm(tick)

    def arm(self, tick: int) -> None:
        """The ticker's timer fires at ``tick`` unless it already fires sooner."""
        if self.timer is None or tick < self.timer_tick:
            if self.timer is not None:
                self.timer.cancel()
            self.timer_tick = tick
            self.timer = self.loop.call_at(tick * self.config.tick_s, self.tick)

    def tick(self) -> None:
        """Write the token of every stream that is due (the hot loop: inlined on purpose)."""
        self.timer = None
        tick_s = self.config.tick_s
        now = self.loop.time()
        # Half a tick of slack: a timer that fires a hair early (the loop's clock is in ms)
        # must not spin until its tick comes.
        current = int((now + tick_s / 2) // tick_s)
        pending, buckets, delay = self.pending_ticks, self.buckets, self.config.token_delay_s
        written = 0
        second = int(time.time())
        while pending and pending[0] <= current:
            for job in buckets.pop(heapq.heappop(pending)):
                if job.cancelled:
                    continue
                if job.created != second:
                    job.render(second)
                k = job.index
                frame = job.word % ((k, k + 2) if job.seq else k)
                if k == 0:
                    frame = job.tail + frame  # the role chunk rides with the first token
                    self.events += 1
                transport = job.conn.transport
                if transport is not None:
                    transport.write(b"%x\r\n%b\r\n" % (len(frame), frame))
                written += 1
                k += 1
                job.index = k
                if k >= job.words:
                    self.end(job, now)
                    continue
                due = -int(-(job.start + (k + 1) * delay) // tick_s)  # ceil: never early
                bucket = buckets.get(due)
                if bucket is None:
                    buckets[due] = [job]
                    heapq.heappush(pending, due)
                else:
                    bucket.append(job)
        self.events += written
        self.tokens += written
        self.writes += written
        if pending:
            self.arm(pending[0])

    # ------------------------------------------------------------------ generations

    def chat(self, conn: Connection, body: bytes) -> None:
        try:
            request = json.loads(body)
        except ValueError:
            conn.json(400, {"error": {"code": 400, "message": "Failed to parse JSON",
                                      "type": "invalid_request_error"}})
            return
        if not isinstance(request, dict):
            conn.json(400, {"error": {"code": 400, "message": "not an object",
                                      "type": "invalid_request_error"}})
            return
        words = self.config.words
        finish = "stop"
        limit = request.get("max_tokens", request.get("n_predict"))
        if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0:
            words, finish = limit, "length"
        prompt_tokens = max(1, len(body) // 4)
        pinned = request.get("id_slot")
        slot = (self.slots[pinned % len(self.slots)]
                if isinstance(pinned, int) and not isinstance(pinned, bool) and pinned >= 0
                else None)
        self.tasks += 1
        job = Job(conn, slot, words, prompt_tokens, self.tasks, self.config.model, finish,
                  seq=self.config.seq_in_tokens)
        if not request.get("stream"):
            conn.json(200, self.whole(job))
            return
        job.flood = request.get("flood") is True
        conn.job = job
        if slot is None:
            slot = next((s for s in self.slots if not s.busy), None)
            if slot is None:
                self.unpinned.append(job)
                return
            job.slot = slot
        if slot.busy:
            slot.waiting.append(job)  # llama-server queues a task for a busy slot
            return
        self.begin(job)

    def begin(self, job: Job) -> None:
        slot = job.slot
        assert slot is not None
        slot.busy, slot.id_task, slot.n_prompt_tokens = True, self.tasks, job.prompt_tokens
        self.prompt_tokens_total += job.prompt_tokens
        self.streams_started += 1
        job.start = self.loop.time()
        job.conn.write(STREAM_HEAD + job.first_write())
        self.events += 1
        if job.words == 0:
            self.end(job, job.start)
        elif job.flood:
            self.loop.call_soon(self.flood, job)
        else:
            self.schedule(job, job.start + self.config.token_delay_s)

    def flood(self, job: Job) -> None:
        """A flooding stream's next batch of tokens (``FLOOD_BATCH`` bytes), then the next
        turn of the loop, or, once its transport's buffer is full, ``resume_writing``."""
        conn = job.conn
        transport = conn.transport
        if job.cancelled or transport is None:
            return
        if conn.write_paused:
            job.flood_parked = True
            return
        second = int(time.time())
        if job.created != second:
            job.render(second)
        word, seq, words, k = job.word, job.seq, job.words, job.index
        parts, size = [], 0
        while k < words and size < FLOOD_BATCH:
            frame = word % ((k, k + 2) if seq else k)
            if k == 0:
                frame = job.tail + frame  # the role chunk rides with the first token
                self.events += 1
            part = b"%x\r\n%b\r\n" % (len(frame), frame)
            parts.append(part)
            size += len(part)
            k += 1
        transport.write(b"".join(parts))
        self.writes += 1
        self.events += k - job.index
        self.tokens += k - job.index
        job.index = k
        if k >= words:
            self.end(job, self.loop.time())
        else:  # (parked there if the write filled the transport's buffer)
            self.loop.call_soon(self.flood, job)

    def end(self, job: Job, now: float) -> None:
        job.conn.write(job.finish(now - job.start))
        self.events += 2 + (job.words == 0)  # finish, usage (and the role chunk if no token)
        self.streams_done += 1
        self.release(job)
        job.conn.job = None
        job.conn.next_request()

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        self.streams_cancelled += 1
        slot = job.slot
        if slot is not None and job in slot.waiting:
            slot.waiting.remove(job)
        elif job in self.unpinned:
            self.unpinned.remove(job)
        elif job.start:
            self.release(job)

    def release(self, job: Job) -> None:
        slot = job.slot
        assert slot is not None
        slot.busy = False
        slot.n_prompt_tokens = job.prompt_tokens + max(0, job.index - 1)
        while slot.waiting and slot.waiting[0].cancelled:
            slot.waiting.popleft()
        if slot.waiting:
            self.begin(slot.waiting.popleft())
        elif self.unpinned:
            queued = self.unpinned.popleft()
            queued.slot = slot
            self.begin(queued)

    def whole(self, job: Job) -> dict[str, Any]:
        text = "".join(f" w{k}" for k in range(job.words))
        return {"choices": [{"finish_reason": job.finish_reason, "index": 0,
                             "message": {"role": "assistant", "content": text}}],
                "created": int(time.time()), "model": self.config.model,
                "system_fingerprint": BUILD, "object": "chat.completion",
                "usage": {"completion_tokens": job.words, "prompt_tokens": job.prompt_tokens,
                          "total_tokens": job.words + job.prompt_tokens},
                "id": f"chatcmpl-fast{self.tasks}"}

    # ------------------------------------------------------------------ the other paths

    def props(self) -> dict[str, Any]:
        props: dict[str, Any] = {
            "default_generation_settings": {"params": {"n_predict": -1},
                                            "n_ctx": self.config.n_ctx},
            "total_slots": self.config.slots, "model_alias": self.config.model,
            "model_path": self.config.model, "modalities": {"vision": False, "audio": False},
            "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
            "chat_template": CHAT_TEMPLATE, "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>", "build_info": BUILD, "is_sleeping": False,
        }
        if self.config.cache_ram is not None:
            props["cache_ram"] = self.config.cache_ram
        return props

    def models(self) -> dict[str, Any]:
        model = self.config.model
        return {"object": "list", "data": [{
            "id": model, "aliases": [model], "tags": [], "object": "model",
            "created": int(time.time()), "owned_by": "llamacpp",
            "meta": {"vocab_type": 2, "n_vocab": 49152, "n_ctx": self.config.n_ctx,
                     "n_ctx_train": 8192}}]}

    def slot_list(self) -> list[dict[str, Any]]:
        return [{"id": s.id, "n_ctx": self.config.n_ctx, "speculative": False,
                 "is_processing": s.busy, "id_task": s.id_task,
                 "n_prompt_tokens": s.n_prompt_tokens} for s in self.slots]

    def metrics(self) -> bytes:
        return (f"# TYPE llamacpp:prompt_tokens_total counter\n"
                f"llamacpp:prompt_tokens_total {self.prompt_tokens_total}\n"
                f"# TYPE llamacpp:tokens_predicted_total counter\n"
                f"llamacpp:tokens_predicted_total {self.tokens}\n"
                f"# TYPE llamacpp:requests_processing gauge\n"
                f"llamacpp:requests_processing {sum(s.busy for s in self.slots)}\n").encode()

    def stats(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"events": self.events, "tokens": self.tokens, "writes": self.writes,
                "streams_started": self.streams_started, "streams_done": self.streams_done,
                "streams_cancelled": self.streams_cancelled,
                "requests": dict(self.requests), "cpu_s": usage.ru_utime + usage.ru_stime,
                "max_rss_kib": usage.ru_maxrss, "pid": os.getpid()}

    def handle(self, conn: Connection, method: bytes, target: bytes, body: bytes) -> None:
        path = target.partition(b"?")[0]
        name = path.decode("latin-1")
        self.requests[f"{method.decode('latin-1')} {name}"] += 1
        if method == b"POST" and path in (b"/v1/chat/completions", b"/chat/completions"):
            self.chat(conn, body)
        elif path == b"/health":
            conn.json(200, {"status": "ok"})
        elif path == b"/props":
            conn.json(200, self.props())
        elif path in (b"/v1/models", b"/models"):
            conn.json(200, self.models())
        elif path == b"/slots":
            conn.json(200, self.slot_list())
        elif path == b"/metrics":
            conn.respond(200, b"text/plain; version=0.0.4", self.metrics(),
                         b"Process-Start-Time-Unix: %d\r\n" % self.start_us)
        elif path == b"/fast/stats":
            conn.json(200, self.stats())
        elif method == b"POST" and path == b"/tokenize":
            content = _field(body, "content")
            conn.json(200, {"tokens": list(range(len(str(content or "").split())))})
        elif method == b"POST" and path == b"/apply-template":
            messages = _field(body, "messages") or []
            prompt = "".join(f"<|im_start|>{m.get('role')}\n{m.get('content')}<|im_end|>\n"
                             for m in messages if isinstance(m, dict))
            conn.json(200, {"prompt": prompt + "<|im_start|>assistant\n"})
        elif method == b"POST" and path.startswith(b"/slots/"):
            conn.json(501, {"error": {"code": 501, "message": "This server does not support "
                                      "slots action. Start it with `--slot-save-path`",
                                      "type": "not_supported_error"}})
        else:
            conn.json(404, {"error": {"message": "File Not Found", "type": "not_found_error",
                                      "code": 404}})


def _field(body: bytes, name: str) -> Any:
    try:
        value = json.loads(body or b"{}")
    except ValueError:
        return None
    return value.get(name) if isinstance(value, dict) else None


class Connection(asyncio.Protocol):
    """One client connection: HTTP/1.1 requests in turn (keep-alive), no pipelining needed
    but tolerated (a request that arrives during a stream waits for it)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.job: Job | None = None
        self.close_after = False
        self.write_paused = False  # the transport's buffer is full (flow control)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.job is not None:
            self.engine.cancel(self.job)
            self.job = None

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        job = self.job
        if job is not None and job.flood_parked:
            job.flood_parked = False
            self.engine.flood(job)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.job is None:
            self.next_request()

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)
            self.engine.writes += 1

    def next_request(self) -> None:
        """Serve the buffered requests while no stream holds the connection."""
        while self.job is None and self.transport is not None:
            if self.close_after:
                self.transport.close()
                return
            buffer = self.buffer
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buffer[:end]).split(b"\r\n")
            try:
                method, target, _version = head[0].split(b" ", 2)
            except ValueError:
                self.respond(400, b"text/plain", b"bad request line")
                self.transport.close()
                return
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value.strip())
                elif name == b"connection" and value.strip().lower() == b"close":
                    self.close_after = True
                elif name == b"transfer-encoding":
                    self.respond(411, b"text/plain", b"chunked requests are not supported")
                    self.transport.close()
                    return
            if len(buffer) < end + 4 + length:
                return
            body = bytes(buffer[end + 4:end + 4 + length])
            del buffer[:end + 4 + length]
            self.engine.handle(self, method, target, body)

    def respond(self, status: int, content_type: bytes, body: bytes, extra: bytes = b"") -> None:
        keep = (b"Connection: close\r\n" if self.close_after
                else b"Keep-Alive: timeout=5, max=100\r\n")
        self.write(b"HTTP/1.1 %d %b\r\n%bContent-Type: %b\r\nContent-Length: %d\r\n%b%b\r\n%b"
                   % (status, REASONS.get(status, b"Status"), SERVER_HEAD, content_type,
                      len(body), extra, keep, body))

    def json(self, status: int, value: Any) -> None:
        self.respond(status, b"application/json; charset=utf-8", _compact(value))


async def serve(config: Config, host: str, port: int) -> None:
    engine = Engine(config)
    server = await engine.loop.create_server(lambda: Connection(engine), host, port,
                                             backlog=4096, reuse_address=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--words", type=int, default=100,
                        help="tokens per reply when the request sets no max_tokens")
    parser.add_argument("--token-delay-ms", type=float, default=20.0,
                        help="between two tokens of a stream (20: 50 tokens/s)")
    parser.add_argument("--tick-ms", type=float, default=2.0,
                        help="the shared ticker's period: a token is written at most this "
                             "late (1 ms costs ~2 µs more per event at 256 streams)")
    parser.add_argument("--n-ctx", type=int, default=4096, help="per slot")
    parser.add_argument("--model", default="fast-model.gguf",
                        help="the model path /props declares (a real GGUF here lets the "
                             "proxy read its tokenizer: implicit identity on)")
    parser.add_argument("--cache-ram", type=int, default=None,
                        help="declare /props cache_ram (MiB); not declared by default, as "
                             "llama-server")
    parser.add_argument("--no-uvloop", action="store_true", help="the stock asyncio loop")
    parser.add_argument("--seq-in-tokens", action="store_true",
                        help='a "seq" field in every token event too (not llama-server\'s shape)')
    args = parser.parse_args(argv)
    config = Config(slots=args.slots, words=args.words, token_delay_s=args.token_delay_ms / 1000,
                    tick_s=args.tick_ms / 1000, n_ctx=args.n_ctx, model=args.model,
                    cache_ram=args.cache_ram, seq_in_tokens=args.seq_in_tokens)
    coroutine = serve(config, args.host, args.port)
    if not args.no_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(coroutine)
            return
    asyncio.run(coroutine)


if __name__ == "__main__":
    main()

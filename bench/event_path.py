"""The relay's per-event Python alone, without sockets (issue 18): CPU µs per event.

Each of ``--streams`` streams is the real engine connection (``adapters.h1``) with a null
transport, its response pushed through llama-server's stream, a ``Generation`` and a
client's ``LiveStream`` writing through uvicorn's real ``send`` into a null transport. The
loop feeds every stream's connection one chunked token event at a time, as the engine's
reads would come, and reports the best of three passes (process CPU time):

    python bench/event_path.py [--streams 64] [--events 20000] [--tree PATH]

What it leaves out is what a socket costs (the reads, the writes, the loop's polling): the
load bench (``bench/load.py``) measures the whole. Compare trees in one session (the
machine's phases move it), e.g. ``--tree /tmp/before`` then this tree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Any

import httpx

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
ENVELOPE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": "m", "system_fingerprint": "b1"}


def token_event(i: int) -> bytes:
    """One llama-server token chunk, chunk-encoded as it crosses the engine connection."""
    data = {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": f" w{i}"}}],
            **ENVELOPE}
    event = b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(event), event)


class NullTransport:
    """Takes writes and drops them; never paused, never closing."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def one_stream(client: Any, out: NullTransport, batch: Any) -> Any:
    """A stream set up to its first token: the connection to feed, the client asleep."""
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    from prefixpin.adapters.h1 import PUSHED_BODY, H1Transport, _Body, _Connection
    from prefixpin.adapters.llama_server import _LlamaStream
    from prefixpin.proxy.codecs import codec_of
    from prefixpin.proxy.pipeline.generation import Generation
    from prefixpin.proxy.pipeline.relay import LiveStream

    loop = asyncio.get_running_loop()
    try:
        from prefixpin.adapters.h1 import ReadShare
    except ImportError:  # a tree from before the connections shared their flooding reads
        connection = _Connection(loop)  # type: ignore[call-arg,unused-ignore]
    else:
        try:
            from prefixpin.adapters.h1 import EngineBounds
        except ImportError:  # a tree from before the engine's bounds were settings
            connection = _Connection(loop, ReadShare())  # type: ignore[call-arg,unused-ignore]
        else:
            connection = _Connection(loop, ReadShare(), EngineBounds())
    connection.connection_made(NullTransport())  # type: ignore[arg-type]
    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions", content=b"{}")
    try:
        connection.send(request.method, request.url.raw_path, request.headers.raw,
                        request.content, request)
    except TypeError:  # a tree from before the request was sent from its parts
        connection.send(request)  # type: ignore[call-arg, arg-type]
    connection.data_received(HEAD)
    body = _Body(H1Transport(fallback=_NoFallback()), ("127.0.0.1", 1), connection, None)
    response = httpx.Response(connection.status, headers=connection.headers, stream=body,
                              extensions={PUSHED_BODY: body})
    generation = Generation(lambda g: None, grace_s=0)  # type: ignore[arg-type, return-value]
    consume = asyncio.create_task(generation._consume(_LlamaStream(response, "POST /v1")))
    transport: Any = out
    scope: dict[str, Any] = {"type": "http"}
    if batch is not None:  # the tree batches client writes and has the body writer
        from prefixpin.proxy.pipeline.relay import BODY_WRITER
        from prefixpin.proxy.speed.client_writes import BatchedTransport, ChunkedBodyWriter
        transport = BatchedTransport(out, batch)  # type: ignore[arg-type]
    cycle = RequestResponseCycle(
        {"type": "http", "method": "POST"},  # type: ignore[typeddict-item]
        transport, FlowControl(transport), logging.getLogger("x"),
        logging.getLogger("y"), False, [], asyncio.Event(), False, True, lambda: None)
    if batch is not None:
        scope["extensions"] = {BODY_WRITER: ChunkedBodyWriter(cycle).write}
    live = LiveStream(codec_of(client), generation.subscribe(), client, 30.0, lambda: None,
                      True)

    async def receive() -> Any:
        await asyncio.Event().wait()

    send: Any = cycle.send  # uvicorn's typed ASGI send, as the server hands it over
    task = asyncio.create_task(live(scope, receive, send))
    for _ in range(10):
        await asyncio.sleep(0)
    return connection, consume, task


def _batch_if_any() -> Any:
    try:
        from prefixpin.proxy.speed.client_writes import WriteBatch
    except ImportError:  # a tree from before client writes were batched
        return None
    return WriteBatch(asyncio.get_running_loop())


class _NoFallback(httpx.AsyncBaseTransport):
    """The transport's fallback, never used here (httpx's own would load TLS certificates
    per stream)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise AssertionError("not served here")


async def measure(streams: int, events: int) -> tuple[float, int]:
    from prefixpin.proxy.pipeline.validation import parse_request

    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                      "stream_options": {"include_usage": True}}).encode()
    client = parse_request(raw, "chat", "/v1/chat/completions", max_messages=100)
    out = NullTransport()
    batch = _batch_if_any()
    set_up = [await one_stream(client, out, batch) for _ in range(streams)]
    flush = batch.flush if batch is not None else (lambda: None)
    feed = [connection.data_received for connection, _, _ in set_up]
    tokens = [token_event(i) for i in range(max(1, events // streams))]
    best = float("inf")
    for _ in range(3):
        started = time.process_time()
        for token in tokens:
            for data_received in feed:
                data_received(token)
            flush()  # the end of the loop's turn
        best = min(best, (time.process_time() - started) / (len(tokens) * streams))
    for _, consume, task in set_up:
        consume.cancel()
        task.cancel()
    return best * 1e6, out.written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--tree", default=None, help="the source tree to import (default: this)")
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    import uvloop

    us, written = uvloop.run(measure(args.streams, args.events))
    if not written:
        raise SystemExit("nothing reached the clients: the path did not run")
    print(f"{us:.2f} µs of CPU per event (best of 3 passes, {args.streams} streams); "
          f"{written} bytes written to the clients")


if __name__ == "__main__":
    main()

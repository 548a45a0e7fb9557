"""What each client receives from a generation: SSE with heartbeats, or one JSON body.

Stream first, decide later: a streaming client gets headers and a first comment at once
(unless the engine's error status arrives before the first-byte deadline, which then keeps
its status), heartbeat comments while the engine is silent (with the prefill progress in
their text), the engine's frames unchanged and in order, and, if the engine fails after the
headers went out, an OpenAI-shaped error event and a clean end of stream.

Ollama's native API (``/api/chat``, ``/api/generate``) streams NDJSON, which has no
comments: there the keep-alive is a space written before the next JSON object (the only
bytes ollama-python, Ollama's Go client and ollama-js all parse and never see; see
``core.ndjson``). A streaming native client gets the headers and one space at once, a
space every ``--heartbeat`` seconds while Ollama is silent (queue, model load, prefill),
then Ollama's lines unchanged; a failure after the headers is Ollama's own late-error line
``{"error": "..."}``. A ``stream: false`` client gets nothing until the one JSON body, as
from Ollama itself (padding would break ollama-python's parse of an error body).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from adapters.base import Frame, FrameKind, Progress
from proxy.aggregate import aggregate
from core.errors import ProxyError, UpstreamStatusError, error_event, error_response
from core.figures import count_of, figures_from, mapping_of, with_cached_tokens
from proxy.generation import Generation, Subscriber
from core.ndjson import (
    GO_JSON_MEDIA_TYPE,
    KEEPALIVE,
    NDJSON_MEDIA_TYPE,
    encode_json,
    error_line,
    fold_chat,
    fold_generate,
)
from core.sse import encode_comment, encode_data
from core.streaming import StreamResponse, wait_disconnect
from proxy.validation import ClientRequest

BATCH_FRAMES = 256
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def respond(request: Request, client: ClientRequest, generation: Generation, *,
                  arrival: float, first_byte_s: float, heartbeat_s: float,
                  on_heartbeat: Callable[[], None], fill_cached: bool = True) -> Response:
    """``fill_cached``: the engine measures cached tokens, so a usage the engine left
    without them may be completed from its other fields; otherwise nothing is added (an
    estimate is never presented to a client as measured)."""
    subscriber = generation.subscribe()
    try:
        if client.api == "ollama":
            return await _native_response(request, subscriber, client, arrival=arrival,
                                          first_byte_s=first_byte_s, heartbeat_s=heartbeat_s,
                                          on_heartbeat=on_heartbeat)
        if client.stream:
            early_error = await _early_error(generation, arrival, first_byte_s)
            if early_error is not None:
                subscriber.close()
                return error_response(early_error)
            body = _sse_body(subscriber, client, heartbeat_s, on_heartbeat, fill_cached)
            return StreamResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        return await _json_response(request, subscriber, client, fill_cached)
    except BaseException:
        subscriber.close()
        raise


async def _early_error(generation: Generation, arrival: float,
                       first_byte_s: float) -> ProxyError | None:
    """The engine's error if it arrives before the headers must go out, else None.

    Part of the first-byte budget is kept back for sending the headers themselves.
    """
    budget = first_byte_s * 0.6 - (time.monotonic() - arrival)
    if budget <= 0:
        return None
    # asyncio.wait leaves the future alone on timeout (no shield needed) and wakes this
    # task straight from its callback, without wait_for's extra hops through the loop.
    done, _ = await asyncio.wait((generation.head,), timeout=budget)
    return generation.head.result().error if done else None


async def _sse_body(subscriber: Subscriber, client: ClientRequest, heartbeat_s: float,
                    on_heartbeat: Callable[[], None],
                    fill_cached: bool = True) -> AsyncGenerator[bytes, None]:
    generation = subscriber.generation
    view = ClientView(client, generation, fill_cached=fill_cached)

    def encode(frames: Sequence[Frame]) -> bytes:
        return b"".join(part for part in map(view.bytes_for, frames) if part)

    try:
        yield encode_comment("prefixpin")
        paced = _paced(subscriber, heartbeat_s, on_heartbeat, encode, lambda: (
            encode_comment(heartbeat_text(generation.progress, generation))))
        async with contextlib.aclosing(paced):  # closed with this body, however it ends
            async for out in paced:
                yield out
        if tail := view.flush():
            yield tail
        if generation.error is not None and not generation.completed:
            yield error_event(generation.error)
    finally:
        subscriber.close()


async def _paced(subscriber: Subscriber, heartbeat_s: float, on_heartbeat: Callable[[], None],
                 encode: Callable[[Sequence[Frame]], bytes],
                 heartbeat: Callable[[], bytes]) -> AsyncGenerator[bytes, None]:
    """A client's bytes until its generation ends: frames as they come (those produced while
    the client was busy in one write), a heartbeat after ``heartbeat_s`` of silence."""
    last_sent = time.monotonic()
    while True:
        wait = max(0.0, heartbeat_s - (time.monotonic() - last_sent))
        try:
            frame = await subscriber.next_frame(wait)
        except StopAsyncIteration:
            return
        if frame is None:
            on_heartbeat()
            yield heartbeat()
            last_sent = time.monotonic()
            continue
        out = encode((frame, *subscriber.take_ready(BATCH_FRAMES)))
        if out:
            yield out
            last_sent = time.monotonic()


class ClientView:
    """What one client sees of a generation's frames.

    The proxy always asks the engine for progress and usage; a client that did not ask
    gets neither. llama-server puts ``timings`` on the usage chunk when usage was asked for
    and on the finish chunk otherwise, so for a client that did not ask, the finish chunk
    is held back one frame and given the usage chunk's ``timings``: the client sees what
    the engine would have sent it directly.
    """

    def __init__(self, client: ClientRequest, generation: Generation, *,
                 fill_cached: bool = True) -> None:
        self._client = client
        self._generation = generation
        self._fill_cached = fill_cached
        self._held: Frame | None = None

    def bytes_for(self, frame: Frame) -> bytes | None:
        if frame.kind is FrameKind.USAGE and not self._client.wants_usage:
            return self._release_with_timings(frame)
        out = self._release_with_timings(None)
        own = self._own_bytes(frame)
        if own is not None and _is_finish_chunk(frame) and not self._client.wants_usage:
            self._held = frame
            return out
        return (out or b"") + own if own is not None else out

    def flush(self) -> bytes | None:
        return self._release_with_timings(None)

    def _own_bytes(self, frame: Frame) -> bytes | None:
        if frame.kind is FrameKind.PING:
            return None  # the proxy sends its own heartbeats
        if frame.kind is FrameKind.PROGRESS:
            return frame.raw if self._client.wants_progress else None
        if frame.kind is FrameKind.USAGE and self._fill_cached:
            generation = self._generation
            return with_cached_tokens(frame, generation.frames, generation.progress).raw
        return frame.raw

    def _release_with_timings(self, usage: Frame | None) -> bytes | None:
        held, self._held = self._held, None
        if held is None:
            return None
        timings = (usage.data or {}).get("timings") if usage is not None else None
        if timings is None or (held.data or {}).get("timings") is not None:
            return held.raw
        return encode_data(json.dumps({**(held.data or {}), "timings": timings},
                                      separators=(",", ":"), ensure_ascii=False))


def _is_finish_chunk(frame: Frame) -> bool:
    if frame.kind is not FrameKind.CHUNK or frame.data is None:
        return False
    choices = frame.data.get("choices")
    return isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") for c in choices)


def heartbeat_text(progress: Progress | None, generation: Generation) -> str:
    if generation.waiting is not None:
        return generation.waiting
    if progress is None:
        return "waiting for the engine"
    if generation.timeline.first_output is not None:
        return "generating"
    return f"prefill {progress.processed}/{progress.total} cached {progress.cache}"


async def _json_response(request: Request, subscriber: Subscriber,
                         client: ClientRequest, fill_cached: bool = True) -> Response:
    generation = subscriber.generation
    try:
        answered = await _answered_or_disconnected(request, generation)
    finally:
        subscriber.close()
    if not answered:
        return Response(status_code=499)  # nobody is listening; nothing to send
    if generation.error is not None and not generation.completed:
        return error_response(generation.error)
    body = aggregate(generation.frames, chat=client.endpoint == "chat")
    _ensure_usage(body, generation, fill_cached=fill_cached)
    return JSONResponse(body)


async def _answered_or_disconnected(request: Request, generation: Generation) -> bool:
    """Wait for the generation's answer; False if the client disconnected first."""
    answered = asyncio.ensure_future(generation.wait_answered())
    disconnected = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({answered, disconnected},
                                     return_when=asyncio.FIRST_COMPLETED)
        return answered in done
    finally:
        for task in (answered, disconnected):
            task.cancel()
        await asyncio.gather(answered, disconnected, return_exceptions=True)


def _ensure_usage(body: dict[str, Any], generation: Generation, *,
                  fill_cached: bool = True) -> None:
    """Fill in what the engine's usage left out, from the proxy's figures (the engine's
    own fields are kept as sent); cached tokens only from an engine that measures them."""
    figures = figures_from(generation.frames, generation.progress)
    usage = dict(mapping_of(body.get("usage")))
    if figures.prompt_tokens is not None:
        usage.setdefault("prompt_tokens", figures.prompt_tokens)
    if figures.completion_tokens is not None:
        usage.setdefault("completion_tokens", figures.completion_tokens)
    prompt, completion = count_of(usage.get("prompt_tokens")), count_of(
        usage.get("completion_tokens"))
    if prompt is not None and completion is not None:
        usage.setdefault("total_tokens", prompt + completion)
    if fill_cached:
        details = dict(mapping_of(usage.get("prompt_tokens_details")))
        details.setdefault("cached_tokens", figures.cached_tokens or 0)
        usage["prompt_tokens_details"] = details
    body["usage"] = usage


# ------------------------------------------------------------- Ollama's native API (NDJSON)

NDJSON_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _native_response(request: Request, subscriber: Subscriber, client: ClientRequest,
                           *, arrival: float, first_byte_s: float, heartbeat_s: float,
                           on_heartbeat: Callable[[], None]) -> Response:
    generation = subscriber.generation
    if client.stream:
        early_error = await _early_error(generation, arrival, first_byte_s)
        if early_error is not None:
            subscriber.close()
            return native_error_response(early_error)
        body = _ndjson_body(subscriber, heartbeat_s, on_heartbeat)
        return StreamResponse(body, media_type=NDJSON_MEDIA_TYPE, headers=NDJSON_HEADERS)
    try:
        answered = await _answered_or_disconnected(request, generation)
    finally:
        subscriber.close()
    if not answered:
        return Response(status_code=499)
    if generation.error is not None and not generation.completed:
        return native_error_response(generation.error)
    chunks = [f.data for f in generation.frames
              if f.data is not None and f.kind in (FrameKind.CHUNK, FrameKind.DONE)]
    folded = fold_chat(chunks) if client.endpoint == "chat" else fold_generate(chunks)
    return Response(encode_json(folded), media_type=GO_JSON_MEDIA_TYPE)


async def _ndjson_body(subscriber: Subscriber, heartbeat_s: float,
                       on_heartbeat: Callable[[], None]) -> AsyncGenerator[bytes, None]:
    """Ollama's lines as they came, with spaces before them while Ollama is silent."""
    generation = subscriber.generation

    def encode(frames: Sequence[Frame]) -> bytes:
        return b"".join(f.raw for f in frames if f.kind in (FrameKind.CHUNK, FrameKind.DONE))

    try:
        yield KEEPALIVE
        paced = _paced(subscriber, heartbeat_s, on_heartbeat, encode, lambda: KEEPALIVE)
        async with contextlib.aclosing(paced):  # closed with this body, however it ends
            async for out in paced:
                yield out
        if generation.error is not None and not generation.completed:
            yield error_line(generation.error.message)
    finally:
        subscriber.close()


def native_error_response(exc: ProxyError) -> Response:
    """An error before any byte, as Ollama answers one: its status and ``{"error": "..."}``
    (Ollama's own error body is passed on as it came)."""
    if isinstance(exc, UpstreamStatusError) and _is_json_object(exc.raw_body):
        return error_response(exc)
    return Response(encode_json({"error": exc.message}), status_code=exc.status_code,
                    media_type=GO_JSON_MEDIA_TYPE, headers=exc.headers())


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, UnicodeDecodeError):
        return False


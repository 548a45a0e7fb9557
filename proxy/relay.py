"""What each client receives from a generation: SSE with heartbeats, or one JSON body.

Stream first, decide later: a streaming client gets headers and a first comment at once
(unless the engine's error status arrives before the first-byte deadline, which then keeps
its status), heartbeat comments while the engine is silent (with the prefill progress in
their text), the engine's frames unchanged and in order, and, if the engine fails after the
headers went out, an OpenAI-shaped error event and a clean end of stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from adapters.base import Frame, FrameKind, Progress
from proxy.aggregate import aggregate
from proxy.errors import ProxyError, error_event, error_response
from proxy.figures import figures_from, with_cached_tokens
from proxy.generation import Generation, Subscriber
from proxy.sse import encode_comment
from proxy.validation import ClientRequest

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def respond(request: Request, client: ClientRequest, generation: Generation, *,
                  arrival: float, first_byte_s: float, heartbeat_s: float,
                  on_heartbeat: Callable[[], None]) -> Response:
    subscriber = generation.subscribe()
    try:
        if client.stream:
            early_error = await _early_error(generation, arrival, first_byte_s)
            if early_error is not None:
                subscriber.close()
                return error_response(early_error)
            body = _sse_body(subscriber, client, heartbeat_s, on_heartbeat)
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        return await _json_response(request, subscriber, client)
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
    try:
        head = await asyncio.wait_for(asyncio.shield(generation.head), budget)
    except TimeoutError:
        return None
    return head.error


async def _sse_body(subscriber: Subscriber, client: ClientRequest, heartbeat_s: float,
                    on_heartbeat: Callable[[], None]) -> AsyncIterator[bytes]:
    generation = subscriber.generation
    try:
        yield encode_comment("prefixpin")
        last_sent = time.monotonic()
        while True:
            wait = max(0.0, heartbeat_s - (time.monotonic() - last_sent))
            try:
                frame = await subscriber.next_frame(wait)
            except StopAsyncIteration:
                break
            if frame is None:
                on_heartbeat()
                yield encode_comment(heartbeat_text(generation.progress, generation))
                last_sent = time.monotonic()
                continue
            out = client_bytes(frame, client, generation)
            if out:
                yield out
                last_sent = time.monotonic()
        if generation.error is not None and not generation.completed:
            yield error_event(generation.error)
    finally:
        subscriber.close()


def client_bytes(frame: Frame, client: ClientRequest, generation: Generation) -> bytes | None:
    """The bytes of ``frame`` this client should see, or None to hide it."""
    if frame.kind is FrameKind.PING:
        return None  # the proxy sends its own heartbeats
    if frame.kind is FrameKind.PROGRESS:
        return frame.raw if client.wants_progress else None
    if frame.kind is FrameKind.USAGE:
        if not client.wants_usage:
            return None
        return with_cached_tokens(frame, generation.frames, generation.progress).raw
    return frame.raw


def heartbeat_text(progress: Progress | None, generation: Generation) -> str:
    if progress is None:
        return "waiting for the engine"
    if generation.timeline.first_output is not None:
        return "generating"
    return f"prefill {progress.processed}/{progress.total} cached {progress.cache}"


async def _json_response(request: Request, subscriber: Subscriber,
                         client: ClientRequest) -> Response:
    generation = subscriber.generation
    try:
        finished = await _finished_or_disconnected(request, generation)
    finally:
        subscriber.close()
    if not finished:
        return Response(status_code=499)  # nobody is listening; nothing to send
    if generation.error is not None and not generation.completed:
        return error_response(generation.error)
    body = aggregate(generation.frames, chat=client.endpoint == "chat")
    _ensure_usage(body, generation)
    return JSONResponse(body)


async def _finished_or_disconnected(request: Request, generation: Generation) -> bool:
    """Wait for the generation; False if the client disconnected first."""
    finished = asyncio.ensure_future(generation.wait_finished())
    disconnected = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({finished, disconnected},
                                     return_when=asyncio.FIRST_COMPLETED)
        return finished in done
    finally:
        for task in (finished, disconnected):
            task.cancel()
        await asyncio.gather(finished, disconnected, return_exceptions=True)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _ensure_usage(body: dict[str, Any], generation: Generation) -> None:
    figures = figures_from(generation.frames, generation.progress)
    usage = dict(body.get("usage") or {})
    if figures.prompt_tokens is not None:
        usage.setdefault("prompt_tokens", figures.prompt_tokens)
    if figures.completion_tokens is not None:
        usage.setdefault("completion_tokens", figures.completion_tokens)
    if "prompt_tokens" in usage and "completion_tokens" in usage:
        usage.setdefault("total_tokens", usage["prompt_tokens"] + usage["completion_tokens"])
    details = dict(usage.get("prompt_tokens_details") or {})
    details.setdefault("cached_tokens", figures.cached_tokens or 0)
    usage["prompt_tokens_details"] = details
    body["usage"] = usage


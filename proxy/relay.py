"""What each client receives from a generation: its codec's stream with heartbeats, or one
body, paced the same way for every wire format.

Stream first, decide later: a streaming client gets the headers and its codec's opening
bytes at once (unless the engine's error status arrives before the first-byte deadline,
which then keeps its status, in the codec's error shape), the codec's heartbeat while the
engine is silent (an SSE comment carrying the prefill progress, an NDJSON leading space),
the engine's frames as the codec encodes them (unchanged and in order, for the formats
today), and, if the engine fails after the headers went out, the codec's late-error event
and a clean end of stream. A ``stream: false`` client gets nothing until the codec's one
body. What differs per wire format is the codec's (``proxy.codecs``); nothing here asks
which API a client speaks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable

from starlette.requests import Request
from starlette.responses import Response

from adapters.base import Progress
from core.errors import ProxyError
from core.streaming import StreamResponse, wait_disconnect
from proxy.codecs import Codec, codec_of
from proxy.codecs.openai_sse import ensure_usage as _ensure_usage
from proxy.generation import Generation, Subscriber
from proxy.validation import ClientRequest

# ``_ensure_usage``: the OpenAI codec's usage fill, under the name tests read it by here.
__all__ = ["BATCH_FRAMES", "_ensure_usage", "heartbeat_text", "respond"]

BATCH_FRAMES = 256


async def respond(request: Request, client: ClientRequest, generation: Generation, *,
                  arrival: float, first_byte_s: float, heartbeat_s: float,
                  on_heartbeat: Callable[[], None], fill_cached: bool = True) -> Response:
    """``fill_cached``: the engine measures cached tokens, so a usage the engine left
    without them may be completed from its other fields; otherwise nothing is added (an
    estimate is never presented to a client as measured)."""
    codec = codec_of(client)
    subscriber = generation.subscribe()
    try:
        if client.stream:
            early_error = await _early_error(generation, arrival, first_byte_s)
            if early_error is not None:
                subscriber.close()
                return codec.error_response(early_error)
            body = _stream_body(codec, subscriber, client, heartbeat_s, on_heartbeat,
                                fill_cached)
            return StreamResponse(body, media_type=codec.media_type, headers=codec.headers)
        return await _whole_response(request, codec, subscriber, client, fill_cached)
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


async def _stream_body(codec: Codec, subscriber: Subscriber, client: ClientRequest,
                       heartbeat_s: float, on_heartbeat: Callable[[], None],
                       fill_cached: bool) -> AsyncGenerator[bytes, None]:
    """A client's bytes until its generation ends: the frames as they come, each batch
    (all that arrived while this client was busy, up to ``BATCH_FRAMES``) in one write, and
    a heartbeat after ``heartbeat_s`` of silence."""
    generation = subscriber.generation
    encoder = codec.stream(client, generation, fill_cached=fill_cached)
    encode = encoder.encode
    next_frames = subscriber.next_frames
    monotonic = time.monotonic
    try:
        # The opening and whatever the engine sent already (its first events usually come
        # with its answer's head) in one write.
        ready = subscriber.take_ready(BATCH_FRAMES)
        yield codec.opening + encode(ready) if ready else codec.opening
        deadline = monotonic() + heartbeat_s
        while True:
            try:
                frames = await next_frames(deadline, BATCH_FRAMES)
            except StopAsyncIteration:
                break
            if frames is None:
                on_heartbeat()
                yield codec.heartbeat(heartbeat_text(generation.progress, generation))
            elif out := encode(frames):
                yield out
            else:
                continue  # nothing for this client: the silence goes on
            deadline = monotonic() + heartbeat_s
        if tail := encoder.flush():
            yield tail
        if generation.error is not None and not generation.completed:
            yield codec.late_error(generation.error)
    finally:
        subscriber.close()


def heartbeat_text(progress: Progress | None, generation: Generation) -> str:
    """What a heartbeat says the proxy is waiting for (a codec may write it or not)."""
    if generation.waiting is not None:
        return generation.waiting
    if progress is None:
        return "waiting for the engine"
    if generation.timeline.first_output is not None:
        return "generating"
    return f"prefill {progress.processed}/{progress.total} cached {progress.cache}"


async def _whole_response(request: Request, codec: Codec, subscriber: Subscriber,
                          client: ClientRequest, fill_cached: bool) -> Response:
    generation = subscriber.generation
    try:
        answered = await _answered_or_disconnected(request, generation)
    finally:
        subscriber.close()
    if not answered:
        return Response(status_code=499)  # nobody is listening; nothing to send
    if generation.error is not None and not generation.completed:
        return codec.error_response(generation.error)
    return codec.whole(client, generation, fill_cached=fill_cached)


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

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
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from prefixpin.adapters.base import FrameKind, Progress
from prefixpin.core.errors import ProxyError
from prefixpin.core.streaming import StreamResponse, wait_disconnect
from prefixpin.proxy.codecs import Codec
from prefixpin.proxy.codecs.openai_sse import ensure_usage as _ensure_usage
from prefixpin.proxy.pipeline.generation import Generation, Subscriber
from prefixpin.proxy.pipeline.validation import ClientRequest

# ``_ensure_usage``: the OpenAI codec's usage fill, under the name tests read it by here.
__all__ = ["BATCH_FRAMES", "BODY_WRITER", "_ensure_usage", "heartbeat_text", "respond"]

_CHUNK = FrameKind.CHUNK  # read per event: a global, not an enum lookup

BATCH_FRAMES = 256
# A client's heartbeat timer may fire this early (a loop's clock resolution: uvloop's is
# 1 ms): its sleep still ends then, rather than spinning on re-armed timers until the due.
TIMER_SLACK_S = 0.001
# The scope extension a server may offer a streamed response: a plain writer of one body
# chunk, ``write(bytes) -> bool`` (False: declined, ``send`` it instead). The tenant
# listener's protocol offers one (``proxy.listen.http_limits``); absent elsewhere (h11,
# another server, tests' ASGI transports), where every batch goes through ``send``.
BODY_WRITER = "prefixpin.body_writer"


async def respond(request: Request, client: ClientRequest, codec: Codec,
                  generation: Generation, *, arrival: float, first_byte_s: float,
                  heartbeat_s: float, on_heartbeat: Callable[[], None],
                  fill_cached: bool = True) -> Response:
    """``fill_cached``: the engine measures cached tokens, so a usage the engine left
    without them may be completed from its other fields; otherwise nothing is added (an
    estimate is never presented to a client as measured)."""
    subscriber = generation.subscribe()
    try:
        if client.stream:
            early_error = await _early_error(generation, arrival, first_byte_s)
            if early_error is not None:
                subscriber.close()
                return codec.error_response(early_error)
            return LiveStream(codec, subscriber, client, heartbeat_s, on_heartbeat,
                              fill_cached)
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
    head = generation.head
    if budget > 0 and not head.done():
        # Woken by the head's arrival itself, or the budget's end: the head's future is
        # the generation's, never cancelled here; and its callbacks would wake this task
        # a turn of the loop later (asyncio.wait's, two turns): under load, a turn's wait
        # is milliseconds of the first event's.
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def wake() -> None:
            if not waiter.done():
                waiter.set_result(None)

        generation.listen_for_head(wake)
        timer = loop.call_later(budget, wake)
        try:
            await waiter
        finally:
            timer.cancel()
            generation.unlisten_for_head(wake)
    return head.result().error if head.done() else None


class LiveStream(StreamResponse):
    """A client's stream, written from the generation's changes themselves.

    While this response's task sleeps, every change of the generation
    (``Generation.listen``: in the engine connection's read) encodes the frames this client
    has not read, up to ``BATCH_FRAMES`` a write, and writes them there and then with the
    server's plain writer of a body chunk (``BODY_WRITER``): no task
    wakes per event. What must wait is this task's: bytes the plain writer declined (the
    client reads slowly: its socket drains) or, on a server without one, every batch,
    which the task ``send``s before writing what arrived meanwhile and sleeping again
    (one wake-up per batch); the heartbeat after ``heartbeat_s`` of silence (one timer
    per client, moved on only when it fires early); the end (the encoder's tail, the
    late error); and an error of a write, raised here, never in the generation."""

    def __init__(self, codec: Codec, subscriber: Subscriber, client: ClientRequest,
                 heartbeat_s: float, on_heartbeat: Callable[[], None],
                 fill_cached: bool) -> None:
        super().__init__(media_type=codec.media_type, headers=codec.headers)
        self._codec = codec
        self._subscriber = subscriber
        self._generation = subscriber.generation
        self._encode = codec.stream(client, self._generation, fill_cached=fill_cached)
        self._raw_chunks = self._encode.raw_chunks  # (fixed per encoder: read per event)
        self._heartbeat_s = heartbeat_s
        self._on_heartbeat = on_heartbeat
        # The server's plain writer of a body chunk, where it has one (``send`` otherwise).
        self._write_body: Callable[[bytes], bool] | None = None
        self._asleep = False  # changes write this client's frames only while it sleeps
        self._waiter: asyncio.Future[bool] | None = None
        # Encoded bytes the plain writer declined in a change (the socket drains), for this
        # task to ``send``: it writes them first.
        self._pending = b""
        self._failed: Exception | None = None
        self._quiet_until = 0.0  # the next heartbeat is due then, unless something is sent
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        extensions = scope.get("extensions") or {}
        self._write_body = extensions.get(BODY_WRITER)
        await super().__call__(scope, receive, send)

    async def write(self, send: Send) -> None:
        subscriber, generation, codec = self._subscriber, self._generation, self._codec
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            # The opening and whatever the engine sent already (its first events usually
            # come with its answer's head) in one write.
            ready = subscriber.take_ready(BATCH_FRAMES)
            opening = codec.opening + self._encode.encode(ready) if ready else codec.opening
            await send(_body(opening))
            generation.listen(self._on_change)
            await self._follow(send)
            if tail := self._encode.flush():
                await send(_body(tail))
            if generation.error is not None and not generation.completed:
                await send(_body(codec.late_error(generation.error)))
        finally:
            generation.unlisten(self._on_change)
            if self._timer is not None:
                self._timer.cancel()
            subscriber.close()

    async def _follow(self, send: Send) -> None:
        """Until the generation is answered and this client has all of it."""
        subscriber, generation = self._subscriber, self._generation
        encode, monotonic, write_body = self._encode.encode, time.monotonic, self._write_body
        self._quiet_until = monotonic() + self._heartbeat_s
        while True:
            if pending := self._pending:
                self._pending = b""
                await send(_body(pending))
            if self._failed is not None:
                raise self._failed
            while frames := subscriber.take_ready(BATCH_FRAMES):  # while this task was busy
                if out := encode(frames):
                    if write_body is None or not write_body(out):
                        await send(_body(out))
                    self._quiet_until = monotonic() + self._heartbeat_s
            if generation.answered:
                return
            if not await self._sleep():
                self._on_heartbeat()
                await send(_body(self._encode.heartbeat(heartbeat_text(generation.progress,
                                                                       generation))))
                self._quiet_until = monotonic() + self._heartbeat_s

    def _on_change(self) -> None:
        """The generation changed (called by the change itself): this client's new frames
        written now by the server's plain writer if this task sleeps (else, or without
        that writer, the task writes them before it sleeps again)."""
        if not self._asleep:
            return
        subscriber, log = self._subscriber, self._generation.frames
        position = subscriber.position
        if position == len(log) - 1 and self._raw_chunks:
            # The common change, one new output chunk, for an encoder that writes it as its
            # bytes: written as the loop below would, without a batch taken and encoded
            # (unless the plain writer declines: then the loop's ``send`` does it).
            frame = log[position]
            if (frame.kind is _CHUNK and (write_body := self._write_body) is not None
                    and write_body(frame.raw)):
                subscriber.position = position + 1
                self._quiet_until = time.monotonic() + self._heartbeat_s
                return
        write_body = self._write_body
        if write_body is None:  # ``send`` is a coroutine: only this task runs it
            self._wake(True)
            return
        try:
            while subscriber.position < len(log):
                frames = subscriber.take_ready(BATCH_FRAMES)
                if not (out := self._encode.encode(frames)):
                    continue
                self._quiet_until = time.monotonic() + self._heartbeat_s
                if write_body(out):
                    continue  # written as ``send`` would have, without it
                # Declined (the socket drains): this task ``send``s it, and what arrives
                # meanwhile after it.
                self._pending = out
                self._wake(True)
                return
            if self._generation.answered:
                self._wake(True)
        except Exception as exc:  # this client's failure, not the generation's
            self._failed = exc
            self._wake(True)

    async def _sleep(self) -> bool:
        """Until a change needs this task (True) or the heartbeat is due (False)."""
        now = time.monotonic()
        due = self._quiet_until
        if now >= due - TIMER_SLACK_S:
            return False
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter
        if self._timer is None or self._timer_at > due:
            self._arm(loop, due, now)
        self._asleep = True
        try:
            return await waiter
        finally:
            self._asleep = False
            self._waiter = None

    def _wake(self, needed: bool) -> None:
        self._asleep = False  # from now on this task writes, until it sleeps again
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(needed)

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = loop.call_later(at - now, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if not self._asleep:
            return  # awake: the next sleep arms it again
        now = time.monotonic()
        if now >= self._quiet_until - TIMER_SLACK_S:
            self._wake(False)
        else:  # something was sent since it was armed: the silence starts later
            self._arm(asyncio.get_running_loop(), self._quiet_until, now)


def _body(chunk: bytes) -> Message:
    return {"type": "http.response.body", "body": chunk, "more_body": True}


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

"""A generation: one upstream request whose frames any number of clients read.

The upstream runs in its own task and appends frames to a log; each client is a
``Subscriber`` with its own read position, so a client that attaches late (a retry joining
the generation in flight) receives everything produced so far, then the live stream.
When the last subscriber leaves before the end, the upstream keeps running for a grace
period (a resend can still join it), then is cancelled, which closes its connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from adapters.base import Frame, FrameKind, Progress, UpstreamStream
from core.errors import (
    GenerationCancelledError,
    ProxyError,
    UpstreamProtocolError,
    UpstreamStatusError,
)
from proxy.logs import get_logger

Opener = Callable[["Generation"], AbstractAsyncContextManager[UpstreamStream]]


@dataclass(slots=True)
class Head:
    """What the upstream answered first: its status, or the error that replaced it."""

    status_code: int
    error: ProxyError | None = None


@dataclass(slots=True)
class Timeline:
    started: float = field(default_factory=time.monotonic)
    head: float | None = None
    first_progress: float | None = None
    first_output: float | None = None
    finished: float | None = None


class Generation:
    """``on_settled`` runs once, when the answer is settled: as soon as the engine's answer
    is complete, right after the clients wrote their last bytes and before any of them can
    act on those (so what it records, a session's committed history, is in place before a
    client can send its next turn), else when the generation finishes without one (an
    error, every client gone)."""

    def __init__(self, opener: Opener, *, grace_s: float,
                 on_settled: Callable[[Generation], None] | None = None) -> None:
        self._opener = opener
        self._grace_s = grace_s
        self._on_settled = on_settled
        self.frames: list[Frame] = []
        self.head: asyncio.Future[Head] = asyncio.get_running_loop().create_future()
        self.error: ProxyError | None = None
        self.finished = False
        self.completed = False  # ended with [DONE] (or a finish), not an error or cancel
        self.progress: Progress | None = None
        self.waiting: str | None = None  # why no request went out yet (e.g. queued for a slot)
        self.timeline = Timeline()
        self._wakeup = asyncio.Event()
        self._subscribers = 0
        self._subscribed = False  # some client read it (and so can have left it)
        self._grace_handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._done_callbacks: list[Callable[[Generation], None]] = []

    @property
    def answered(self) -> bool:
        """Nothing more will reach a client: the answer is complete, or the generation
        ended without one."""
        return self.completed or self.finished

    @property
    def abandoned(self) -> bool:
        """Every client that read it has left: it runs on for ``grace_s``, for a retry."""
        return self._subscribed and self._subscribers == 0 and not self.answered

    def on_done(self, callback: Callable[[Generation], None]) -> None:
        """Run ``callback`` when the generation finishes (after the figures are recorded)."""
        self._done_callbacks.append(callback)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="prefixpin-generation")

    def subscribe(self) -> Subscriber:
        self._subscribers += 1
        self._subscribed = True
        if self._grace_handle is not None:
            self._grace_handle.cancel()
            self._grace_handle = None
        return Subscriber(self)

    async def wait_answered(self) -> None:
        while not self.answered:
            await self.changed().wait()

    async def aclose(self) -> None:
        """Cancel the upstream now and wait until its connection is closed."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _unsubscribe(self) -> None:
        self._subscribers -= 1
        if self._subscribers > 0 or self.answered or self._task is None:
            return  # a complete answer is read to its end: its connection is reused
        if self._grace_s <= 0:
            self._task.cancel()
        else:
            loop = asyncio.get_running_loop()
            self._grace_handle = loop.call_later(self._grace_s, self._task.cancel)

    def changed(self) -> asyncio.Event:
        """The event set at the next change. Take it *before* re-checking state and awaiting:
        an event looked up lazily (inside a task that starts later) can miss a wake-up."""
        return self._wakeup

    def _notify(self) -> None:
        # Broadcast: wake every waiter, then arm a fresh event for the next change.
        self._wakeup.set()
        self._wakeup = asyncio.Event()

    async def _run(self) -> None:
        try:
            async with self._opener(self) as upstream:
                await self._consume(upstream)
        except ProxyError as exc:
            self._fail(exc)
        except asyncio.CancelledError:
            self._fail(GenerationCancelledError("generation cancelled: every client left"))
            raise
        except Exception as exc:
            # A bug or an error nobody translated: every client still gets an error and an
            # end of stream (never a silent empty answer); the details stay in the log.
            get_logger().log(logging.ERROR, "generation failed", exc_info=True)
            self._fail(ProxyError(f"internal proxy error ({type(exc).__name__})"))
        finally:
            self._finish()

    async def _consume(self, upstream: UpstreamStream) -> None:
        if upstream.status_code >= 400:
            body = await upstream.aread_error()
            raise UpstreamStatusError(upstream.status_code, body, upstream.content_type)
        self._set_head(Head(upstream.status_code))
        async for frame in upstream.aiter_frames():
            if self.completed:
                continue  # read to the end of the body so the connection is reused
            self._append(frame)
            if frame.kind is FrameKind.ERROR:
                raise _mid_stream_error(frame)
            if frame.kind is FrameKind.DONE:
                self.completed = True
                self._notify()
                # The clients write their last bytes first, then the answer is settled (the
                # session's history committed) in the same turn of the loop: before any
                # client can have read those bytes and sent its next turn. Reading the
                # body's end and releasing the slot come after, off their latency too.
                asyncio.get_running_loop().call_soon(self._settle)
                await asyncio.sleep(0)
        if not self.completed:
            # A stream that ends without [DONE] was cut off: never pretend it completed.
            raise UpstreamProtocolError("engine closed the stream before it finished")

    def _append(self, frame: Frame) -> None:
        now = time.monotonic()
        if frame.progress is not None:
            self.progress = frame.progress
            if self.timeline.first_progress is None:
                self.timeline.first_progress = now
        if frame.has_output and self.timeline.first_output is None:
            self.timeline.first_output = now
        if frame.kind is FrameKind.ERROR:
            return  # re-raised by the caller; the relay writes its own error event
        self.frames.append(frame)
        self._notify()

    def _set_head(self, head: Head) -> None:
        if not self.head.done():
            self.timeline.head = time.monotonic()
            self.head.set_result(head)

    def _fail(self, exc: ProxyError) -> None:
        if self.error is None:
            self.error = exc
        status = exc.status_code if isinstance(exc, UpstreamStatusError) else 502
        self._set_head(Head(status, exc))

    def _finish(self) -> None:
        self.finished = True
        self.timeline.finished = time.monotonic()
        if self._grace_handle is not None:
            self._grace_handle.cancel()
        self._settle()
        self._notify()
        for callback in self._done_callbacks:
            callback(self)

    def _settle(self) -> None:
        settled, self._on_settled = self._on_settled, None
        if settled is not None:
            settled(self)


class Subscriber:
    """A client's read position in a generation's frame log."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.position = 0
        self._closed = False

    async def next_frame(self, wait_s: float) -> Frame | None:
        """The next frame; ``None`` when ``wait_s`` passed first. Raises at the end."""
        generation = self.generation
        deadline = time.monotonic() + wait_s
        while self.position >= len(generation.frames):
            if generation.answered:
                raise StopAsyncIteration
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            changed = generation.changed()
            try:
                async with asyncio.timeout(remaining):  # no task per wait, unlike wait_for
                    await changed.wait()
            except TimeoutError:
                return None
        frame = generation.frames[self.position]
        self.position += 1
        return frame

    def take_ready(self, limit: int) -> list[Frame]:
        """The frames already produced that this client has not read, up to ``limit``."""
        frames = self.generation.frames
        taken = frames[self.position:self.position + limit]
        self.position += len(taken)
        return taken

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.generation._unsubscribe()


def _mid_stream_error(frame: Frame) -> ProxyError:
    error = (frame.data or {}).get("error")
    message = error.get("message") if isinstance(error, dict) else str(error)
    exc = UpstreamProtocolError(f"engine error mid-stream: {message}")
    if isinstance(error, dict) and isinstance(error.get("code"), int):
        exc.status_code = int(error["code"])
    return exc

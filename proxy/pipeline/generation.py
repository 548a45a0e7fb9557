"""A generation: one upstream request whose frames any number of clients read.

The upstream runs in its own task and appends frames to a log (pushed from the engine
connection's reads where the stream can: that task then wakes only at the end); each
client is a ``Subscriber`` with its own read position, written from each change itself
while it keeps up (``listen``, ``proxy.pipeline.relay.LiveStream``), so a client that attaches late
(a retry joining the generation in flight) receives everything produced so far, then the
live stream.
When the last subscriber leaves before the end, the upstream keeps running for a grace
period (a resend can still join it), then is cancelled, which closes its connection.

The log is kept whole for its first ``keep_events`` events. Past them it lets go of what
every client has read (``_let_go``): those frames are folded into what the reply and the
figures need (``proxy.pipeline.aggregate.fold_read``), so a long or flooding reply streams in
memory that does not grow with it. From then on no retry can join it (a joiner reads from
the start), and when every client has left it is cancelled at once. A reply whose read
frames do not fold (tool-call deltas from end to end) keeps only its figures: the session
does not commit it (``reply_kept``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from prefixpin.adapters.base import Frame, FrameKind, Progress, UpstreamStream
from prefixpin.core.defaults import MAX_REPLY_BYTES
from prefixpin.core.errors import (
    GenerationCancelledError,
    ProxyError,
    UpstreamProtocolError,
    UpstreamStatusError,
)
from prefixpin.core.figures import may_carry_figures
from prefixpin.proxy.ops.logs import get_logger
from prefixpin.proxy.pipeline.aggregate import fold_read

Opener = Callable[["Generation"], AbstractAsyncContextManager[UpstreamStream]]


# Read per frame: globals, not enum lookups.
_ERROR, _DONE, _CHUNK = FrameKind.ERROR, FrameKind.DONE, FrameKind.CHUNK


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
                 on_settled: Callable[[Generation], None] | None = None,
                 max_frames: int = 131_072, max_bytes: int = MAX_REPLY_BYTES,
                 keep_events: int = 8192) -> None:
        self._opener = opener
        self._grace_s = grace_s
        # An engine that sends more events than this (one that ignores max_tokens, or
        # floods), or more bytes of events (a few events of megabytes each: the log keeps
        # the events its clients have not read, and whole ones for a retry), is cut off
        # with an error.
        self._max_frames = max_frames
        self._max_bytes = max_bytes
        self._bytes = 0  # the reply's event bytes so far
        self._keep_events = keep_events
        self.whole = True  # every frame is in the log as the engine sent it: joinable
        self.reply_kept = True  # the log still folds to the whole reply
        self._keep_whole = False  # someone reads the log by its own index (``keep_whole``)
        self._dropped = 0  # frames folded away
        # The log's length at which the next frame is taken the long way (``take_frames``:
        # the reply's bound checked, the log let go of what was read).
        self._check_at = min(keep_events, max_frames)
        self._readers: list[Subscriber] = []
        self._on_settled = on_settled
        self.frames: list[Frame] = []
        self.head: asyncio.Future[Head] = asyncio.get_running_loop().create_future()
        self.error: ProxyError | None = None
        self.finished = False
        self.completed = False  # ended with [DONE] (or a finish), not an error or cancel
        self.progress: Progress | None = None
        self.waiting: str | None = None  # why no request went out yet (e.g. queued for a slot)
        self.timeline = Timeline()
        self._loop = asyncio.get_running_loop()
        # Who hears of the next change: the listeners (clients' streams, called by the
        # change itself) and, only once someone asks, an event (``changed``: the waits for
        # the answer, the Redis tap); with no event asked for, a change costs the calls.
        self._wakeup: asyncio.Event | None = None
        self._listeners: list[Callable[[], None]] = []
        self._head_listeners: list[Callable[[], None]] = []
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
        if not self.whole:
            raise RuntimeError("a log that let go of its read frames cannot be joined")
        self._subscribers += 1
        self._subscribed = True
        if self._grace_handle is not None:
            self._grace_handle.cancel()
            self._grace_handle = None
        subscriber = Subscriber(self)
        self._readers.append(subscriber)
        return subscriber

    def keep_whole(self) -> None:
        """Never let go of a frame: for a reader that indexes ``frames`` itself (the
        replicas' tap, which may read on after its subscription ends)."""
        self._keep_whole = True

    async def wait_answered(self) -> None:
        while not self.answered:
            await self.changed().wait()

    async def aclose(self) -> None:
        """Cancel the upstream now and wait until its connection is closed."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _unsubscribe(self, subscriber: Subscriber) -> None:
        self._subscribers -= 1
        with contextlib.suppress(ValueError):
            self._readers.remove(subscriber)
        if self._subscribers > 0 or self.answered or self._task is None:
            return  # a complete answer is read to its end: its connection is reused
        if self._grace_s <= 0 or not self.whole:  # nobody can join it any more
            self._task.cancel()
        else:
            loop = asyncio.get_running_loop()
            self._grace_handle = loop.call_later(self._grace_s, self._task.cancel)

    def changed(self) -> asyncio.Event:
        """The event set at the next change. Take it *before* re-checking state and awaiting:
        an event looked up lazily (inside a task that starts later) can miss a wake-up."""
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        return self._wakeup

    def listen(self, listener: Callable[[], None]) -> None:
        """``listener()`` at every change from now on, called by the change itself (in the
        engine connection's read, ``take_frames``) before any waiter wakes: a client's
        stream written without waking its task (``proxy.pipeline.relay``). It must not raise, and
        leaves with ``unlisten``."""
        self._listeners.append(listener)

    def unlisten(self, listener: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _notify(self) -> None:
        for listener in self._listeners:
            listener()
        # Broadcast: wake every waiter of the event; the next change has its own.
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

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
        if (push := upstream.pusher) is not None:
            # Each engine read's frames land here from the read itself: the clients are
            # the only tasks woken per read.
            await push(self)
        else:
            async for frame in upstream.aiter_frames():
                answered = self.completed
                self.take_frame(frame)
                if self.completed and not answered:
                    # The clients write their last bytes before this task reads on (and
                    # then releases the slot): off their latency.
                    await asyncio.sleep(0)
        if not self.completed:
            # A stream that ends without [DONE] was cut off: never pretend it completed.
            raise UpstreamProtocolError("engine closed the stream before it finished")

    def take_frame(self, frame: Frame) -> None:
        """``take_frames([frame])``. The common frame, a streamed token after the first
        output, goes straight into the log: no list, and none of the checks that cannot
        apply to it (a progress, the first output, an error, the end)."""
        size = len(frame.raw)
        if (frame.kind is not _CHUNK or frame.progress is not None or self.completed
                or self.timeline.first_output is None
                or len(self.frames) >= self._check_at or self._bytes + size > self._max_bytes):
            self.take_frames([frame])
            return
        self._bytes += size
        self.frames.append(frame)
        # ``_notify``, inline (once per streamed token: a call fewer).
        for listener in self._listeners:
            listener()
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    def take_frames(self, frames: list[Frame]) -> None:
        """The frames of one engine read, in order, into the log, the clients told once.
        The frames after the answer are read (so the connection is reused) and dropped.
        Complete, the answer is settled (the session's history committed) right after the
        clients wrote their last bytes (those the change wrote, and the tasks it woke), in
        the same turn of the loop: before any client can have read them and sent its next
        turn."""
        if self.completed:
            return
        log, timeline = self.frames, self.timeline
        if self._dropped + len(log) + len(frames) > self._max_frames:
            raise self._too_many_events()
        self._bytes += sum(len(frame.raw) for frame in frames)
        if self._bytes > self._max_bytes:
            raise self._too_many_bytes()
        if len(log) >= self._check_at:
            self._let_go()
        for frame in frames:
            if frame.progress is not None or (frame.has_output
                                              and timeline.first_output is None):
                self._note(frame)
            kind = frame.kind
            if kind is _ERROR:
                raise _mid_stream_error(frame)  # the frames before it still reach the clients
            log.append(frame)
            if kind is _DONE:
                self.completed = True
                break
        self._notify()
        if self.completed:
            self._loop.call_soon(self._settle)

    def _too_many_events(self) -> UpstreamProtocolError:
        return UpstreamProtocolError(f"the engine's reply exceeds {self._max_frames} events "
                                     "(--max-reply-events)")

    def _too_many_bytes(self) -> UpstreamProtocolError:
        return UpstreamProtocolError(f"the engine's reply exceeds {self._max_bytes} bytes "
                                     "(--max-reply-bytes)")

    def _let_go(self) -> None:
        """Past ``keep_events``, fold the frames every client has read (``fold_read``) and
        move each client's position back by what went. Not while the log is kept whole, a
        client is far behind (a non-streaming one reads at the end: nothing is read
        before) or every client left (a retry may still join in the grace period); tried
        again after another eighth of ``keep_events``."""
        log, readers = self.frames, self._readers
        step = max(1, self._keep_events // 8)
        read = min((reader.position for reader in readers), default=0)
        if not self._keep_whole and read >= step:
            folded = fold_read(log[:read]) if self.reply_kept else []
            if not self.reply_kept or len(folded) > step:
                # Not text (a flood of tool-call deltas): only what figures are read from
                # is kept, its last frames at most.
                folded = [frame for frame in log[:read] if may_carry_figures(frame)][-step:]
                self.reply_kept = False
            log[:read] = folded
            gone = read - len(folded)
            for reader in readers:
                reader.position -= gone
            self._dropped += gone
            self.whole = False
        self._check_at = min(len(log) + step, self._max_frames - self._dropped)

    def _note(self, frame: Frame) -> None:
        """The progress a frame carries, and when the first progress and output came (the
        caller calls this only for a frame that may change either)."""
        timeline = self.timeline
        if frame.progress is not None:
            self.progress = frame.progress
            if timeline.first_progress is None:
                timeline.first_progress = time.monotonic()
        if frame.has_output and timeline.first_output is None:
            timeline.first_output = time.monotonic()

    def listen_for_head(self, listener: Callable[[], None]) -> None:
        """``listener()`` once, when the head is known (at once if it is), called by the
        change itself: a waiter woken from here is one turn of the loop sooner than
        through the future's callbacks (``asyncio.wait`` takes two). It must not raise."""
        if self.head.done():
            listener()
        else:
            self._head_listeners.append(listener)

    def unlisten_for_head(self, listener: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._head_listeners.remove(listener)

    def engine_answered(self, status: int) -> None:
        """The engine's response head was read (``UpstreamCall.on_head``: a final status
        below 400), before the opener returns: the clients waiting for the head go on now.
        An error status waits for its body (``_consume``)."""
        if status < 400:
            self._set_head(Head(status))

    def _set_head(self, head: Head) -> None:
        if not self.head.done():
            self.timeline.head = time.monotonic()
            self.head.set_result(head)
            listeners, self._head_listeners = self._head_listeners, []
            for listener in listeners:
                listener()

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
    """A client's read position in a generation's frame log (its stream is written from
    the generation's changes: ``Generation.listen``, ``proxy.pipeline.relay.LiveStream``)."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.position = 0
        self._closed = False

    def take_ready(self, limit: int) -> list[Frame]:
        """The frames already produced that this client has not read, up to ``limit``."""
        frames = self.generation.frames
        taken = frames[self.position:self.position + limit]
        self.position += len(taken)
        return taken

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.generation._unsubscribe(self)


def _mid_stream_error(frame: Frame) -> ProxyError:
    error = (frame.data or {}).get("error")
    message = error.get("message") if isinstance(error, dict) else str(error)
    exc = UpstreamProtocolError(f"engine error mid-stream: {message}")
    if isinstance(error, dict) and isinstance(error.get("code"), int):
        exc.status_code = int(error["code"])
    return exc

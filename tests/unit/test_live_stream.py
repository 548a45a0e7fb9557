"""A client's stream written from the generation's changes themselves (``relay.LiveStream``):
no task wakes per event while the client keeps up (the server's plain body writer writes);
without that writer, or when it declines, the client's task ``send``s and nothing is lost
or reordered; one client's failed write never reaches the
generation or the other clients; heartbeats only after silence."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
from starlette.types import Message

from prefixpin.core.errors import ProxyError
from prefixpin.core.frames import Frame
from prefixpin.proxy.codecs import codec_of
from prefixpin.proxy.codecs.anthropic import AnthropicCodec
from prefixpin.proxy.codecs.openai_sse import ClientView
from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.pipeline.relay import BODY_WRITER, LiveStream
from tests.unit.test_relay_path import STREAM, client_of, event, frames_of, opener_of


class Client:
    """An ASGI client side: what was sent, a send that can be made to wait or to fail, and
    a receive that reports no disconnect."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.blocked: asyncio.Event | None = None
        self.fail_on: bytes | None = None

    async def send(self, message: Message) -> None:
        if self.fail_on is not None and self.fail_on in message.get("body", b""):
            raise ConnectionResetError("the client's socket broke")
        if self.blocked is not None and message["type"] == "http.response.body":
            await self.blocked.wait()
        self.messages.append(message)

    async def receive(self) -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages)

    @property
    def ended(self) -> bool:
        return bool(self.messages) and self.messages[-1] == {
            "type": "http.response.body", "body": b"", "more_body": False}


def live(generation: Generation, heartbeat_s: float = 30.0,
         beats: list[int] | None = None) -> tuple[LiveStream, Any]:
    client = client_of(stream_options={"include_usage": True})
    response = LiveStream(codec_of(client), generation.subscribe(), client, heartbeat_s,
                          lambda: beats.append(1) if beats is not None else None, True)
    return response, client


def expected_body(generation: Generation, client: Any) -> bytes:
    view = ClientView(client, generation)
    return codec_of(client).opening + view.encode(frames_of(STREAM)) + (view.flush() or b"")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def started(generation: Generation, heartbeat_s: float = 30.0,
                  beats: list[int] | None = None, *, writer: bool = False
                  ) -> tuple[LiveStream, Any, Client, asyncio.Task[None]]:
    """A client's stream running, its head and opening out, its task asleep; ``writer``:
    the server offers its plain body writer (as uvicorn's does here, ``BODY_WRITER``)."""
    response, request = live(generation, heartbeat_s, beats)
    sent = Client()

    def write_body(body: bytes) -> bool:
        sent.messages.append({"type": "http.response.body", "body": body, "more_body": True})
        return True

    scope = {"type": "http", "extensions": {BODY_WRITER: write_body} if writer else {}}
    task = asyncio.create_task(response(scope, sent.receive, sent.send))
    await settle()
    return response, request, sent, task


def test_frames_are_written_by_the_change_itself_and_the_stream_ends_whole() -> None:
    async def run() -> None:
        generation = Generation(opener_of, grace_s=0)
        _, request, sent, task = await started(generation, writer=True)
        frames = frames_of(STREAM)
        before = len(sent.messages)
        generation.take_frames(frames[:3])
        # Written before any task ran: the change itself wrote them.
        assert len(sent.messages) == before + 1
        for frame in frames[3:]:
            generation.take_frames([frame])
        await asyncio.wait_for(task, 5)
        assert sent.messages[0]["type"] == "http.response.start"
        assert sent.ended
        assert sent.body == expected_body(generation, request)

    asyncio.run(run())


def test_without_a_plain_writer_the_task_sends_once_per_batch() -> None:
    """A server without the plain body writer: a change wakes the client's task, which
    sends what arrived until it ran in one ``send``."""
    async def run() -> None:
        generation = Generation(opener_of, grace_s=0)
        _, request, sent, task = await started(generation)
        frames = frames_of(STREAM)
        before = len(sent.messages)
        generation.take_frames(frames[:3])
        generation.take_frames(frames[3:5])
        assert len(sent.messages) == before  # the task has not run yet
        await settle()
        assert len(sent.messages) == before + 1
        for frame in frames[5:]:
            generation.take_frames([frame])
        await asyncio.wait_for(task, 5)
        assert sent.ended
        assert sent.body == expected_body(generation, request)

    asyncio.run(run())


def test_a_send_that_waits_is_the_tasks_and_nothing_is_lost_or_reordered() -> None:
    async def run() -> None:
        generation = Generation(opener_of, grace_s=0)
        _, request, sent, task = await started(generation)
        sent.blocked = asyncio.Event()
        frames = frames_of(STREAM)
        generation.take_frames(frames[:3])  # a progress, then output
        await settle()  # the task's write waits; what comes next must not go around it
        for frame in frames[3:5]:
            generation.take_frames([frame])
        await settle()
        writes_while_blocked = len(sent.messages)
        sent.blocked.set()
        await settle()
        # The waiting write finished, then everything that arrived meanwhile in one write.
        assert len(sent.messages) == writes_while_blocked + 2
        sent.blocked = None
        for frame in frames[5:]:
            generation.take_frames([frame])
        await asyncio.wait_for(task, 5)
        assert sent.body == expected_body(generation, request)
        assert sent.ended

    asyncio.run(run())


def test_a_client_whose_write_fails_leaves_the_generation_and_the_others_whole() -> None:
    async def run() -> None:
        generation = Generation(opener_of, grace_s=0)
        broken, _ = live(generation)
        fine, request = live(generation)
        bad, good = Client(), Client()
        bad.fail_on = b"Hel"
        bad_task = asyncio.create_task(broken({"type": "http"}, bad.receive, bad.send))
        good_task = asyncio.create_task(fine({"type": "http"}, good.receive, good.send))
        await settle()
        for frame in frames_of(STREAM):
            generation.take_frames([frame])  # raises nothing, whoever fails
        await asyncio.wait_for(good_task, 5)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(bad_task, 5)
        assert good.body == expected_body(generation, request)
        assert generation.completed
        assert generation.error is None

    asyncio.run(run())


def test_heartbeats_come_after_silence_only() -> None:
    async def run() -> tuple[int, int, Client]:
        generation = Generation(opener_of, grace_s=0)
        beats: list[int] = []
        _, _, sent, task = await started(generation, heartbeat_s=0.05, beats=beats)
        await asyncio.sleep(0.18)  # silence: about three heartbeats
        silent = len(beats)
        frames = frames_of(STREAM)
        for frame in frames[:-1]:  # frames every 10 ms: no heartbeat between them
            generation.take_frames([frame])
            await asyncio.sleep(0.01)
        flowing = len(beats) - silent
        generation.take_frames(frames[-1:])
        await asyncio.wait_for(task, 5)
        return silent, flowing, sent

    silent, flowing, sent = asyncio.run(run())
    assert 2 <= silent <= 4
    assert flowing == 0
    assert sent.body.count(b": ") >= silent  # each heartbeat is an SSE comment


def test_an_anthropic_stream_keeps_alive_with_comments_until_message_start() -> None:
    """A heartbeat is the client's stream's own: an Anthropic client waiting for the
    engine's first chunk (queued, prefilling) hears SSE comments, never a ``ping`` before
    ``message_start`` (Anthropic's streams open with it); once it went out, ``ping``."""
    async def run() -> bytes:
        generation = Generation(opener_of, grace_s=0)
        client = AnthropicCodec().parse(json.dumps({
            "model": "m", "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}).encode(), "/v1/messages",
            max_messages=100)
        response = LiveStream(codec_of(client), generation.subscribe(), client, 0.02,
                              lambda: None, True)
        sent = Client()
        task = asyncio.create_task(response({"type": "http"}, sent.receive, sent.send))
        await asyncio.sleep(0.1)  # the engine silent: heartbeats
        frames = frames_of(STREAM)
        generation.take_frames(frames[:5])  # progress, role chunks, the first text
        await asyncio.sleep(0.1)  # silent again, mid-answer
        for frame in frames[5:]:
            generation.take_frames([frame])
        await asyncio.wait_for(task, 5)
        return sent.body

    body = asyncio.run(run())
    start = body.index(b"event: message_start\n")
    waiting = body[:start].split(b"\n\n")[:-1]
    assert len(waiting) >= 2  # the opening, then heartbeats
    assert all(part.startswith(b": ") for part in waiting), waiting
    assert b"event: ping\n" in body[start:]


def test_a_client_keeps_one_timer_however_many_writes_and_none_after_the_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    armed: list[float] = []
    arm = LiveStream._arm

    def counted(self: LiveStream, loop: asyncio.AbstractEventLoop, at: float,
                now: float) -> None:
        armed.append(at)
        arm(self, loop, at, now)

    monkeypatch.setattr(LiveStream, "_arm", counted)

    async def run() -> LiveStream:
        generation = Generation(opener_of, grace_s=0)
        response, _, _, task = await started(generation, heartbeat_s=10.0)
        for frame in frames_of(STREAM):  # every write moves the heartbeat's due
            generation.take_frames([frame])
            await asyncio.sleep(0.001)
        await asyncio.wait_for(task, 5)
        return response

    response = asyncio.run(run())
    assert len(armed) == 1  # armed once, for the first sleep; never moved by a write
    assert response._timer is not None
    assert response._timer.cancelled()  # the end leaves no timer behind


def test_one_frame_taken_alone_is_what_a_list_of_it_does() -> None:
    """``Generation.take_frame`` (a pushed read of one frame, the common one: a token)
    against ``take_frames([frame])``, frame by frame over a whole stream (a progress, role
    chunks, empty deltas, the first output, tokens, the finish, usage, [DONE], a token
    after it) and an engine's error mid-stream: the same log, end, progress and timeline,
    the listeners told as often, the same error raised."""
    async def run() -> None:
        frames = frames_of(STREAM)
        alone, listed = Generation(opener_of, grace_s=0), Generation(opener_of, grace_s=0)
        told = {"alone": 0, "listed": 0}
        alone.listen(lambda: told.__setitem__("alone", told["alone"] + 1))
        listed.listen(lambda: told.__setitem__("listed", told["listed"] + 1))
        for frame in [*frames, frames[4]]:
            alone.take_frame(frame)
            listed.take_frames([frame])
            assert alone.frames == listed.frames
            assert (alone.completed, alone.progress) == (listed.completed, listed.progress)
            assert ((alone.timeline.first_output is None, alone.timeline.first_progress is None)
                    == (listed.timeline.first_output is None,
                        listed.timeline.first_progress is None))
            assert told["alone"] == told["listed"]
        assert alone.completed

        error = frames_of([event({"error": {"message": "boom", "code": 503}})])[0]
        raised = []
        for one_at_a_time in (True, False):
            generation = Generation(opener_of, grace_s=0)

            def take(frame: Frame, generation: Generation = generation,
                     alone: bool = one_at_a_time) -> None:
                if alone:
                    generation.take_frame(frame)
                else:
                    generation.take_frames([frame])

            for frame in frames[:6]:
                take(frame)
            with pytest.raises(ProxyError) as caught:
                take(error)
            raised.append((str(caught.value), caught.value.status_code,
                           len(generation.frames)))
        assert raised[0] == raised[1]

    asyncio.run(run())


def test_a_lone_new_chunk_is_written_as_its_bytes_without_the_encoder() -> None:
    """With the server's plain body writer in the scope (``BODY_WRITER``), a change that
    brings one output chunk writes that chunk's bytes through it without a batch encoded;
    a batch, any other frame, and a chunk the writer declines take the general way (the
    encoder, then the writer or ``send``); the stream is whole and in order either way."""
    async def run() -> tuple[bytes, bytes, list[int], int, list[Message]]:
        generation = Generation(opener_of, grace_s=0)
        response, request = live(generation)
        sent = Client()
        declines = {"left": 0}  # the writer's next calls that decline

        def write_body(body: bytes) -> bool:
            if declines["left"]:
                declines["left"] -= 1
                return False
            sent.messages.append({"type": "http.response.body", "body": body,
                                  "more_body": True, "by": "writer"})
            return True

        encoded: list[int] = []  # the size of each batch the encoder was given
        encode = response._encode.encode

        def counted(frames: Sequence[Frame]) -> bytes:
            encoded.append(len(frames))
            return encode(frames)

        response._encode.encode = counted  # type: ignore[method-assign]
        scope = {"type": "http", "extensions": {BODY_WRITER: write_body}}
        task = asyncio.create_task(response(scope, sent.receive, sent.send))
        await settle()
        frames = frames_of(STREAM)  # progress, then chunks: role, "", null, Hel, hmm, tool...
        generation.take_frames(frames[:3])  # a batch: encoded
        before_lone = len(encoded)
        for frame in frames[3:6]:  # lone chunks: written, never encoded
            generation.take_frame(frame)
        lone_encoded = len(encoded) - before_lone
        declines["left"] = 2  # the lone chunk's write, then the general way's
        generation.take_frame(frames[6])  # declined by the writer: encoded, then ``send``
        for frame in frames[7:]:
            generation.take_frame(frame)
        await asyncio.wait_for(task, 5)
        declined = [m for m in sent.messages if frames[6].raw in m.get("body", b"")]
        return sent.body, expected_body(generation, request), encoded, lone_encoded, declined

    body, expected, encoded, lone_encoded, declined = asyncio.run(run())
    assert body == expected
    assert lone_encoded == 0
    assert encoded[:2] == [3, 1]  # the batch, then the declined chunk alone
    assert len(declined) == 1
    assert "by" not in declined[0]  # it went out through ``send``

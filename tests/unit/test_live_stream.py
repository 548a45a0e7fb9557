"""A client's stream written from the generation's changes themselves (``relay.LiveStream``):
no task wakes per event while the client keeps up; a send that has to wait is handed to the
client's task and nothing is lost or reordered; one client's failed write never reaches the
generation or the other clients; heartbeats only after silence."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.types import Message

from proxy.codecs import codec_of
from proxy.codecs.openai_sse import ClientView
from proxy.generation import Generation
from proxy.relay import LiveStream
from tests.unit.test_relay_path import STREAM, client_of, frames_of, opener_of


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
                  beats: list[int] | None = None
                  ) -> tuple[LiveStream, Any, Client, asyncio.Task[None]]:
    """A client's stream running, its head and opening out, its task asleep."""
    response, request = live(generation, heartbeat_s, beats)
    sent = Client()
    task = asyncio.create_task(response({"type": "http"}, sent.receive, sent.send))
    await settle()
    return response, request, sent, task


def test_frames_are_written_by_the_change_itself_and_the_stream_ends_whole() -> None:
    async def run() -> None:
        generation = Generation(opener_of, grace_s=0)
        _, request, sent, task = await started(generation)
        frames = frames_of(STREAM)
        before = len(sent.messages)
        generation._take_frames(frames[:3])
        # Written before any task ran: the change itself sent them.
        assert len(sent.messages) == before + 1
        for frame in frames[3:]:
            generation._take_frames([frame])
        await asyncio.wait_for(task, 5)
        assert sent.messages[0]["type"] == "http.response.start"
        assert sent.ended
        assert sent.body == expected_body(generation, request)

    asyncio.run(run())


def test_a_send_that_waits_is_handed_to_the_task_and_nothing_is_lost_or_reordered() -> None:
    async def run() -> None:
        generation = Generation(opener_of, grace_s=0)
        _, request, sent, task = await started(generation)
        sent.blocked = asyncio.Event()
        frames = frames_of(STREAM)
        for frame in frames[:5]:  # the first write waits; the others must not go around it
            generation._take_frames([frame])
        await settle()
        writes_while_blocked = len(sent.messages)
        sent.blocked.set()
        await settle()
        # The handed write finished, then everything that arrived meanwhile in one write.
        assert len(sent.messages) == writes_while_blocked + 2
        sent.blocked = None
        for frame in frames[5:]:
            generation._take_frames([frame])
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
            generation._take_frames([frame])  # raises nothing, whoever fails
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
            generation._take_frames([frame])
            await asyncio.sleep(0.01)
        flowing = len(beats) - silent
        generation._take_frames(frames[-1:])
        await asyncio.wait_for(task, 5)
        return silent, flowing, sent

    silent, flowing, sent = asyncio.run(run())
    assert 2 <= silent <= 4
    assert flowing == 0
    assert sent.body.count(b": ") >= silent  # each heartbeat is an SSE comment


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
            generation._take_frames([frame])
            await asyncio.sleep(0.001)
        await asyncio.wait_for(task, 5)
        return response

    response = asyncio.run(run())
    assert len(armed) == 1  # armed once, for the first sleep; never moved by a write
    assert response._timer is not None
    assert response._timer.cancelled()  # the end leaves no timer behind

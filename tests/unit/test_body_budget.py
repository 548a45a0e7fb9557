"""``--max-bodies``: the request-body bytes held at once across connections (``BodyBudget``),
reserved as each body is read and given back however its reading ends."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from starlette.requests import ClientDisconnect

from prefixpin.core.errors import (
    BodiesFullError,
    ClientDisconnectedError,
    PayloadTooLargeError,
    error_response,
)
from prefixpin.proxy.cli import SERVE_FLAGS, build_parser, settings_from_args
from prefixpin.proxy.codecs.anthropic import error_body
from prefixpin.proxy.ops.logs import get_logger
from prefixpin.proxy.pipeline.validation import BodyBudget, read_body
from prefixpin.proxy.settings import Settings

pytestmark = pytest.mark.anyio


def budget(limit: int = 1024) -> BodyBudget:
    return BodyBudget(limit, get_logger())


async def chunks(*parts: bytes, gate: asyncio.Event | None = None,
                 fail: BaseException | None = None) -> AsyncIterator[bytes]:
    """``parts`` one by one; before the last, wait for ``gate``; after them, raise ``fail``."""
    for index, part in enumerate(parts):
        if gate is not None and index == len(parts) - 1:
            await gate.wait()
        yield part
    if fail is not None:
        raise fail


def test_reserve_release_and_refuse() -> None:
    """Up to the limit is held; a reservation that would pass it is refused and holds
    nothing; what is released is free again."""
    bodies = budget(1024)
    bodies.reserve(1000)
    bodies.reserve(24)
    assert bodies.held == 1024
    with pytest.raises(BodiesFullError):
        bodies.reserve(1)
    assert bodies.held == 1024
    bodies.release(1000)
    bodies.reserve(900)
    assert bodies.held == 924
    bodies.release(924)
    assert bodies.held == 0


def test_releasing_more_than_held_or_a_negative_size_is_a_bug() -> None:
    bodies = budget()
    bodies.reserve(10)
    with pytest.raises(ValueError, match="released"):
        bodies.release(11)
    with pytest.raises(ValueError, match="reservation of -1"):
        bodies.reserve(-1)
    assert bodies.held == 10


def test_the_refusal_is_a_503_with_retry_after_labelled_bodies_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "prefixpin")
    bodies = budget(2048)
    bodies.reserve(2000)
    with pytest.raises(BodiesFullError) as caught:
        bodies.reserve(100)
    exc = caught.value
    assert exc.status_code == 503
    assert exc.limit == "bodies"
    assert "--max-bodies" in exc.message
    assert exc.headers() == {"Retry-After": "1"}
    response = error_response(exc)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert error_body(exc)["error"]["type"] == "overloaded_error"
    [line] = [r for r in caplog.records if r.getMessage() == "request body refused"]
    assert line.levelno == logging.WARNING
    assert line.fields == {"limit": "bodies", "max_bodies": 2048, "held": 2000,  # type: ignore[attr-defined]
                           "wanted": 100}


def test_a_reservation_gives_back_all_it_grew_to_whatever_ends_its_block() -> None:
    bodies = budget(1024)
    with bodies.reservation() as held:
        held.grow_to(100)
        held.grow_to(50)  # holds 100 already: nothing more
        held.grow_to(300)
        assert bodies.held == held.size == 300
    assert bodies.held == 0
    def fail_holding(size: int) -> None:
        with bodies.reservation() as held:
            held.grow_to(size)
            raise RuntimeError

    with pytest.raises(RuntimeError):
        fail_holding(500)
    assert bodies.held == 0
    with bodies.reservation() as held:
        held.grow_to(1000)
        with pytest.raises(BodiesFullError):
            held.grow_to(1025)
        assert held.size == 1000  # a refused growth keeps what it held, until the end
    assert bodies.held == 0


async def test_read_body_reserves_the_declared_length_before_reading() -> None:
    bodies = budget(4096)
    gate = asyncio.Event()
    with bodies.reservation() as held:
        reading = asyncio.create_task(read_body(chunks(b"x" * 10, b"y" * 10, gate=gate),
                                                "3000", 8192, held))
        await asyncio.sleep(0.01)
        assert bodies.held == 3000  # the declared length, with 10 bytes read
        gate.set()
        assert await reading == b"x" * 10 + b"y" * 10
        assert bodies.held == 3000
    assert bodies.held == 0


async def test_read_body_reserves_a_streamed_body_as_its_chunks_arrive() -> None:
    bodies = budget(4096)
    gate = asyncio.Event()
    with bodies.reservation() as held:
        reading = asyncio.create_task(read_body(chunks(b"x" * 600, b"y" * 400, gate=gate),
                                                None, 8192, held))
        await asyncio.sleep(0.01)
        assert bodies.held == 600
        gate.set()
        assert len(await reading) == 1000
        assert bodies.held == 1000
    assert bodies.held == 0


async def test_read_body_refuses_a_body_that_would_pass_the_budget() -> None:
    """Declared: before a byte is read. Streamed: at the chunk that would pass it, which is
    not kept. Either way the budget is back to what it was once the block ends."""
    bodies = budget(2048)
    bodies.reserve(1024)  # another connection's body
    with pytest.raises(BodiesFullError), bodies.reservation() as held:
        await read_body(chunks(b"x"), "1500", 8192, held)
    assert bodies.held == 1024
    with pytest.raises(BodiesFullError), bodies.reservation() as held:
        await read_body(chunks(b"x" * 1000, b"y" * 1000), None, 8192, held)
    assert bodies.held == 1024


async def test_max_body_is_judged_before_the_budget() -> None:
    """A body over --max-body is a 413 (it will never fit), not a 503 (try again)."""
    bodies = budget(1024)
    with pytest.raises(PayloadTooLargeError), bodies.reservation() as held:
        await read_body(chunks(b"x"), "4096", 2048, held)
    with pytest.raises(PayloadTooLargeError), bodies.reservation() as held:
        await read_body(chunks(b"x" * 1000, b"x" * 1500), None, 2048, held)
    assert bodies.held == 0


async def test_a_disconnect_or_a_cancellation_mid_body_releases_its_reservation() -> None:
    bodies = budget(4096)
    with pytest.raises(ClientDisconnectedError), bodies.reservation() as held:
        await read_body(chunks(b"x" * 700, fail=ClientDisconnect()), None, 8192, held)
    assert bodies.held == 0

    async def read_forever() -> bytes:
        with bodies.reservation() as held:
            return await read_body(chunks(b"x" * 700, b"", gate=asyncio.Event()), "2000",
                                   8192, held)

    task = asyncio.create_task(read_forever())
    await asyncio.sleep(0.01)
    assert bodies.held == 2000
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert bodies.held == 0


async def test_concurrent_bodies_never_hold_more_than_the_budget_together() -> None:
    """Twenty bodies read at once, in chunks interleaved on the loop: those that fit are
    read whole, the rest refused; the budget never passes its limit and ends at 0."""
    bodies = budget(10_000)
    peak = 0

    async def body(index: int) -> bytes:
        nonlocal peak

        async def slow() -> AsyncIterator[bytes]:
            nonlocal peak
            for _ in range(10):
                await asyncio.sleep(0)
                peak = max(peak, bodies.held)
                yield bytes([index]) * 100

        with bodies.reservation() as held:
            declared = "1000" if index % 2 else None
            return await read_body(slow(), declared, 8192, held)

    results = await asyncio.gather(*(body(i) for i in range(20)), return_exceptions=True)
    served = [r for r in results if isinstance(r, bytes)]
    refused = [r for r in results if isinstance(r, BodiesFullError)]
    assert len(served) + len(refused) == 20
    assert served
    assert refused
    assert all(len(r) == 1000 for r in served)
    assert peak <= 10_000
    assert bodies.held == 0


def test_max_bodies_is_a_setting_a_flag_and_an_environment_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    default = Settings.model_fields["max_bodies_bytes"].default
    assert default == 256 * 1024 * 1024
    assert SERVE_FLAGS["--max-bodies"][0] == "max_bodies_bytes"
    args = build_parser().parse_args(["serve", "--upstream", "http://z:1",
                                      "--max-bodies", "65536"])
    assert settings_from_args(args).max_bodies_bytes == 65536
    monkeypatch.setenv("PREFIXPIN_MAX_BODIES_BYTES", "131072")
    assert Settings(upstream="http://z:1").max_bodies_bytes == 131072
    with pytest.raises(ValueError, match="max_bodies_bytes"):
        Settings(upstream="http://z:1", max_bodies_bytes=100)

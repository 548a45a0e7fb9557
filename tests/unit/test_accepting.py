"""Connections waiting on a listener are accepted in one turn of the loop
(``proxy.speed.accepting``), on uvloop as on asyncio's loop.

Each case lets clients connect while the loop is held (the kernel completes their
handshakes and queues them), then counts the loop's turns until every one of them has
been read. The turns are counted, not timed: under uvloop a listener alone takes one turn
per connection, and a turn of a loop relaying hundreds of streams is tens of
milliseconds.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import resource
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvicorn
import uvloop

from prefixpin.proxy.listen.server import _Follower
from prefixpin.proxy.speed.accepting import AcceptDrain

CLIENTS = 64
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


class Reader(asyncio.Protocol):
    """Counts the connections that sent their byte."""

    def __init__(self, read: list[int]) -> None:
        self.read = read

    def data_received(self, data: bytes) -> None:
        self.read.append(len(data))


def run(loop_name: str, main: Coroutine[Any, Any, int]) -> int:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        return runner.run(main)


def connect_while_held(port: int, sending: bytes = b"x") -> list[socket.socket]:
    """Clients connected and their first bytes sent, without yielding to the loop."""
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(CLIENTS)]
    for client in clients:
        client.sendall(sending)
    return clients


async def turns_until(done: Callable[[], bool], most: int = 1_000) -> int:
    turns = 0
    while not done() and turns < most:
        await asyncio.sleep(0)  # one turn of the loop, its poll included
        turns += 1
    return turns


async def sleep_while(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while condition():  # noqa: ASYNC110 (what it waits for has no event)
            await asyncio.sleep(0.02)


async def turns_to_read_waiting(drain: bool) -> int:
    loop, read = asyncio.get_running_loop(), list[int]()
    server = await loop.create_server(lambda: Reader(read), "127.0.0.1", 0, backlog=1024)
    (listening,) = server.sockets
    drains = [AcceptDrain(loop, listening.fileno(), lambda: Reader(read))] if drain else []
    clients = connect_while_held(listening.getsockname()[1])
    try:
        return await turns_until(lambda: len(read) == CLIENTS)
    finally:
        for each in drains:
            each.close()
        for client in clients:
            client.close()
        server.close()
        await server.wait_closed()


def test_uvloop_alone_accepts_one_waiting_connection_per_turn() -> None:
    """Why the drain is there (libuv 1.45 and later). Should a uvloop release accept them
    all again, this fails, and the drain can go."""
    assert run("uvloop", turns_to_read_waiting(drain=False)) >= CLIENTS


@pytest.mark.parametrize("loop_name", list(LOOPS))
def test_the_drain_accepts_every_waiting_connection_in_a_few_turns(loop_name: str) -> None:
    assert run(loop_name, turns_to_read_waiting(drain=True)) <= 8


def test_a_closed_drain_accepts_nothing_more() -> None:
    async def main() -> int:
        loop, read = asyncio.get_running_loop(), list[int]()
        listening = socket.create_server(("127.0.0.1", 0), backlog=1024)
        listening.setblocking(False)
        drain = AcceptDrain(loop, listening.fileno(), lambda: Reader(read))
        drain.close()
        drain.close()  # twice is once
        clients = connect_while_held(listening.getsockname()[1])
        await turns_until(lambda: False, most=20)
        for client in clients:
            client.close()
        listening.close()
        return len(read)

    assert run("uvloop", main()) == 0


def test_out_of_descriptors_the_drain_pauses_then_accepts_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    """An accept that fails for want of a descriptor is not tried again on every turn (a
    loop spinning on the listener, a log line each time): the drain waits, then accepts
    what still waits."""
    async def main() -> int:
        loop, read = asyncio.get_running_loop(), list[int]()
        listening = socket.create_server(("127.0.0.1", 0), backlog=1024)
        listening.setblocking(False)
        clients = connect_while_held(listening.getsockname()[1])
        drain = AcceptDrain(loop, listening.fileno(), lambda: Reader(read), pause_s=0.3)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            taken = {int(fd) for fd in os.listdir("/proc/self/fd")}
            lowest_free = next(n for n in itertools.count() if n not in taken)
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free + 8, hard))  # room for 8
            await turns_until(lambda: drain.paused)
            await turns_until(lambda: False, most=200)  # turns while out of descriptors
            assert drain.paused
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            await sleep_while(lambda: drain.paused)
            await turns_until(lambda: len(read) == CLIENTS)
            return len(read)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            drain.close()
            for client in clients:
                client.close()
            listening.close()

    with caplog.at_level(logging.WARNING):
        assert run("uvloop", main()) == CLIENTS
    assert [r.getMessage() for r in caplog.records].count("accepting paused") == 1


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hello"})


async def turns_to_answer_waiting(port: int) -> int:
    clients = connect_while_held(port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    for client in clients:
        client.setblocking(False)
    answered: set[int] = set()

    def all_answered() -> bool:
        for index, client in enumerate(clients):
            try:
                if b"hello" in client.recv(4096):
                    answered.add(index)
            except BlockingIOError:
                pass
        return len(answered) == CLIENTS

    try:
        return await turns_until(all_answered)
    finally:
        for client in clients:
            client.close()


def test_the_proxy_listener_answers_a_burst_of_waiting_connections_in_a_few_turns() -> None:
    """The listeners ``prefixpin serve`` runs (``proxy.listen.server``): each drains what waits on
    its socket from startup, and stops at shutdown."""
    async def main() -> int:
        server = _Follower(uvicorn.Config(hello, host="127.0.0.1", port=0, lifespan="off",
                                          log_level="error"))
        serving = asyncio.create_task(server.serve())
        try:
            await sleep_while(lambda: not server.started)  # (its address: on a thread)
            assert len(server.drains) == 1
            return await turns_to_answer_waiting(server.servers[0].sockets[0].getsockname()[1])
        finally:
            server.should_exit = True
            await serving
            assert server.drains == ()

    assert run("uvloop", main()) <= 8

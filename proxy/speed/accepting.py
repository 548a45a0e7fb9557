"""Every connection waiting on a listener, accepted in one turn of the loop.

libuv, under uvloop, accepts one connection each time its poll finds the listening socket
readable: one per turn of the loop (libuv 1.45 and later, libuv#3696, which leaves the rest
to level-triggered polling). A turn of a loop relaying hundreds of streams lasts tens of
milliseconds, so a burst of new connections waits a turn each, in the kernel's accept
queue, before the proxy reads a byte of them. asyncio's own loop accepts up to its backlog
in one turn.

``AcceptDrain`` watches a second descriptor of the same listening socket and, each time it
is readable, accepts what is waiting (up to ``max_per_turn``, so one turn stays short) and
hands each socket to the loop's own transport (``loop.connect_accepted_socket``), with the
listener's protocol. The server that owns the socket keeps its own watcher, its shutdown
and its connections' bookkeeping; a connection accepted by either is served the same way.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Callable

from prefixpin.proxy.ops.logs import get_logger, log_event

MAX_ACCEPTS_PER_TURN = 128
# Out of descriptors or kernel memory: the listener stops accepting for this long, as
# asyncio's loop does, instead of failing the same accept on every turn.
PAUSE_WHEN_EXHAUSTED_S = 1.0
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class AcceptDrain:
    """Accepts every connection waiting on ``listening_fd`` (a descriptor the caller keeps
    open; this one watches a duplicate of it) whenever the loop finds one there."""

    def __init__(self, loop: asyncio.AbstractEventLoop, listening_fd: int,
                 protocol_factory: Callable[[], asyncio.Protocol], *,
                 max_per_turn: int = MAX_ACCEPTS_PER_TURN,
                 pause_s: float = PAUSE_WHEN_EXHAUSTED_S) -> None:
        self._loop = loop
        self._factory = protocol_factory
        self._max_per_turn = max_per_turn
        self._pause_s = pause_s
        self._socket = socket.socket(fileno=os.dup(listening_fd))
        self._socket.setblocking(False)
        self._adopting: set[asyncio.Task[object]] = set()
        self._resume: asyncio.TimerHandle | None = None
        self._closed = False
        loop.add_reader(self._socket.fileno(), self._accept_waiting)

    @property
    def paused(self) -> bool:
        """Out of descriptors (or kernel memory) at the last accept, it waits to try again."""
        return self._resume is not None

    def close(self) -> None:
        """Stop accepting; connections already handed to the loop stay as they are."""
        if self._closed:
            return
        self._closed = True
        if self._resume is not None:
            self._resume.cancel()
        else:
            self._loop.remove_reader(self._socket.fileno())
        self._socket.close()

    def _accept_waiting(self) -> None:
        for _ in range(self._max_per_turn):
            try:
                connection, _ = self._socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # the client left while it waited: the next one
                continue
            except OSError as exc:
                if exc.errno in _EXHAUSTED:
                    self._pause(exc)
                else:
                    log_event(get_logger(), logging.ERROR, "accept failed", error=str(exc))
                return
            self._adopt(connection)

    def _adopt(self, connection: socket.socket) -> None:
        connection.setblocking(False)  # accept() gave it blocking; both loops want it not
        task: asyncio.Task[object] = self._loop.create_task(
            self._loop.connect_accepted_socket(self._factory, connection))
        self._adopting.add(task)
        task.add_done_callback(lambda done: self._adopted(done, connection))

    def _adopted(self, task: asyncio.Task[object], connection: socket.socket) -> None:
        self._adopting.discard(task)
        if task.cancelled():
            connection.close()
        elif (exc := task.exception()) is not None:
            connection.close()
            log_event(get_logger(), logging.WARNING, "accepted connection not served",
                      error=f"{type(exc).__name__}: {exc}")

    def _pause(self, exc: OSError) -> None:
        log_event(get_logger(), logging.WARNING, "accepting paused", error=str(exc),
                  seconds=self._pause_s)
        self._loop.remove_reader(self._socket.fileno())
        self._resume = self._loop.call_later(self._pause_s, self._go_on)

    def _go_on(self) -> None:
        self._resume = None
        self._loop.add_reader(self._socket.fileno(), self._accept_waiting)

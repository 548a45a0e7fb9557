"""A TCP relay between the proxy and an engine that records when each connection opens and
closes, and can inject network faults (refuse, reset, stall). Real sockets, on loopback.

``kill()`` cuts every open connection with a reset and refuses new ones until ``revive()``:
on the wire, what the proxy sees when the engine process dies (SIGKILL) and is restarted.

It answers questions a test cannot see from either end, such as "did the proxy close its
engine connection within a second of the client leaving?".
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tests.fakes.servers import free_port


@dataclass(slots=True)
class TapConnection:
    opened: float
    closed_by_client: float | None = None  # the proxy side sent FIN / closed
    closed: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    reset: float | None = None  # when the tap cut it (reset_after_bytes_down)


@dataclass(slots=True)
class TcpTap:
    target_host: str
    target_port: int
    port: int = field(default_factory=free_port)
    connections: list[TapConnection] = field(default_factory=list)
    reset_after_bytes_down: int | None = None  # cut every connection after this many bytes
    accept_delay_s: float = 0.0
    refusing: bool = False  # reset new connections at once (the engine is down)
    _loop: asyncio.AbstractEventLoop | None = None
    _live: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """Reset every open connection and refuse new ones (callable from any thread)."""
        self.refusing = True
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._abort_all(), self._loop).result(10)

    def revive(self) -> None:
        self.refusing = False

    async def _abort_all(self) -> None:
        for writer in list(self._live):
            writer.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        record = TapConnection(time.monotonic())
        self.connections.append(record)
        writers = [writer]
        self._live.add(writer)
        try:
            if self.refusing:
                writer.transport.abort()
                return
            if self.accept_delay_s:
                await asyncio.sleep(self.accept_delay_s)
            up_reader, up_writer = await asyncio.open_connection(self.target_host,
                                                                 self.target_port)
            writers.append(up_writer)
            self._live.add(up_writer)
            pumps = [asyncio.create_task(self._pump(reader, up_writer, record, upstream=True)),
                     asyncio.create_task(self._pump(up_reader, writer, record, upstream=False))]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in pumps:
                    task.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, asyncio.CancelledError):
            pass  # the target is down, a side went away, or the tap is stopping: close both
        finally:
            for w in writers:
                self._live.discard(w)
                with contextlib.suppress(Exception):
                    w.close()
            record.closed = time.monotonic()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    record: TapConnection, *, upstream: bool) -> None:
        while data := await reader.read(65536):
            if upstream:
                record.bytes_up += len(data)
            else:
                record.bytes_down += len(data)
                limit = self.reset_after_bytes_down
                if limit is not None and record.bytes_down > limit:
                    record.reset = time.monotonic()
                    transport = writer.transport
                    transport.abort()  # RST, as a crashed peer would
                    return
            writer.write(data)
            await writer.drain()
        if upstream:
            record.closed_by_client = time.monotonic()


@contextlib.contextmanager
def run_tap(target_host: str, target_port: int, **options: object) -> Iterator[TcpTap]:
    tap = TcpTap(target_host, target_port, **options)  # type: ignore[arg-type]
    ready = threading.Event()
    control: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def main() -> None:
        stop = asyncio.Event()
        server = await asyncio.start_server(tap._handle, "127.0.0.1", tap.port)
        tap._loop = asyncio.get_running_loop()
        control.append((tap._loop, stop))
        ready.set()
        async with server:
            await stop.wait()
            # A connection made just before the stop (the proxy's last health probe, say)
            # is accepted and refused while the server still serves: Python 3.11 drops the
            # socket of one accepted after server.close() unclosed (its transport asserts
            # the server is serving), a ResourceWarning.
            tap.refusing = True
            await asyncio.sleep(0.05)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.sleep(0.05)  # let the closed transports finish closing

    thread = threading.Thread(target=asyncio.run, args=(main(),), name=f"tcp-tap-{tap.port}",
                              daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("tcp tap did not start")
    try:
        yield tap
    finally:
        loop, stop = control[0]
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)

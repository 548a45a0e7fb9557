"""A TCP relay between the proxy and an engine that records when each connection opens and
closes, and can inject network faults (refuse, reset, stall). Real sockets, on loopback.

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

from proxy.testing.servers import free_port


@dataclass(slots=True)
class TapConnection:
    opened: float
    closed_by_client: float | None = None  # the proxy side sent FIN / closed
    closed: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass(slots=True)
class TcpTap:
    target_host: str
    target_port: int
    port: int = field(default_factory=free_port)
    connections: list[TapConnection] = field(default_factory=list)
    reset_after_bytes_down: int | None = None  # cut every connection after this many bytes
    accept_delay_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        record = TapConnection(time.monotonic())
        self.connections.append(record)
        if self.accept_delay_s:
            await asyncio.sleep(self.accept_delay_s)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host,
                                                                 self.target_port)
        except OSError:
            writer.close()
            record.closed = time.monotonic()
            return
        up = asyncio.create_task(self._pump(reader, up_writer, record, upstream=True))
        down = asyncio.create_task(self._pump(up_reader, writer, record, upstream=False))
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        for w in (writer, up_writer):
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
        control.append((asyncio.get_running_loop(), stop))
        ready.set()
        async with server:
            await stop.wait()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

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

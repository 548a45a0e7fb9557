"""A byte pipe (no HTTP parsing) on uvloop protocols: the floor of any Python relay here.

Copied to a throwaway tree as ``proxy/cli.py`` (with empty ``proxy/__init__.py`` and
``adapters/__init__.py``), run as ``python bench/load.py --streams 256 --burst-streams 0
--rounds 2 --tree /tmp/rawtree``: each client connection gets its own engine connection
and every byte is copied across; ``/healthz`` is answered here. Not part of prefixpin."""

from __future__ import annotations

import asyncio
import sys
from typing import cast

import uvloop

HEALTH = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 31\r\n\r\n"
          b'{"upstream": {"status": "ok"}}\n')


class Up(asyncio.Protocol):
    """The engine side: its bytes to the client as they come."""

    def __init__(self, down: asyncio.Transport) -> None:
        self.down = down
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.down.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.down.close()


class Down(asyncio.Protocol):
    """The client side: its bytes to its own engine connection."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.up: Up | None = None
        self.pending: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        asyncio.get_running_loop().create_task(self.connect())

    async def connect(self) -> None:
        assert self.transport is not None
        down = self.transport
        _, self.up = await asyncio.get_running_loop().create_connection(
            lambda: Up(down), self.host, self.port)
        assert self.up.transport is not None
        for data in self.pending:
            self.up.transport.write(data)
        self.pending = []

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if data.startswith(b"GET /healthz"):
            self.transport.write(HEALTH)
        elif self.up is None or self.up.transport is None:
            self.pending.append(data)
        else:
            self.up.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()


async def main() -> None:
    args = sys.argv[1:]
    upstream = args[args.index("--upstream") + 1]
    port = int(args[args.index("--port") + 1])
    host, upstream_port = upstream.split("//")[1].split(":")
    server = await asyncio.get_running_loop().create_server(
        lambda: Down(host, int(upstream_port)), "127.0.0.1", port)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main())

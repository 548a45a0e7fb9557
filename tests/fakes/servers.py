"""Run an ASGI app under a real uvicorn on a free loopback port, in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from prefixpin.proxy.listen.app import ProxyApps
from prefixpin.proxy.listen.server import serve_both


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the test runner owns signals
        pass


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> tuple[int, ...]:
    """``count`` distinct free ports: each socket stays bound until all are chosen (two
    calls of one port each may return the same one, as the kernel reuses it at once)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return tuple(int(sock.getsockname()[1]) for sock in sockets)


@contextlib.contextmanager
def serve_in_thread(app: ASGIApp, *, port: int | None = None, startup_timeout: float = 30.0,
                    **options: Any) -> Iterator[str]:
    """Yield the base URL of ``app`` served by uvicorn; shut it down on exit. ``options``
    go to ``uvicorn.Config`` (e.g. ``proxy.listen.http_limits.http_options()``, as served)."""
    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=3, lifespan="on",
                            **options)
    server = _Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn on port {port} did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


class ServedURL(str):
    """A served proxy's tenant base URL (it is the string); ``admin`` is its operator
    listener's, where ``/sessions``, ``/metrics`` and the status page live."""

    admin: str

    def __new__(cls, url: str, admin: str) -> ServedURL:
        served = super().__new__(cls, url)
        served.admin = admin
        return served


@contextlib.contextmanager
def serve_proxy(apps: ProxyApps, *, startup_timeout: float = 30.0,
                **options: Any) -> Iterator[ServedURL]:
    """Both listeners of ``apps`` under two uvicorn servers in one event loop, as
    ``prefixpin serve`` runs them (``proxy.listen.server``): the operator listener forwards
    through the lanes' engine clients, which belong to the loop the tenant's lifespan
    opened them in."""
    ports = free_ports(2)
    def config(app: ASGIApp, port: int, *, lifespan: bool) -> uvicorn.Config:
        return uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                              access_log=False, timeout_graceful_shutdown=3,
                              lifespan="on" if lifespan else "off", **options)

    servers = (_Server(config(apps.tenant_listener, ports[0], lifespan=True)),
               _Server(config(apps.operator_listener, ports[1], lifespan=False)))

    def run() -> None:
        asyncio.run(serve_both(*servers))

    thread = threading.Thread(target=run, name=f"uvicorn-{ports[0]}+{ports[1]}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not all(server.started for server in servers):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn on ports {ports} did not start")
        time.sleep(0.01)
    try:
        yield ServedURL(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}")
    finally:
        for server in servers:
            server.should_exit = True
        thread.join(15)

"""The one place prefixpin reaches into uvicorn beyond its public API, and the check that
what it reaches for is there.

The tenant listener (``proxy.listen.http_limits``) subclasses uvicorn's httptools protocol: it
bounds each request's head and body, and it gives each streamed response a writer that
bypasses ASGI's ``send`` on the hot path (``proxy.speed.client_writes``: a body chunk
written as a plain call), which reads the request's ``RequestResponseCycle`` to write as
``send`` would. Both listeners accept more than one connection per turn of the loop
(``proxy.speed.accepting``): that needs the server's listening sockets and the protocol
its startup gives the loop. None of this is a public API of uvicorn, so ``pyproject.toml``
pins uvicorn to the minor version these names were checked against, ``CHECKED_MINOR``,
and ``missing_internals`` (run by ``tests/unit/test_uvicorn_seam.py``) names any of them a
uvicorn release moved.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
from collections.abc import Callable
from importlib.metadata import version
from typing import Protocol

import uvicorn

CHECKED_MINOR = (0, 55)

# What the listener's protocol overrides (called by uvicorn) and reads of itself.
PROTOCOL_METHODS = ("connection_made", "connection_lost", "data_received",
                    "on_headers_complete", "on_message_complete", "send_400_response",
                    "shutdown")
PROTOCOL_ATTRIBUTES = ("connections", "cycle", "logger", "loop", "scope", "transport")
# What the body writers read of the request's cycle (and the listener sets: its keep_alive
# while the body is read), and of its flow control.
CYCLE_ATTRIBUTES = ("chunked_encoding", "disconnected", "flow", "keep_alive",
                    "response_complete", "response_started", "scope", "transport")
FLOW_ATTRIBUTES = ("write_paused",)
# What the accept drain reads of the server once it has started, and what it passes the
# protocol class, as the server's startup does.
SERVER_ATTRIBUTES = ("config", "lifespan", "server_state", "servers")
LIFESPAN_ATTRIBUTES = ("state",)
PROTOCOL_ARGUMENTS = ("config", "server_state", "app_state")


class FlowControl(Protocol):
    @property
    def write_paused(self) -> bool:
        """The socket's buffer is over its high-water mark: ``send`` waits for it."""
        ...


class ResponseCycle(Protocol):
    """uvicorn's ``RequestResponseCycle`` as the body writers read it: a response is
    writable without ``send`` while it is started and chunked, not complete, its client
    there and its socket draining."""

    @property
    def transport(self) -> asyncio.Transport: ...

    @property
    def chunked_encoding(self) -> bool | None: ...

    @property
    def response_complete(self) -> bool: ...

    @property
    def disconnected(self) -> bool: ...

    @property
    def flow(self) -> FlowControl: ...


def protocol_factory(server: uvicorn.Server) -> Callable[[], asyncio.Protocol]:
    """Each new connection's protocol, made as the started ``server`` makes it."""
    config, server_state, app_state = server.config, server.server_state, server.lifespan.state

    def create() -> asyncio.Protocol:
        protocol: asyncio.Protocol = config.http_protocol_class(  # type: ignore[call-arg]
            config=config, server_state=server_state, app_state=app_state)
        return protocol

    return create


def listening_descriptors(server: uvicorn.Server) -> list[int]:
    """The started ``server``'s listening sockets, by descriptor."""
    return [sock.fileno() for each in server.servers for sock in each.sockets]


def uvicorn_minor() -> tuple[int, int]:
    major, minor = version("uvicorn").split(".")[:2]
    return int(major), int(minor)


def missing_internals() -> list[str]:
    """Each internal this seam relies on that the installed uvicorn lacks, by name (empty
    when all are there): read from uvicorn's source, so a release that renames one fails
    the check here, by name, not a streamed response somewhere later."""
    from uvicorn import server
    from uvicorn.lifespan import off, on
    from uvicorn.protocols.http import flow_control, httptools_impl

    found: dict[str, set[str]] = {}
    for module in (httptools_impl, flow_control, server):
        found |= assigned_attributes(inspect.getsource(module))
    lifespans = {name: assigned_attributes(inspect.getsource(module))[name]
                 for name, module in (("LifespanOn", on), ("LifespanOff", off))}
    missing = [f"HttpToolsProtocol.{name}()" for name in PROTOCOL_METHODS
               if not callable(getattr(httptools_impl.HttpToolsProtocol, name, None))]
    for owner, names in (("HttpToolsProtocol", PROTOCOL_ATTRIBUTES),
                         ("RequestResponseCycle", CYCLE_ATTRIBUTES),
                         ("FlowControl", FLOW_ATTRIBUTES),
                         ("Server", SERVER_ATTRIBUTES)):
        missing += [f"{owner}.{name}" for name in names if name not in found.get(owner, ())]
    missing += [f"{owner}.{name}" for owner, names in lifespans.items()
                for name in LIFESPAN_ATTRIBUTES if name not in names]
    parameters = inspect.signature(httptools_impl.HttpToolsProtocol).parameters
    missing += [f"HttpToolsProtocol({name}=)" for name in PROTOCOL_ARGUMENTS
                if name not in parameters]
    return missing


def assigned_attributes(source: str) -> dict[str, set[str]]:
    """class name -> the ``self.<name>`` attributes its methods assign."""
    assigned: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        names = assigned.setdefault(node.name, set())
        for inner in ast.walk(node):
            targets = (inner.targets if isinstance(inner, ast.Assign)
                       else [inner.target] if isinstance(inner, ast.AnnAssign) else [])
            for target in targets:
                for leaf in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                            and leaf.value.id == "self"):
                        names.add(leaf.attr)
    return assigned

"""The embedded engine's worker process: llama.cpp loaded here, not in the proxy.

``python -m prefixpin.adapters.embedded.worker CONFIG_JSON SOCKET`` loads the model, binds the Unix
socket, writes one JSON line to stdout (``{"ready": true}`` or ``{"error": "..."}``) and
serves llama-server's HTTP API (``create_engine_app``) on the socket until its stdin
closes: the supervisor (``adapters.embedded.supervisor``) holds the other end, so a proxy
that dies, even by SIGKILL, takes its worker with it. A crash inside llama.cpp ends this
process only; the supervisor sees it and starts another.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import threading
from typing import Any

import uvicorn

from prefixpin.adapters.embedded.adapter import EngineConfig, create_engine_app
from prefixpin.adapters.embedded.errors import EmbeddedEngineError


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _exit_when_stdin_closes() -> None:
    """The supervisor's end of stdin closes when the proxy exits, however it exits."""
    def watch() -> None:
        sys.stdin.buffer.read()
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _bind(path: str) -> socket.socket:
    with_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with_socket.bind(path)
    os.chmod(path, 0o600)
    with_socket.listen(128)
    return with_socket


def serve(config: EngineConfig, socket_path: str) -> int:
    _exit_when_stdin_closes()
    try:
        app = create_engine_app(config)
    except EmbeddedEngineError as exc:
        _say({"error": str(exc)})
        return 2
    listening = _bind(socket_path)
    _say({"ready": True, "pid": os.getpid()})
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           lifespan="on", timeout_graceful_shutdown=5))
    asyncio.run(server.serve(sockets=[listening]))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m adapters.embedded.worker CONFIG_JSON SOCKET", file=sys.stderr)
        return 64
    logging.basicConfig(level=logging.WARNING, format="[prefixpin engine] %(message)s")
    logging.getLogger("prefixpin.embedded").setLevel(logging.INFO)  # the CPU paths line
    logging.getLogger("prefixpin.embedded.llama").setLevel(logging.WARNING)
    return serve(EngineConfig.from_json(argv[0]), argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

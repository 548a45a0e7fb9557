"""A real ``redis-server`` (Debian's package) on a free loopback port, for tests and benches.

The shared state of several proxy replicas lives in Redis (``--redis URL``); the tests and
the multi-backend bench start their own server with persistence off, in a temporary
directory, and stop it when done.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.rig._process import apt_install, free_port, log_tail, stop_process

BINARY = "redis-server"


@dataclass(slots=True)
class RedisProcess:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)


def find_redis_server() -> Path | None:
    found = shutil.which(BINARY)
    return Path(found) if found else None


def ensure_redis_server(*, quiet: bool = False) -> Path | None:
    """The redis-server binary, installed from Debian's packages when missing and possible."""
    found = find_redis_server()
    if found is not None:
        return found
    if not apt_install("redis-server", "the replica tests", quiet=quiet):
        return None
    return find_redis_server()


@contextlib.contextmanager
def run_redis_server(*, port: int | None = None,
                     startup_timeout: float = 20.0) -> Iterator[RedisProcess]:
    """redis-server on 127.0.0.1 only, no persistence, stopped (and its files removed) on
    exit. Raises ``RuntimeError`` when the binary is missing and cannot be installed."""
    binary = ensure_redis_server()
    if binary is None:
        raise RuntimeError("redis-server is not installed (Debian package redis-server)")
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="prefixpin-redis-") as tmp:
        log_path = Path(tmp) / "redis.log"
        command = [str(binary), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                   "--appendonly", "no", "--dir", tmp, "--logfile", str(log_path),
                   "--protected-mode", "yes"]
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        handle = RedisProcess(f"redis://127.0.0.1:{port}/0", port, process, log_path)
        try:
            _wait_ready(handle, startup_timeout)
            yield handle
        finally:
            stop_process(handle.process)


def _wait_ready(handle: RedisProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {handle.process.returncode}:\n"
                               f"{handle.log_tail()}")
        with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", handle.port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            if sock.recv(16).startswith(b"+PONG"):
                return
        time.sleep(0.05)
    raise TimeoutError(f"redis-server not ready after {timeout} s:\n{handle.log_tail()}")

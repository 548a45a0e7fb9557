"""A proxy replica as its own process (``prefixpin serve``), for replica tests and benches."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from proxy.rig.llama_process import free_port


@dataclass(slots=True)
class ReplicaProcess:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no cleanup, connections simply drop."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def start_replica(upstreams: Sequence[str], log_path: Path, *, redis: str | None = None,
                  replica_id: str | None = None, args: Sequence[str] = (),
                  env: Mapping[str, str] | None = None, port: int | None = None,
                  startup_timeout: float = 60.0) -> ReplicaProcess:
    """``prefixpin serve`` on a free loopback port; returns once /healthz says every
    upstream answers (or raises with the log's tail)."""
    port = port or free_port()
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port)]
    for url in upstreams:
        argv += ["--upstream", url]
    if redis is not None:
        argv += ["--redis", redis]
    if replica_id is not None:
        argv += ["--replica-id", replica_id]
    argv += list(args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                   cwd=Path(__file__).resolve().parents[2])
    handle = ReplicaProcess(f"http://127.0.0.1:{port}", port, process, log_path)
    try:
        _wait_ready(handle, len(upstreams), startup_timeout)
    except BaseException:
        handle.stop()
        raise
    return handle


@contextlib.contextmanager
def run_replica(upstreams: Sequence[str], log_path: Path, **options: object
                ) -> Iterator[ReplicaProcess]:
    handle = start_replica(upstreams, log_path, **options)  # type: ignore[arg-type]
    try:
        yield handle
    finally:
        handle.stop()


def _wait_ready(handle: ReplicaProcess, n_upstreams: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            raise RuntimeError(f"prefixpin exited with {handle.process.returncode}:\n"
                               f"{handle.log_tail()}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = httpx.get(f"{handle.url}/healthz", timeout=2.0)
            body = response.json()
            upstreams = body.get("upstreams") or [body.get("upstream") or {}]
            if response.status_code == 200 and len(upstreams) == n_upstreams and all(
                    u.get("status") == "ok" for u in upstreams):
                return
        time.sleep(0.1)
    raise TimeoutError(f"prefixpin not ready after {timeout} s:\n{handle.log_tail()}")

"""A proxy replica as its own process (``prefixpin serve``), for replica tests and benches."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.rig._process import free_port, kill_process, log_tail, stop_process


@dataclass(slots=True)
class ReplicaProcess:
    url: str  # the tenant port
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    admin_url: str  # the operator listener: /sessions, /metrics, engine paths

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no cleanup, connections simply drop."""
        kill_process(self.process)

    def stop(self) -> None:
        stop_process(self.process, grace_s=15)


def start_replica(upstreams: Sequence[str], log_path: Path, *, redis: str | None = None,
                  replica_id: str | None = None, args: Sequence[str] = (),
                  env: Mapping[str, str] | None = None, port: int | None = None,
                  startup_timeout: float = 60.0,
                  program: Sequence[str] = (sys.executable, "-m", "prefixpin.proxy.cli"),
                  cwd: Path | None = None, operator: bool = True) -> ReplicaProcess:
    """``prefixpin serve`` on a free loopback port (no upstreams: the embedded engine);
    returns once /healthz says every engine answers (or raises with the log's tail).
    ``program`` runs it another way, e.g. as the installed ``prefixpin`` console script;
    ``cwd`` (default: this repository) another checkout's ``python -m prefixpin.proxy.cli``;
    ``operator=False`` for a checkout from before the operator listener (its views are on
    its one port)."""
    port = port or free_port()
    admin_port = free_port() if operator else port
    argv = [*program, "serve", "--host", "127.0.0.1", "--port", str(port)]
    if operator:
        argv += ["--admin-listen", f"127.0.0.1:{admin_port}"]
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
                                   cwd=cwd or Path(__file__).resolve().parents[2])
    handle = ReplicaProcess(f"http://127.0.0.1:{port}", port, process, log_path,
                            f"http://127.0.0.1:{admin_port}")
    try:
        _wait_ready(handle, max(1, len(upstreams)), startup_timeout)
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


def _wait_ready(handle: ReplicaProcess, n_engines: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            raise RuntimeError(f"prefixpin exited with {handle.process.returncode}:\n"
                               f"{handle.log_tail()}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = httpx.get(f"{handle.url}/healthz", timeout=2.0)
            body = response.json()
            upstreams = body.get("upstreams") or [body.get("upstream") or {}]
            if response.status_code == 200 and len(upstreams) == n_engines and all(
                    u.get("status") == "ok" for u in upstreams):
                return
        time.sleep(0.1)
    raise TimeoutError(f"prefixpin not ready after {timeout} s:\n{handle.log_tail()}")

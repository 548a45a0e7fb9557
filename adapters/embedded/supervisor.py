"""The embedded engine's worker process, kept running: started, watched, restarted.

llama.cpp runs in a worker process (``adapters.embedded.worker``) so that a crash inside
it, whatever its cause, ends the worker and not the proxy: the streams it was serving lose
their connection (each client gets a clean error event), the other lanes never notice,
and the supervisor starts a new worker. The proxy's engine watch then sees a new process
start time and does what it does for any engine restart: forgets what the slots held,
so a session returns through its park file.

A worker that fails before it is ready at the first start is an error (``ModelLoadError``,
with the signal that killed it and what to try); once the engine has served, every exit
that the supervisor did not ask for is a crash, and restarts back off from 0.5 s to 30 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prefixpin.adapters.embedded.adapter import EngineConfig
from prefixpin.adapters.embedded.errors import ModelLoadError

_LOG = logging.getLogger("prefixpin.embedded")

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a worker that served this long resets the backoff
STOP_GRACE_S = 10.0


def describe_exit(returncode: int) -> str:
    """``-11`` -> "killed by SIGSEGV"; ``2`` -> "exited with status 2"."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


CRASH_HINT = ("if it dies in its first decode, try --repack off (llama.cpp's repacked CPU "
              "kernels) and tell us the CPU: prefixpin doctor")


@dataclass(frozen=True, slots=True)
class Crash:
    at: float  # wall clock
    how: str  # describe_exit

    def line(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.at))
        return f"the embedded engine's worker {self.how} at {stamp}"


class _Worker:
    """One worker process and its ready line."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.process.pid

    async def ready(self) -> None:
        """Wait for the worker's ready line; ``ModelLoadError`` if it says why not or dies."""
        stdout = self.process.stdout
        assert stdout is not None
        line = await stdout.readline()
        message = _parse(line)
        if message.get("ready") is True:
            return
        if "error" in message:
            await self.process.wait()
            raise ModelLoadError(str(message["error"]))
        returncode = await self.process.wait()
        raise ModelLoadError(f"the embedded engine's worker {describe_exit(returncode)} "
                             f"while loading the model; {CRASH_HINT}")

    async def stop(self) -> None:
        """SIGTERM (uvicorn's graceful shutdown frees the model), then SIGKILL."""
        process = self.process
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                async with asyncio.timeout(STOP_GRACE_S):
                    await process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if process.stdin is not None:
            process.stdin.close()


def _parse(line: bytes) -> dict[str, object]:
    try:
        message = json.loads(line)
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


class EngineSupervisor:
    """Starts the worker, restarts it after a crash, stops it on ``aclose``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._dir = Path(tempfile.mkdtemp(prefix="prefixpin-engine-"))  # 0700: ours alone
        self.socket_path = self._dir / "engine.sock"
        self._worker: _Worker | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._closing = False
        self.restarts = 0
        self.last_crash: Crash | None = None
        self.state = "starting"

    @property
    def pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    def fault(self) -> str | None:
        """What is wrong with the engine now, in a line (None while it serves)."""
        if self.state == "running" or self.last_crash is None:
            return None
        return f"{self.last_crash.line()}; {self.state} ({CRASH_HINT})"

    async def start(self) -> None:
        """The first worker, ready; then the watch that restarts it."""
        self._worker = await self._spawn()
        self.state = "running"
        self._watcher = asyncio.create_task(self._watch(), name="embedded-engine-supervisor")

    async def _spawn(self) -> _Worker:
        self.socket_path.unlink(missing_ok=True)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prefixpin.adapters.embedded.worker", self.config.to_json(),
            str(self.socket_path), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            # Its own session: a terminal's Ctrl-C reaches the proxy, which stops the worker
            # in order, instead of ending the worker first (which would read as a crash).
            start_new_session=True)
        worker = _Worker(process)
        try:
            await worker.ready()
        except BaseException:
            await worker.stop()
            raise
        return worker

    async def _watch(self) -> None:
        backoff = FIRST_BACKOFF_S
        while True:
            worker = self._worker
            assert worker is not None
            returncode = await worker.process.wait()
            if self._closing:
                return
            self._crashed(describe_exit(returncode))
            if time.monotonic() - worker.started > STABLE_S:
                backoff = FIRST_BACKOFF_S
            self._worker = await self._restart(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _crashed(self, how: str) -> None:
        self.last_crash = Crash(time.time(), how)
        self.state = "restarting"
        _LOG.error("%s; restarting it (%s)", self.last_crash.line(), CRASH_HINT)

    async def _restart(self, backoff: float) -> _Worker:
        """A new worker, retried with growing pauses until one is ready."""
        while True:
            await asyncio.sleep(backoff)
            try:
                worker = await self._spawn()
            except ModelLoadError as exc:
                self.last_crash = Crash(time.time(), str(exc))
                _LOG.error("the embedded engine did not come back: %s", exc)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            self.restarts += 1
            self.state = "running"
            _LOG.warning("the embedded engine is back (worker pid %d, restart %d)",
                         worker.pid, self.restarts)
            return worker

    async def aclose(self) -> None:
        self._closing = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self._worker is not None:
            await self._worker.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

"""The processes a run owns (llama-server, managed proxy arms) and the engine's HTTP API.

Every process is started with an explicit argv, logs to a file, is waited for on its
health URL, and is stopped by its own pid (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

JSON = dict[str, Any]
_METRIC_LINE = re.compile(r"^(llamacpp:[a-z_]+)\s+([0-9.eE+-]+)$", re.MULTILINE)


class EngineError(RuntimeError):
    """A managed process would not start, or the engine API answered unexpectedly."""


@dataclass(slots=True)
class ManagedProcess:
    """One child process: ``start`` waits until ``health_url`` answers 200."""

    name: str
    argv: list[str]
    health_url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 120.0
    _process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self._process is not None:
            raise EngineError(f"{self.name} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env}, start_new_session=True)
        self._wait_healthy()

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)

    def cpu_seconds(self) -> float | None:
        """User + system CPU time the process has used so far (Linux /proc), if running."""
        if self._process is None:
            return None
        try:
            fields = Path(f"/proc/{self._process.pid}/stat").read_text().rsplit(")", 1)[1]
        except OSError:
            return None
        utime, stime = fields.split()[11:13]  # fields 14 and 15 of proc(5)
        return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")

    def restart(self) -> None:
        self.stop()
        self.start()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise EngineError(f"{self.name} exited with {self._process.returncode} during "
                                  f"start-up; see {self.log_path}")
            try:
                if httpx.get(self.health_url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise EngineError(f"{self.name} not healthy after {self.startup_timeout_s:.0f} s; "
                          f"see {self.log_path}")


def llama_server_argv(binary: Path, model: Path, port: int, slot_dir: Path,
                      extra: list[str]) -> list[str]:
    """The bench's llama-server: 2 slots of 8k, slot API and metrics on, loopback only."""
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-c", "16384", "-np", "2", "--slot-save-path", str(slot_dir), "--metrics",
            *extra]


class EngineAPI:
    """The llama-server behind every arm: its props, slots and counters."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def props(self) -> JSON:
        return self._get("/props").json()  # type: ignore[no-any-return]

    def total_slots(self) -> int:
        return int(self.props()["total_slots"])

    def erase_slots(self) -> None:
        """Empty every slot's KV (needs --slot-save-path; the RAM cache is not cleared)."""
        for slot in range(self.total_slots()):
            response = httpx.post(f"{self.url}/slots/{slot}?action=erase", timeout=30)
            if response.status_code != 200:
                raise EngineError(f"erasing slot {slot} failed ({response.status_code}): "
                                  f"{response.text[:200]}; start llama-server with "
                                  "--slot-save-path, or use --reset restart")

    def counters(self) -> dict[str, float]:
        """llama-server's ``/metrics`` counters (empty when it runs without --metrics)."""
        try:
            response = httpx.get(f"{self.url}/metrics", timeout=10)
        except httpx.HTTPError:
            return {}
        if response.status_code != 200:
            return {}
        return {name: float(value) for name, value in _METRIC_LINE.findall(response.text)}

    def _get(self, path: str) -> httpx.Response:
        try:
            response = httpx.get(f"{self.url}{path}", timeout=30)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise EngineError(f"GET {self.url}{path} failed: {exc}") from exc
        return response

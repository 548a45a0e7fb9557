"""What every process the rig starts needs: a free port, its log's tail, a clean stop, and
its binary from Debian's packages when it is missing."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.fakes.servers import free_port

__all__ = ["apt_install", "free_port", "kill_process", "log_tail", "stop_process"]


def log_tail(path: Path, lines: int) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def kill_process(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL, as a crash: no shutdown, no cleanup, connections simply drop."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGKILL)
    process.wait(10)


def stop_process(process: subprocess.Popen[bytes], grace_s: float = 10) -> None:
    """SIGTERM, then SIGKILL if it is still running after ``grace_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            kill_process(process)


def apt_install(package: str, purpose: str, *, quiet: bool) -> bool:
    """Install a Debian package when apt-get is there and this is root; False otherwise."""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        if not quiet:
            print(f"[prefixpin rig] {package} not found; install Debian's `{package}` "
                  f"package for {purpose}", file=sys.stderr)
        return False
    if not quiet:
        print(f"[prefixpin rig] installing {package} (apt-get)", file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", package], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return True

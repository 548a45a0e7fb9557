"""Headless Chromium for the status page test (Debian's package; no browser download)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> Path | None:
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return Path(found)
    return None


def ensure_chromium(*, quiet: bool = False) -> Path | None:
    """The Chromium binary, installed from Debian's packages when missing and possible."""
    found = find_chromium()
    if found is not None:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        if not quiet:
            print("[prefixpin rig] chromium not found; install Debian's `chromium` package "
                  "for the status page test", file=sys.stderr)
        return None
    if not quiet:
        print("[prefixpin rig] installing chromium (apt-get)", file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return find_chromium()


def headless_args(user_data_dir: Path) -> list[str]:
    # As the machine notes advise: no background networking (connections are refused
    # here), no sandbox (root), a fresh profile.
    return ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={user_data_dir}"]

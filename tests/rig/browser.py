"""Headless Chromium for the status page test (Debian's package; no browser download)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.rig._process import apt_install

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
    if not apt_install("chromium", "the status page test", quiet=quiet):
        return None
    return find_chromium()


def headless_args(user_data_dir: Path) -> list[str]:
    # As the machine notes advise: no background networking (connections are refused
    # here), no sandbox (root), a fresh profile.
    return ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={user_data_dir}"]

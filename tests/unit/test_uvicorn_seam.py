"""The uvicorn internals the tenant listener reads (``proxy.speed.uvicorn_seam``) are where it
reads them, in the uvicorn installed: a release that moves one fails here, by name."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from prefixpin.proxy.speed.uvicorn_seam import (
    CHECKED_MINOR,
    assigned_attributes,
    missing_internals,
    uvicorn_minor,
)

ROOT = Path(__file__).resolve().parents[2]


def test_every_internal_the_listener_reads_is_in_the_installed_uvicorn() -> None:
    assert missing_internals() == []


def test_the_installed_uvicorn_is_the_minor_version_the_seam_was_checked_against() -> None:
    assert uvicorn_minor() == CHECKED_MINOR, (
        f"uvicorn {uvicorn_minor()} is installed; proxy/speed/uvicorn_seam.py was checked "
        f"against {CHECKED_MINOR}: check its internals, then move the pin and CHECKED_MINOR")


def test_pyproject_pins_uvicorn_to_the_checked_minor_version() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "dependencies"]
    (pin,) = [d for d in dependencies if re.match(r"uvicorn\b", d)]
    major, minor = CHECKED_MINOR
    assert pin == f"uvicorn>={major}.{minor},<{major}.{minor + 1}"


def test_the_check_sees_a_renamed_attribute() -> None:
    """The source reading is not vacuous: an attribute assigned under another name, or
    only read, is missing."""
    source = '''
class RequestResponseCycle:
    def __init__(self, flow):
        self.flow = flow
        self.response_complete, self.disconnected = False, False
        self.chunked: bool | None = None
        print(self.transport)
'''
    assigned = assigned_attributes(source)["RequestResponseCycle"]
    assert {"flow", "response_complete", "disconnected", "chunked"} <= assigned
    assert "chunked_encoding" not in assigned
    assert "transport" not in assigned

"""Counts a suite prints in the test output, past pytest's capture (the issues ask to see
how many inputs, faults and events a suite tried, even when it passes)."""

from __future__ import annotations

import pytest


def print_uncaptured(request: pytest.FixtureRequest, text: str) -> None:
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        print(text)
        return
    with capture.global_and_fixture_disabled():
        print(text)

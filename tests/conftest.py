"""Shared fixtures. The anyio backend is asyncio (the proxy's own loop)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"

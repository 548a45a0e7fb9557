"""Shared fixtures. The anyio backend is asyncio (the proxy's own loop)."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pytest_unconfigure(config: pytest.Config) -> None:
    # llama-cpp-python opens /dev/null twice at import and never closes it: an "unclosed
    # file" ResourceWarning at interpreter exit, after the run, on every run that loaded it.
    utils = sys.modules.get("llama_cpp._utils")
    for name in ("outnull_file", "errnull_file"):
        handle = getattr(utils, name, None)
        if handle is not None:
            handle.close()

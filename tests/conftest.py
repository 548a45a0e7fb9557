"""Shared fixtures. The anyio backend is asyncio (the proxy's own loop).

The real parts end-to-end tests need go through ``tests.rig.parts``: missing, they skip the
test on a developer's machine and fail it under CI (``CI`` set).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.coverage_gate import PLUGIN_NAME, CoverageGate
from tests.rig.parts import require_chromium, require_llama_cpp, require_redis_server


@pytest.fixture
def tenant_file(tmp_path: Path) -> Callable[..., Path]:
    """Writes a tenants file (``--tenants``) in which each key given is a tenant of that
    name; its path."""
    def write(*keys: str) -> Path:
        path = tmp_path / "tenants.toml"
        path.write_text("[tenants]\n" + "".join(f'"{k}" = "{k}"\n' for k in keys))
        return path

    return write


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def redis_server_binary() -> Path:
    """Debian's redis-server (``pytest.mark.usefixtures`` it in the replica tests)."""
    return require_redis_server()


@pytest.fixture(scope="session")
def chromium_binary() -> Path:
    """Headless Chromium, for the status page test."""
    return require_chromium()


def pytest_runtest_setup(item: pytest.Item) -> None:
    # The ``embedded`` marker: the test runs the embedded engine, on llama-cpp-python.
    if item.get_closest_marker("embedded") is not None:
        require_llama_cpp()


def pytest_unconfigure(config: pytest.Config) -> None:
    # llama-cpp-python opens /dev/null twice at import and never closes it: an "unclosed
    # file" ResourceWarning at interpreter exit, after the run, on every run that loaded it.
    utils = sys.modules.get("llama_cpp._utils")
    for name in ("outnull_file", "errnull_file"):
        handle = getattr(utils, name, None)
        if handle is not None:
            handle.close()


def pytest_configure(config: pytest.Config) -> None:
    # The coverage gate (tests/coverage_gate.py): a run of the whole suite fails when line+branch
    # coverage of prefixpin falls under its gates; a run of some tests only is never gated.
    config.pluginmanager.register(CoverageGate(config), PLUGIN_NAME)

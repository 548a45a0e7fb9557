"""The real parts the end-to-end tests run on, and what a missing one does.

On a developer's machine a missing part (redis-server, chromium, llama-cpp-python) skips
the tests that need it, with the reason; llama-server and the test models are built and
fetched on demand. Under CI (``CI`` set, as ``.ci/run`` runs) the prepare step has run
first, so a missing part means the rig is broken: the test fails, naming the part and the
command that provides it, and nothing is built or fetched in the middle of a test run.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import NoReturn

PREPARE = "python -m tests.rig prepare"


def on_ci() -> bool:
    """``CI`` is set to something other than an explicit no."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing_part(part: str, remedy: str = f"run `{PREPARE}`") -> NoReturn:
    """Skip the test (locally) or fail it (under CI): ``part`` is not on this machine.

    Usable at module level too (a skip then skips the whole module; a failure under CI is
    a collection error, which fails the run)."""
    import pytest  # the rig's process helpers serve the benches too, without pytest

    message = f"{part} is missing: {remedy}"
    if on_ci():
        pytest.fail(f"{message} (CI: a missing real part fails the test)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require_redis_server() -> Path:
    from tests.rig.redis_process import find_redis_server

    return find_redis_server() or missing_part(
        "redis-server", f"run `{PREPARE}` as root (it installs Debian's redis-server)")


def require_chromium() -> Path:
    from tests.rig.browser import find_chromium

    return find_chromium() or missing_part(
        "chromium", f"run `{PREPARE}` as root (it installs Debian's chromium)")


def require_llama_cpp() -> None:
    """llama-cpp-python, the embedded engine's library (the ``embedded`` extra)."""
    if importlib.util.find_spec("llama_cpp") is None:
        missing_part("llama-cpp-python",
                     "install the embedded extra (`.venv/bin/pip install -e '.[embedded,test]'`, "
                     f"as the README's test command does), then run `{PREPARE}`")


def prepared(path: Path, part: str) -> Path:
    """``path`` when it exists; under CI a missing one fails the test (the prepare step
    makes it), elsewhere the caller builds or fetches it on demand."""
    if on_ci() and not path.exists():
        missing_part(f"{part} ({path})")
    return path

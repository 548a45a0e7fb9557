"""``python -m proxy.rig prepare``: build llama-server, fetch the test models, and install
headless Chromium (Debian's package, when running as root) for the status page test."""

from __future__ import annotations

import sys

from proxy.rig.browser import ensure_chromium
from proxy.rig.llama_build import ensure_llama_server
from proxy.rig.models import MODELS, ensure_model


def main(argv: list[str]) -> int:
    if argv[:1] != ["prepare"]:
        print("usage: python -m proxy.rig prepare", file=sys.stderr)
        return 2
    for name in MODELS:
        print(ensure_model(name))
    print(ensure_llama_server())
    print(ensure_chromium() or "chromium: not installed (status page test will fail)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""``python -m proxy.rig prepare``: build llama-server and fetch the test models."""

from __future__ import annotations

import sys

from proxy.rig.llama_build import ensure_llama_server
from proxy.rig.models import MODELS, ensure_model


def main(argv: list[str]) -> int:
    if argv[:1] != ["prepare"]:
        print("usage: python -m proxy.rig prepare", file=sys.stderr)
        return 2
    for name in MODELS:
        print(ensure_model(name))
    print(ensure_llama_server())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

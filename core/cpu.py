"""The CPU's instruction-set extensions, and which of llama.cpp's CPU paths prefixpin avoids.

llama.cpp compiled with ``-march=native`` on a CPU with AMX (every Xeon since Sapphire
Rapids, and the host CPUs of most GPU servers) moves the weights of supported quant types
into its ``AMX`` buffer and multiplies them with tile instructions
(``ggml/src/ggml-cpu/amx/mmq.cpp``). That path is unsafe as built here: its tile
configuration is a stack struct passed to ``_tile_loadconfig``, whose inline assembly in
GCC's ``amxtileintrin.h`` (GCC 12 on this project's machines) declares that it reads only
the first 8 bytes. GCC then drops every store to the tile rows and column widths, so
``ldtilecfg`` loads a configuration with no tile set (``tests/unit/test_cpu.py`` compiles
the function and reads the assembly). The result depends on what the calling thread's
stack and tile state hold: llama-cpp-python's high-level API happened to survive it, while
llama-server and prefixpin's slot threads died with a general protection fault on their
first decode. llama.cpp's own reports: ggml-org/llama.cpp#20824 (open), the unmerged fix
#26954 (the config moved to ``.rodata``).

So prefixpin never takes that path: the rig builds llama-server with ``-mno-amx-*`` (the
AMX kernels are not compiled), and the embedded engine, whose library pip builds natively,
loads its model without llama.cpp's extra buffer types when the library has AMX compiled
in (llama-server's ``--no-repack``). Everything else ``-march=native`` gives (AVX-512,
VNNI, BF16) stays on.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

# GCC options that keep llama.cpp's AMX kernels out of a -march=native build: an explicit
# -mno-* wins over what -march enables, whichever comes first on the command line.
NO_AMX_CFLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The ``flags`` of the first processor in a /proc/cpuinfo text (x86)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags; empty where /proc/cpuinfo is missing or has none."""
    try:
        return parse_flags(CPUINFO.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return frozenset()


def has_amx(flags: frozenset[str] | None = None) -> bool:
    return "amx_int8" in (cpu_flags() if flags is None else flags)


def flags_digest(flags: frozenset[str] | None = None) -> str:
    """A short digest of the CPU's flags: a native build is only run where they match."""
    text = " ".join(sorted(cpu_flags() if flags is None else flags))
    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


def library_has_amx(system_info: str) -> bool:
    """llama.cpp's ``llama_print_system_info()`` says ``AMX_INT8 = 1`` when its CPU backend
    was compiled with the AMX kernels (and so may move weights into the AMX buffer)."""
    return "AMX_INT8 = 1" in system_info


AMX_CRASH = ("this CPU has AMX (amx_int8): llama.cpp's AMX kernels, which weight repacking "
             "takes, crash as GCC builds them (a general protection fault in "
             "libggml-cpu at the first decode: core/cpu.py)")


def crash_advice() -> str:
    """What to try when an engine stops answering: it may have crashed. Said without
    knowing the engine's host, which may not be this one (its CPU flags are not ours)."""
    return ("If it crashed with a 'general protection fault ... libggml-cpu' in dmesg on a CPU "
            "with AMX (amx_int8 in /proc/cpuinfo), restart it with --no-repack: llama.cpp's "
            "AMX kernels crash as GCC builds them (core/cpu.py); otherwise its own log says "
            "where.")

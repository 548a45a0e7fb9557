"""Which of llama.cpp's CPU paths the embedded engine takes, chosen once at start.

llama.cpp moves the weights of some quant types into "extra" buffer types at load time:
``AMX`` (Intel's tile instructions) and ``CPU_REPACK`` (interleaved rows for AVX2/AVX-512
and ARM kernels). pip builds llama-cpp-python with ``-march=native``, so on a CPU with AMX
its library has the AMX kernels, which crash as GCC builds them (``core.cpu`` says why).
``auto`` therefore loads without extra buffer types there (llama-server's ``--no-repack``)
and keeps llama.cpp's default everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prefixpin.core.cpu import library_has_amx

Repack = Literal["auto", "on", "off"]

# The features of llama_print_system_info() worth a line at start (it lists ~30).
_SHOWN = ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8", "NEON", "REPACK")


@dataclass(frozen=True, slots=True)
class CpuPaths:
    repack: bool  # llama.cpp's extra buffer types (AMX, CPU_REPACK) in use
    reason: str
    features: tuple[str, ...]  # the library's compiled-in CPU features among _SHOWN

    def summary(self) -> str:
        return f"repack {'on' if self.repack else 'off'}: {self.reason}"

    def line(self) -> str:
        shown = " ".join(self.features) or "none of " + ", ".join(_SHOWN)
        return f"llama.cpp CPU paths: {shown}; weight {self.summary()}"


def compiled_features(system_info: str) -> tuple[str, ...]:
    """``AVX2 = 1 | AMX_INT8 = 1 | ...`` -> the names in _SHOWN that are 1."""
    on = set()
    for part in system_info.split("|"):
        name, _, value = part.partition("=")
        if value.strip() == "1":
            on.add(name.strip().split(":")[-1].strip())
    return tuple(name for name in _SHOWN if name in on)


def choose_cpu_paths(setting: Repack, system_info: str) -> CpuPaths:
    features = compiled_features(system_info)
    if setting == "on":
        return CpuPaths(True, "--repack on", features)
    if setting == "off":
        return CpuPaths(False, "--repack off", features)
    if library_has_amx(system_info):
        return CpuPaths(False, "auto: llama.cpp's AMX kernels are unsafe as built "
                               "(--repack on takes them)", features)
    return CpuPaths(True, "auto: llama.cpp's default (no AMX kernels in this build)", features)

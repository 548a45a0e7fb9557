"""How the Python running the proxy was built, as far as the build says.

About half of the relay's CPU per event is the interpreter's
(``bench/results/load/PROFILE.md``: libpython about half of a relayed event's samples),
and the same CPython version costs more or less by how it was built. A shared
``libpython`` compiled without profile-guided or link-time optimization
(``--enable-shared`` alone: pyenv's default) took about 5% more CPU per relayed event at
256 streams than Debian's ``python3.11`` (a static interpreter built with PGO and LTO),
side by side on one machine (``bench/results/load/versus/ALTERNATE-interpreter.md``:
0.93-0.95x the other way). ``serve`` logs the build at start, with that note when it
applies: a deployment can pick its interpreter, the proxy cannot.
"""

from __future__ import annotations

import platform
import shlex
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLOW_BUILD_NOTE = ("a shared libpython configured without --enable-optimizations or "
                   "--with-lto (pyenv's default build): about 5% more CPU per relayed event "
                   "than a static PGO/LTO build (docs/benchmarks.md: the interpreter)")


@dataclass(frozen=True, slots=True)
class InterpreterBuild:
    implementation: str
    version: str
    shared: bool  # this process runs libpython as a shared library
    # The configure arguments' own word (a packager may optimize by other means: Debian
    # builds its python3.11 with PGO and LTO through its make targets, and names neither).
    enable_optimizations: bool  # --enable-optimizations: profile-guided optimization
    with_lto: bool

    @property
    def unoptimized_shared(self) -> bool:
        """The build known to cost more: a shared libpython configured with neither PGO
        nor LTO. (A static interpreter whose configure arguments name neither, as
        Debian's, may have been optimized by its packager's own make targets: not said.)"""
        return self.implementation == "CPython" and self.shared and not (
            self.enable_optimizations or self.with_lto)

    def fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "implementation": self.implementation, "version": self.version,
            "libpython": "shared" if self.shared else "static",
            "enable_optimizations": self.enable_optimizations, "with_lto": self.with_lto}
        if self.unoptimized_shared:
            fields["note"] = SLOW_BUILD_NOTE
        return fields


def interpreter_build(config_var: Callable[[str], Any] = sysconfig.get_config_var,
                      mapped: Sequence[str] | None = None,
                      implementation: str | None = None,
                      version: str | None = None) -> InterpreterBuild:
    """This interpreter's build (or the one ``config_var`` and ``mapped``, the lines of a
    process's ``/proc/PID/maps``, describe)."""
    flags = {argument.split("=", 1)[0] for argument in _arguments(config_var("CONFIG_ARGS"))}
    if mapped is None:
        mapped = _own_mappings()
    # Whether this process loaded libpython, read from its mappings where the system shows
    # them: a distribution's sysconfig describes its shared build even for its static
    # executable (Debian's /usr/bin/python3.11 says Py_ENABLE_SHARED=1 and maps none).
    shared = (any("/libpython" in line for line in mapped) if mapped
              else bool(config_var("Py_ENABLE_SHARED")))
    return InterpreterBuild(
        implementation=implementation or platform.python_implementation(),
        version=version or platform.python_version(),
        shared=shared,
        enable_optimizations="--enable-optimizations" in flags,
        with_lto="--with-lto" in flags)


def _arguments(config_args: Any) -> list[str]:
    """CONFIG_ARGS as the shell read it: quoted ('--enable-shared'), and a quoted value may
    hold spaces ('CFLAGS=-g -O2') that are not arguments of their own."""
    text = str(config_args or "")
    try:
        return shlex.split(text)
    except ValueError:  # unbalanced quotes: word by word, unquoted
        return [word.strip("'\"") for word in text.split()]


def _own_mappings() -> list[str]:
    try:
        return Path("/proc/self/maps").read_text().splitlines()
    except OSError:  # not Linux: the build's own word
        return []

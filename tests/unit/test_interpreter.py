"""proxy.speed.interpreter: which build of Python runs the proxy, read from the build's own
configuration and, where Linux shows them, the process's mappings; and ``serve`` saying so
at start."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from prefixpin.proxy.speed.interpreter import SLOW_BUILD_NOTE, interpreter_build

PYENV_ARGS = ("'--prefix=/root/.pyenv/versions/3.11.7' '--enable-shared' "
              "'--libdir=/root/.pyenv/versions/3.11.7/lib' 'LDFLAGS=-L/root/lib'")
DEBIAN_ARGS = ("'--enable-shared' '--prefix=/usr' '--with-computed-gotos' "
               "'--without-ensurepip' 'CFLAGS=-g -O2'")
DOCKER_ARGS = ("--build=x86_64-linux-gnu --enable-loadable-sqlite-extensions "
               "--enable-optimizations --enable-option-checking=fatal --enable-shared "
               "--with-lto --with-system-expat --without-ensurepip")
LIBPYTHON_MAPPED = ["7f00-7f10 r-xp 00000000 fd:01 42 /root/.pyenv/versions/3.11.7/lib/"
                    "libpython3.11.so.1.0"]
STATIC_MAPPED = ["5600-5610 r-xp 00000000 fd:01 7 /usr/bin/python3.11",
                 "7f00-7f10 r-xp 00000000 fd:01 9 /usr/lib/x86_64-linux-gnu/libc.so.6"]


def config(args: str, shared: int = 1) -> Any:
    return {"CONFIG_ARGS": args, "Py_ENABLE_SHARED": shared}.get


def test_pyenvs_default_build_is_named_with_its_cost() -> None:
    build = interpreter_build(config(PYENV_ARGS), LIBPYTHON_MAPPED, "CPython", "3.11.7")
    assert (build.shared, build.enable_optimizations, build.with_lto) == (True, False, False)
    assert build.unoptimized_shared
    assert build.fields() == {
        "implementation": "CPython", "version": "3.11.7", "libpython": "shared",
        "enable_optimizations": False, "with_lto": False, "note": SLOW_BUILD_NOTE}


def test_a_static_interpreter_is_static_whatever_its_sysconfig_says() -> None:
    """Debian's /usr/bin/python3.11: its sysconfig describes the shared build beside it
    (Py_ENABLE_SHARED 1, --enable-shared), the executable maps no libpython."""
    build = interpreter_build(config(DEBIAN_ARGS), STATIC_MAPPED, "CPython", "3.11.2")
    assert not build.shared
    assert not build.unoptimized_shared
    assert "note" not in build.fields()
    assert build.fields()["libpython"] == "static"


def test_a_shared_build_with_pgo_and_lto_is_not_flagged() -> None:
    build = interpreter_build(config(DOCKER_ARGS), LIBPYTHON_MAPPED, "CPython", "3.11.14")
    assert (build.shared, build.enable_optimizations, build.with_lto) == (True, True, True)
    assert not build.unoptimized_shared
    only_lto = interpreter_build(config("'--enable-shared' '--with-lto'"), LIBPYTHON_MAPPED)
    assert only_lto.with_lto
    assert not only_lto.enable_optimizations
    assert not only_lto.unoptimized_shared


def test_without_mappings_the_builds_own_word_stands() -> None:
    """Where /proc/self/maps is not there (macOS, Windows): Py_ENABLE_SHARED."""
    assert interpreter_build(config(PYENV_ARGS, shared=1), []).shared
    assert not interpreter_build(config(PYENV_ARGS, shared=0), []).shared
    assert not interpreter_build(config("", shared=0), []).unoptimized_shared
    # Another implementation is never called a slow CPython build.
    assert not interpreter_build(config(PYENV_ARGS), LIBPYTHON_MAPPED, "PyPy").unoptimized_shared


def test_this_process_is_read_from_its_own_mappings() -> None:
    build = interpreter_build()
    maps = Path("/proc/self/maps").read_text()
    assert build.shared == ("/libpython" in maps)
    assert build.version == ".".join(map(str, sys.version_info[:3]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_logs_the_interpreter_at_start(tmp_path: Path) -> None:
    """The real ``prefixpin serve``: its first lines name the interpreter's build (the same
    fields as this process reads of itself: the same interpreter)."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefixpin.proxy.cli", "serve", "--upstream", "http://127.0.0.1:9",
             "--port", str(free_port()), "--admin-listen", f"127.0.0.1:{free_port()}"],
            stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            line = None
            while line is None and time.monotonic() < deadline:
                for text in log.read_text().splitlines():
                    if text.startswith("{") and json.loads(text).get("event") == "interpreter":
                        line = json.loads(text)
                if proc.poll() is not None:
                    break
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(10)
    assert line is not None, log.read_text()
    assert {k: line[k] for k in interpreter_build().fields()} == interpreter_build().fields()
    assert line["level"] == "info"


@pytest.mark.parametrize("args", [PYENV_ARGS, DEBIAN_ARGS, DOCKER_ARGS])
def test_flags_are_read_as_whole_arguments(args: str) -> None:
    """``--with-lto`` is not found inside another argument's value, nor
    ``--enable-optimizations`` in ``--enable-optimizations-foo``."""
    tricky = args + " 'CFLAGS=--with-lto-ish' '--enable-optimizations-foo'"
    build = interpreter_build(config(tricky), LIBPYTHON_MAPPED)
    assert build.with_lto == ("--with-lto" in args.split())
    assert build.enable_optimizations == ("--enable-optimizations" in args.split())


def test_a_quoted_value_with_spaces_is_one_argument() -> None:
    build = interpreter_build(config("'--enable-shared' 'CFLAGS=-O2 --with-lto'"),
                              LIBPYTHON_MAPPED)
    assert not build.with_lto
    unbalanced = interpreter_build(config("'--enable-shared' '--with-lto"), LIBPYTHON_MAPPED)
    assert unbalanced.with_lto

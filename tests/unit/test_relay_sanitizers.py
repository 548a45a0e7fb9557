"""The compiled relay (``core/_relay.c``) under AddressSanitizer and UndefinedBehaviorSanitizer.

The C is built with both into a temporary folder, and the fuzz driver
(``tests/fuzz/relay_fuzz.py``) runs a CI-sized number of seeded cases on that build, in a
subprocess with gcc's ASan runtime preloaded (Python itself is not instrumented) and
``PYTHONMALLOC=malloc`` (so that ASan sees the Python objects the C writes into): the relay's
socket loop over socket pairs and TCP connections, and its scanner on random bytes. Any
report aborts the subprocess. A longer run is one command (``docs/testing.md``).

gcc and its libasan are required: without them these tests fail, saying what is missing
(CI has both), rather than skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "core" / "_relay.c"
CASES = 2000  # about 12 s on 2 cores under the sanitizers; the driver's --cases for more
SEED = 1
SANITIZE = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
            "-fno-sanitize-recover=undefined"]
REPORTS = ("ERROR: AddressSanitizer", "runtime error:")

CANARY = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

/* A write one past a heap block whose size only the run knows (UBSan's object-size check
 * cannot see it: what stops it is ASan's). */
static PyObject *overflow(PyObject *module, PyObject *arg) {
    (void)module;
    long n = PyLong_AsLong(arg);
    volatile char *p = malloc((size_t)n);
    p[n] = 1;
    free((void *)p);
    Py_RETURN_NONE;
}

static PyObject *signed_overflow(PyObject *module, PyObject *arg) {
    (void)module;
    int x = (int)PyLong_AsLong(arg);
    return PyLong_FromLong(x + 1);
}

static PyMethodDef methods[] = {
    {"overflow", overflow, METH_O, NULL},
    {"signed_overflow", signed_overflow, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef canary = {PyModuleDef_HEAD_INIT, .m_name = "canary", .m_size = -1,
                                    .m_methods = methods};

PyMODINIT_FUNC PyInit_canary(void) { return PyModule_Create(&canary); }
"""


def toolchain() -> tuple[str, str, str]:
    """(gcc, its libasan.so, Python's include folder); a missing one fails the test."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc is not on PATH: the sanitizer build of core/_relay.c needs it "
                    "(Debian: apt-get install gcc)")
    found = subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True,
                           text=True, check=True).stdout.strip()
    libasan = Path(found)
    if not libasan.is_absolute() or not libasan.exists():
        pytest.fail(f"gcc has no AddressSanitizer runtime (-print-file-name=libasan.so "
                    f"says {found!r}): install it (Debian: libasan8, with gcc 12)")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        pytest.fail(f"Python's headers are not in {include}: install them (Debian: python3-dev)")
    return gcc, str(libasan), include


def build(source: Path, folder: Path, name: str, flags: list[str]) -> Path:
    gcc, _, include = toolchain()
    built = folder / (name + str(sysconfig.get_config_var("EXT_SUFFIX")))
    made = subprocess.run([gcc, *flags, "-shared", "-fPIC", f"-I{include}", str(source),
                           "-o", str(built)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    return built


def sanitized(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``argv`` run by this Python with the sanitizers' runtime, from the repository root."""
    _, libasan, _ = toolchain()
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("COVERAGE_PROCESS")}  # not measured: no tracer under ASan
    env.update(LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1", PYTHONMALLOC="malloc")
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_relay_fuzzed_under_asan_and_ubsan_reports_nothing(tmp_path: Path) -> None:
    relay = build(SOURCE, tmp_path, "_relay", SANITIZE)
    run = sanitized(["-m", "tests.fuzz.relay_fuzz", "--cases", str(CASES), "--seed", str(SEED),
                     "--relay", str(relay)])
    tail = run.stderr[-6000:]
    for report in REPORTS:
        assert report not in run.stderr, tail
    assert run.returncode == 0, tail
    # The build under test, with the runtime loaded, ran every case.
    assert f"relay: {relay} (AddressSanitizer loaded)" in run.stdout, run.stdout
    assert f"ok: {CASES // 2} relay cases, {CASES - CASES // 2} scanner cases" in run.stdout


@pytest.mark.parametrize(("call", "report"), [
    ("overflow(8)", "ERROR: AddressSanitizer: heap-buffer-overflow"),
    ("signed_overflow(2**31 - 1)", "runtime error: signed integer overflow"),
])
def test_the_sanitizers_catch_what_they_must(tmp_path: Path, call: str, report: str) -> None:
    """The same flags and runtime abort on a planted bug: the fuzz test's silence means
    something."""
    source = tmp_path / "canary.c"
    source.write_text(CANARY)
    build(source, tmp_path, "canary", SANITIZE)
    run = sanitized(["-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
                           f"import canary; canary.{call}"])
    assert report in run.stderr, run.stderr[-3000:]
    assert run.returncode != 0


def test_the_relay_compiles_without_warnings(tmp_path: Path) -> None:
    build(SOURCE, tmp_path, "_relay", ["-O2", "-Wall", "-Wextra", "-Werror"])

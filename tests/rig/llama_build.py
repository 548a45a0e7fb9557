"""Build llama-server from the llama.cpp tree vendored in the pinned llama-cpp-python sdist.

The sdist comes from PyPI through ``pip download`` (the only registry this project may
reach); only the ``llama-server`` target is built, into a cache directory keyed by the
sdist version and the build flags, and reused on every later call.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from prefixpin.core.cpu import NO_AMX_CFLAGS, flags_digest
from prefixpin.proxy.settings import cache_root
from tests.rig.parts import prepared

LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# The UI assets would be fetched from a model hub at build time; the proxy never needs
# them. HTTPS is for the server's own downloads, which we never use either. Native, but
# without llama.cpp's AMX kernels, which crash as GCC builds them (core.cpu says why).
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    f"-DCMAKE_C_FLAGS={NO_AMX_CFLAGS}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX_CFLAGS}",
)


def build_key() -> str:
    """The sdist, the build flags and this CPU: a native binary built on a machine of the
    same kind with another CPU may use instructions this one lacks, so it is rebuilt."""
    flags = hashlib.blake2b(" ".join(CMAKE_FLAGS).encode(), digest_size=4).hexdigest()
    return f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}-{flags}-cpu{flags_digest()}"


def binary_path(root: Path | None = None) -> Path:
    return (root or cache_root()) / "llama-server" / build_key() / "llama-server"


def ensure_llama_server(*, jobs: int | None = None, quiet: bool = False,
                        preparing: bool = False) -> Path:
    """Return the cached llama-server binary, building it first if it is missing.

    Under CI only the prepare step (``preparing``) builds it: a test that finds it missing
    fails, naming it (``tests.rig.parts``)."""
    override = os.environ.get("PREFIXPIN_LLAMA_SERVER")
    if override:
        return Path(override)
    target = binary_path()
    if target.exists():
        return target
    if not preparing:
        prepared(target, "llama-server binary")
    _say(quiet, f"building llama-server {build_key()} (about 5 minutes on 2 cores)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="prefixpin-build-") as tmp:
        source = unpacked_tree(Path(tmp), quiet=quiet)
        built = _cmake_build(source, Path(tmp) / "build", jobs or os.cpu_count() or 2, quiet)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_suffix(".partial")
        shutil.copy2(built, staging)
        staging.replace(target)  # atomic: a killed build never leaves a half binary
    _say(quiet, f"llama-server ready at {target} ({time.monotonic() - started:.0f} s)")
    return target


def unpacked_tree(tmp: Path, *, quiet: bool = False) -> Path:
    """Fetch the pinned sdist into ``tmp`` and unpack it there; the vendored llama.cpp tree."""
    _say(quiet, f"fetching llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist with pip download")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "-q", "-d", str(tmp),
         f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
        check=True,
    )
    sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp, filter="data")
    return tmp / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"


def _cmake_build(source: Path, build: Path, jobs: int, quiet: bool) -> Path:
    output = subprocess.DEVNULL if quiet else None
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS],
                   check=True, stdout=output)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
                   check=True, stdout=output)
    return build / "bin" / "llama-server"


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"[prefixpin rig] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    print(ensure_llama_server(preparing=True))

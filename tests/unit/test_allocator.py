"""``proxy.speed.allocator``: with glibc's thresholds fixed, large buffers that come and go are
reused from the heap instead of faulted in afresh each time (counted as the process's
minor page faults, in a fresh interpreter each: the thresholds are process-wide)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Rounds of what a refused upload does to the heap: 8 MiB of 256 KiB buffers (a socket
# read's size), each written, then all freed at once.
ROUNDS = 20
SCRIPT = f"""
import resource, sys
from prefixpin.proxy.speed.allocator import keep_large_buffers
if sys.argv[1] == "kept":
    assert keep_large_buffers()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def one_round():
    buffers = [b"x" * (256 * 1024) for _ in range(32)]
    del buffers
one_round()  # the heap's first growth faults either way
before = faults()
for _ in range({ROUNDS}):
    one_round()
print(faults() - before)
"""


def faults_per_round(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True,
                          text=True, check=True, timeout=60)
    return int(done.stdout.strip()) / ROUNDS


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_large_buffers_freed_at_once_are_reused_not_faulted_in_again() -> None:
    default = faults_per_round("default")
    kept = faults_per_round("kept")
    assert default > 1000, default  # 8 MiB handed back and faulted in again: 2,048 pages
    assert kept < default / 20, (kept, default)

"""The rig gives a test engine the cores no other work keeps busy (tests/rig/llama_process.py):
a CPU-bound process beside it takes one core away, and there is always at least one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.rig.llama_process import engine_threads


def test_a_busy_core_is_not_given_to_the_engine() -> None:
    cores = os.cpu_count() or 1
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # past the interpreter's start, into the loop
        beside_a_spinner = engine_threads()
    finally:
        spinner.kill()
        spinner.wait(10)
    assert 1 <= beside_a_spinner <= max(1, cores - 1)

"""Start a real llama-server on a free loopback port, wait until it serves, stop it cleanly."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.rig._process import free_port, kill_process, log_tail, stop_process
from tests.rig.llama_build import ensure_llama_server
from tests.rig.models import ensure_model


def engine_threads(sample_s: float = 0.25) -> int:
    """How many compute threads a test engine gets: the cores no other work keeps busy as
    it starts, at least one.

    llama.cpp's threads meet at a barrier after every operation, so the engine moves at the
    pace of its slowest thread: beside another CPU-bound job on two cores, two threads ran
    an end-to-end module over 4x slower than one, while alone two are 1.5x faster. The idle
    share of the cores is read from ``/proc/stat``; without it every core counts as free.
    """
    cores = os.cpu_count() or 1
    try:
        before = _cpu_ticks()
        time.sleep(sample_s)
        after = _cpu_ticks()
    except OSError:
        return cores
    total, idle = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return cores
    return max(1, min(cores, round(idle / total * cores)))


def _cpu_ticks() -> tuple[int, int]:
    """(all ticks, idle and iowait ticks) since boot, summed over every core."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    return sum(fields[:8]), fields[3] + fields[4]


@dataclass(slots=True)
class LlamaServerProcess:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    slot_save_path: Path | None
    args: tuple[str, ...]  # the whole command line, binary included

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def kill(self) -> None:
        """Kill -9, as a crash would: no cleanup on the engine's side."""
        kill_process(self.process)


def llama_args(model: Path, port: int, *, slots: int, ctx_per_slot: int,
               slot_save_path: Path | None, threads: int, extra: Sequence[str]) -> list[str]:
    args = ["-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(threads),
            "--metrics", "--no-webui"]
    if slot_save_path is not None:
        args += ["--slot-save-path", str(slot_save_path)]
    return [*args, *extra]


@contextlib.contextmanager
def run_llama_server(model: str | Path = "smollm2", *, slots: int = 2, ctx_per_slot: int = 8192,
                     slot_save_path: Path | bool | None = True, threads: int | None = None,
                     extra: Sequence[str] = (), port: int | None = None,
                     startup_timeout: float = 120.0, nice: int = 10,
                     ) -> Iterator[LlamaServerProcess]:
    """A llama-server for tests and benches.

    It runs at a lower CPU priority (``nice``): on a 2-core machine its compute threads
    would otherwise starve the proxy and the test client, which on a real GPU box never
    compete with the engine for the CPU. Without ``threads`` it takes the cores that are
    free as it starts (:func:`engine_threads`).
    """
    binary = ensure_llama_server()
    model_file = Path(model) if isinstance(model, Path) or "/" in str(model) else ensure_model(
        str(model))
    with tempfile.TemporaryDirectory(prefix="prefixpin-llama-") as tmp:
        save_dir: Path | None = None
        if slot_save_path is True:
            save_dir = Path(tmp) / "slots"
            save_dir.mkdir()
        elif isinstance(slot_save_path, Path):
            save_dir = slot_save_path
        handle = start_llama_server(binary, model_file, Path(tmp) / "llama-server.log",
                                    slots=slots, ctx_per_slot=ctx_per_slot,
                                    slot_save_path=save_dir, threads=threads or engine_threads(),
                                    extra=extra, port=port or free_port(),
                                    startup_timeout=startup_timeout, nice=nice)
        try:
            yield handle
        finally:
            stop(handle)


def start_llama_server(binary: Path, model: Path, log_path: Path, *, slots: int,
                       ctx_per_slot: int, slot_save_path: Path | None, threads: int,
                       extra: Sequence[str], port: int,
                       startup_timeout: float, nice: int = 10) -> LlamaServerProcess:
    args = llama_args(model, port, slots=slots, ctx_per_slot=ctx_per_slot,
                      slot_save_path=slot_save_path, threads=threads, extra=extra)
    return launch_llama_server(binary, args, log_path, port=port, slot_save_path=slot_save_path,
                               startup_timeout=startup_timeout, nice=nice)


def launch_llama_server(binary: Path, args: Sequence[str], log_path: Path, *, port: int,
                        slot_save_path: Path | None = None, startup_timeout: float = 120.0,
                        nice: int = 10) -> LlamaServerProcess:
    """llama-server with exactly ``args``, healthy (``start_llama_server`` adds the rig's
    own: slots, context, threads, ``--metrics``)."""
    log = log_path.open("ab")
    command = ["nice", "-n", str(nice), str(binary), *args] if nice else [str(binary), *args]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
    log.close()
    handle = LlamaServerProcess(f"http://127.0.0.1:{port}", port, process, log_path,
                                slot_save_path, tuple(command))
    try:
        wait_healthy(handle, startup_timeout)
    except BaseException:
        stop(handle)
        raise
    return handle


def wait_healthy(handle: LlamaServerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {handle.process.returncode}:\n"
                               f"{handle.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{handle.url}/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"llama-server not healthy after {timeout} s:\n{handle.log_tail()}")


def restart(handle: LlamaServerProcess, startup_timeout: float = 120.0) -> LlamaServerProcess:
    """Stop and start the same server (same port, flags and slot-save path)."""
    stop(handle)
    log = handle.log_path.open("ab")
    process = subprocess.Popen(list(handle.args), stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    handle.process = process
    wait_healthy(handle, startup_timeout)
    return handle


def stop(handle: LlamaServerProcess) -> None:
    stop_process(handle.process)

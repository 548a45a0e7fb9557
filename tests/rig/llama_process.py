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
    compete with the engine for the CPU.
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
                                    slot_save_path=save_dir, threads=threads or os.cpu_count() or 2,
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

"""The arms of a run and the engine behind them: started, reset and stopped by the run.

An arm is an OpenAI-compatible base URL. ``--arm NAME=URL`` points at something already
running (``NAME`` alone is the engine itself); ``--serve-arm NAME[:ENV=VALUE,...]`` is a
``prefixpin serve --upstream ENGINE`` the run starts with those environment variables and
restarts before each of its reps, so every rep starts from the same proxy state.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.engine import EngineAPI, EngineError, ManagedProcess, llama_server_argv
from tests.fakes.servers import free_port

TEMPLATES = Path(__file__).resolve().parent / "templates"


@dataclass(slots=True)
class Arm:
    name: str
    url: str
    process: ManagedProcess | None = None  # a proxy this run starts and restarts
    embedded: bool = False  # its engine is in the process itself, not the rig's engine


@dataclass(slots=True)
class Rig:
    engine: EngineAPI
    reset: str  # restart | erase | none
    llama: ManagedProcess | None
    slot_dir: Path | None = None  # the started engine's --slot-save-path

    def reset_for(self, arm: Arm) -> None:
        # The arm's proxy stops first: a clean shutdown parks its sessions, and those files
        # (and the park index) must not warm this rep's turn 0.
        if arm.process is not None:
            arm.process.stop()
        if self.slot_dir is not None and self.reset != "none":
            shutil.rmtree(self.slot_dir, ignore_errors=True)
            self.slot_dir.mkdir(parents=True)
        if self.reset == "restart":
            if self.llama is None:
                raise EngineError("--reset restart needs --start-llama")
            self.llama.restart()
        elif self.reset == "erase":
            self.engine.erase_slots()
        if arm.process is not None:
            arm.process.start()


def build_arms(args: argparse.Namespace, engine_url: str, log_dir: Path) -> list[Arm]:
    arms = []
    for spec in args.arm:
        name, _, url = spec.partition("=")
        arms.append(Arm(name, engine_url if url in ("", "engine") else url.rstrip("/")))
    served = [(spec, False) for spec in args.serve_arm]
    served += [(spec, True) for spec in args.embedded_arm]
    for spec, embedded in served:
        name, _, env_spec = spec.partition(":")
        env = dict(item.split("=", 1) for item in env_spec.split(",") if item)
        if embedded:
            # Its own park directory, emptied with the engine's before every rep.
            env.setdefault("PREFIXPIN_PARK_DIR", f"{{slots}}/embedded-{name}")
        # {slots} is the started engine's --slot-save-path: a parking arm parks there.
        env = {key: value.replace("{slots}", str(log_dir / "slots")) for key, value in env.items()}
        port = free_port()
        upstream = [] if embedded else ["--upstream", engine_url]
        argv = [str(Path(sys.executable).parent / "prefixpin"), "serve", *upstream,
                "--host", "127.0.0.1", "--port", str(port)]
        process = ManagedProcess(f"prefixpin[{name}]", argv, f"http://127.0.0.1:{port}/healthz",
                                 log_dir / f"prefixpin-{name}.log", env=env)
        arms.append(Arm(name, f"http://127.0.0.1:{port}", process, embedded))
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise SystemExit(f"arm names must be unique: {names}")
    return arms


def start_llama(args: argparse.Namespace, work: Path) -> tuple[ManagedProcess, list[str]]:
    from prefixpin.proxy.engine.models import ensure_model
    from tests.rig.llama_build import ensure_llama_server

    port = free_port()
    slot_dir = work / "slots"
    slot_dir.mkdir(parents=True, exist_ok=True)
    template = [] if args.template == "native" else [
        "--chat-template-file", str(TEMPLATES / f"{args.template}.jinja")]
    argv = llama_server_argv(ensure_llama_server(), ensure_model(args.model), port, slot_dir,
                             ["-t", str(args.threads), *template, *args.llama_arg])
    process = ManagedProcess("llama-server", argv, f"http://127.0.0.1:{port}/health",
                             work / "llama-server.log")
    process.start()
    return process, argv


def rep_order(arms: list[Arm], rep: int) -> list[Arm]:
    """Rotate the arms each rep: A B, B A, A B... so no arm always runs first."""
    shift = rep % len(arms)
    return arms[shift:] + arms[:shift]




def check_arms_with_alone(parser: argparse.ArgumentParser, given: str,
                          known: tuple[str, ...] | list[str]) -> None:
    """``--arms``: only ``known`` arms, and ``alone`` among them (the sessions run one at
    a time: what the other arms are measured against)."""
    chosen = given.split(",")
    if set(chosen) - set(known) or "alone" not in chosen:
        parser.error(f"--arms needs 'alone' (the reference) and only {list(known)}; "
                     f"got {given}")

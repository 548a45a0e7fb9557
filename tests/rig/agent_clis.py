"""Drive the real coding-agent CLIs headless, one turn at a time, against a base URL.

``AgentSession(cli, base_url, root)`` gives one CLI a fresh HOME and working directory of
its own under ``root`` and configures it to talk to ``base_url`` (prefixpin, or an engine
directly) with a dummy key; each ``turn(prompt)`` runs the CLI once and returns when it
exits (or is killed at its timeout): the first turn starts a session, every later one
continues it.

    cli       API it speaks           turn 1                           later turns
    opencode  /v1/chat/completions    opencode run -m local/smol P     opencode run -c P
    claude    /v1/messages            claude -p P --model smol         claude -p -c P --model smol
    codex     /v1/responses           codex exec P                     codex exec resume --last P

Offline: nothing a CLI does may leave the machine. Every CLI gets a dead HTTP(S) proxy
(loopback port 9) with loopback exempt, on top of its own switches: OpenCode's
``OPENCODE_DISABLE_*`` (no models.dev fetch, no autoupdate, no LSP download, no share) and
a dead npm registry for the background install of ``@opencode-ai/plugin`` into its config
directory (its ``@ai-sdk/openai-compatible`` provider is bundled in the binary); Claude
Code's ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`` (without it, it also calls
api.anthropic.com itself, past the base URL, for telemetry and updates; in ``-p`` mode it
sends one request per turn to the base URL either way); Codex's ``plugins`` feature off (it would
``git clone`` github.com/openai/plugins.git on every start), its analytics off (OTLP
metrics to ab.chatgpt.com) and no update check.

Tiny models ramble up to the 32k tokens these CLIs ask for, and llama-server's ``-n``
does not cap a request's own ``max_tokens``: cap generation on the engine with a default
grammar (``ENGINE_CAP_ARGS``), which ends every answer naturally (``stop``/``end_turn``)
after a few words. A capped ``max_tokens`` instead would make Claude Code send
"continue" requests until it gives up.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tests.rig.agents import ensure_agent

Cli = Literal["opencode", "claude", "codex"]
CLIS: tuple[Cli, ...] = ("opencode", "claude", "codex")

MODEL = "smol"  # the name every CLI asks for (llama-server serves its one model by any name)

# llama-server arguments that keep a tiny model's answers short and deterministic: greedy,
# and a grammar of at most 60 plain characters, after which only end-of-generation is
# allowed (a request's own max_tokens still applies; none of these CLIs sends a grammar).
ENGINE_CAP_ARGS: tuple[str, ...] = ("--temp", "0", "--grammar",
                                    "root ::= [a-zA-Z0-9 ,.!?]{1,60}")

_DEAD = "http://127.0.0.1:9"  # discard port: connections are refused at once
_OFFLINE = {"HTTP_PROXY": _DEAD, "HTTPS_PROXY": _DEAD, "ALL_PROXY": _DEAD,
            "http_proxy": _DEAD, "https_proxy": _DEAD, "all_proxy": _DEAD,
            "NO_PROXY": "127.0.0.1,localhost,::1", "no_proxy": "127.0.0.1,localhost,::1"}


@dataclass(frozen=True, slots=True)
class Turn:
    cli: Cli
    number: int  # 1 for the turn that started the session
    argv: tuple[str, ...]
    returncode: int | None  # None: killed at its timeout
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def check(self) -> Turn:
        """This turn, or an AssertionError naming what the CLI printed."""
        if not self.ok:
            ended = "timed out" if self.returncode is None else f"exited {self.returncode}"
            raise AssertionError(f"{self.cli} turn {self.number} {ended} after "
                                 f"{self.seconds:.1f} s: {' '.join(self.argv[1:])}\n"
                                 f"stdout: {self.stdout[-1500:]}\nstderr: {self.stderr[-3000:]}")
        return self


class AgentSession:
    """One CLI's conversation against ``base_url`` (no ``/v1``: each CLI adds its paths)."""

    def __init__(self, cli: Cli, base_url: str, root: Path, *, executable: Path | None = None,
                 timeout: float = 180.0, env: Mapping[str, str] | None = None,
                 key: str = "dummy") -> None:
        self.cli: Cli = cli
        self.key = key  # the API key the CLI sends (any: prefixpin checks none by default)
        self.base_url = base_url.rstrip("/")
        self.home = root / "home"
        self.workdir = root / "work"
        self.home.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.executable = executable or ensure_agent(cli, quiet=True)
        self.timeout = timeout
        self.extra_env = dict(env or {})
        self.turns: list[Turn] = []
        _CONFIGURE[cli](self)

    def turn(self, prompt: str, *, timeout: float | None = None) -> Turn:
        """Run the CLI once (starting the session, or continuing it) until it exits."""
        argv = (str(self.executable), *_ARGS[self.cli](prompt, continuing=bool(self.turns)))
        turn = self._run(argv, timeout or self.timeout)
        self.turns.append(turn)
        return turn

    def environment(self) -> dict[str, str]:
        node_dir = os.path.dirname(shutil.which("node") or "/usr/bin/node")  # codex.js
        path = os.pathsep.join(dict.fromkeys([node_dir, "/usr/local/bin", "/usr/bin", "/bin"]))
        env = {"PATH": path, "HOME": str(self.home), "LANG": "C.UTF-8", "TERM": "dumb",
               "NO_COLOR": "1", "TMPDIR": str(self._tmp()), **_OFFLINE}
        env.update(_ENV[self.cli](self.base_url, self.key))
        env.update(self.extra_env)
        return env

    def _tmp(self) -> Path:
        tmp = self.home / "tmp"
        tmp.mkdir(exist_ok=True)
        return tmp

    def _run(self, argv: Sequence[str], timeout: float) -> Turn:
        started = time.monotonic()
        process = subprocess.Popen(list(argv), cwd=self.workdir, env=self.environment(),
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
            returncode: int | None = process.returncode
        except subprocess.TimeoutExpired:
            _kill_group(process)
            stdout, stderr = process.communicate()
            returncode = None
        finally:
            if process.poll() is None:  # interrupted (KeyboardInterrupt): leave nothing behind
                _kill_group(process)
        return Turn(self.cli, len(self.turns) + 1, tuple(argv), returncode, stdout, stderr,
                    time.monotonic() - started)


def _kill_group(process: subprocess.Popen[str]) -> None:
    """The CLI and whatever it started (its own session: start_new_session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)


# --- OpenCode --------------------------------------------------------------------------


def _configure_opencode(session: AgentSession) -> None:
    config = {"$schema": "https://opencode.ai/config.json",
              "autoupdate": False, "share": "disabled",
              "provider": {"local": {"npm": "@ai-sdk/openai-compatible", "name": "local",
                                     "options": {"baseURL": f"{session.base_url}/v1",
                                                 "apiKey": session.key},
                                     "models": {MODEL: {"name": MODEL}}}}}
    (session.workdir / "opencode.json").write_text(json.dumps(config, indent=2))


def _opencode_args(prompt: str, *, continuing: bool) -> tuple[str, ...]:
    return ("run", "-c", prompt) if continuing else ("run", "-m", f"local/{MODEL}", prompt)


def _opencode_env(base_url: str, key: str) -> dict[str, str]:
    return {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1", "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
            # Its background `npm install @opencode-ai/plugin` into the config directory.
            "npm_config_registry": f"{_DEAD}/"}


# --- Claude Code -----------------------------------------------------------------------


def _configure_claude(session: AgentSession) -> None:
    pass  # environment only; it keeps its sessions under HOME/.claude, keyed by the cwd


def _claude_args(prompt: str, *, continuing: bool) -> tuple[str, ...]:
    return ("-p", "-c", prompt, "--model", MODEL) if continuing else (
        "-p", prompt, "--model", MODEL)


def _claude_env(base_url: str, key: str) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": key,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}


# --- Codex -----------------------------------------------------------------------------


def _configure_codex(session: AgentSession) -> None:
    codex_home = session.home / ".codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\n'
        'model_provider = "local"\n'
        "check_for_update_on_startup = false\n"
        "\n"
        "[model_providers.local]\n"
        'name = "local"\n'
        f'base_url = "{session.base_url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "LOCAL_KEY"\n'
        "\n"
        "[features]\n"
        "plugins = false\n"
        "\n"
        "[analytics]\n"
        "enabled = false\n")


def _codex_args(prompt: str, *, continuing: bool) -> tuple[str, ...]:
    if continuing:
        return ("exec", "resume", "--last", "--skip-git-repo-check", prompt)
    return ("exec", "--skip-git-repo-check", prompt)


def _codex_env(base_url: str, key: str) -> dict[str, str]:
    return {"LOCAL_KEY": key}


_CONFIGURE = {"opencode": _configure_opencode, "claude": _configure_claude,
              "codex": _configure_codex}
_ARGS = {"opencode": _opencode_args, "claude": _claude_args, "codex": _codex_args}
_ENV = {"opencode": _opencode_env, "claude": _claude_env, "codex": _codex_env}

"""The real coding-agent CLIs the agent end-to-end tests drive: OpenCode, Claude Code, Codex.

Each is an npm package at a pinned version, installed with ``npm install --prefix`` into a
cache directory of its own outside the repository (``~/.cache/prefixpin/agents/
<name>-<version>/``, or under ``PREFIXPIN_CACHE``) and reused on every later call. All
three ship their real program as a native binary in a platform package (an optional
dependency); the install checks that it is there and that the CLI answers ``--version``
with no network, in a HOME of its own. A developer's machine installs a missing CLI on
demand (npm reaches the registry); under CI the prepare step has installed them, and a test
that finds one missing fails, naming it (``tests.rig.parts``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prefixpin.proxy.settings import cache_root
from tests.rig.parts import PREPARE, missing_part, on_ci


@dataclass(frozen=True, slots=True)
class AgentCli:
    name: str  # the command: opencode, claude, codex
    package: str  # its npm package
    version: str  # pinned exactly
    native: str  # the platform package whose binary the launcher runs (linux x64)

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"


AGENTS: dict[str, AgentCli] = {
    "opencode": AgentCli("opencode", "opencode-ai", "1.18.33", "opencode-linux-x64"),
    "claude": AgentCli("claude", "@anthropic-ai/claude-code", "2.1.328",
                       "@anthropic-ai/claude-code-linux-x64"),
    "codex": AgentCli("codex", "@openai/codex", "0.169.0", "@openai/codex-linux-x64"),
}


def install_dir(name: str, root: Path | None = None) -> Path:
    agent = AGENTS[name]
    return (root or cache_root()) / "agents" / f"{agent.name}-{agent.version}"


def executable_path(name: str, root: Path | None = None) -> Path:
    """Where the CLI's launcher is once installed (it may not be)."""
    return install_dir(name, root) / "node_modules" / ".bin" / AGENTS[name].name


def find_agent(name: str) -> Path | None:
    """The installed CLI, or None (``PREFIXPIN_<NAME>`` overrides, e.g. PREFIXPIN_CLAUDE)."""
    override = os.environ.get(f"PREFIXPIN_{name.upper()}")
    if override:
        return Path(override)
    path = executable_path(name)
    return path if path.exists() and _native_installed(install_dir(name), AGENTS[name]) else None


def ensure_agent(name: str, *, quiet: bool = False, preparing: bool = False) -> Path:
    """The CLI's executable, installing the pinned version first when it is missing.

    Under CI only the prepare step (``preparing``) installs; a test that finds it missing
    fails. Locally, with no npm on the PATH, the test skips."""
    found = find_agent(name)
    if found is not None:
        return found
    agent = AGENTS[name]
    if on_ci() and not preparing:
        missing_part(f"{agent.spec} ({executable_path(name)})", f"run `{PREPARE} agents`")
    if shutil.which("npm") is None or shutil.which("node") is None:
        if preparing:
            raise RuntimeError(f"{agent.spec}: npm and node are needed to install it")
        missing_part(f"{agent.spec} (npm and node are needed to install it)",
                     f"install Node.js 20 with npm, then run `{PREPARE} agents`")
    return _install(agent, quiet)


def require_agent(name: str) -> Path:
    """For tests: the CLI (installed on demand locally; missing under CI fails the test)."""
    return ensure_agent(name, quiet=True)


def agent_version(path: Path) -> str:
    """What ``<cli> --version`` prints, in a throwaway HOME with no way out (a dead proxy)."""
    dead = "http://127.0.0.1:9"
    with tempfile.TemporaryDirectory(prefix="prefixpin-agent-home-") as home:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home,
               "HTTP_PROXY": dead, "HTTPS_PROXY": dead, "ALL_PROXY": dead,
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
               "OPENCODE_DISABLE_AUTOUPDATE": "1", "NO_COLOR": "1"}
        done = subprocess.run([str(path), "--version"], env=env, cwd=home, capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{path} --version exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout.strip()


def _install(agent: AgentCli, quiet: bool) -> Path:
    target = install_dir(agent.name)
    _say(quiet, f"installing {agent.spec} into {target} (npm)")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        # A package.json of its own: npm never walks up into another project's.
        (staging / "package.json").write_text(json.dumps(
            {"name": f"prefixpin-agent-{agent.name}", "private": True}))
        subprocess.run(
            ["npm", "install", "--prefix", str(staging), "--no-audit", "--no-fund",
             "--save-exact", "--include=optional", "--loglevel=error", agent.spec],
            check=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL if quiet else sys.stderr)
        if not _native_installed(staging, agent):
            raise RuntimeError(f"{agent.spec}: its native package {agent.native} was not "
                               f"installed (npm skipped the optional dependency?)")
        version = agent_version(staging / "node_modules" / ".bin" / agent.name)
        if agent.version not in version:
            raise RuntimeError(f"{agent.spec}: --version printed {version!r}")
        if target.exists() and _native_installed(target, agent):
            shutil.rmtree(staging)  # a concurrent install won the race: keep that one
        else:
            shutil.rmtree(target, ignore_errors=True)  # a broken one (its binary gone)
            staging.replace(target)  # atomic: a killed install never leaves half a CLI
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _say(quiet, f"{agent.spec} ready: {executable_path(agent.name)}")
    return executable_path(agent.name)


def _native_installed(root: Path, agent: AgentCli) -> bool:
    """The platform package with the real binary is there (only checked on linux x64, the
    platform the rig runs on; elsewhere npm picks another one)."""
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "amd64"):
        return True
    return (root / "node_modules" / agent.native / "package.json").exists()


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"[prefixpin rig] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    for cli in AGENTS:
        print(ensure_agent(cli, preparing=True))

"""Openings with the real Claude Code: new sessions of one namespace start from the system
prompt and tools their siblings share.

    python -m bench.openings [--sessions 4] [--slots 2] [--out bench/results/openings]

One arm each, side by side in one run, every arm against a freshly started llama-server
(the rig's tiny random-weight ``qwen35-agent``: Qwen3.5's hybrid architecture and real
chat template, whose reply ends at once; the text is noise, the engine's cache mechanics
are real) with prefixpin in front (its own process):

- ``openings``: prefixpin's defaults;
- ``no-openings``: ``prefixpin serve --no-openings``.

Per arm, ``--sessions`` Claude Code sessions (``claude -p``: one user's, in one HOME and
one repository) start one after the other on
``--slots`` slots. Llama-server straight, Claude Code gets no answer at all with this
template: it sends a ``system`` message after the first user turn, which Qwen3.5's template
refuses (500 "System message must be at the beginning"; prefixpin renders it as a user
turn, ``proxy.pipeline.system_turns``), so there is no direct arm.

Measured per session: its request's prompt and cached tokens (prefixpin's request line,
as the engine reported them), what the engine prefilled in all during the session's run
(``llamacpp:prompt_tokens_total``), and the opening prefixpin saved or restored (its log).
A new session after the first *differs* from its sibling by ``prompt - shared`` tokens,
``shared`` being what its prompt shares with the previous session's, token for token, as
the engine holds them (its slot saved and read back after the turn); the target: it
prefills at most that plus 16. Writes ``--out``/``sessions.json`` and
``RUN.md``; exit status 2 when a later session of the ``openings`` arm missed the target.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.agents.run import ProxyLog
from bench.provenance import git_revision, host_lines
from prefixpin.proxy.parking.slotfile import read_slot_tokens
from prefixpin.proxy.session.tokens import common_prefix
from tests.rig.agent_clis import ENGINE_CAP_ARGS, AgentSession
from tests.rig.agents import ensure_agent
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.replica_process import start_replica
from tests.rig.tiny_models import ensure_tiny_model

Row = dict[str, Any]
ARMS = {"openings": (), "no-openings": ("--no-openings",)}
NAMES = ("Ann", "Bob", "Cleo", "Dev", "Eve", "Finn", "Gus", "Hana")
SLACK = 16
OUT = Path(__file__).parent / "results" / "openings"
REPO = Path(__file__).resolve().parents[1]


def prefilled(engine: LlamaServerProcess) -> int:
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("llamacpp:prompt_tokens_total "):
            return int(float(line.split()[-1]))
    return 0


def run_arm(arm: str, args: argparse.Namespace, work: Path) -> list[Row]:
    base = work / arm
    repo = base / "repo"  # the same path in every arm: the same system prompt
    repo.mkdir(parents=True)
    slots = base / "slots"
    slots.mkdir()
    rows: list[Row] = []
    with run_llama_server(ensure_tiny_model("qwen35-agent"), slots=args.slots,
                          ctx_per_slot=args.ctx, threads=args.threads, slot_save_path=slots,
                          extra=[*ENGINE_CAP_ARGS, "--cache-ram", "0"]) as engine:
        log_path = base / "prefixpin.log"
        replica = start_replica([engine.url], log_path, args=[
            "--park-index-dir", str(base / "index"), *ARMS[arm]])
        try:
            log = ProxyLog(log_path)
            log.read()
            for number in range(1, args.sessions + 1):
                rows.append(one_session(arm, number, args, base, repo, engine,
                                        replica.url, log))
                print(json.dumps({k: rows[-1][k] for k in (
                    "arm", "session", "ok", "prompt_tokens", "cached_tokens", "prefilled",
                    "opening")}), file=sys.stderr, flush=True)
        finally:
            replica.stop()
    return rows


def one_session(arm: str, number: int, args: argparse.Namespace, base: Path, repo: Path,
                engine: LlamaServerProcess, url: str, log: ProxyLog) -> Row:
    # One user: every session runs in the same HOME and repository, so their system prompts
    # are the same (Claude Code writes HOME's memory path into it).
    root = base / "user"
    if not root.exists():
        root.mkdir()
        (root / "work").symlink_to(repo, target_is_directory=True)
    session = AgentSession("claude", url, root, executable=ensure_agent("claude", quiet=True),
                           timeout=args.turn_timeout)
    before = prefilled(engine)
    started = time.monotonic()
    turn = session.turn(f"Say hello to {NAMES[(number - 1) % len(NAMES)]}.")
    seconds = time.monotonic() - started
    lines = log.wait_for("request", 1, timeout=5)
    requests = [e for e in lines if e.get("event") == "request"]
    main = max(requests, key=lambda e: e.get("prompt_tokens") or 0, default={})
    openings = [e for e in lines if e.get("event") in ("opening saved", "opening restored")
                and e.get("session") == main.get("session")]
    prompt, cached = main.get("prompt_tokens"), main.get("cached_tokens")
    held = held_prompt(engine, base / "slots", main.get("slot"), number, prompt)
    row: Row = {
        "arm": arm, "session": number, "ok": turn.ok and main.get("outcome") == "ok",
        "cli_seconds": round(seconds, 1), "requests": len(requests),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "prefilled": prefilled(engine) - before,
        # "restored 10084", "saved 12500": what prefixpin did for the session, in order
        "opening": [f"{e['event'].removeprefix('opening ')} {e['tokens']}" for e in openings],
        "ttft_ms": main.get("ttft_ms"), "decision": main.get("decision"),
    }
    if held is not None and prompt is not None and cached is not None:
        row["main_prefilled"] = prompt - cached
        if previous := PROMPTS.get(arm):
            row["differs"] = prompt - common_prefix(held, previous)
        PROMPTS[arm] = held
    return row


PROMPTS: dict[str, list[int]] = {}  # per arm, the previous session's prompt


def held_prompt(engine: LlamaServerProcess, slots: Path, slot: int | None, number: int,
                prompt: int | None) -> list[int] | None:
    """The session's prompt as the engine holds it: its slot saved (under a name prefixpin
    never touches) and the file's token list read back."""
    if slot is None or prompt is None:
        return None
    name = f"bench-s{number}.bin"
    response = httpx.post(f"{engine.url}/slots/{slot}?action=save", json={"filename": name},
                          timeout=60)
    response.raise_for_status()
    return read_slot_tokens(slots / name)[:prompt]


def verdicts(rows: list[Row]) -> tuple[list[str], bool]:
    """The per-session findings, and whether every later session of the openings arm
    prefilled at most what differs + SLACK."""
    lines, met = [], True
    by_arm: dict[str, dict[int, Row]] = {}
    for row in rows:
        by_arm.setdefault(row["arm"], {})[row["session"]] = row
    on, off = by_arm.get("openings", {}), by_arm.get("no-openings", {})
    for number in sorted(on):
        row = on[number]
        if number == 1:
            continue
        ok = ("main_prefilled" in row
              and row["main_prefilled"] <= row["differs"] + SLACK)
        met &= ok
        other = off.get(number)
        versus = (f"; without openings {other['prefilled']} prefilled "
                  f"({other['prefilled'] / max(row['prefilled'], 1):.1f}x)"
                  if other else "")
        lines.append(f"session {number}: prompt {row['prompt_tokens']}, openings "
                     f"{', '.join(row['opening']) or '-'}, differs {row.get('differs')}, "
                     f"prefilled {row.get('main_prefilled')} for its request "
                     f"({row['prefilled']} by the engine in all){versus}: "
                     f"{'met' if ok else 'MISSED'}")
    return lines, met


def run_md(args: argparse.Namespace, rows: list[Row], lines: list[str], met: bool,
           claude: str) -> str:
    table = ["| arm | session | prompt | cached | prefilled (engine) | opening | TTFT ms |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        opening = ", ".join(r["opening"]) or "-"
        table.append(f"| {r['arm']} | {r['session']} | {r['prompt_tokens']} | "
                     f"{r['cached_tokens']} | {r['prefilled']} | {opening} | {r['ttft_ms']} |")
    return "\n".join([
        "# Run: openings with the real Claude Code (tiny hybrid qwen35)", "",
        "```", " ".join(["python -m bench.openings", *sys.argv[1:]]), "```", "",
        *host_lines(shared=True), f"- repository: {git_revision(REPO)}",
        f"- Claude Code: {claude}",
        f"- llama-server: qwen35-agent (random weights, Qwen3.5's template), {args.slots} "
        f"slots of {args.ctx} tokens, {' '.join(ENGINE_CAP_ARGS)} --cache-ram 0, "
        f"{args.threads} thread(s)", "",
        "Weights are random: only the engine's cache mechanics are real.", "",
        *table, "",
        f"Target (each later session of the openings arm prefills at most what its prompt "
        f"does not share with the previous session's + {SLACK}): "
        f"{'met' if met else 'MISSED'}", "",
        *[f"- {line}" for line in lines], "", *READING])


READING = [
    "## Reading", "",
    "- Claude Code's first prompt here is about 12.6k tokens: ~10.1k of system prompt and",
    "  tools (the template's opening), ~150 of the first user turn's reminder that every",
    "  session shares, then its prompt and the `# Environment` system message, which sit",
    "  after the prompt and so cannot be shared as a prefix (~2.3k tokens).",
    "- The second session restores the first's opening and saves a longer one (its",
    "  reminder too); every later one restores that and prefills only what its prompt does",
    "  not share with its sibling's.",
    "- Without openings, a new session on an empty slot prefills everything; one on a",
    "  sibling's slot starts from the engine's checkpoint at that sibling's first user turn.",
    "- Straight at llama-server there is no answer to compare: Qwen3.5's template refuses",
    "  Claude Code's `system` message after the first user turn (500 \"System message must",
    "  be at the beginning\", retried by Claude Code until it gives up).",
    "- TTFT is this shared 2-core machine's, with a tiny model: read the token counts.", ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.openings",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=32768, help="context per slot")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--turn-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    claude = str(ensure_agent("claude", quiet=True))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="prefixpin-openings-") as tmp:
        for arm in ARMS:
            rows += run_arm(arm, args, Path(tmp))
    lines, met = verdicts(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sessions.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "RUN.md").write_text(run_md(args, rows, lines, met, claude))
    print("\n".join(lines))
    return 0 if met and all(r["ok"] for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())

"""The agent bench (issue 17): the real OpenCode, Claude Code and Codex CLIs, several
multi-turn sessions per CLI on fewer slots than sessions, against llama-server directly and
through prefixpin, side by side in one run.

    python bench/agents/run.py                     # every CLI, every condition, both arms
    python bench/agents/run.py --quick             # smoke: OpenCode, default, 2 x 2 turns
    python bench/agents/run.py --clis codex --conditions restart --out /tmp/agents

Per CLI, ``--sessions`` sessions of ``--turns`` turns, interleaved (s1t1, s2t1, s3t1, s1t2,
...) on a llama-server with ``--slots`` slots, so the sessions evict each other. Each
session has its own HOME; the sessions of one CLI share one working directory (their system
prompts share a prefix, as several agents in one repository do). The CLIs run headless, one
turn at a time (``tests.rig.agent_clis``).

Arms, each against a freshly started llama-server (SmolLM2-135M, ``ENGINE_CAP_ARGS``,
``--slot-save-path``, ``--metrics``): ``direct`` (the CLIs' base URL is llama-server) and
``prefixpin`` (``prefixpin serve --upstream ENGINE``, its own process, parking into the
engine's save directory). Conditions: ``default`` (llama-server's default flags: its host
prompt cache ``--cache-ram`` on), ``cache-ram-0`` and ``restart`` (default flags, and the
engine is stopped and started again on the same port and save directory between turn 2 and
turn 3 of every session; prefixpin keeps running, and turn 3 waits for its /healthz).

Both arms are measured the same way, by a recording relay the CLIs talk to
(``bench.agents.relay``): per request, the TTFT (request in to the first SSE event with
generated text) and the answer's usage; per turn, the tokens llama-server prefilled (its
``llamacpp:prompt_tokens_total`` around the CLI's run). A turn's main request is the one
with tools, else the biggest body (OpenCode's first turn also asks for a title).

Writes ``--out``: ``rows.jsonl`` (a turn each), ``arms.jsonl`` (an arm run each),
``prefixpin-events.jsonl`` (prefixpin's own log events: request, park, restore, restart),
``summary.json``, ``table.md``, ``ttft.png``, ``prefill.png`` and ``RUN.md``. Exit status 1
if a turn failed, 2 if a prefixpin follow-up turn did not reuse its previous prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx

from bench.agents.relay import Exchange, Relay, serve_relay
from bench.agents.report import (
    SLACK,
    kept_whole,
    read_jsonl,
    render,
    reuses,
    side_by_side,
    summarize,
)
from bench.provenance import git_revision, host_lines
from tests.rig.agent_clis import CLIS, ENGINE_CAP_ARGS, AgentSession, Cli
from tests.rig.agents import AGENTS, ensure_agent
from tests.rig.llama_process import LlamaServerProcess, restart, run_llama_server
from tests.rig.replica_process import ReplicaProcess, start_replica
from tests.rig.scrape import metric, prefilled
from tests.rig.tiny_models import TINY_MODELS, ensure_tiny_model

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "results" / "agents"
CONDITIONS = ("default", "cache-ram-0", "restart")
ARMS = ("direct", "prefixpin")
CONDITION_FLAGS: dict[str, tuple[str, ...]] = {"default": (), "cache-ram-0": ("--cache-ram", "0"),
                                               "restart": ()}
NAMES = ("Ann", "Bob", "Cleo", "Dev", "Eve", "Finn")
TURN_TIMEOUT_S = 300.0
RESTART_BEFORE_TURN = 3
PROXY_EVENTS = ("request", "parked", "restored", "restore declined", "park failed",
                "engine restarted", "upstream unreachable", "upstream ready", "parking paused",
                "parking resumed", "evicted", "prefix break", "repaired", "declined")

Row = dict[str, Any]


def prompt_for(session: int, turn: int) -> str:
    """Distinct per session from the first turn on (``session`` and ``turn`` from 1)."""
    name = NAMES[(session - 1) % len(NAMES)]
    if turn == 1:
        return f"Say hello to {name}."
    if turn == 2:
        return "Now say goodbye."
    if turn == 3:
        return "Thanks, that is all."
    return f"One more thing: count to {turn}."


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/agents/run.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--clis", default=",".join(CLIS))
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--model", default="smollm2", help="a rig model (smollm2) or a tiny "
                        "random-weight one (qwen35-agent: Qwen3.5's hybrid and template, "
                        "its reply ending at once)")
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="one more llama-server argument (repeat), e.g. "
                        "--engine-arg=--reasoning-budget --engine-arg=0")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=8192, help="context per slot")
    parser.add_argument("--threads", type=int, default=1,
                        help="llama-server threads (1: robust on a shared 2-core machine)")
    parser.add_argument("--turn-timeout", type=float, default=TURN_TIMEOUT_S)
    parser.add_argument("--quick", action="store_true",
                        help="smoke: OpenCode, default flags, 2 sessions x 2 turns")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--keep-work", action="store_true",
                        help="keep the work directory (HOMEs, logs, slot files)")
    parser.add_argument("--render-only", action="store_true",
                        help="run nothing: re-render --out's tables, plots and RUN.md from "
                             "its rows")
    args = parser.parse_args(argv)
    if args.quick:
        args.clis, args.conditions, args.sessions, args.turns = "opencode", "default", 2, 2
    args.cli_list = [c for c in args.clis.split(",") if c]
    args.condition_list = [c for c in args.conditions.split(",") if c]
    args.arm_list = [a for a in args.arms.split(",") if a]
    for given, known, flag in ((args.cli_list, CLIS, "--clis"),
                               (args.condition_list, CONDITIONS, "--conditions"),
                               (args.arm_list, ARMS, "--arms")):
        if not given or set(given) - set(known):
            parser.error(f"{flag}: choose from {list(known)}; got {given}")
    return args


# ---------------------------------------------------------------- prefixpin's log

@dataclass(slots=True)
class ProxyLog:
    """prefixpin's JSON log lines, read on from where the last read stopped."""

    path: Path
    offset: int = 0
    events: list[Row] = field(default_factory=list)

    def read(self) -> list[Row]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1  # a line being written stays for the next read
        self.offset += end
        new = []
        for line in data[:end].decode("utf-8", "replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    new.append(json.loads(line))
        self.events += new
        return new

    def wait_for(self, event: str, count: int, timeout: float) -> list[Row]:
        """Read until ``count`` lines of ``event`` came in (or ``timeout``); all new lines."""
        got: list[Row] = []
        deadline = time.monotonic() + timeout
        while True:
            got += self.read()
            if sum(1 for e in got if e.get("event") == event) >= count:
                return got
            if time.monotonic() > deadline:
                return got
            time.sleep(0.1)


def wait_parking(replica: ReplicaProcess, timeout: float = 60.0) -> Row:
    """The lane's slots known and parking on; the /sessions view."""
    deadline = time.monotonic() + timeout
    view: Row = {}
    while time.monotonic() < deadline:
        view = httpx.get(f"{replica.admin_url}/sessions", timeout=10).json()
        backends = view.get("backends") or []
        if backends and all(b["slots"] and b["up"] and b.get("parking") for b in backends):
            return view
        time.sleep(0.2)
    raise RuntimeError(f"prefixpin's parking is not on: {view}\n{replica.log_tail()}")


def wait_proxy_healthy(replica: ReplicaProcess, timeout: float = 120.0) -> float:
    """Poll prefixpin's /healthz until 200 (each call probes the engine: the watch learns
    of the restart from it); seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{replica.url}/healthz", timeout=10).status_code == 200:
                return time.monotonic() - started
        time.sleep(0.2)
    raise TimeoutError(f"prefixpin /healthz not 200 after {timeout} s\n{replica.log_tail()}")


# ---------------------------------------------------------------- one arm run

@dataclass(slots=True)
class Seen:
    """What RUN.md says of the engines and proxies."""

    argvs: dict[str, list[str]] = field(default_factory=dict)
    proxy_argv: list[str] = field(default_factory=list)
    props: Row = field(default_factory=dict)
    cli_versions: dict[str, str] = field(default_factory=dict)


def main_exchange(exchanges: list[Exchange]) -> Exchange | None:
    """The turn's main generation request: one with tools, else the biggest body."""
    generation = [e for e in exchanges if e.api is not None and e.method == "POST"]
    if not generation:
        return None
    return max(generation, key=lambda e: (e.tools > 0, e.body_bytes))


def proxy_line_for(lines: list[Row], main: Exchange | None) -> Row | None:
    """prefixpin's request line of the main request: equal prompt tokens, else the
    largest prompt."""
    requests = [e for e in lines if e.get("event") == "request"]
    if not requests:
        return None
    if main is not None and main.prompt_tokens is not None:
        for line in requests:
            if line.get("prompt_tokens") == main.prompt_tokens:
                return line
    return max(requests, key=lambda e: e.get("prompt_tokens") or 0)


def _compact(line: Row | None) -> Row | None:
    if line is None:
        return None
    return {k: v for k, v in line.items() if k not in ("ts", "level", "event")}


def make_session(cli: Cli, url: str, base: Path, repo: Path, number: int,
                 timeout: float) -> AgentSession:
    """Its own HOME under ``base``; its working directory the CLI's one ``repo``."""
    root = base / f"s{number}"
    root.mkdir(parents=True)
    (root / "work").symlink_to(repo, target_is_directory=True)
    return AgentSession(cli, url, root, executable=ensure_agent(cli, quiet=True),
                        timeout=timeout)


@contextlib.contextmanager
def arm_upstream(arm: str, engine: LlamaServerProcess, log_path: Path, index_dir: Path,
                 seen: Seen) -> Iterator[ReplicaProcess | None]:
    if arm == "direct":
        yield None
        return
    replica = start_replica([engine.url], log_path, args=["--park-index-dir", str(index_dir)])
    try:
        seen.proxy_argv = seen.proxy_argv or [
            "prefixpin", "serve", "--upstream", "ENGINE", "--host", "127.0.0.1", "--port", "P",
            "--admin-listen", "127.0.0.1:P2", "--park-index-dir", "DIR"]
        wait_parking(replica)
        yield replica
    finally:
        replica.stop()


def run_arm(cli: Cli, condition: str, arm: str, relay: Relay, relay_url: str, work: Path,
            args: argparse.Namespace, seen: Seen, all_events: list[Row]
            ) -> tuple[list[Row], Row]:
    tag = f"{cli}-{condition}-{arm}"
    base = work / "agent"  # the same paths in every arm: the CLIs render the same prompts
    shutil.rmtree(base, ignore_errors=True)
    repo = base / "repo"
    repo.mkdir(parents=True)
    slot_dir = work / "slots" / tag
    slot_dir.mkdir(parents=True)
    log_path = work / "logs" / f"prefixpin-{tag}.log"
    extra = [*ENGINE_CAP_ARGS, *CONDITION_FLAGS[condition], *args.engine_arg]
    rows: list[Row] = []
    run: Row = {"cli": cli, "condition": condition, "arm": arm, "restart": None}
    model = ensure_tiny_model(args.model) if args.model in TINY_MODELS else args.model
    with run_llama_server(model, slots=args.slots, ctx_per_slot=args.ctx,
                          threads=args.threads, slot_save_path=slot_dir,
                          extra=extra) as engine:
        seen.argvs.setdefault(condition, list(engine.args))
        if not seen.props:
            seen.props = httpx.get(f"{engine.url}/props", timeout=10).json()
        with arm_upstream(arm, engine, log_path, work / "park-index" / tag, seen) as replica:
            relay.upstream = replica.url if replica is not None else engine.url
            relay.bodies = work / "bodies" / tag if args.keep_work else None
            log = ProxyLog(log_path)
            log.read()
            sessions = [make_session(cli, relay_url, base, repo, s, args.turn_timeout)
                        for s in range(1, args.sessions + 1)]
            previous: dict[int, int | None] = {}
            restarted = False
            started = time.monotonic()
            seq = 0
            for turn in range(1, args.turns + 1):
                if condition == "restart" and turn == min(RESTART_BEFORE_TURN, args.turns) > 1:
                    run["restart"] = restart_engine(engine, replica, log)
                    restarted = True
                for number, session in enumerate(sessions, 1):
                    row = one_turn(session, number, turn, engine, relay, replica, log, args)
                    row.update(cli=cli, condition=condition, arm=arm, seq=seq,
                               after_restart=restarted)
                    row["prev_prompt_tokens"] = previous.get(number)
                    row["reused"] = reuses(row["cached_tokens"], row["prev_prompt_tokens"])
                    previous[number] = row["prompt_tokens"]
                    rows.append(row)
                    seq += 1
                    print(progress(row), file=sys.stderr, flush=True)
            run["wall_s"] = round(time.monotonic() - started, 1)
            if replica is not None:
                run["parks"] = metric(replica.admin_url, "prefixpin_parks_total",
                                      outcome="parked")
                run["restores"] = metric(replica.admin_url, "prefixpin_restores_total",
                                         outcome="restored")
                view = httpx.get(f"{replica.admin_url}/sessions", timeout=10).json()
                all_events.append({"event": "sessions view at the end", "tag": tag,
                                   "view": view})
        if replica is not None:
            log.read()
            all_events += [{"tag": tag, **e} for e in log.events
                           if e.get("event") in PROXY_EVENTS]
    return rows, run


def restart_engine(engine: LlamaServerProcess, replica: ReplicaProcess | None,
                   log: ProxyLog) -> Row:
    """Stop llama-server and start it again (same port, flags, save directory); with
    prefixpin, wait until its /healthz is 200 again and it logged the restart."""
    started = time.monotonic()
    restart(engine)
    out: Row = {"engine_s": round(time.monotonic() - started, 1)}
    if replica is not None:
        out["healthz_s"] = round(wait_proxy_healthy(replica), 2)
        lines = log.wait_for("engine restarted", 1, timeout=30)
        out["proxy_saw_restart"] = any(e.get("event") == "engine restarted" for e in lines)
    print(f"  engine restarted: {out}", file=sys.stderr, flush=True)
    return out


def one_turn(session: AgentSession, number: int, turn: int, engine: LlamaServerProcess,
             relay: Relay, replica: ReplicaProcess | None, log: ProxyLog,
             args: argparse.Namespace) -> Row:
    prompt = prompt_for(number, turn)
    mark = relay.mark()
    load1 = os.getloadavg()[0]
    before = prefilled([engine])
    result = session.turn(prompt, timeout=args.turn_timeout)
    exchanges = relay.settle(mark)
    engine_prefilled = prefilled([engine]) - before
    generation = [e for e in exchanges if e.api is not None and e.method == "POST"]
    main = main_exchange(exchanges)
    lines: list[Row] = []
    if replica is not None:
        lines = log.wait_for("request", len(generation), timeout=5)
    line = proxy_line_for(lines, main)
    failed = [e for e in generation if e.error or (e.status or 0) >= 400]
    ok = result.ok and main is not None and not failed and main.prompt_tokens is not None
    error = None
    if not ok:
        error = (f"CLI {'timed out' if result.returncode is None else 'exit'} "
                 f"{result.returncode}; " if not result.ok else "") + "; ".join(
            f"{e.path}: {e.error}" for e in failed) + (
            "" if main is not None else "no generation request")
        if not result.ok:
            error += f" | stderr: {result.stderr[-600:]}"
    return {
        "session": number, "turn": turn, "prompt": prompt, "ok": ok, "error": error,
        "returncode": result.returncode, "cli_seconds": round(result.seconds, 2),
        "answer": result.stdout.strip()[-200:],
        "requests": len(generation),
        "prompt_tokens": main.prompt_tokens if main else None,
        "cached_tokens": main.cached_tokens if main else None,
        "engine_prefilled": engine_prefilled,
        "ttft_s": round(main.ttft_s, 3) if main and main.ttft_s is not None else None,
        "side_prompt_tokens": sum(e.prompt_tokens or 0 for e in generation if e is not main),
        "main": main.row() if main else None,
        "exchanges": [e.row() for e in exchanges if e is not main],
        "proxy": _compact(line),
        "proxy_events": [e.get("event") for e in lines if e.get("event") != "request"],
        "load1": round(load1, 2),
    }


def progress(row: Row) -> str:
    proxy = row.get("proxy") or {}
    decision = f" [{proxy.get('decision')}: {proxy.get('reason')}]" if proxy else ""
    return (f"  {row['cli']:>8} {row['condition']:>11} {row['arm']:>9} s{row['session']}"
            f"t{row['turn']}: prompt {row['prompt_tokens']} cached {row['cached_tokens']} "
            f"prev {row['prev_prompt_tokens']} engine {row['engine_prefilled']:.0f} "
            f"ttft {row['ttft_s']} s cli {row['cli_seconds']} s reqs {row['requests']}"
            f"{decision}" + (f" ERROR {row['error']}" if row["error"] else ""))


# ---------------------------------------------------------------- RUN.md

def findings(rows: list[Row]) -> list[str]:
    """The claims the bench checks, each stated as it came out: per CLI x condition, the
    prefixpin follow-ups that reused their previous prompt (within the slack) and those
    that kept all of it, with prefixpin's own account of each that did not; then every
    turn where prefixpin kept less or prefilled more than direct."""
    out = []
    for cli in dict.fromkeys(r["cli"] for r in rows):
        for condition in dict.fromkeys(r["condition"] for r in rows if r["cli"] == cli):
            mine = [r for r in rows if r["cli"] == cli and r["condition"] == condition
                    and r["arm"] == "prefixpin" and r["turn"] > 1]
            if not mine:
                continue
            whole = [r for r in mine if kept_whole(r["cached_tokens"], r["prev_prompt_tokens"])]
            reused = [r for r in mine if r["reused"]]
            out.append(f"{cli}, {condition}: prefixpin follow-ups reusing their previous "
                       f"prompt (±{SLACK}) {len(reused)} of {len(mine)}, keeping all of it "
                       f"{len(whole)} of {len(mine)}" + ("" if len(whole) == len(mine)
                                                         else "; not all of it:"))
            for r in mine:
                if r in whole:
                    continue
                proxy = r.get("proxy") or {}
                restart = ", after the engine restart" if r.get("after_restart") else ""
                out.append(f"  - s{r['session']} turn {r['turn']}{restart}: prompt "
                           f"{r['prompt_tokens']}, cached {r['cached_tokens']} of the previous "
                           f"{r['prev_prompt_tokens']}; prefixpin: decision "
                           f"{proxy.get('decision')!r}, reason {proxy.get('reason')!r}, slot "
                           f"{proxy.get('slot')}, session {proxy.get('session')}"
                           + (f", cache {proxy['cache']!r}" if proxy.get("cache") else "")
                           + (f"; events {', '.join(r['proxy_events'])}"
                              if r.get("proxy_events") else ""))
    for case in side_by_side(rows):
        p, d = case["prefixpin"], case["direct"]
        out.append(f"worse than direct: {p['cli']}, {p['condition']}, s{p['session']} turn "
                   f"{p['turn']}: cached {p['cached_tokens']} vs {d['cached_tokens']}, engine "
                   f"prefilled {p['engine_prefilled']:.0f} vs {d['engine_prefilled']:.0f}")
    return out


def cold_turns(rows: list[Row]) -> list[str]:
    """What a cold turn cost: the first turn of each direct arm run (a fresh engine)."""
    out = []
    for r in rows:
        if r["arm"] == "direct" and r["turn"] == 1 and r["session"] == 1 and r["ttft_s"]:
            rate = (r["engine_prefilled"] or 0) / r["ttft_s"]
            out.append(f"{r['cli']} ({r['condition']}): {r['prompt_tokens']} prompt tokens, "
                       f"{r['engine_prefilled']:.0f} prefilled in the turn, TTFT "
                       f"{r['ttft_s']:.1f} s (~{rate:.0f} tok/s), the CLI's run "
                       f"{r['cli_seconds']:.1f} s")
    return out


def cold_probes(path: Path) -> list[str]:
    """The one-off cold turns of ``cold_turn.py`` (other models) kept beside the results."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        rate = f" (~{r['engine_prefilled'] / r['ttft_s']:.0f} tok/s)" if r.get("ttft_s") else ""
        more = "".join(f" {a}" for a in r.get("llama_args") or [])
        out.append(f"{r['cli']} on {r['model']} ({r['ctx']} ctx, {r['threads']} thread(s)"
                   f"{', --swa-full' if r['swa_full'] else ''}{more}; {r['date']}, load "
                   f"{r['load_before'][0]}): {r['prompt_tokens']} prompt tokens, "
                   f"{r['engine_prefilled']:.0f} prefilled, TTFT {r['ttft_s']} s{rate}, the "
                   f"CLI's run {r['cli_seconds']} s"
                   + ("" if r["ok"] else " (the turn did not end: killed at its timeout)")
                   + " (`bench/agents/cold_turn.py`)")
    return out


def run_md(command: str, table: str, seen: Seen, notes: list[str], found: list[str],
           cold: list[str]) -> str:
    props = seen.props
    settings = props.get("default_generation_settings", {})
    return "\n".join([
        "# Run: the agent bench (real CLIs, direct vs prefixpin)", "", "```", command, "```", "",
        *host_lines(shared=True),
        f"- repository: {git_revision(REPO)}",
        "- CLIs: " + ", ".join(f"{k} {v}" for k, v in seen.cli_versions.items()),
        f"- llama-server build_info: {props.get('build_info', 'unknown')}; model "
        f"{Path(str(props.get('model_path', 'unknown'))).name}; {props.get('total_slots')} "
        f"slots of {settings.get('n_ctx', '?')} tokens; started fresh for every arm run "
        "(nice 10, as the rig starts it)",
        *[f"- llama-server, {k}: `{shlex.join(v)}`" for k, v in seen.argvs.items()],
        f"- prefixpin: `{shlex.join(seen.proxy_argv)}` (its own process, default settings; "
        "it finds the engine's --slot-save-path on its command line in /proc)",
        *[f"- {note}" for note in notes], "", generated_md(table, found, cold)])


GENERATED = "## What a cold turn costs"  # RUN.md from here on is re-rendered from the rows


def generated_md(table: str, found: list[str], cold: list[str]) -> str:
    return "\n".join([
        GENERATED, "", *[f"- {c}" for c in cold], "",
        "## Findings (computed)", "", *[f"- {f}" if not f.startswith("  ") else f
                                        for f in found], "",
        "## Summary", "", table,
        "Every turn: `table.md`; rows: `rows.jsonl` (the main request's relay record, the "
        "turn's other requests, prefixpin's request log line); prefixpin's log events: "
        "`prefixpin-events.jsonl`; plots: `ttft.png`, `prefill.png`.", ""])


def render_only(out: Path) -> int:
    """Re-render table.md, the plots, summary.json's summary and RUN.md from the cold-turn
    section on, from ``out``'s rows; what RUN.md says before that section is kept."""
    rows, runs = read_jsonl(out / "rows.jsonl"), read_jsonl(out / "arms.jsonl")
    table = render(out, rows, runs)
    summary_path = out / "summary.json"
    if summary_path.exists():
        data = json.loads(summary_path.read_text())
        data["summary"] = summarize(rows, runs)
        summary_path.write_text(json.dumps(data, indent=2) + "\n")
    run_path = out / "RUN.md"
    head = run_path.read_text().split(GENERATED)[0] if run_path.exists() else ""
    cold = cold_turns(rows) + cold_probes(out / "cold-turns.jsonl")
    run_path.write_text(head + generated_md(table, findings(rows), cold))
    print(table)
    return 0


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.render_only:
        return render_only(args.out)
    work = Path(tempfile.mkdtemp(prefix="prefixpin-agents-"))
    seen = Seen(cli_versions={c: AGENTS[c].version for c in args.cli_list})
    for cli in args.cli_list:
        ensure_agent(cli, quiet=True)
    load_before = os.getloadavg()
    began = time.monotonic()
    rows: list[Row] = []
    runs: list[Row] = []
    events: list[Row] = []
    relay = Relay()
    with serve_relay(relay) as relay_url:
        for i, cli in enumerate(args.cli_list):
            for j, condition in enumerate(args.condition_list):
                # Counterbalanced: direct first on every other CLI x condition.
                arms = args.arm_list if (i + j) % 2 == 0 else args.arm_list[::-1]
                for arm in arms:
                    print(f"agent bench: {cli}, {condition}, {arm}", file=sys.stderr,
                          flush=True)
                    arm_rows, run = run_arm(cli, condition, arm, relay, relay_url, work, args,
                                            seen, events)
                    rows += arm_rows
                    runs.append(run)
    runtime = time.monotonic() - began
    args.out.mkdir(parents=True, exist_ok=True)
    for name, items in (("rows.jsonl", rows), ("arms.jsonl", runs),
                        ("prefixpin-events.jsonl", events)):
        with (args.out / name).open("w") as out:
            for item in items:
                out.write(json.dumps(item) + "\n")
    table = render(args.out, rows, runs)
    summary = summarize(rows, runs)
    (args.out / "summary.json").write_text(json.dumps(
        {"sessions": args.sessions, "turns": args.turns, "slots": args.slots,
         "summary": summary, "arm_runs": runs}, indent=2) + "\n")
    restarts = [f"{r['cli']} {r['arm']}: {r['restart']}" for r in runs if r.get("restart")]
    notes = [
        f"{len(args.cli_list)} CLI(s) x {len(args.condition_list)} condition(s) x "
        f"{len(args.arm_list)} arms; per arm run {args.sessions} sessions x {args.turns} "
        f"turns, interleaved (s1t1, s2t1, ..., s1t2, ...), on {args.slots} slots of "
        f"{args.ctx} tokens; {args.threads} llama-server thread(s); turn timeout "
        f"{args.turn_timeout:.0f} s",
        "prompts: turn 1 \"Say hello to <Ann|Bob|Cleo|...>.\", turn 2 \"Now say goodbye.\", "
        "turn 3 \"Thanks, that is all.\"; each session its own HOME, the sessions of one CLI "
        "one shared working directory (the same paths in every arm)",
        f"reuse: a follow-up's cached tokens >= its session's previous prompt - {SLACK}; "
        "engine prefilled: the delta of llama-server's llamacpp:prompt_tokens_total around "
        "the CLI's run (every request of the turn); TTFT: the relay's clock, request in to "
        "the first SSE event carrying generated text, of the main request",
        "arm order counterbalanced: direct first on every other CLI x condition",
        *([f"restarts (engine stop+start, then prefixpin's /healthz): {'; '.join(restarts)}"]
          if restarts else []),
        "load average (1, 5, 15 min) at start {:.2f} {:.2f} {:.2f}, at end {:.2f} {:.2f} "
        "{:.2f}; per turn in rows.jsonl (`load1`): token counts do not depend on load, "
        "times do".format(*load_before, *os.getloadavg()),
        f"runtime {runtime / 60:.1f} min",
    ]
    command = shlex.join(["python", "bench/agents/run.py", *argv])
    found = findings(rows)
    cold = cold_turns(rows) + cold_probes(args.out / "cold-turns.jsonl")
    (args.out / "RUN.md").write_text(run_md(command, table, seen, notes, found, cold))
    print(table)
    print("\n".join(found))
    print(f"runtime {runtime / 60:.1f} min; results in {args.out}")
    if args.keep_work:
        print(f"work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if any(not r["ok"] for r in rows):
        return 1
    missed = [r for r in rows if r["arm"] == "prefixpin" and r["turn"] > 1 and not r["reused"]]
    return 2 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())

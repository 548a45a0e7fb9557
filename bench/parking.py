"""Parking bench: six agent sessions on a two-slot llama-server, turns interleaved.

    python bench/parking.py                      # all arms, 5 rounds, results in
                                                 # bench/results/parking/
    python bench/parking.py --rounds 3 --out /tmp/park-smoke

Two measurements, each side by side in one run:

1. **Interleaved sessions.** Six sessions (the committed transcripts ``session-00`` ..
   ``session-05``, each extending only its own history) take turns round-robin for
   ``--rounds`` rounds on one llama-server with two slots. The figure is the number of
   prompt tokens the engine prefilled per turn after a session's first (prompt tokens minus
   cached tokens as the engine reports them), summed per session and compared with the
   same session run **alone** (its turns back to back on an otherwise idle engine). Arms:
   ``alone`` (the baseline), ``direct`` (llama-server itself: its own slot choice and its
   host-RAM prompt cache, ``--cache-ram`` at its default), ``no-parking`` (prefixpin with
   ``PREFIXPIN_PARKING=0``), ``parking`` (prefixpin with ``--park-dir`` = the engine's
   ``--slot-save-path``). Every arm gets a freshly started llama-server (empty slots,
   empty RAM cache) and, for the prefixpin arms, a freshly started proxy.
2. **Restore vs cold prefill.** A session of about ``--restore-tokens`` tokens is sent cold
   through the parking proxy, which then stops (a clean shutdown parks it); llama-server
   restarts; a new proxy gets the session's next turn, finds it in the park index and
   restores it: the proxy's restore time (file checks + the engine's restore,
   ``prefixpin_restore_seconds``) is compared with the engine's cold prefill of the same
   prompt (``timings.prompt_ms``); the two turns' TTFTs are listed beside them.

Outputs: ``rows.jsonl`` (one row per request), ``summary.json``, ``table.md``,
``prefill.png`` (prefilled tokens per turn, per arm) and ``RUN.md`` (command, machine,
versions, llama-server command line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.arms import TEMPLATES, check_arms_with_alone
from bench.clients.base import Request
from bench.clients.interleaved import InterleavedClient
from bench.engine import EngineAPI, EngineError, ManagedProcess, llama_server_argv
from bench.provenance import git_revision, host_lines
from bench.runner import HTTP_TIMEOUT, Turn, send_turn
from bench.transcript import Transcript, load_named
from bench.trees import operator_url
from tests.fakes.servers import free_port

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "parking"
SESSIONS = tuple(f"session-{i:02d}" for i in range(6))
ARMS = ("alone", "direct", "no-parking", "parking")
PROXY_ENV = {"no-parking": {"PREFIXPIN_PARKING": "0"}, "parking": {}}
TARGET_RATIO = 1.2  # parking's prefilled tokens per turn vs the session alone
TARGET_SPEEDUP = 20.0  # cold prefill / restore of a ~4k-token session

Row = dict[str, Any]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/parking.py", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="turns per session (default 5)")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma-separated subset of {','.join(ARMS)}")
    parser.add_argument("--restore-tokens", type=int, default=4000,
                        help="size of the session whose restore is timed (0: skip)")
    parser.add_argument("--threads", type=int, default=1, help="llama-server threads")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                        help="extra llama-server argument (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep-work", action="store_true",
                        help="keep the work directory (process logs, slot files)")
    args = parser.parse_args(argv)
    check_arms_with_alone(parser, args.arms, ARMS)
    return args


# ---------------------------------------------------------------- processes

@dataclass(slots=True)
class Rig:
    """One llama-server (restarted per arm) and the argv it runs with."""

    llama: ManagedProcess
    url: str
    slot_dir: Path
    work: Path

    def fresh_engine(self) -> None:
        self.llama.stop()
        for path in self.slot_dir.iterdir():
            if path.is_file():
                path.unlink()
        self.llama.start()

    def proxy(self, name: str, env: dict[str, str]) -> ManagedProcess:
        port = free_port()
        argv = [str(Path(sys.executable).parent / "prefixpin"), "serve", "--upstream", self.url,
                "--host", "127.0.0.1", "--port", str(port), "--park-dir", str(self.slot_dir)]
        return ManagedProcess(f"prefixpin[{name}]", argv, f"http://127.0.0.1:{port}/healthz",
                              self.work / f"prefixpin-{name}.log",
                              env={"PREFIXPIN_RETRY_GRACE_S": "0", **env})


def start_rig(args: argparse.Namespace, work: Path) -> Rig:
    from prefixpin.proxy.engine.models import ensure_model
    from tests.rig.llama_build import ensure_llama_server

    slot_dir = work / "slots"
    slot_dir.mkdir(parents=True)
    port = free_port()
    argv = llama_server_argv(
        ensure_llama_server(), ensure_model(args.model), port, slot_dir,
        ["-t", str(args.threads), "--chat-template-file",
         str(TEMPLATES / "chatml-tools.jinja"), *args.llama_arg])
    llama = ManagedProcess("llama-server", argv, f"http://127.0.0.1:{port}/health",
                           work / "llama-server.log")
    return Rig(llama, f"http://127.0.0.1:{port}", slot_dir, work)


# ---------------------------------------------------------------- requests

def schedule(transcripts: dict[str, Transcript], rounds: int, interleave: bool
             ) -> list[Request]:
    client = InterleavedClient()
    per_session = [[client.request(transcripts[name], step)
                    for step in range(min(rounds, len(transcripts[name].steps)))]
                   for name in SESSIONS]
    if not interleave:
        return [request for requests in per_session for request in requests]
    return [requests[i] for i in range(rounds) for requests in per_session
            if i < len(requests)]


def row_of(arm: str, seq: int, request: Request, turn: Turn, round_index: int) -> Row:
    final = turn.final.observation
    usage = final.usage or {}
    timings = final.timings or {}
    details = usage.get("prompt_tokens_details") or {}
    prompt = usage.get("prompt_tokens")
    cached = details.get("cached_tokens", timings.get("cache_n"))
    prefilled = timings.get("prompt_n")
    if prefilled is None and prompt is not None and cached is not None:
        prefilled = prompt - cached
    ttft = turn.ttft_s
    return {"arm": arm, "seq": seq, "session": request.session, "round": round_index,
            "step": request.step, "status": turn.final.status, "error": turn.final.error,
            "prompt_tokens": prompt, "cached_tokens": cached, "prefilled_tokens": prefilled,
            "prefill_ms": timings.get("prompt_ms"),
            "ttft_ms": None if ttft is None else round(ttft * 1000, 1)}


async def run_requests(arm: str, url: str, requests: list[Request],
                       before_session: Any = None) -> list[Row]:
    rows: list[Row] = []
    rounds: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
        for seq, request in enumerate(requests):
            if before_session is not None and request.session not in rounds:
                before_session()
            index = rounds.get(request.session, 0)
            rounds[request.session] = index + 1
            turn = await send_turn(client, url, request)
            if turn.final.error and "without sending a response" in turn.final.error:
                # llama-server closed a kept-alive connection: the request never reached it
                # (the proxy retries these itself; the direct arms need the same courtesy).
                turn = await send_turn(client, url, request)
            row = row_of(arm, seq, request, turn, index)
            rows.append(row)
            print(f"  {arm:>10} {request.session} round {index}: prompt {row['prompt_tokens']} "
                  f"cached {row['cached_tokens']} prefilled {row['prefilled_tokens']} "
                  f"ttft {row['ttft_ms']} ms", file=sys.stderr, flush=True)
    return rows


def run_arm(arm: str, rig: Rig, transcripts: dict[str, Transcript], rounds: int) -> list[Row]:
    rig.fresh_engine()
    engine = EngineAPI(rig.url)
    if arm == "alone":
        # Each session back to back on an idle engine: slots emptied before each one (the
        # RAM cache may still hold the shared system prompt: only turns after the first
        # count).
        return asyncio.run(run_requests(arm, rig.url, schedule(transcripts, rounds, False),
                                        engine.erase_slots))
    requests = schedule(transcripts, rounds, True)
    if arm == "direct":
        return asyncio.run(run_requests(arm, rig.url, requests))
    proxy = rig.proxy(arm, PROXY_ENV[arm])
    proxy.start()
    try:
        return asyncio.run(run_requests(arm, _url(proxy), requests))
    finally:
        proxy.stop()


# ---------------------------------------------------------------- restore vs cold

def metric_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def step_near(transcript: Transcript, engine_url: str, tokens: int) -> tuple[int, int]:
    """The step whose request is closest to ``tokens`` prompt tokens (measured by the
    engine's own template and tokenizer), and its size."""
    client = InterleavedClient()
    best = (0, 0)
    for step in range(len(transcript.steps)):
        body = client.request(transcript, step).body
        rendered = httpx.post(f"{engine_url}/apply-template", timeout=60,
                              json={"messages": body["messages"], "tools": body["tools"]})
        rendered.raise_for_status()
        count = len(httpx.post(f"{engine_url}/tokenize", timeout=60, json={
            "content": rendered.json()["prompt"], "add_special": True,
            "parse_special": True}).json()["tokens"])
        if abs(count - tokens) < abs(best[1] - tokens):
            best = (step, count)
    return best


def run_restore(rig: Rig, transcripts: dict[str, Transcript], tokens: int) -> dict[str, Any]:
    """The big session's turn goes cold through a parking proxy; the proxy stops (a clean
    shutdown parks what its slots hold), llama-server restarts (every slot empty), a new
    proxy starts: the session's next turn is rebuilt from the park index and restored."""
    rig.fresh_engine()
    big = transcripts["session-00"]
    step, size = step_near(big, rig.url, tokens)
    client = InterleavedClient()
    first = rig.proxy("parking", {})
    first.start()
    try:
        rows = asyncio.run(run_requests("restore", _url(first), [client.request(big, step)]))
    finally:
        first.stop()
    rig.llama.restart()
    second = rig.proxy("parking", {})
    second.start()
    try:
        before = httpx.get(f"{operator_url(_url(second))}/metrics", timeout=10).text
        rows += asyncio.run(run_requests("restore", _url(second),
                                         [client.request(big, step + 1)]))
        after = httpx.get(f"{operator_url(_url(second))}/metrics", timeout=10).text
    finally:
        second.stop()
    restores = (metric_value(after, 'prefixpin_restores_total{outcome="restored"}')
                - metric_value(before, 'prefixpin_restores_total{outcome="restored"}'))
    restore_s = (metric_value(after, "prefixpin_restore_seconds_sum")
                 - metric_value(before, "prefixpin_restore_seconds_sum"))
    cold, back = rows[0], rows[-1]
    return {
        "session": big.name, "step": step, "prompt_tokens_measured": size,
        "how": "parked at a clean proxy shutdown; llama-server restarted; restored by a new "
               "proxy from the park index",
        "cold_prompt_tokens": cold["prompt_tokens"], "cold_prefill_ms": cold["prefill_ms"],
        "cold_ttft_ms": cold["ttft_ms"], "restores": restores,
        "restore_ms": round(restore_s * 1000, 1),
        "engine_restore_ms": _engine_restore_ms(rig.work / "prefixpin-parking.log"),
        "returning_prompt_tokens": back["prompt_tokens"],
        "returning_cached_tokens": back["cached_tokens"],
        "returning_prefill_ms": back["prefill_ms"], "returning_ttft_ms": back["ttft_ms"],
        "speedup": (round(cold["prefill_ms"] / (restore_s * 1000), 1)
                    if restore_s > 0 and cold["prefill_ms"] else None),
        "ttft_speedup": (round(cold["ttft_ms"] / back["ttft_ms"], 1)
                         if back["ttft_ms"] and cold["ttft_ms"] else None),
        "rows": rows,
    }


def _url(proxy: ManagedProcess) -> str:
    return proxy.health_url.removesuffix("/healthz")


def _engine_restore_ms(log: Path) -> float | None:
    """The engine's own restore time, from the proxy's "restored" log line."""
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"event": "restored"' in line:
            value = json.loads(line).get("engine_ms")
            return float(value) if value is not None else None
    return None


# ---------------------------------------------------------------- figures

def per_session(rows: list[Row]) -> dict[str, dict[str, int]]:
    """Per arm and session: prefilled tokens summed over turns after the session's first."""
    sums: dict[str, dict[str, int]] = {}
    for row in rows:
        if row["round"] == 0 or row["prefilled_tokens"] is None:
            continue
        arm = sums.setdefault(row["arm"], {})
        arm[row["session"]] = arm.get(row["session"], 0) + int(row["prefilled_tokens"])
    return sums


def summarize(rows: list[Row], arms: list[str]) -> dict[str, Any]:
    sums = per_session(rows)
    alone = sums.get("alone", {})
    summary: dict[str, Any] = {}
    for arm in arms:
        arm_rows = [r for r in rows if r["arm"] == arm]
        later = [r for r in arm_rows if r["round"] > 0]
        turns = len(later)
        total = sum(sums.get(arm, {}).values())
        ratios = {s: round(sums[arm][s] / alone[s], 2) for s in sums.get(arm, {})
                  if alone.get(s)}
        summary[arm] = {
            "turns_after_first": turns,
            "prefilled_after_first": total,
            "prefilled_per_turn": round(total / turns, 1) if turns else None,
            "ratio_vs_alone": round(total / sum(alone.values()), 2) if alone else None,
            "worst_session_ratio": max(ratios.values()) if ratios else None,
            "session_ratios": ratios,
            "cached_fraction_after_first": _fraction(later),
            "ttft_s_after_first": round(sum(r["ttft_ms"] or 0 for r in later) / 1000, 1),
            "failed": sum(1 for r in arm_rows if r["status"] != 200 or r["error"]),
        }
    return summary


def _fraction(rows: list[Row]) -> float | None:
    prompt = sum(r["prompt_tokens"] or 0 for r in rows)
    cached = sum(r["cached_tokens"] or 0 for r in rows)
    return round(cached / prompt, 3) if prompt else None


def markdown(summary: dict[str, Any], restore: dict[str, Any] | None, rounds: int) -> str:
    lines = [
        f"## Six interleaved sessions on two slots, {rounds} rounds", "",
        "Prompt tokens the engine prefilled on each session's turns after its first "
        "(prompt − cached, as llama-server reports them), against the same sessions run "
        f"alone. Target for `parking`: ratio ≤ {TARGET_RATIO}.", "",
        "| arm | turns | prefilled tokens | per turn | ratio vs alone | worst session | "
        "cached fraction | summed TTFT (s) | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, s in summary.items():
        lines.append(
            f"| {arm} | {s['turns_after_first']} | {s['prefilled_after_first']} | "
            f"{s['prefilled_per_turn']} | {s['ratio_vs_alone']} | {s['worst_session_ratio']} | "
            f"{s['cached_fraction_after_first']} | {s['ttft_s_after_first']} | {s['failed']} |")
    if restore is not None:
        new = ((restore["returning_prompt_tokens"] or 0)
               - (restore["returning_cached_tokens"] or 0))
        lines += [
            "", "## Restore of a parked session vs its cold prefill", "",
            f"`{restore['session']}` at step {restore['step']} "
            f"({restore['cold_prompt_tokens']} prompt tokens) {restore['how']}; then its next "
            f"turn. Target: ≥ {TARGET_SPEEDUP:.0f}×.",
            "",
            "| figure | cold | parked → restored |", "|---|---|---|",
            f"| engine prefill of the parked prompt (ms) | {restore['cold_prefill_ms']:.0f} | "
            f"restore {restore['restore_ms']:.0f} (engine {restore['engine_restore_ms']}) |",
            f"| speedup (cold prefill / restore) | | **{restore['speedup']}×** |",
            f"| TTFT of the turn (ms) | {restore['cold_ttft_ms']:.0f} | "
            f"{restore['returning_ttft_ms']:.0f} (prefilled {new} new tokens) |",
        ]
    return "\n".join(lines) + "\n"


def plot(path: Path, rows: list[Row], arms: list[str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for arm in arms:
        ys = [r["prefilled_tokens"] or 0 for r in rows if r["arm"] == arm]
        if arm == "alone":  # in the interleaved order, for comparison turn by turn
            order = {(r["session"], r["round"]): r["prefilled_tokens"] or 0
                     for r in rows if r["arm"] == "alone"}
            ys = [order.get((r["session"], r["round"]), 0)
                  for r in rows if r["arm"] == arms[-1]]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", markersize=3, label=arm)
    ax.set_xlabel("request (interleaved order)")
    ax.set_ylabel("prompt tokens prefilled by the engine")
    ax.set_title("Six sessions, two slots: prefill per request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_md(command: str, table: str, props: dict[str, Any], llama_argv: list[str],
           notes: list[str]) -> str:
    settings = props.get("default_generation_settings", {})
    lines = [
        "# Run: parking", "", "```", command, "```", "",
        *host_lines(),
        f"- repository: {git_revision(REPO)}",
        f"- llama-server build_info: {props.get('build_info', 'unknown')}; model "
        f"{Path(str(props.get('model_path', 'unknown'))).name}; {props.get('total_slots')} "
        f"slots of {settings.get('n_ctx', '?')} tokens",
        f"- llama-server (restarted before every arm): `{shlex.join(llama_argv)}`",
        *[f"- {note}" for note in notes], "", table,
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    arms = [arm for arm in ARMS if arm in args.arms.split(",")]
    transcripts = {name: load_named(name) for name in SESSIONS}
    work = Path(tempfile.mkdtemp(prefix="prefixpin-parking-bench-"))
    rig = start_rig(args, work)
    load_before = os.getloadavg()
    rows: list[Row] = []
    restore: dict[str, Any] | None = None
    props: dict[str, Any] = {}
    try:
        rig.llama.start()
        props = EngineAPI(rig.url).props()
        for arm in arms:
            print(f"parking bench: arm {arm}", file=sys.stderr, flush=True)
            rows += run_arm(arm, rig, transcripts, args.rounds)
        if args.restore_tokens:
            print("parking bench: restore vs cold", file=sys.stderr, flush=True)
            restore = run_restore(rig, transcripts, args.restore_tokens)
    except EngineError as exc:
        print(f"parking bench: FAILED: {exc}; logs in {work}", file=sys.stderr)
        return 1
    finally:
        rig.llama.stop()
    summary = summarize(rows, arms)
    table = markdown(summary, restore, args.rounds)
    notes = [
        f"sessions: {', '.join(SESSIONS)} (bench/transcripts), extend-only requests "
        "(InterleavedClient), stream, max_tokens 8, temperature 0; x-session-id per session",
        f"{args.rounds} rounds; arms {', '.join(arms)}; each arm on a freshly started "
        "llama-server (empty slots and RAM cache), prefixpin arms freshly started with "
        "--park-dir = the engine's --slot-save-path and PREFIXPIN_RETRY_GRACE_S=0",
        "alone: each session's turns back to back, slots erased before each session",
        "load average (1, 5, 15 min) at start {:.2f} {:.2f} {:.2f}, at end {:.2f} {:.2f} "
        "{:.2f}: token counts do not depend on load, times do".format(
            *load_before, *os.getloadavg()),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "rows.jsonl").open("w") as out:
        for row in rows + (restore["rows"] if restore else []):
            out.write(json.dumps(row) + "\n")
    (args.out / "summary.json").write_text(json.dumps(
        {"rounds": args.rounds, "arms": summary,
         "restore": {k: v for k, v in (restore or {}).items() if k != "rows"} or None},
        indent=2) + "\n")
    (args.out / "table.md").write_text(table)
    plot(args.out / "prefill.png", rows, arms)
    command = shlex.join(["python", "bench/parking.py", *argv])
    (args.out / "RUN.md").write_text(run_md(command, table, props, rig.llama.argv, notes))
    print(table)
    print(f"results in {args.out}")
    if args.keep_work:
        print(f"work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    failed = sum(s["failed"] for s in summary.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

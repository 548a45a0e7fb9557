"""Replay a rewriting agent client against arms side by side and measure TTFT per turn.

    python bench/replay.py --scenario sliding-window --start-llama --arm direct \\
        --serve-arm passthrough --reps 2

Arms are OpenAI-compatible base URLs (``--arm name=URL``; ``--arm direct`` is the engine
itself) or proxies the harness starts against the engine (``--serve-arm
name[:ENV=VALUE,...]`` runs ``prefixpin serve --upstream ENGINE``). Reps are interleaved
and counterbalanced across arms (A B, B A, A B, ...), and before every rep of every arm
the engine is reset: restarted when the harness owns it (slots, RAM prompt cache and all;
managed proxies are restarted too), otherwise its slots are erased through the slot API.

Exit status: 0 on success; 1 if a request failed; 2 if the run did not reproduce the
scenario's regime (no rewrite where the client claims one, too few sessions for the
slots, no resend) or the command line is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench import report
from bench.arms import Arm, Rig, build_arms, rep_order, start_llama
from bench.clients.base import Request
from bench.engine import EngineAPI, EngineError
from bench.provenance import run_md
from bench.rewrite_check import Observed, RegimeError, check_resends, check_slots, verify
from bench.runner import HTTP_TIMEOUT, Turn, send_turn
from bench.scenarios import SCENARIOS, Scenario
from bench.transcript import load_named

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    parser.add_argument("--arm", action="append", default=[], metavar="NAME[=URL]",
                        help="an arm by URL; NAME alone or NAME=engine is the engine itself")
    parser.add_argument("--serve-arm", action="append", default=[],
                        metavar="NAME[:ENV=VALUE,...]",
                        help="start `prefixpin serve --upstream ENGINE` with these env vars "
                             "({slots} in a value: the started engine's --slot-save-path)")
    parser.add_argument("--embedded-arm", action="append", default=[],
                        metavar="NAME[:ENV=VALUE,...]",
                        help="start `prefixpin serve` on its embedded engine (no upstream): "
                             "an engine of its own, restarted before each of its reps")
    parser.add_argument("--engine", metavar="URL", help="the llama-server behind the arms")
    parser.add_argument("--start-llama", action="store_true",
                        help="start the rig's llama-server (SmolLM2, -c 16384 -np 2)")
    parser.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                        help="extra llama-server argument (repeat; use --llama-arg=--flag)")
    parser.add_argument("--model", default="smollm2", help="rig model for --start-llama")
    parser.add_argument("--threads", type=int, default=1,
                        help="llama-server -t for --start-llama (default 1: on a shared "
                             "two-core machine two threads spin at barriers and stall)")
    parser.add_argument("--template", choices=("chatml-tools", "native"), default="chatml-tools",
                        help="chat template for --start-llama: bench/templates/chatml-tools.jinja "
                             "renders tools, tool calls and reasoning (SmolLM2's own renders "
                             "role and content only)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--turns", type=int, help="requests per session (scenario default)")
    parser.add_argument("--baseline", help="arm the ratios divide by (default: the first)")
    parser.add_argument("--reset", choices=("restart", "erase", "none"),
                        help="engine reset before each rep (default: restart if the harness "
                             "started llama-server, else erase)")
    parser.add_argument("--out", type=Path, help="default bench/results/<scenario>/")
    parser.add_argument("--logs", type=Path, help="keep llama-server and proxy logs here "
                        "(default: a temporary directory, removed after a successful run)")
    args = parser.parse_args(argv)
    if not args.arm and not args.serve_arm and not args.embedded_arm:
        args.arm = ["direct"]
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if not args.start_llama and not args.engine:
        parser.error("give --engine URL or --start-llama: the harness resets the engine")
    return args


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What is read around every turn: engine counters and CPU time of managed processes."""

    counters: dict[str, float]
    engine_cpu_s: float | None
    arm_cpu_s: float | None


def snapshot(rig: Rig, arm: Arm) -> Snapshot:
    if arm.embedded and arm.process is not None:
        # The arm is its own engine: the rig engine's counters say nothing of it.
        return Snapshot({}, arm.process.cpu_seconds(), None)
    return Snapshot(rig.engine.counters(),
                    rig.llama.cpu_seconds() if rig.llama else None,
                    arm.process.cpu_seconds() if arm.process else None)


async def run_rep(arm: Arm, rep: int, order: int, scenario: Scenario, requests: list[Request],
                  observed: list[Observed], rig: Rig) -> tuple[list[report.Row], float]:
    rows = []
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
        started = time.perf_counter()
        for seq, (request, seen) in enumerate(zip(requests, observed, strict=True)):
            before = snapshot(rig, arm)
            turn = await send_turn(client, arm.url, request)
            after = snapshot(rig, arm)
            row = turn_row(scenario.name, arm.name, rep, order, seq, request, seen, turn,
                           before, after)
            rows.append(row)
            _progress(row)
        wall_ms = (time.perf_counter() - started) * 1000
    return rows, wall_ms


def turn_row(scenario: str, arm: str, rep: int, order: int, seq: int, request: Request,
             seen: Observed, turn: Turn, before: Snapshot, after: Snapshot) -> report.Row:
    final = turn.final.observation
    usage = final.usage or {}
    timings = final.timings or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", timings.get("cache_n"))
    ttft = turn.ttft_s
    processed = "llamacpp:prompt_tokens_total"
    return {
        "scenario": scenario, "arm": arm, "rep": rep, "order": order, "seq": seq,
        "session": request.session, "step": request.step,
        "claimed_rewrite": seen.claimed, "rewrote": seen.rewrote,
        "first_difference": seen.first_difference,
        "attempts": len(turn.attempts),
        "status": turn.final.status, "error": turn.final.error,
        "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
        "ttft_source": turn.ttft_source,
        "ttft_last_attempt_ms": None if final.first_token_s is None
        else round(final.first_token_s * 1000, 1),
        "wall_ms": round(turn.wall_s * 1000, 1),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": cached,
        "cache_n": timings.get("cache_n"), "prompt_n": timings.get("prompt_n"),
        "prefill_ms": timings.get("prompt_ms"),
        "engine_prompt_tokens": after.counters[processed] - before.counters[processed]
        if processed in before.counters and processed in after.counters else None,
        "engine_cpu_ms": _cpu_ms(before.engine_cpu_s, after.engine_cpu_s),
        "arm_cpu_ms": _cpu_ms(before.arm_cpu_s, after.arm_cpu_s),
        "comments": final.comments, "progress_chunks": final.progress_chunks,
        "output": "".join(final.text)[:60],
    }


def _cpu_ms(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round((after - before) * 1000)


def _progress(row: report.Row) -> None:
    print(f"  {row['arm']:>12} rep {row['rep']} turn {row['seq']:2d} "
          f"({row['session']} step {row['step']:2d}{', rewrite' if row['rewrote'] else ''}): "
          f"TTFT {row['ttft_ms']} ms, cached {row['cached_tokens']}/{row['prompt_tokens']}"
          f"{', tries ' + str(row['attempts']) if row['attempts'] > 1 else ''}"
          f"{', ERROR ' + str(row['error']) if row['error'] else ''}", file=sys.stderr)


def write_outputs(out: Path, scenario: Scenario, rows: list[report.Row], baseline: str,
                  provenance: dict[str, Any]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    report.write_rows(out / "rows.jsonl", rows)
    table = report.render(out, scenario.name, baseline)
    (out / "RUN.md").write_text(run_md(scenario=scenario.name, summary_md=table,
                                       repo=REPO, **provenance), encoding="utf-8")
    return table


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    scenario = SCENARIOS[args.scenario]
    transcripts = {name: load_named(name) for name in scenario.sessions}
    requests = scenario.schedule(transcripts, args.turns or scenario.default_turns)
    try:
        observed = verify(scenario.name, scenario.client.rewrites, requests)
    except RegimeError as exc:
        print(f"replay: FAILED: {exc}", file=sys.stderr)
        return 2
    work = args.logs or Path(tempfile.mkdtemp(prefix="prefixpin-bench-"))  # logs, slot files
    work.mkdir(parents=True, exist_ok=True)
    try:
        status = run(args, argv, scenario, requests, observed, work)
    except EngineError as exc:
        print(f"replay: FAILED: {exc}", file=sys.stderr)
        status = 1
    if status == 0 and args.logs is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"replay: logs in {work}", file=sys.stderr)
    return status


def run(args: argparse.Namespace, argv: list[str], scenario: Scenario,
        requests: list[Request], observed: list[Observed], work: Path) -> int:
    llama, llama_argv = start_llama(args, work) if args.start_llama else (None, None)
    engine = EngineAPI(args.engine or (llama.health_url.removesuffix("/health") if llama
                                       else ""))
    arms = build_arms(args, engine.url, work)
    rig = Rig(engine, args.reset or ("restart" if llama else "erase"), llama,
              work / "slots" if llama else None)
    baseline = args.baseline or arms[0].name
    rows: list[report.Row] = []
    props: dict[str, Any] = {}
    load_before = os.getloadavg()
    try:
        check_slots(scenario, engine)
        props = engine.props()
        order = 0
        for rep in range(args.reps):
            for arm in rep_order(arms, rep):
                rig.reset_for(arm)
                print(f"{scenario.name}: rep {rep} arm {arm.name}", file=sys.stderr)
                arm_rows, wall = asyncio.run(run_rep(arm, rep, order, scenario, requests,
                                                     observed, rig))
                for row in arm_rows:
                    row.update(rep_wall_ms=round(wall, 1), baseline=baseline)
                rows += arm_rows
                order += 1
        check_resends(scenario, rows, baseline)
    except RegimeError as exc:
        print(f"replay: FAILED: {exc}", file=sys.stderr)
        return 2
    finally:
        for arm in arms:
            if arm.process is not None:
                arm.process.stop()
        if llama is not None:
            llama.stop()
    failed = [r for r in rows if r["error"] or r["status"] != 200 or r["ttft_ms"] is None]
    notes = run_notes(args, scenario, len(requests), rig.reset)
    notes.append(template_note(props))
    notes.append("load average (1, 5, 15 min) at start {:.2f} {:.2f} {:.2f}, at end "
                 "{:.2f} {:.2f} {:.2f}; the machine may be shared, arms are interleaved so "
                 "that load hits them alike".format(*load_before, *os.getloadavg()))
    notes += [f"arm {arm.name}: " + (f"`{' '.join(arm.process.argv)}` with env "
                                     f"{arm.process.env or '{}'}" if arm.process else arm.url)
              for arm in arms]
    out = args.out or RESULTS / scenario.name
    table = write_outputs(out, scenario, rows, baseline, {
        "command": shlex.join(["python", "bench/replay.py", *argv]), "engine_props": props,
        "llama_argv": llama_argv, "notes": notes})
    print(table.split("\n## Per turn")[0])
    print(f"results in {out}")
    if failed:
        print(f"replay: FAILED: {len(failed)} requests failed, first: {failed[0]['error']}",
              file=sys.stderr)
        return 1
    return 0


def template_note(props: dict[str, Any]) -> str:
    caps = props.get("chat_template_caps") or {}
    checks = (("tools", "supports_tools"), ("tool calls", "supports_tool_calls"),
              ("reasoning of earlier turns", "supports_preserve_reasoning"))
    rendered = [name for name, cap in checks if caps.get(cap)]
    return ("engine chat template renders " + (", ".join(rendered) or "none of tools, tool "
            "calls, earlier reasoning") + " (from /props chat_template_caps)")


def run_notes(args: argparse.Namespace, scenario: Scenario, n_requests: int,
              reset: str) -> list[str]:
    turns = args.turns or scenario.default_turns
    resets = {"restart": "llama-server (and each managed proxy) restarted before every rep "
                         "of every arm: empty slots and an empty RAM prompt cache",
              "erase": "slots erased through POST /slots/{id}?action=erase before every rep "
                       "of every arm (the --cache-ram prompt cache is NOT cleared)",
              "none": "engine NOT reset between reps"}
    return [f"scenario {scenario.name}: client `{type(scenario.client).__name__}`, sessions "
            f"{', '.join(scenario.sessions)}, {turns} turns per session, {n_requests} "
            f"requests per rep, {args.reps} reps per arm, interleaved A B / B A",
            f"reset: {resets[reset]}",
            "requests: stream, max_tokens 8, temperature 0, stream_options.include_usage; "
            "TTFT stops at the first chunk with content, reasoning or a tool-call delta"]


if __name__ == "__main__":
    raise SystemExit(main())

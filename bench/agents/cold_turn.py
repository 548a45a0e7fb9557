"""What one cold turn of a real agent CLI costs on this machine: a fresh llama-server
(one slot), the CLI's first turn straight against it through the bench's recording relay;
prompt tokens, tokens prefilled, TTFT and the CLI's whole run.

    python bench/agents/cold_turn.py --cli opencode                       # SmolLM2, 8k
    python bench/agents/cold_turn.py --cli opencode --model gemma3 --ctx 32768 --swa-full
    python bench/agents/cold_turn.py --cli claude --model gemma3 --ctx 32768 --swa-full \
        --llama-arg=--chat-template-file --llama-arg=bench/templates/chatml-tools.jinja

The agent bench (``run.py``) uses SmolLM2; this measures what the model the issue
suggested (Gemma 3 270M, ``--swa-full``, 32k, for the CLIs' full prompts with their
tools: a template that renders tools, e.g. the bench's ``chatml-tools.jinja``) would cost
per cold turn instead. Appends a JSON line to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx

from bench.agents.relay import Relay, serve_relay
from bench.agents.run import main_exchange
from tests.rig.agent_clis import CLIS, ENGINE_CAP_ARGS, AgentSession
from tests.rig.agents import ensure_agent
from tests.rig.llama_process import run_llama_server
from tests.rig.scrape import prefilled

OUT = Path(__file__).resolve().parents[2] / "bench" / "results" / "agents" / "cold-turns.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/agents/cold_turn.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--cli", choices=CLIS, default="opencode")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--swa-full", action="store_true")
    parser.add_argument("--llama-arg", action="append", default=[],
                        help="one more llama-server argument (repeat), e.g. "
                             "--llama-arg=--chat-template-file --llama-arg=PATH")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    extra = [*ENGINE_CAP_ARGS, *(["--swa-full"] if args.swa_full else []), *args.llama_arg]
    work = Path(tempfile.mkdtemp(prefix="prefixpin-cold-turn-"))
    relay = Relay()
    load = os.getloadavg()
    try:
        with run_llama_server(args.model, slots=1, ctx_per_slot=args.ctx, threads=args.threads,
                              extra=extra) as engine, serve_relay(relay) as url:
            relay.upstream = engine.url
            props = httpx.get(f"{engine.url}/props", timeout=10).json()
            session = AgentSession(args.cli, url, work, executable=ensure_agent(args.cli),
                                   timeout=args.timeout)
            before = prefilled([engine])
            turn = session.turn("Say hello to Ann.")
            exchanges = relay.settle(0)
            main = main_exchange(exchanges)
            row = {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "cli": args.cli, "model": Path(str(props.get("model_path"))).name,
                "ctx": args.ctx, "threads": args.threads, "swa_full": args.swa_full,
                "llama_args": args.llama_arg,
                "ok": turn.ok, "requests": len([e for e in exchanges if e.api]),
                "prompt_tokens": main.prompt_tokens if main else None,
                "engine_prefilled": prefilled([engine]) - before,
                "ttft_s": round(main.ttft_s, 2) if main and main.ttft_s else None,
                "cli_seconds": round(turn.seconds, 1),
                "load_before": [round(x, 2) for x in load],
                "load_after": [round(x, 2) for x in os.getloadavg()],
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        out.write(json.dumps(row) + "\n")
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Sessions that share a system prompt, taking turns on fewer slots, on a hybrid recurrent
model: what each follow-up turn prefills, alone, directly and through prefixpin.

    python -m bench.hybrid [--model qwen35-tiny] [--engine-arg=--swa-full ...]
                           [--sessions 4] [--slots 2] [--turns 4] [--system 900]
                           [--user 300] [--think-s 0.5] [--out FILE]

The engine is the rig's llama-server at its default flags (plus ``--slot-save-path``,
which parking needs, ``-np``, and one thread) on the rig's tiny random-weight ``qwen35``
(Qwen3.5's architecture and real chat template; the text is noise, the cache mechanics are
real); ``--model gptoss-tiny`` runs the tiny sliding-window gpt-oss instead. Every session
starts from one shared system prompt, adds a user turn of about
``--user`` words each turn, and sends back each reply as the engine returned it (Qwen3.5's
template drops its reasoning from earlier turns, as a client that strips it would).
Between two turns ``--think-s`` passes: the time a user or a tool takes.

Arms, in one run:

- ``alone``: each session on its own one-slot engine, its turns back to back (the floor:
  llama-server's own checkpoints);
- ``direct``: the sessions round-robin on an engine of ``--slots`` slots, the engine choosing;
- ``prefixpin``: the same through ``prefixpin serve`` (its defaults: pinning, parking ahead,
  anchoring).

Printed per arm: prompt tokens prefilled (prompt - cached) on follow-up turns, in all and
per turn, the share of follow-up prompt tokens read from cache, and the ratio to
``alone``; and for prefixpin the worst follow-up over the same
turn alone (the issue's bound: at most +16 tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from tests.e2e.helpers import filler
from tests.rig.llama_process import run_llama_server
from tests.rig.replica_process import run_replica
from tests.rig.tiny_models import TINY_MODELS, ensure_tiny_model

Json = dict[str, Any]


class Session:
    def __init__(self, index: int, system: str, user_words: int) -> None:
        self.index = index
        self.user_words = user_words
        self.messages: list[Json] = [{"role": "system", "content": system}]
        self.prefilled: list[int] = []  # per turn: prompt tokens not from cache
        self.prompts: list[int] = []  # per turn: prompt tokens

    def turn(self, client: httpx.Client, number: int) -> None:
        self.messages.append({"role": "user", "content": f"Session {self.index} turn "
                              f"{number}: " + filler(self.user_words, seed=self.index * 97
                                                     + number)})
        response = client.post("/v1/chat/completions", json={
            "messages": self.messages, "max_tokens": 16, "temperature": 0},
            headers={"x-session-id": f"session-{self.index}"})
        response.raise_for_status()
        body = response.json()
        self.messages.append(body["choices"][0]["message"])
        usage = body["usage"]
        self.prompts.append(int(usage["prompt_tokens"]))
        self.prefilled.append(int(usage["prompt_tokens"])
                              - int(usage["prompt_tokens_details"]["cached_tokens"]))


def sessions(args: argparse.Namespace) -> list[Session]:
    system = "You are a coding agent in a shared workspace. " + filler(args.system, seed=1)
    return [Session(i, system, args.user) for i in range(args.sessions)]


@contextmanager
def engine(args: argparse.Namespace, slots: int, save: Path) -> Iterator[str]:
    save.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_model(args.model) if args.model in TINY_MODELS else args.model
    with run_llama_server(model, slots=slots, ctx_per_slot=16384, slot_save_path=save,
                          threads=1, extra=args.engine_arg) as handle:
        yield handle.url


def alone(args: argparse.Namespace, tmp: Path) -> list[Session]:
    runs = sessions(args)
    for session in runs:
        with engine(args, 1, tmp / f"alone-{session.index}") as url, \
                httpx.Client(base_url=url, timeout=300) as client:
            for number in range(1, args.turns + 1):
                session.turn(client, number)
                time.sleep(args.think_s)
    return runs


def round_robin(args: argparse.Namespace, url: str) -> list[Session]:
    runs = sessions(args)
    with httpx.Client(base_url=url, timeout=300) as client:
        for number in range(1, args.turns + 1):
            for session in runs:
                session.turn(client, number)
                time.sleep(args.think_s)
    return runs


def direct(args: argparse.Namespace, tmp: Path) -> list[Session]:
    with engine(args, args.slots, tmp / "direct") as url:
        return round_robin(args, url)


def through_prefixpin(args: argparse.Namespace, tmp: Path) -> list[Session]:
    save = tmp / "prefixpin"
    with engine(args, args.slots, save) as url, run_replica(
            [url], tmp / "prefixpin.log", args=["--park-dir", str(save)]) as proxy:
        return round_robin(args, proxy.url)


def follow_ups(runs: list[Session]) -> list[int]:
    return [n for session in runs for n in session.prefilled[1:]]


def report(arms: dict[str, list[Session]]) -> Json:
    floor = sum(follow_ups(arms["alone"]))
    result: Json = {}
    for name, runs in arms.items():
        prefilled = follow_ups(runs)
        prompts = sum(n for session in runs for n in session.prompts[1:])
        result[name] = {"follow_up_prefilled": sum(prefilled),
                        "follow_up_cached_fraction": round(1 - sum(prefilled) / prompts, 4),
                        "per_follow_up_median": statistics.median(prefilled),
                        "over_alone": round(sum(prefilled) / floor, 3) if floor else None,
                        "per_session": [s.prefilled for s in runs]}
    worst = max(p - a for p, a in zip(follow_ups(arms["prefixpin"]), follow_ups(arms["alone"]),
                                      strict=True))
    result["prefixpin_worst_over_alone_tokens"] = worst
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen35-tiny",
                        help="a tiny model (qwen35-tiny, gptoss-tiny) or a rig model name")
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="one more llama-server argument (repeat: --engine-arg=--swa-full)")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=900, help="system prompt words")
    parser.add_argument("--user", type=int, default=300, help="words per user turn")
    parser.add_argument("--think-s", type=float, default=0.5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prefixpin-hybrid-") as name:
        tmp = Path(name)
        arms = {"alone": alone(args, tmp), "direct": direct(args, tmp),
                "prefixpin": through_prefixpin(args, tmp)}
    result = {"setup": vars(args) | {"out": str(args.out) if args.out else None},
              **report(arms)}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

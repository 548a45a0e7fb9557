"""Latency the proxy adds on a long conversation: 64 messages, ~30k tokens, affinity on.

Side by side in one run, against a zero-latency fake llama-server (its own process):
direct, prefixpin pass-through (every feature off) and prefixpin with affinity and repair
on (the SmolLM2 tokenizer for fingerprints), once with a session key (explicit identity)
and once without (implicit). Each request resends the same conversation, so the affinity
arms take their full path every time: parse, digests of 64 messages, bytes decide, the
slot lease and the commit; the keyless arm also looks its fingerprint chain up (memoised
by message prefix: tokenizing what a real turn adds costs ~0.3 ms per 1,000 characters on
top, see bench/fingerprint_bench.py). Arms alternate; added latency is the arm's
percentile minus direct's; the order of the arms rotates every round.

    python bench/affinity_latency.py [--requests 200] [--out bench/results/affinity-latency]
                                     [--before-tree PATH]

``--before-tree PATH`` adds the three proxy arms again (``before_passthrough``,
``before_affinity``, ``before_affinity_keyless``), run by ``proxy.cli serve`` from another
source tree (e.g. ``git worktree add /tmp/pp-before 783c80c``; see ``bench/trees.py``), all
seven arms rotating together. ``ARM_minus_before`` is the median of the per-round
differences between an arm and its before twin, with a 95% interval; ``trees`` records
which files each tree's arms import and their commits. ``cpu_us_per_request``: each proxy
process's own CPU time per request (from ``/proc``; the affinity process serves the keyed
and the keyless arm), a figure that other load on the machine barely moves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.overhead import percentile, process, timed_request
from bench.trees import (
    Tree,
    cpu_per_request_us,
    cpu_seconds,
    operator_url,
    paired_median_ms,
    rotated,
)
from prefixpin.proxy.engine.models import ensure_model
from tests.fakes.servers import free_port

WORDS = ["parse", "render", "token", "slot", "cache", "prefix", "commit", "session", "engine",
         "queue", "def", "return", "import", "class", "while", "yield", "async", "await",
         "lambda", "tuple", "dict", "list"]


def conversation(messages: int = 64, target_tokens: int = 30_000) -> list[dict[str, Any]]:
    """A coding-agent-like history: system prompt, then user/assistant/tool turns."""
    per_message = target_tokens * 4 // messages  # ~4 characters per token
    out: list[dict[str, Any]] = [{"role": "system", "content": _text(per_message, 0)}]
    roles = ("user", "assistant", "tool")
    for index in range(1, messages):
        role = roles[index % 3]
        message: dict[str, Any] = {"role": role, "content": _text(per_message, index)}
        if role == "tool":
            message["tool_call_id"] = f"call_{index}"
        out.append(message)
    return out


def _text(chars: int, seed: int) -> str:
    words, state, size = [], seed * 7919 + 1, 0
    while size < chars:
        state = (state * 1103515245 + 12345) % 2**31
        word = WORDS[state % len(WORDS)]
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


PROXY_ARMS = ("passthrough", "affinity", "affinity_keyless")


def run(requests: int, before: Tree | None = None) -> dict[str, Any]:
    fake_port = free_port()
    fake = f"http://127.0.0.1:{fake_port}"
    messages = conversation()
    body: dict[str, Any] = {"messages": messages, "max_tokens": 4, "stream": True}
    tokenizer = str(ensure_model("smollm2"))
    trees = {"this": Tree.this()}
    if before is not None:
        trees["before"] = before
    # Each arm: its URL and whether requests carry the session key.
    arms: dict[str, tuple[str, bool]] = {"direct": (fake, True)}
    affinity_urls: dict[str, str] = {}
    pids: dict[str, int] = {}  # per proxy process: its pid
    with ExitStack() as stack:
        stack.enter_context(process([sys.executable, "-m", "tests.fakes.fake_llama",
                                     "--port", str(fake_port), "--reply-words", "4",
                                     "--n-ctx", "131072"], fake))
        for label, tree in trees.items():
            prefix = "" if label == "this" else f"{label}_"
            serve = [*tree.serve(), "--upstream", fake, "--log-level", "warning"]
            plain, affinity = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
            pids[f"{prefix}passthrough"] = stack.enter_context(process(
                [*serve, "--port", plain.rsplit(":", 1)[1], "--no-affinity", "--no-repair",
                 "--no-parking"], plain, **tree.popen_kwargs())).pid
            pids[f"{prefix}affinity"] = stack.enter_context(process(
                [*serve, "--port", affinity.rsplit(":", 1)[1], "--tokenizer", tokenizer],
                affinity, **tree.popen_kwargs())).pid
            arms[f"{prefix}passthrough"] = (plain, True)
            arms[f"{prefix}affinity"] = (affinity, True)
            arms[f"{prefix}affinity_keyless"] = (affinity, False)
            affinity_urls[label] = affinity
        keyed = stack.enter_context(httpx.Client(timeout=60, headers={"x-session-id": "bench"}))
        keyless = stack.enter_context(httpx.Client(timeout=60))
        totals: dict[str, list[float]] = {arm: [] for arm in arms}
        for url, with_key in arms.values():
            for _ in range(10):
                timed_request(keyed if with_key else keyless, url, body)
        order = list(arms)
        cpu_start = {name: cpu_seconds(pid) for name, pid in pids.items()}
        for index in range(requests):
            # Rotated each round: every arm takes every position equally often (what one arm
            # leaves running, e.g. the pass-through's /slots read, lands on all of them).
            for arm in rotated(order, index):
                url, with_key = arms[arm]
                totals[arm].append(timed_request(keyed if with_key else keyless, url, body)[1])
        # The affinity process serves the keyed and the keyless arm: two requests a round.
        cpu = cpu_per_request_us(cpu_start, {name: cpu_seconds(pid) for name, pid in pids.items()},
                                 {name: requests * (2 if name.endswith("affinity") else 1)
                                  for name in pids})
        sessions = {label: keyed.get((operator_url(url) if label == "this" else url)
                                     + "/sessions").json()
                    for label, url in affinity_urls.items()}
        checks = [(label, client.post(url + "/v1/chat/completions",
                                      json={**body, "stream": False}).json())
                  for label, url in affinity_urls.items() for client in (keyed, keyless)]
    for label, check in checks:
        usage = check.get("usage") or {}
        if not (usage.get("prompt_tokens_details") or {}).get("cached_tokens"):
            raise SystemExit(f"an affinity arm's check request ({label} tree) was not served "
                             f"from cache: {check}")
    result: dict[str, Any] = {"requests_per_arm": requests, "messages": len(messages),
                              "body_bytes": len(json.dumps(body))}
    for arm in order[1:]:
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            added = (percentile(totals[arm], q) - percentile(totals["direct"], q)) * 1000
            result[f"{arm}_added_{label}_ms"] = round(added, 3)
    result["direct_p50_ms"] = round(percentile(totals["direct"], 0.5) * 1000, 3)
    if before is not None:
        for arm in PROXY_ARMS:
            result[f"{arm}_minus_before"] = paired_median_ms(totals[arm], totals[f"before_{arm}"])
    # Each proxy process's own CPU time per request (the affinity process: keyed and
    # keyless alike), a figure that other load on the machine barely moves.
    result["cpu_us_per_request"] = cpu
    result["affinity_sessions"] = _sessions(sessions["this"])
    if before is not None:
        result["before_affinity_sessions"] = _sessions(sessions["before"])
    result["trees"] = {("proxy" if label == "this" else label): tree.describe()
                       for label, tree in trees.items()}
    return result


def _sessions(sessions: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(s["key"], s["last_decision"], s["slot"])
            for group in sessions["namespaces"].values() for s in group]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench/results/affinity-latency"))
    parser.add_argument("--before-tree", type=Path, metavar="PATH",
                        help="also run the three proxy arms from this source tree (e.g. a git "
                             "worktree of an older commit), as arms 'before_*'")
    args = parser.parse_args()
    before = Tree.other(args.before_tree) if args.before_tree else None
    load_start = os.getloadavg()
    result = run(args.requests, before)
    result["command"] = "python " + " ".join(sys.argv)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "load_average_start": load_start, "load_average": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

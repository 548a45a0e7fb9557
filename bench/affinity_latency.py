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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.overhead import percentile, process, timed_request
from proxy.models import ensure_model
from proxy.testing.servers import free_port

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


def run(requests: int) -> dict[str, Any]:
    fake_port, plain_port, affinity_port = free_port(), free_port(), free_port()
    fake = f"http://127.0.0.1:{fake_port}"
    messages = conversation()
    body: dict[str, Any] = {"messages": messages, "max_tokens": 4, "stream": True}
    serve = [sys.executable, "-m", "proxy.cli", "serve", "--upstream", fake,
             "--log-level", "warning"]
    affinity = f"http://127.0.0.1:{affinity_port}"
    # Each arm: its URL and whether requests carry the session key.
    arms = {"direct": (fake, True), "passthrough": (f"http://127.0.0.1:{plain_port}", True),
            "affinity": (affinity, True), "affinity_keyless": (affinity, False)}
    totals: dict[str, list[float]] = {arm: [] for arm in arms}
    with process([sys.executable, "-m", "proxy.testing.fake_llama", "--port", str(fake_port),
                  "--reply-words", "4", "--n-ctx", "131072"], fake), \
            process([*serve, "--port", str(plain_port), "--no-affinity", "--no-repair",
                     "--no-parking"], arms["passthrough"][0]), \
            process([*serve, "--port", str(affinity_port), "--tokenizer",
                     str(ensure_model("smollm2"))], affinity), \
            httpx.Client(timeout=60, headers={"x-session-id": "bench"}) as keyed, \
            httpx.Client(timeout=60) as keyless:
        for url, with_key in arms.values():
            for _ in range(10):
                timed_request(keyed if with_key else keyless, url, body)
        order = list(arms)
        for index in range(requests):
            # Rotated each round: every arm follows every other equally often (what one arm
            # leaves running, e.g. the pass-through's /slots read, lands on all of them).
            for arm in order[index % len(order):] + order[:index % len(order)]:
                url, with_key = arms[arm]
                totals[arm].append(timed_request(keyed if with_key else keyless, url, body)[1])
        sessions = keyed.get(affinity + "/sessions").json()
        checks = [client.post(affinity + "/v1/chat/completions",
                              json={**body, "stream": False}).json()
                  for client in (keyed, keyless)]
    for check in checks:
        usage = check.get("usage") or {}
        if not (usage.get("prompt_tokens_details") or {}).get("cached_tokens"):
            raise SystemExit(f"an affinity arm's check request was not served from cache: {check}")
    result: dict[str, Any] = {"requests_per_arm": requests, "messages": len(messages),
                              "body_bytes": len(json.dumps(body))}
    for arm in ("passthrough", "affinity", "affinity_keyless"):
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            added = (percentile(totals[arm], q) - percentile(totals["direct"], q)) * 1000
            result[f"{arm}_added_{label}_ms"] = round(added, 3)
    result["direct_p50_ms"] = round(percentile(totals["direct"], 0.5) * 1000, 3)
    result["affinity_sessions"] = [(s["key"], s["last_decision"], s["slot"])
                                   for group in sessions["namespaces"].values() for s in group]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench/results/affinity-latency"))
    args = parser.parse_args()
    result = run(args.requests)
    result["command"] = "python " + " ".join(sys.argv)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "load_average": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Micro-benchmark: fingerprinting a 64-message, ~30k-token agent conversation.

Times ``chain_for_messages`` side by side in one run:

* cold: an empty token cache, so every message is tokenized;
* warm: every message but the last already cached, the steady state of a session where
  each request adds one message (the last message differs on every call, so each warm
  call tokenizes exactly one message).

Samples of both arms are interleaved so they see the same machine load; wall and CPU time
are both reported because the machines this runs on are shared.

Usage: ``python bench/fingerprint_bench.py [--model smollm2|gemma3] [--tokenizer PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixpin.fingerprint.messages import Markers, MessageTokenCache, chain_for_messages
from prefixpin.fingerprint.tokenizer import ModelTokenizer, load_tokenizer, markers_for
from prefixpin.proxy.engine.models import MODELS, ensure_model

Message = dict[str, Any]

MESSAGES = 64
TARGET_TOKENS = 30_000


def code_file(index: int, lines: int) -> str:
    body = [f'"""Module {index}: helpers for the storage layer."""', "", "import os", ""]
    for n in range(lines // 4):
        body += [f"def handler_{index}_{n}(request, limit={n * 7}):",
                 f"    items = [item for item in request.items if item.size < limit + {n}]",
                 f"    return {{'count': len(items), 'module': {index}, 'step': {n}}}", ""]
    return "\n".join(body)


WORDS = ("the", "cache", "keeps", "the", "prefix", "of", "every", "session", "warm", "so",
         "that", "a", "long", "agent", "conversation", "answers", "as", "fast", "on", "its",
         "twentieth", "turn", "as", "on", "its", "second", "while", "tools", "run", "42")


def prose(index: int, sentences: int) -> str:
    return " ".join(
        " ".join(WORDS[(index * 7 + s * 3 + k) % len(WORDS)] for k in range(14)).capitalize()
        + "." for s in range(sentences))


def conversation(scale: int) -> list[Message]:
    """A system prompt, then rounds of user / tool call / tool result / answer."""
    messages: list[Message] = [{"role": "system", "content": prose(0, 12 * scale)}]
    index = 0
    while len(messages) < MESSAGES - 1:
        index += 1
        call_id = f"call_{index}"
        arguments = {"path": f"src/module_{index}.py", "content": code_file(index, 6 * scale)}
        messages += [
            {"role": "user", "content": f"Step {index}: {prose(index, 2 * scale)}"},
            {"role": "assistant", "content": "", "reasoning_content": prose(index + 1, scale),
             "tool_calls": [{"id": call_id, "type": "function", "function": {
                 "name": "write_file", "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": code_file(index + 100, 5 * scale)},
            {"role": "assistant", "content": f"<think>{prose(index, scale)}</think>"
                                             f"{prose(index + 2, 2 * scale)}"},
        ]
    return messages[:MESSAGES - 1]


def full_tokens(messages: list[Message], tokenizer: ModelTokenizer) -> int:
    """Tokens of the conversation's content as the engine sees it (reasoning dropped)."""
    def rendered(message: Message) -> str:
        calls = [call["function"]["arguments"] for call in message.get("tool_calls", [])]
        return "\n".join([message["role"], message["content"], *calls])

    return sum(len(tokenizer.encode(rendered(message))) for message in messages)


def sized_conversation(tokenizer: ModelTokenizer) -> list[Message]:
    for scale in range(1, 40):
        messages = conversation(scale)
        if full_tokens(messages, tokenizer) >= TARGET_TOKENS:
            return messages
    raise RuntimeError("could not reach the target size")  # pragma: no cover


def last_message(round_: int) -> Message:
    return {"role": "user", "content": f"Round {round_}: now run the whole test suite and "
                                       "report the failures, grouped by module."}


@dataclass
class Samples:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, request: list[Message], tokenizer: ModelTokenizer, markers: Markers,
            cache: MessageTokenCache) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        chain_for_messages(request, tokenizer, cache, markers)
        self.wall.append((time.perf_counter() - wall) * 1000)
        self.cpu.append((time.process_time() - cpu) * 1000)

    def summary(self) -> str:
        wall, cpu = _percentiles(self.wall), _percentiles(self.cpu)
        return f"wall {wall}   cpu {cpu}   (n={len(self.wall)})"


def _percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return f"p50 {statistics.median(ordered):7.2f} ms p90 {p90:7.2f} ms"


def run(tokenizer: ModelTokenizer, markers: Markers, rounds: int, warm_per_round: int) -> None:
    history = sized_conversation(tokenizer)
    requests = [[*history, last_message(i)] for i in range(rounds * (warm_per_round + 1))]
    probe = MessageTokenCache()
    chain = chain_for_messages(requests[0], tokenizer, probe, markers)
    print(f"conversation: {len(requests[0])} messages, ~{full_tokens(requests[0], tokenizer)} "
          f"tokens as sent; {probe.cached_tokens} tokens in fingerprint views; "
          f"{len(chain)} segments")

    warm_cache = MessageTokenCache()
    chain_for_messages(history, tokenizer, warm_cache, markers)
    misses = warm_cache.stats.misses
    cold, warm = Samples(), Samples()
    pending = iter(requests)
    # Interleaved, so both arms see the same machine load.
    for _ in range(rounds):
        cold.add(next(pending), tokenizer, markers, MessageTokenCache())
        for _ in range(warm_per_round):
            warm.add(next(pending), tokenizer, markers, warm_cache)
    tokenized = warm_cache.stats.misses - misses
    assert tokenized == len(warm.wall), "each warm call must tokenize exactly one message"

    print(f"cold (empty cache):         {cold.summary()}")
    print(f"warm (all but last cached): {warm.summary()}")
    ratio = statistics.median(cold.wall) / statistics.median(warm.wall)
    cpu_ratio = statistics.median(cold.cpu) / statistics.median(warm.cpu)
    print(f"ratio cold/warm (p50):      wall {ratio:.1f}x   cpu {cpu_ratio:.1f}x")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json or GGUF to use instead")
    parser.add_argument("--rounds", type=int, default=20, help="cold samples")
    parser.add_argument("--warm-per-round", type=int, default=10, help="warm samples per cold")
    args = parser.parse_args(argv)
    source = args.tokenizer or ensure_model(args.model, quiet=True)
    started = time.perf_counter()
    tokenizer = load_tokenizer(source)
    print(f"tokenizer: {tokenizer!r} loaded in {time.perf_counter() - started:.1f} s")
    markers = markers_for(tokenizer)
    if markers is None:
        print("no known message markers in this vocabulary", file=sys.stderr)
        return 1
    run(tokenizer, markers, args.rounds, args.warm_per_round)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""The proxy's CPU for one follow-up of a Claude Code session on the Anthropic Messages API
(``/v1/messages``), at a short and a long history: what a turn costs before its first
event, against the length of the conversation it resends.

    python bench/anthropic_follow_up.py [--sizes 36000 560000] [--follow-ups 8]
                                        [--before-tree PATH ...] [--out FILE]

The engine is the fast fake llama-server (``bench/fast_engine.py``: it answers at once),
declaring ``bench/long.py``'s model (the proxy reads its tokenizer and memory kind).
prefixpin runs from this tree, and from each ``--before-tree`` (``bench/trees.py``), in its
own process at its defaults, one tree after the other.

Per size and tree, a new session is built to about that many bytes of body, in Claude
Code's layout: compact JSON, ``messages`` first, a system of two text blocks (the billing
line's ``cch`` stamp new on every request), five tools, a task, then turns of an assistant
message (text and a ``tool_use``) answered by a user message with its ``tool_result`` (~3
kB), the cache marker on the last block only. Its history is sent once (not measured),
then ``--follow-ups`` turns each add the engine's reply with a tool call and its result.
Per follow-up: the proxy process's CPU, every thread's (``/proc/PID/task/*/schedstat``),
from just before the request is sent (a second after the turn before ended) to its first
``content_block_delta`` event. Printed and written (``--out``): the median and the least
per size and tree, and the last follow-up's bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.long import MODEL, fast_fake, schedstat_ns
from bench.trees import Tree
from tests.rig.replica_process import ReplicaProcess, start_replica
from tests.rig.tiny_models import ensure_tiny_model

Json = dict[str, Any]

EPHEMERAL = {"type": "ephemeral"}
RESULT_CHARS = 3_000
TURN_BYTES = 3_400  # what a tool turn adds to the body, about
SETTLE_S = 1.0  # the proxy's work after the turn before, done before the next is sent
FIRST_OUTPUT = b"event: content_block_delta"
TOOLS = [{"name": name, "description": f"{name}: " + "what the tool does and when. " * 30,
          "input_schema": {"type": "object",
                           "properties": {"path": {"type": "string"},
                                          "pattern": {"type": "string"}},
                           "required": ["path"]}}
         for name in ("Read", "Edit", "Bash", "Grep", "Glob")]
WORDS = ("def", "return", "self", "value", "index", "test", "assert", "import", "path",
         "error", "result", "config", "request", "session", "token", "cache", "message")


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def tool_result(rng: random.Random) -> str:
    lines: list[str] = []
    size = 0
    while size < RESULT_CHARS:
        lines.append(f"{len(lines) + 1:>5}\t{words(rng, rng.randrange(3, 14))}")
        size += len(lines[-1]) + 1
    return "\n".join(lines)


def system(stamp: int) -> list[Json]:
    billing = ("x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; "
               f"cch={stamp % 100_000:05d};")
    return [{"type": "text", "text": billing},
            {"type": "text", "text": "You are Claude Code, a coding agent. " * 200,
             "cache_control": EPHEMERAL}]


def tool_turn(rng: random.Random, number: int, reply: str) -> list[Json]:
    call = f"toolu_{number:04d}"
    return [{"role": "assistant", "content": [
                {"type": "text", "text": reply},
                {"type": "tool_use", "id": call, "name": rng.choice(TOOLS)["name"],
                 "input": {"path": f"src/{rng.choice(WORDS)}.py", "pattern": words(rng, 2)}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call,
                                          "content": tool_result(rng)}]}]


def body(messages: list[Json], stamp: int) -> bytes:
    """Claude Code's request: the cache marker on the last block of the last message."""
    marked = [*messages[:-1], {**messages[-1], "content": [
        *messages[-1]["content"][:-1], {**messages[-1]["content"][-1],
                                        "cache_control": EPHEMERAL}]}]
    return json.dumps({"model": MODEL, "messages": marked, "temperature": 1,
                       "system": system(stamp), "tools": TOOLS,
                       "metadata": {"user_id": f"user_bench_session_{stamp // 1000}"},
                       "max_tokens": 8, "stream": True},
                      separators=(",", ":"), ensure_ascii=False).encode()


def send(client: httpx.Client, pid: int, raw: bytes) -> tuple[float, str]:
    """The proxy's CPU (ms) to the first output event, and the text the engine answered."""
    seen, before, at_output = b"", schedstat_ns(pid), None
    with client.stream("POST", "/v1/messages", content=raw,
                       headers={"content-type": "application/json"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for chunk in response.iter_raw():
            seen += chunk
            if at_output is None and FIRST_OUTPUT in seen:
                at_output = schedstat_ns(pid)
    if at_output is None:
        raise RuntimeError("no content_block_delta in the answer")
    text = "".join(json.loads(line[6:])["delta"].get("text", "")
                   for line in seen.decode().splitlines()
                   if line.startswith("data: ") and '"text_delta"' in line)
    return (at_output - before) / 1e6, text


def session(proxy: ReplicaProcess, size: int, follow_ups: int, seed: int) -> Json:
    rng = random.Random(seed)
    messages: list[Json] = [{"role": "user", "content": [
        {"type": "text", "text": f"session {seed}: " + words(rng, 120)}]}]
    while len(body(messages, 0)) + follow_ups * TURN_BYTES < size:  # the follow-ups reach it
        messages += tool_turn(rng, len(messages), words(rng, 12))
    cpu: list[float] = []
    stamp = seed * 1000
    with httpx.Client(base_url=proxy.url, timeout=120) as client:
        _, reply = send(client, proxy.process.pid, body(messages, stamp))  # the new session
        for _ in range(follow_ups):
            time.sleep(SETTLE_S)
            stamp += 1
            messages += tool_turn(rng, len(messages), reply)
            raw = body(messages, stamp)
            spent, reply = send(client, proxy.process.pid, raw)
            cpu.append(spent)
    return {"body_bytes": len(raw), "messages": len(messages),
            "cpu_to_first_event_ms": round(statistics.median(cpu), 2),
            "min_ms": round(min(cpu), 2),
            "each_ms": [round(value, 2) for value in cpu]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[36_000, 560_000])
    parser.add_argument("--follow-ups", type=int, default=8)
    parser.add_argument("--before-tree", type=Path, action="append", default=[])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"this": Tree.this(), **{f"before{'' if k == 0 else k + 1}": Tree.other(path)
                                     for k, path in enumerate(args.before_tree)}}
    model = ensure_tiny_model(MODEL)
    result: Json = {"sizes": args.sizes, "follow_ups": args.follow_ups, "trees": {}}
    with fast_fake(model) as engine, tempfile.TemporaryDirectory() as tmp:
        for name, tree in trees.items():
            proxy = start_replica([engine], Path(tmp) / f"{name}.log",
                                  program=tree.serve()[:-1], cwd=tree.root, env=tree.env())
            try:
                runs = [session(proxy, size, args.follow_ups, seed)
                        for seed, size in enumerate(args.sizes, start=1)]
            finally:
                proxy.stop()
            result["trees"][name] = {"tree": tree.describe(), "runs": runs}
            for run in runs:
                print(f"{name:8} {run['body_bytes']:>8} B {run['messages']:>4} messages: "
                      f"{run['cpu_to_first_event_ms']:>6} ms CPU to the first event, "
                      f"min {run['min_ms']} (each: {run['each_ms']})")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

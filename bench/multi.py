"""Several backends and replicas: affinity placement against round-robin and least-loaded,
side by side in one run.

    python -m bench.multi                   # 3 llama-servers, 2 replicas, 12 sessions

One redis-server, three llama-servers (SmolLM2-135M, one thread, 4 slots of 2048 tokens
each) and, per arm, two `prefixpin serve` replicas sharing state in Redis with
``--placement affinity | round-robin | least-loaded``. Twelve sessions run at once; each
session's turns alternate between the two replicas (turn t of session s goes to replica
(s + t) mod 2), so every arm also crosses replicas on every turn. Before each arm the
engines' slots are erased; every arm's prompts are its own (no arm can reuse another's
cache, including llama-server's host-RAM prompt cache, left at its default).

Measured per turn at the client: TTFT (request sent to first content token) and the
usage's prompt and cached tokens; per arm: the tokens the engines really prefilled
(``llamacpp:prompt_tokens_total``) and the Redis commands per request (``INFO``).

Writes ``bench/results/multi/``: ``turns.jsonl``, ``summary.md``, ``multi.png``,
``RUN.md``; exit status 1 if a request failed, 2 if affinity's cached fraction on turns
after the first is below the issue's target (0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.provenance import git_revision, host_lines
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.redis_process import RedisProcess, run_redis_server
from tests.rig.replica_process import ReplicaProcess, start_replica
from tests.rig.scrape import prefilled

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "multi"
ARMS = ("affinity", "round-robin", "least-loaded")
TARGET = 0.9
IDLE_S = 4.0
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda",
         "sigma", "omega", "parse", "render", "token", "slot", "cache", "prefix", "commit",
         "session", "engine", "queue", "replica", "backend", "shard", "lease", "stream",
         "frame", "retry", "join", "placement", "weight", "hash", "ring", "redis")


@dataclass(slots=True)
class TurnRow:
    arm: str
    rep: int
    session: int
    turn: int
    replica: int
    ok: bool
    ttft_ms: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str | None = None


@dataclass(slots=True)
class ArmRun:
    arm: str
    rep: int
    wall_s: float
    engine_prefilled: float
    redis_commands: int
    requests: int
    commandstats: dict[str, int]
    idle_commands_per_s: float  # two replicas' heartbeats and listeners, no request running


def words(n: int, seed: str) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--backends", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4, help="slots per llama-server")
    parser.add_argument("--ctx", type=int, default=2048, help="context per slot")
    parser.add_argument("--system-words", type=int, default=240,
                        help="words in each session's system prompt (~1.3 tokens a word)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", type=Path, default=OUT)
    return parser.parse_args(argv)


async def one_turn(client: httpx.AsyncClient, url: str, key: str,
                   messages: list[dict[str, Any]]) -> tuple[TurnRow, str]:
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.monotonic()
    ttft, usage, text = None, None, []
    row = TurnRow("", 0, 0, 0, 0, False, None, None, None)
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers={"x-session-id": key}) as response:
            if response.status_code != 200:
                row.error = f"status {response.status_code}: {(await response.aread())[:200]!r}"
                return row, ""
            async for line in response.aiter_lines():  # read to the end (see README)
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    row.error = str(event["error"])[:200]
                for choice in event.get("choices") or []:
                    content = choice.get("delta", {}).get("content")
                    if content:
                        ttft = ttft if ttft is not None else time.monotonic() - started
                        text.append(content)
                usage = event.get("usage") or usage
    except httpx.HTTPError as exc:
        row.error = f"{type(exc).__name__}: {exc}"
        return row, ""
    row.ok = usage is not None and row.error is None
    row.ttft_ms = round(ttft * 1000, 1) if ttft is not None else None
    if usage is not None:
        row.prompt_tokens = usage.get("prompt_tokens")
        row.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return row, "".join(text)


async def run_session(client: httpx.AsyncClient, replicas: list[str], arm: str, rep: int,
                      session: int, turns: int, system_words: int) -> list[TurnRow]:
    seed = f"{arm}/{rep}/{session}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"You are agent {seed}. " + words(system_words, seed)}]
    rows = []
    await asyncio.sleep(0.15 * session)  # sessions start staggered, then overlap
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Step {turn}: "
                         + words(16, f"{seed}/{turn}")})
        replica = (session + turn) % len(replicas)
        row, reply = await one_turn(client, replicas[replica], f"agent-{seed}", messages)
        row.arm, row.rep, row.session, row.turn, row.replica = arm, rep, session, turn, replica
        rows.append(row)
        if not row.ok:
            break
        messages.append({"role": "assistant", "content": reply})
    return rows


async def run_arm(replicas: list[str], arm: str, rep: int, args: argparse.Namespace
                  ) -> list[TurnRow]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        results = await asyncio.gather(*(run_session(c, replicas, arm, rep, s, args.turns,
                                                     args.system_words)
                                         for s in range(args.sessions)))
    return [row for rows in results for row in rows]




def redis_stats(url: str) -> tuple[int, dict[str, int]]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        total = int(client.info("stats")["total_commands_processed"])
        commands = {name.removeprefix("cmdstat_"): int(v["calls"])
                    for name, v in client.info("commandstats").items()}
    finally:
        client.close()
    return total, commands


def erase(engines: list[LlamaServerProcess], slots: int) -> None:
    for engine in engines:
        for slot in range(slots):
            httpx.post(f"{engine.url}/slots/{slot}", params={"action": "erase"}, json={},
                       timeout=60).raise_for_status()


@contextlib.contextmanager
def engines_running(n: int, slots: int, ctx: int) -> Iterator[list[LlamaServerProcess]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(run_llama_server("smollm2", slots=slots, ctx_per_slot=ctx,
                                                    threads=1))
               for _ in range(n)]


def measure(args: argparse.Namespace, redis_server: RedisProcess,
            engines: list[LlamaServerProcess], logs: Path) -> tuple[list[TurnRow], list[ArmRun]]:
    urls = [e.url for e in engines]
    arms = args.arms.split(",")
    rows: list[TurnRow] = []
    runs: list[ArmRun] = []
    for rep in range(args.reps):
        order = arms[rep % len(arms):] + arms[:rep % len(arms)]  # rotate the arms' order
        for arm in order:
            erase(engines, args.slots)
            replicas: list[ReplicaProcess] = []
            try:
                for i in range(2):
                    replicas.append(start_replica(
                        urls, logs / f"{arm}-{rep}-replica-{i}.log", redis=redis_server.url,
                        replica_id=f"{arm}-{i}",
                        args=["--placement", arm, "--redis-prefix", f"bench-{arm}-{rep}"],
                        env={"PREFIXPIN_PARKING": "0", "PREFIXPIN_LOG_LEVEL": "warning"}))
                idle_from, _ = redis_stats(redis_server.url)
                time.sleep(IDLE_S)
                idle_to, _ = redis_stats(redis_server.url)
                idle_rate = (idle_to - idle_from - 1) / IDLE_S  # one INFO is ours
                before_tokens = prefilled(engines)
                before_ops, before_cmds = redis_stats(redis_server.url)
                started = time.monotonic()
                arm_rows = asyncio.run(run_arm([r.url for r in replicas], arm, rep, args))
                wall = time.monotonic() - started
                after_ops, after_cmds = redis_stats(redis_server.url)
                after_tokens = prefilled(engines)
            finally:
                for replica in replicas:
                    replica.stop()
            rows += arm_rows
            delta = {k: after_cmds[k] - before_cmds.get(k, 0) for k in after_cmds
                     if after_cmds[k] - before_cmds.get(k, 0) > 0}
            runs.append(ArmRun(arm, rep, round(wall, 1), after_tokens - before_tokens,
                               after_ops - before_ops, len(arm_rows), delta,
                               round(idle_rate, 1)))
            print(f"[multi] rep {rep} {arm}: {len(arm_rows)} turns in {wall:.0f} s, "
                  f"{summarize(arm_rows)['later_cached']:.3f} cached after the first turn",
                  flush=True)
    return rows, runs


def summarize(rows: list[TurnRow]) -> dict[str, Any]:
    later = [r for r in rows if r.turn > 0 and r.ok]
    first = [r for r in rows if r.turn == 0 and r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in later)
    cached = sum(r.cached_tokens or 0 for r in later)
    later_ttft = [r.ttft_ms for r in later if r.ttft_ms is not None]
    first_ttft = [r.ttft_ms for r in first if r.ttft_ms is not None]
    return {
        "later_cached": cached / prompt if prompt else 0.0,
        "later_ttft_median": statistics.median(later_ttft) if later_ttft else None,
        "later_ttft_p90": _quantile(later_ttft, 0.9),
        "first_ttft_median": statistics.median(first_ttft) if first_ttft else None,
        "failed": sum(1 for r in rows if not r.ok),
        "turns": len(rows),
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(rows: list[TurnRow], runs: list[ArmRun], args: argparse.Namespace) -> str:
    arms = args.arms.split(",")
    summaries = {arm: summarize([r for r in rows if r.arm == arm]) for arm in arms}
    base = summaries.get("round-robin") or next(iter(summaries.values()))
    lines = ["| placement | cached, turns 2+ | TTFT median, turns 2+ (ms) | vs round-robin | "
             "TTFT p90, turns 2+ (ms) | TTFT median, turn 1 (ms) | engine prefilled tokens | "
             "Redis commands / request | idle Redis commands / s | failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        s = summaries[arm]
        arm_runs = [run for run in runs if run.arm == arm]
        tokens = sum(run.engine_prefilled for run in arm_runs) / len(arm_runs)
        # Commands beyond what the replicas issue when idle (heartbeats), per request.
        busy = sum(run.redis_commands - run.idle_commands_per_s * run.wall_s
                   for run in arm_runs)
        ops = busy / max(1, sum(run.requests for run in arm_runs))
        idle = sum(run.idle_commands_per_s for run in arm_runs) / len(arm_runs)
        ratio = (s["later_ttft_median"] / base["later_ttft_median"]
                 if s["later_ttft_median"] and base["later_ttft_median"] else float("nan"))
        lines.append(f"| {arm} | {s['later_cached']:.3f} | {_ms(s['later_ttft_median'])} | "
                     f"{ratio:.2f} | {_ms(s['later_ttft_p90'])} | {_ms(s['first_ttft_median'])}"
                     f" | {tokens:.0f} | {ops:.1f} | {idle:.1f} | {s['failed']} of {s['turns']} |")
    lines += ["", "Redis commands per arm (all replicas, whole run):", ""]
    for run in runs:
        top = sorted(run.commandstats.items(), key=lambda kv: -kv[1])[:10]
        lines.append(f"- {run.arm} (rep {run.rep}, {run.requests} requests, {run.wall_s} s): "
                     + ", ".join(f"{k} {v}" for k, v in top))
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def plot(rows: list[TurnRow], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm in args.arms.split(","):
        turns = range(args.turns)
        cached, ttft = [], []
        for t in turns:
            at = [r for r in rows if r.arm == arm and r.turn == t and r.ok]
            p = sum(r.prompt_tokens or 0 for r in at)
            cached.append(sum(r.cached_tokens or 0 for r in at) / p if p else 0.0)
            values = [r.ttft_ms for r in at if r.ttft_ms is not None]
            ttft.append(statistics.median(values) if values else float("nan"))
        left.plot([t + 1 for t in turns], cached, marker="o", label=arm)
        right.plot([t + 1 for t in turns], ttft, marker="o", label=arm)
    left.axhline(TARGET, color="grey", linestyle=":", linewidth=1)
    left.set(xlabel="turn", ylabel="cached / prompt tokens", ylim=(0, 1.05),
             title="Cached share of the prompt")
    right.set(xlabel="turn", ylabel="median TTFT (ms)", title="Time to first token")
    right.set_yscale("log")
    for axis in (left, right):
        axis.legend()
        axis.grid(alpha=0.3)
    fig.suptitle(f"{args.sessions} sessions, {args.backends} llama-servers, 2 replicas "
                 "(turns alternate replicas)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_md(command: str, args: argparse.Namespace, engines: list[LlamaServerProcess],
           summary: str) -> str:
    props = httpx.get(f"{engines[0].url}/props", timeout=10).json()

    return "\n".join([
        "# Run: several backends and replicas", "", "```", command, "```", "",
        *host_lines(dated=False, shared=True),
        f"- repository: {git_revision(REPO)}",
        f"- llama-server build_info: {props.get('build_info', 'unknown')}; "
        f"{args.backends} servers, each: `{' '.join(engines[0].args[3:])}` "
        "(nice 10, as the rig starts them)",
        f"- {args.sessions} sessions x {args.turns} turns, system prompt {args.system_words} "
        "words, 16-word user turns, 12 tokens out, temperature 0; reps: "
        f"{args.reps}", "",
        summary,
        "Rows: `turns.jsonl`; plot: `multi.png`; the analysis: `SCALING.md`.", ""])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    with run_redis_server() as redis_server, \
            engines_running(args.backends, args.slots, args.ctx) as engines:
        rows, runs = measure(args, redis_server, engines, logs)
        summary = report(rows, runs, args)
        (args.out / "turns.jsonl").write_text(
            "".join(json.dumps(asdict(r)) + "\n" for r in rows), encoding="utf-8")
        (args.out / "summary.md").write_text(summary, encoding="utf-8")
        command = "python -m bench.multi " + " ".join(argv)
        (args.out / "RUN.md").write_text(run_md(command.strip(), args, engines, summary),
                                         encoding="utf-8")
    plot(rows, args, args.out / "multi.png")
    print(summary)
    if any(not r.ok for r in rows):
        return 1
    affinity = summarize([r for r in rows if r.arm == "affinity"])
    return 0 if affinity["turns"] == 0 or affinity["later_cached"] >= TARGET else 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

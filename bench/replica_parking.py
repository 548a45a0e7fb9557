"""Parking behind replicas: six sessions, two `prefixpin serve` replicas, two one-slot
llama-servers, against the same sessions alone and against the routed path before parking
worked behind replicas, side by side in one run.

    python bench/replica_parking.py                 # every arm, both RAM-cache settings,
                                                    # results in bench/results/replica-parking/
    python bench/replica_parking.py --cache-ram 0 --arms alone,prefixpin --out /tmp/rp

One redis-server; per arm, two freshly started llama-servers (SmolLM2-135M, one thread,
``-np 1``, 2048 tokens of context, ``--slot-save-path``) and freshly started replicas
(``--redis``, their own key prefix). Six sessions (explicit ``x-session-id``, a ~300-token
system prompt each: over ``--park-min-tokens``), four turns each; a turn appends a
16-word user message, and the assistant turns are fixed text, so every arm sends the same
prompts token for token. Requests go one at a time, streamed, ``max_tokens`` 8,
temperature 0. Arms:

- ``alone`` (the reference): each session's turns back to back through one replica of
  this tree; nothing else runs in between, so its cost is the first prompt plus the new
  tokens of each turn;
- ``prefixpin``: two replicas of this tree, per-engine save directories (each lane reads
  its engine's ``--slot-save-path`` from the engine's command line); the turns interleaved
  across sessions (a round serves the even sessions, then the odd ones, as the end-to-end
  test does) and alternating replicas: turn t of session s goes to replica (s + t) mod 2;
- ``prefixpin-shared``: the same with ``--park-shared``: both engines save to one
  directory, the replicas' ``--park-dir``;
- ``before``: the same interleaved schedule on replicas of commit ``783c80c`` (the routed
  path before the restructuring, which had no parking behind replicas), run from a git
  worktree of it (``--before-tree``, created when missing).

Each arm runs under every ``--cache-ram`` setting given: ``0`` (llama-server's host-RAM
prompt cache off, so what is measured is parking's) and ``default`` (llama-server's own
RAM cache on, 8 GiB: it brings a displaced prompt back by itself).

Measured: per turn, TTFT at the client (request sent to the first content token), the
usage's prompt and cached tokens, and the tokens the engines prefilled for it (the delta of
both engines' ``llamacpp:prompt_tokens_total`` around the turn); per arm, the replicas'
parks and restores (``prefixpin_parks_total``, ``prefixpin_restores_total``) and, from their
logs, the restores of a file the *other* replica parked.

Writes ``bench/results/replica-parking/``: ``rows.jsonl``, ``summary.json``, ``table.md``,
``replica-parking.png`` and ``RUN.md``; exit status 1 if a request failed, 2 if a
prefixpin arm prefilled more than 1.2x the sessions alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.arms import check_arms_with_alone
from bench.provenance import git_revision, host_lines
from bench.trees import Tree
from tests.e2e.helpers import filler
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.redis_process import RedisProcess, run_redis_server
from tests.rig.replica_process import ReplicaProcess, start_replica
from tests.rig.scrape import metric, prefilled

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "replica-parking"
BEFORE_COMMIT = "783c80c"
ARMS = ("alone", "before", "prefixpin", "prefixpin-shared")
CACHE_RAM = ("0", "default")
TARGET_RATIO = 1.2
REPLICA_ENV = {"PREFIXPIN_HEALTH_INTERVAL_S": "1", "PREFIXPIN_RETRY_GRACE_S": "0"}

Row = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    replicas: int
    tree: str  # "this" | "before"
    shared: bool = False  # --park-shared: one save directory for both engines

    @property
    def interleaved(self) -> bool:
        return self.name != "alone"


ARM_SPECS = {"alone": Arm("alone", 1, "this"), "before": Arm("before", 2, "before"),
             "prefixpin": Arm("prefixpin", 2, "this"),
             "prefixpin-shared": Arm("prefixpin-shared", 2, "this", shared=True)}


@dataclass(slots=True)
class ArmRun:
    arm: str
    cache_ram: str
    wall_s: float
    engine_prefilled: float
    parks: float
    restores: float
    across_replicas: int  # restores of a file the other replica parked
    declined: dict[str, int]
    failed: int


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/replica_parking.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=225,
                        help="words in each session's system prompt (~1.3 tokens a word)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=2048, help="context per slot")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--cache-ram", default=",".join(CACHE_RAM),
                        help="llama-server --cache-ram settings to run every arm under "
                             "(MiB, or 'default')")
    parser.add_argument("--before-tree", type=Path, default=Path("/tmp/pp-before"),
                        help=f"a git worktree of {BEFORE_COMMIT} (created when missing)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--keep-work", action="store_true",
                        help="keep the work directory (process logs, slot files)")
    args = parser.parse_args(argv)
    check_arms_with_alone(parser, args.arms, ARMS)
    return args


# ---------------------------------------------------------------- the trees

def before_tree(path: Path) -> Tree:
    """The tree of the ``before`` arm: a worktree of BEFORE_COMMIT at ``path`` (created
    when missing; ``bench.trees`` checks which files its arm imports)."""
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path),
                        BEFORE_COMMIT], check=True, capture_output=True)
    head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if not head.startswith(BEFORE_COMMIT):
        raise SystemExit(f"--before-tree {path} is at {head[:12]}, not {BEFORE_COMMIT}")
    return Tree.other(path)


# ---------------------------------------------------------------- processes

@contextlib.contextmanager
def engines_for(arm: Arm, cache_ram: str, work: Path, ctx: int
                ) -> Iterator[tuple[list[LlamaServerProcess], list[Path]]]:
    """Two fresh one-slot llama-servers: their own save directories, or one shared."""
    base = work / f"{arm.name}-{cache_ram}"
    dirs = [base / "park"] * 2 if arm.shared else [base / "slots-0", base / "slots-1"]
    for directory in dirs:
        directory.mkdir(parents=True, exist_ok=True)
    extra = [] if cache_ram == "default" else ["--cache-ram", cache_ram]
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(run_llama_server(
            "smollm2", slots=1, ctx_per_slot=ctx, threads=1, slot_save_path=directory,
            extra=extra)) for directory in dirs]
        yield engines, dirs


def start_replicas(arm: Arm, cache_ram: str, engines: list[LlamaServerProcess],
                   dirs: list[Path], redis: RedisProcess, work: Path,
                   before: Tree | None) -> list[ReplicaProcess]:
    prefix = f"rp-{arm.name}-{cache_ram}"
    args = ["--redis-prefix", prefix]
    if arm.shared:
        args += ["--park-shared", "--park-dir", str(dirs[0])]
    env = dict(REPLICA_ENV)
    cwd = None
    if arm.tree == "before":  # its proxy and adapters shadow the editable install
        assert before is not None
        env["PYTHONPATH"] = str(before.root)
        cwd = before.root
    started: list[ReplicaProcess] = []
    try:
        for i in range(arm.replicas):
            started.append(start_replica(
                [e.url for e in engines], work / "logs" / f"{prefix}-replica-{i}.log",
                redis=redis.url, replica_id=f"{prefix}-{i}", args=args, env=env, cwd=cwd,
                operator=arm.tree == "this"))
        for replica in started:
            wait_lanes_ready(replica, len(engines), parking=arm.tree == "this")
    except BaseException:
        for replica in started:
            replica.stop()
        raise
    return started


def wait_lanes_ready(replica: ReplicaProcess, lanes: int, *, parking: bool,
                     timeout: float = 60) -> None:
    """Every lane's policies are on (its slots known; parking on, for this tree)."""
    deadline = time.monotonic() + timeout
    backends: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        view = httpx.get(f"{replica.admin_url}/sessions", timeout=10).json()
        backends = view.get("backends") or []
        if len(backends) == lanes and all(b["slots"] and b["up"] and (
                b.get("parking") or not parking) for b in backends):
            return
        time.sleep(0.1)
    raise RuntimeError(f"lanes not ready: {backends}\n{replica.log_tail()}")


# ---------------------------------------------------------------- requests

class Sessions:
    def __init__(self, n: int, system_words: int) -> None:
        self.histories = {s: [{"role": "system", "content": f"You are agent {s}. "
                               + filler(system_words, seed=100 + s)}] for s in range(n)}




def one_turn(client: httpx.Client, url: str, key: str, messages: list[dict[str, Any]],
             max_tokens: int) -> Row:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.monotonic()
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                           headers={"x-session-id": key}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"status {response.status_code}: "
                                   f"{response.read()[:200]!r}")
            for line in response.iter_lines():  # read to the end: the usage comes last
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = str(event["error"])[:200]
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content") and ttft is None:
                        ttft = time.monotonic() - started
                usage = event.get("usage") or usage
    except (httpx.HTTPError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ok": error is None and usage is not None, "error": error,
            "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens")}


def schedule(arm: Arm, sessions: int, turns: int) -> list[tuple[int, int, int]]:
    """(session, turn, replica) in the order sent."""
    if not arm.interleaved:
        return [(s, t, 0) for s in range(sessions) for t in range(turns)]
    order = sorted(range(sessions), key=lambda s: (s % 2, s))  # evens, then odds
    return [(s, t, (s + t) % arm.replicas) for t in range(turns) for s in order]


def run_turns(arm: Arm, cache_ram: str, replicas: list[ReplicaProcess],
              engines: list[LlamaServerProcess], args: argparse.Namespace) -> list[Row]:
    sessions = Sessions(args.sessions, args.system_words)
    rows: list[Row] = []
    with httpx.Client(timeout=600) as client:
        for seq, (s, t, r) in enumerate(schedule(arm, args.sessions, args.turns)):
            history = sessions.histories[s]
            history.append({"role": "user", "content": f"Turn {t}: "
                            + filler(16, seed=1000 + 10 * s + t)})
            before = prefilled(engines)
            row = one_turn(client, replicas[r].url, f"{arm.name}-agent-{s}", list(history),
                           args.max_tokens)
            row.update(arm=arm.name, cache_ram=cache_ram, seq=seq, session=s, turn=t,
                       replica=r, prefilled=prefilled(engines) - before)
            rows.append(row)
            history.append({"role": "assistant", "content": f"Noted, agent {s}, step {t}."})
            print(f"  {arm.name:>16} ram {cache_ram:>7} s{s} t{t} r{r}: prompt "
                  f"{row['prompt_tokens']} cached {row['cached_tokens']} prefilled "
                  f"{row['prefilled']:.0f} ttft {row['ttft_ms']} ms"
                  + (f" ERROR {row['error']}" if row["error"] else ""),
                  file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------- replica figures



def log_events(path: Path, name: str) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == name:
                    out.append(event)
    return out


def park_figures(replicas: list[ReplicaProcess]) -> tuple[float, float]:
    parks = sum(metric(r.admin_url, "prefixpin_parks_total", outcome="parked")
                for r in replicas)
    restores = sum(metric(r.admin_url, "prefixpin_restores_total", outcome="restored")
                   for r in replicas)
    return parks, restores


def log_figures(replicas: list[ReplicaProcess]) -> tuple[int, dict[str, int]]:
    """Restores of a file the other replica parked, and declined restores by outcome."""
    parked_by = {e["file"]: i for i, r in enumerate(replicas)
                 for e in log_events(r.log_path, "parked")}
    across = sum(1 for i, r in enumerate(replicas) for e in log_events(r.log_path, "restored")
                 if parked_by.get(e["file"], i) != i)
    declined: dict[str, int] = {}
    for r in replicas:
        for e in log_events(r.log_path, "restore declined"):
            declined[e["outcome"]] = declined.get(e["outcome"], 0) + 1
    return across, declined


@dataclass(slots=True)
class EngineSeen:
    """What RUN.md says of the engines: one command line per --cache-ram, the props."""

    argvs: dict[str, list[str]]
    props: dict[str, Any]


def run_arm(arm: Arm, cache_ram: str, redis: RedisProcess, work: Path,
            args: argparse.Namespace, before: Tree | None, seen: EngineSeen
            ) -> tuple[list[Row], ArmRun]:
    with engines_for(arm, cache_ram, work, args.ctx) as (engines, dirs):
        if not seen.props:
            seen.props = httpx.get(f"{engines[0].url}/props", timeout=10).json()
        seen.argvs.setdefault(cache_ram, list(engines[0].args))
        replicas = start_replicas(arm, cache_ram, engines, dirs, redis, work, before)
        try:
            started = time.monotonic()
            rows = run_turns(arm, cache_ram, replicas, engines, args)
            wall = time.monotonic() - started
            total = sum(row["prefilled"] for row in rows)
            parks, restores = park_figures(replicas)
        finally:
            for replica in replicas:
                replica.stop()
        across, declined = log_figures(replicas)
    run = ArmRun(arm.name, cache_ram, round(wall, 1), total, parks, restores, across,
                 declined, sum(1 for row in rows if not row["ok"]))
    return rows, run


# ---------------------------------------------------------------- figures

def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def summarize(rows: list[Row], runs: list[ArmRun]) -> list[dict[str, Any]]:
    out = []
    alone = {run.cache_ram: run.engine_prefilled for run in runs if run.arm == "alone"}
    for run in runs:
        mine = [r for r in rows if r["arm"] == run.arm and r["cache_ram"] == run.cache_ram]
        later = [r["ttft_ms"] for r in mine if r["turn"] > 0 and r["ttft_ms"] is not None]
        first = [r["ttft_ms"] for r in mine if r["turn"] == 0 and r["ttft_ms"] is not None]
        per_turn = {t: _median([r["ttft_ms"] for r in mine
                                if r["turn"] == t and r["ttft_ms"] is not None])
                    for t in sorted({r["turn"] for r in mine})}
        reference = alone.get(run.cache_ram)
        out.append({
            "arm": run.arm, "cache_ram": run.cache_ram, "turns": len(mine),
            "engine_prefilled": run.engine_prefilled,
            "ratio_vs_alone": round(run.engine_prefilled / reference, 3) if reference else None,
            "later_prefilled": sum(r["prefilled"] for r in mine if r["turn"] > 0),
            "parks": run.parks, "restores": run.restores,
            "restores_across_replicas": run.across_replicas, "declined": run.declined,
            "ttft_ms_median_later": _median(later), "ttft_ms_median_first": _median(first),
            "ttft_ms_median_by_turn": per_turn, "wall_s": run.wall_s, "failed": run.failed,
        })
    return out


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def markdown(summary: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"## {args.sessions} sessions, 2 replicas, 2 one-slot llama-servers, {args.turns} turns",
        "",
        "Prompt tokens the two engines prefilled over the whole run "
        "(`llamacpp:prompt_tokens_total`), against the same sessions alone (each session's "
        "turns back to back), under each llama-server `--cache-ram` setting. Restores: "
        "`prefixpin_restores_total{outcome=\"restored\"}` summed over the replicas (in "
        "brackets: restores of a file the other replica parked, from their logs). TTFT: "
        f"median at the client. Target for the prefixpin arms: ratio ≤ {TARGET_RATIO}.", "",
        "| --cache-ram | arm | engine prefilled tokens | on turns 2+ | ratio vs alone | "
        "parks | restores (across replicas) | declined | TTFT median, turns 2+ (ms) | "
        "TTFT median, turn 1 (ms) | TTFT median by turn (ms) | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        declined = ", ".join(f"{k} {v}" for k, v in sorted(s["declined"].items())) or "0"
        by_turn = " / ".join(_ms(v) for v in s["ttft_ms_median_by_turn"].values())
        parks = "n/a" if s["arm"] == "before" else f"{s['parks']:.0f}"
        restores = ("n/a" if s["arm"] == "before"
                    else f"{s['restores']:.0f} ({s['restores_across_replicas']})")
        lines.append(
            f"| {s['cache_ram']} | {s['arm']} | {s['engine_prefilled']:.0f} | "
            f"{s['later_prefilled']:.0f} | {s['ratio_vs_alone']} | {parks} | {restores} | "
            f"{declined} | {_ms(s['ttft_ms_median_later'])} | "
            f"{_ms(s['ttft_ms_median_first'])} | {by_turn} | "
            f"{s['failed']} of {s['turns']} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, rows: list[Row], summary: list[dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return
    settings = list(dict.fromkeys(s["cache_ram"] for s in summary))
    fig, axes = plt.subplots(len(settings), 2, figsize=(12, 4 * len(settings)),
                             squeeze=False)
    for (left, right), cache_ram in zip(axes, settings, strict=True):
        arms = [s["arm"] for s in summary if s["cache_ram"] == cache_ram]
        interleaved = [r for r in rows if r["cache_ram"] == cache_ram and r["arm"] != "alone"]
        order = sorted({(r["seq"], r["session"], r["turn"]) for r in interleaved})
        for arm in arms:
            mine = {(r["session"], r["turn"]): r for r in rows
                    if r["arm"] == arm and r["cache_ram"] == cache_ram}
            keys = [(s, t) for _, s, t in order] if order else sorted(mine)
            left.plot(range(1, len(keys) + 1), [mine[k]["prefilled"] if k in mine else 0
                                                for k in keys],
                      marker="o", markersize=3, label=arm)
            summary_row = next(s for s in summary
                               if s["arm"] == arm and s["cache_ram"] == cache_ram)
            turns = list(summary_row["ttft_ms_median_by_turn"])
            right.plot([t + 1 for t in turns],
                       [summary_row["ttft_ms_median_by_turn"][t] or float("nan")
                        for t in turns], marker="o", label=arm)
        left.set(xlabel="request (interleaved order; alone: the same session's turn)",
                 ylabel="tokens the engines prefilled",
                 title=f"Prefill per request (--cache-ram {cache_ram})")
        right.set(xlabel="turn", ylabel="median TTFT (ms)",
                  title=f"Time to first token (--cache-ram {cache_ram})")
        right.set_ylim(bottom=0)
        right.xaxis.set_major_locator(MaxNLocator(integer=True))
        for axis in (left, right):
            axis.grid(alpha=0.3)
            axis.legend()
    fig.suptitle("Six sessions, two replicas, two one-slot llama-servers (turns alternate "
                 "replicas)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_md(command: str, table: str, props: dict[str, Any], argvs: dict[str, list[str]],
           notes: list[str], before: dict[str, Any] | None) -> str:
    settings = props.get("default_generation_settings", {})
    before_rev = "not run"
    if before is not None:
        changes = len(before["local_changes"])
        before_rev = (f"{before['commit'][:12]} at {before['root']} (imports "
                      f"{before['proxy_cli']}; {changes} uncommitted product files)")
    lines = [
        "# Run: parking behind replicas", "", "```", command, "```", "",
        *host_lines(shared=True),
        f"- repository: {git_revision(REPO)}; `before` arm: worktree of {before_rev}",
        f"- llama-server build_info: {props.get('build_info', 'unknown')}; model "
        f"{Path(str(props.get('model_path', 'unknown'))).name}; {props.get('total_slots')} "
        f"slot of {settings.get('n_ctx', '?')} tokens per server, two servers per arm, "
        "started fresh for every arm (nice 10, as the rig starts them)",
        *[f"- llama-server, --cache-ram {k} (first of the two): `{shlex.join(v)}`"
          for k, v in argvs.items()],
        *[f"- {note}" for note in notes], "", table,
        "Rows: `rows.jsonl`; figures: `summary.json`; plot: `replica-parking.png`.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    arms = [ARM_SPECS[name] for name in ARMS if name in args.arms.split(",")]
    settings = args.cache_ram.split(",")
    before = before_tree(args.before_tree) if any(a.tree == "before" for a in arms) else None
    before_facts = before.describe() if before is not None else None
    work = Path(tempfile.mkdtemp(prefix="prefixpin-replica-parking-"))
    load_before = os.getloadavg()
    rows: list[Row] = []
    runs: list[ArmRun] = []
    seen = EngineSeen({}, {})
    with run_redis_server() as redis:
        for cache_ram in settings:
            for arm in arms:
                print(f"replica parking bench: --cache-ram {cache_ram}, arm {arm.name}",
                      file=sys.stderr, flush=True)
                arm_rows, run = run_arm(arm, cache_ram, redis, work, args, before, seen)
                rows += arm_rows
                runs.append(run)
    summary = summarize(rows, runs)
    table = markdown(summary, args)
    notes = [
        f"{args.sessions} sessions x {args.turns} turns; system prompt {args.system_words} "
        "words (~300 tokens), 16-word user turns, fixed assistant turns; streamed, "
        f"max_tokens {args.max_tokens}, temperature 0; one request at a time; "
        "x-session-id per session",
        "replicas: `prefixpin serve --upstream A --upstream B --redis URL --redis-prefix "
        "<per arm>` with PREFIXPIN_HEALTH_INTERVAL_S=1 and PREFIXPIN_RETRY_GRACE_S=0; "
        "prefixpin-shared adds `--park-shared --park-dir <the engines' one save directory>`; "
        "before: `python -m proxy.cli serve` from the worktree (PYTHONPATH and cwd there)",
        "alone: each session's turns back to back through one replica of this tree (its "
        "parking on: a session evicted by the next one is parked, not re-prefilled)",
        "load average (1, 5, 15 min) at start {:.2f} {:.2f} {:.2f}, at end {:.2f} {:.2f} "
        "{:.2f}: token counts do not depend on load, times do".format(
            *load_before, *os.getloadavg()),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "rows.jsonl").open("w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    (args.out / "summary.json").write_text(json.dumps(
        {"sessions": args.sessions, "turns": args.turns, "arms": summary,
         "before_tree": before_facts}, indent=2) + "\n")
    (args.out / "table.md").write_text(table)
    plot(args.out / "replica-parking.png", rows, summary)
    command = shlex.join(["python", "bench/replica_parking.py", *argv])
    (args.out / "RUN.md").write_text(run_md(command, table, seen.props, seen.argvs, notes,
                                            before_facts))
    print(table)
    print(f"results in {args.out}")
    if args.keep_work:
        print(f"work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if any(run.failed for run in runs):
        return 1
    over = [s for s in summary if s["arm"].startswith("prefixpin")
            and (s["ratio_vs_alone"] or 0) > TARGET_RATIO]
    return 2 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())

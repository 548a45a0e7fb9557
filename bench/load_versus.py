"""Two proxy trees under the same load at the same moment: which costs less CPU per event.

On these shared machines the speed of a core moves by a third from one minute to the next,
so two trees measured one after the other (``bench/load.py --tree``) differ by the machine
as much as by the code. Here both proxies (``prefixpin serve`` from each tree, features at
their defaults) run in front of one fast fake engine (``bench/fast_engine.py``) and each
round sends half the streams through each, at once: the same phase of the machine, the
same contention. Per round: each proxy's CPU (``/proc``: utime + stime, and utime alone)
per event its clients checked, and the ratio of each tree to the first.

Each tree's streams come from a client process of its own (``--clients separate``, the
default; forked per round, both started at the same instant): a client shared by both
(``--clients shared``, what this bench did first) is woken by either proxy's writes, which
hides what one proxy's way of writing costs the kernel (``proxy.speed.client_writes``).

Two proxies at once is not the load either tree serves alone, though: what one proxy
costs the kernel depends on how often its client sleeps, which the other proxy changes.
``--mode alternate`` measures each tree alone under all the streams, as ``bench/load.py``
does (fresh fake, proxy and client per run, one round of ``--waves`` requests per
stream), the trees taking turns (the order flipping every round), and divides each run's
proxy CPU per event by the fake's in the same run: the fake's code is the same in every
run, so its cost is the machine's speed at that moment, and the ratio is what the tree
costs at a given speed.

    python bench/load_versus.py BEFORE_TREE AFTER_TREE [--rounds 8] [--streams 256]
                                [--clients separate|shared] [--mode together|alternate]

A tree is a directory holding ``proxy/cli.py`` (a ``git worktree``; this checkout is
``.``), or ``TREE@PYTHON``: that tree run on another interpreter (a venv's ``python`` with
the proxy's dependencies), e.g. ``. .@/tmp/venv-sys/bin/python`` to weigh the interpreter's
build (``bench/trees.py``). The absolute figures are not ``bench/load.py``'s (two proxies
share the cores): the ratios are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import load
from bench.provenance import host_lines
from bench.trees import Tree, tree_line

HERE = Path(__file__).resolve().parent.parent


def user_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK")


def tree_of(spec: str) -> Tree:
    """``TREE`` or ``TREE@PYTHON``."""
    path, _, python = spec.partition("@")
    if Path(path).resolve() == HERE:
        return Tree.this(python or None)
    return Tree.other(Path(path), python or None)


def name_of(spec: str) -> str:
    path, _, python = spec.partition("@")
    name = Path(path).resolve().name or path
    return f"{name}@{python}" if python else name


def file_name(name: str) -> str:
    """An arm's name in a log file's name (``TREE@PYTHON`` holds slashes)."""
    return name.replace("/", "_")


def checked_events(streams: list[load.Stream], name: str) -> int:
    bad = [s for s in streams if s.failed or any(s.problems().values())]
    if bad:
        raise SystemExit(f"{name}: {len(bad)} streams failed or lost events")
    return sum(len(s.seqs) for s in streams)


async def shared_client(procs: dict[str, tuple[int, int]], plan: load.Plan,
                        index: int) -> dict[str, int]:
    """One round of every tree's streams from this process: events checked per tree."""
    results = await asyncio.gather(*(
        load.run_round(port, plan, plan.requests(f"{n}-{index}", index))
        for n, (port, _) in procs.items()))
    return {name: checked_events(streams, name)
            for name, streams in zip(procs, results, strict=True)}


def _client_process(port: int, plan: load.Plan, name: str, index: int, start_at: float,
                    out: Any) -> None:
    gc.disable()  # the client's own collector stays out of the round
    time.sleep(max(0.0, start_at - time.time()))
    streams = load.run_async(load.run_round(port, plan, plan.requests(f"{name}-{index}", index)))
    out.put((name, checked_events(streams, name)))


def separate_clients(procs: dict[str, tuple[int, int]], plan: load.Plan,
                     index: int) -> dict[str, int]:
    """One round, each tree's streams from a client process of its own (forked now, both
    starting at the same instant): events checked per tree."""
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    start_at = time.time() + 0.3
    children = [context.Process(target=_client_process,
                                args=(port, plan, name, index, start_at, out))
                for name, (port, _) in procs.items()]
    for child in children:
        child.start()
    events = dict(out.get(timeout=plan.stream_s * 4 + 120) for _ in children)
    for child in children:
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"a client process failed ({child.exitcode})")
    return events


def rounds(procs: dict[str, tuple[int, int]], plan: load.Plan, warm: load.Plan,
           count: int, separate: bool) -> dict[str, dict[str, list[float]]]:
    async def warm_up() -> None:
        for name, (port, _) in procs.items():
            await load.run_round(port, warm, warm.requests(f"warm-{name}", 0))
            await load.run_round(port, plan, plan.requests(f"warm2-{name}", 0))

    load.run_async(warm_up())
    out: dict[str, dict[str, list[float]]] = {n: {"cpu": [], "user": []} for n in procs}
    for index in range(1, count + 1):
        gc.collect()
        gc.disable()
        cpu0 = {n: load.cpu_seconds(pid) for n, (_, pid) in procs.items()}
        user0 = {n: user_seconds(pid) for n, (_, pid) in procs.items()}
        if separate:
            events = separate_clients(procs, plan, index)
        else:
            events = load.run_async(shared_client(procs, plan, index))
        time.sleep(0.5)  # the work after the last byte counts
        for name, (_, pid) in procs.items():
            out[name]["cpu"].append((load.cpu_seconds(pid) - cpu0[name]) / events[name] * 1e6)
            out[name]["user"].append((user_seconds(pid) - user0[name]) / events[name] * 1e6)
        gc.enable()
        print(f"round {index}: " + ", ".join(
            f"{n} {v['cpu'][-1]:.1f} µs/event" for n, v in out.items()), flush=True)
    return out


def alternate(trees: dict[str, Tree], model: str, plan: load.Plan, warm: load.Plan,
              count: int, logs: Path, *, seq_in_tokens: bool = False,
              ) -> dict[str, dict[str, list[float]]]:
    """Each tree alone under ``plan``, the trees taking turns: per run, the proxy's and
    the fake's CPU per event the client checked."""
    out: dict[str, dict[str, list[float]]] = {
        n: {"cpu": [], "user": [], "fake": []} for n in trees}
    names = list(trees)
    for index in range(1, count + 1):
        for name in names if index % 2 else names[::-1]:
            setup = load.Setup(model, trees[name], [], 2.0, logs, seq_in_tokens)
            with load.engines(setup, f"{file_name(name)}-{index}", plan.streams,
                              plan) as (ports, pids, _):
                port = ports["proxy"]
                load.run_async(load.run_round(port, warm, warm.requests("warm", 0)))
                gc.collect()
                gc.disable()
                proxy0, user0 = load.cpu_seconds(pids["proxy"]), user_seconds(pids["proxy"])
                fake0 = load.cpu_seconds(pids["fake"])
                streams = load.run_async(load.run_round(port, plan, plan.requests(name, index)))
                time.sleep(0.5)  # the work after the last byte counts
                events = checked_events(streams, name)
                out[name]["cpu"].append((load.cpu_seconds(pids["proxy"]) - proxy0) / events * 1e6)
                out[name]["user"].append((user_seconds(pids["proxy"]) - user0) / events * 1e6)
                out[name]["fake"].append((load.cpu_seconds(pids["fake"]) - fake0) / events * 1e6)
                gc.enable()
            print(f"round {index}: {name} {out[name]['cpu'][-1]:.1f} µs/event, the fake "
                  f"{out[name]['fake'][-1]:.1f}", flush=True)
    return out


def report_alternate(result: dict[str, dict[str, list[float]]], names: list[str]) -> None:
    first = names[0]
    ratios = {n: [c / f for c, f in zip(result[n]["cpu"], result[n]["fake"], strict=True)]
              for n in names}
    for name in names:
        print(f"{name}: median {statistics.median(result[name]['cpu']):.1f} µs/event (user "
              f"{statistics.median(result[name]['user']):.1f}), the fake "
              f"{statistics.median(result[name]['fake']):.1f}; proxy / fake: median "
              f"{statistics.median(ratios[name]):.2f}, runs "
              f"{[round(r, 2) for r in ratios[name]]}; to {first}'s: "
              f"{statistics.median(ratios[name]) / statistics.median(ratios[first]):.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--streams", type=int, default=256, help="in all, half per tree")
    parser.add_argument("--events", type=int, default=100)
    parser.add_argument("--token-delay-ms", type=float, default=20.0)
    parser.add_argument("--clients", choices=("separate", "shared"), default="separate")
    parser.add_argument("--mode", choices=("together", "alternate"), default="together")
    parser.add_argument("--seq-in-tokens", action="store_true",
                        help='the fake\'s token events with a "seq" field (not llama\'s shape)')
    parser.add_argument("--waves", type=int, default=3,
                        help="requests per stream in a round (--mode alternate)")
    args = parser.parse_args()
    names = [name_of(t) for t in args.trees]
    if names[0] == names[1]:
        names = ["first", "second"]
    model = load.resolve_model("auto")
    if args.mode == "alternate":
        logs = Path(os.environ.get("TMPDIR", "/tmp")) / "prefixpin-load-versus"
        logs.mkdir(exist_ok=True)
        whole = load.Plan(args.streams, args.waves, args.events, args.token_delay_ms,
                          together=False, fresh=False, timeout_s=120)
        warm_up = load.Plan(16, 1, 4, args.token_delay_ms, together=True, fresh=False,
                            timeout_s=60)
        trees = {name: tree_of(path) for name, path in zip(names, args.trees, strict=True)}
        result_alone = alternate(trees, model, whole, warm_up, args.rounds, logs,
                                 seq_in_tokens=args.seq_in_tokens)
        print()
        print("\n".join(host_lines()))
        print(f"- alternate: each tree alone, {args.streams} streams x {args.waves} requests "
              f"of {args.events} tokens, {args.rounds} runs per tree; the fake's token events "
              + ("with a `seq` field" if args.seq_in_tokens else "in llama-server's shape"))
        for name, tree in trees.items():
            described = tree.describe()
            print(f"- {name}: {tree_line(described)}")
        report_alternate(result_alone, names)
        return 0
    half = load.Plan(args.streams // 2, 1, args.events, args.token_delay_ms, together=False,
                     fresh=False, timeout_s=60)
    warm = load.Plan(16, 1, 4, args.token_delay_ms, together=True, fresh=False, timeout_s=60)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "prefixpin-load-versus"
    logs.mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        fake_port = load.free_ports()
        base = load.Setup(model, Tree.this(), [], 2.0, logs, args.seq_in_tokens)
        flog = stack.enter_context(open(logs / "fake.log", "wb"))
        stack.enter_context(load.process(base.fake_cmd(fake_port, args.streams + 16, half),
                                         f"http://{load.HOST}:{fake_port}/health", flog))
        procs: dict[str, tuple[int, int]] = {}
        for name, path in zip(names, args.trees, strict=True):
            tree = tree_of(path)
            port = load.free_ports()
            admin = f"{load.HOST}:{load.free_ports()}"
            setup = load.Setup(model, tree, ["--admin-listen", admin], 2.0, logs,
                               args.seq_in_tokens)
            plog = stack.enter_context(open(logs / f"proxy-{file_name(name)}.log", "wb"))
            proc = stack.enter_context(load.process(
                setup.proxy_cmd(fake_port, port), f"http://{load.HOST}:{port}/healthz", plog,
                **tree.popen_kwargs()))
            procs[name] = (port, proc.pid)
        result: dict[str, Any] = rounds(procs, half, warm, args.rounds,
                                        args.clients == "separate")
    print()
    print("\n".join(host_lines()))
    print(f"- clients: {args.clients}; {args.streams // 2} streams per tree, {args.rounds} rounds")
    first = names[0]
    for name in names:
        cpu = [a / b for a, b in zip(result[name]["cpu"], result[first]["cpu"], strict=True)]
        user = [a / b for a, b in zip(result[name]["user"], result[first]["user"],
                                      strict=True)]
        print(f"{name}: median {statistics.median(result[name]['cpu']):.1f} µs/event "
              f"(user {statistics.median(result[name]['user']):.1f}); ratio to {first}: "
              f"median {statistics.median(cpu):.3f} (user {statistics.median(user):.3f}), "
              f"rounds {[round(r, 3) for r in cpu]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

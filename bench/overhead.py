"""What the proxy adds: latency per request and relay throughput, side by side with direct.

A zero-latency fake llama-server (``tests.fakes.fake_llama``, real uvicorn, its own
process) serves every arm; prefixpin runs in its own process in front of it (features at
their defaults), and so does the floor: a bare starlette + httpx relay on the same server
stack (``bench/floor_proxy.py``), the least any proxy built on these libraries adds.
Requests alternate direct / proxy / floor, the order rotating every round, so machine noise
hits the arms alike.

    python bench/overhead.py [--requests 400] [--events 20000] [--streams 3]
                             [--out bench/results/overhead] [--before-tree PATH ...]

Added latency = the proxy arm's percentile minus the direct arm's, for the time to the
last byte of a short streamed chat completion (the whole request path) and the time to
its first data event. Relay throughput = data events per second of one long stream (the
median of ``--streams`` streams per arm).
``*_floor_added_ms`` is the same figure for the floor arm: prefixpin's own work is the
difference between the two. ``*_added_over_floor`` is prefixpin's added latency over the
floor's, in the same run; ``floor_target`` checks issue 18's bar against it (within 1.1x).

``--before-tree PATH`` adds a fourth arm, ``before``: the same ``proxy.cli serve`` run from
another source tree (e.g. ``git worktree add /tmp/pp-before 783c80c``; see
``bench/trees.py``), rotating with the others. ``*_before_added_ms`` is its added latency;
``*_proxy_minus_before`` the median of the per-round differences proxy - before, with a 95%
interval, and ``relay_ratio_proxy_over_before`` the median of the per-round throughput
ratios. Given again, each further tree is one more arm, ``before2``, ``before3``, ... with
the same figures under its name, and ``*_before2_minus_before`` (and so on) pairs each tree
with the one given before it. ``cpu_us_per_request``: each proxy process's own CPU time
per short request (from ``/proc``), a figure that other load on the machine barely moves;
``trees`` records which files each proxy arm imports and their commits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.trees import Tree, cpu_per_request_us, cpu_seconds, paired_median_ms, rotated
from tests.fakes.servers import free_port, free_ports

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True}


@contextmanager
def process(args: list[str], url: str, **popen: Any) -> Iterator[subprocess.Popen[bytes]]:
    """``popen``: extra ``subprocess.Popen`` arguments (``env``, ``cwd``: a tree's arm)."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code < 500:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"{args} did not start")
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


def timed_request(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, float,
                                                                                 int]:
    """(seconds to first data event, seconds to last byte, data events)."""
    start = time.perf_counter()
    first = None
    events = 0
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events += 1
                if first is None:
                    first = time.perf_counter() - start
    return (first or 0.0), time.perf_counter() - start, events


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


FLOOR_TARGET = 1.1  # issue 18: prefixpin's added latency within 1.1x of the floor's


def before_arms(count: int) -> list[str]:
    """The names of the ``--before-tree`` arms: before, before2, before3, ..."""
    return ["before" if i == 0 else f"before{i + 1}" for i in range(count)]


def run(requests: int, events: int, before: Tree | list[Tree] | None = None,
        streams: int = 3) -> dict[str, Any]:
    befores = [] if before is None else [before] if isinstance(before, Tree) else before
    fake_port, proxy_port = free_ports(2)
    fake = f"http://127.0.0.1:{fake_port}"
    proxied = f"http://127.0.0.1:{proxy_port}"
    # The fake writes 16 events per socket write: the relay is measured, not the fake's
    # own per-write cost (a real engine's tokens are far slower than either).
    fake_cmd = [sys.executable, "-m", "tests.fakes.fake_llama", "--port", str(fake_port),
                "--reply-words", str(events), "--events-per-write", "16"]
    this = Tree.this()
    proxy_args = ["--upstream", fake, "--log-level", "warning"]
    floor_port = free_port()
    floor = f"http://127.0.0.1:{floor_port}"
    floor_cmd = [sys.executable, str(Path(__file__).with_name("floor_proxy.py")), fake,
                 str(floor_port)]
    arms = {"direct": fake, "proxy": proxied, "floor": floor}
    trees = {"proxy": this.describe()}
    with ExitStack() as stack:
        stack.enter_context(process(fake_cmd, fake))
        pids = {"proxy": stack.enter_context(process(
            [*this.serve(), *proxy_args, "--port", str(proxy_port)], proxied,
            **this.popen_kwargs())).pid}
        pids["floor"] = stack.enter_context(process(floor_cmd, floor)).pid
        for name, tree in zip(before_arms(len(befores)), befores, strict=True):
            trees[name] = tree.describe()
            before_port = free_port()
            arms[name] = f"http://127.0.0.1:{before_port}"
            pids[name] = stack.enter_context(process(
                [*tree.serve(), *proxy_args, "--port", str(before_port)], arms[name],
                **tree.popen_kwargs())).pid
        client = stack.enter_context(httpx.Client(timeout=60))
        first: dict[str, list[float]] = {arm: [] for arm in arms}
        total: dict[str, list[float]] = {arm: [] for arm in arms}
        throughput: dict[str, list[float]] = {arm: [] for arm in arms}
        for url in arms.values():  # warm up every path
            for _ in range(20):
                timed_request(client, url, CHAT)
        order = list(arms)
        cpu_start = {arm: cpu_seconds(pid) for arm, pid in pids.items()}
        for index in range(requests):
            for arm in rotated(order, index):
                f, t, _ = timed_request(client, arms[arm], CHAT)
                first[arm].append(f)
                total[arm].append(t)
        cpu = cpu_per_request_us(cpu_start, {arm: cpu_seconds(pid) for arm, pid in pids.items()},
                                 dict.fromkeys(pids, requests))
        for index in range(streams):
            for arm in rotated(order, index):
                _, seconds, n = timed_request(client, arms[arm], {**CHAT, "max_tokens": events})
                throughput[arm].append(n / seconds)
    result = summarise(first, total, throughput, requests, events)
    # Each proxy process's own CPU time per short request (barely moved by other load).
    result["cpu_us_per_request"] = cpu
    result["trees"] = trees
    return result


def summarise(first: dict[str, list[float]], total: dict[str, list[float]],
              throughput: dict[str, list[float]], requests: int, events: int) -> dict[str, Any]:
    ms = 1000.0
    result: dict[str, Any] = {"requests_per_arm": requests, "events_per_stream": events,
                              "streams_per_arm": len(throughput["direct"])}
    befores = [arm for arm in first if arm.startswith("before")]
    for name, series in (("first_event", first), ("last_byte", total)):
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            direct = percentile(series["direct"], q) * ms
            proxy = percentile(series["proxy"], q) * ms
            floor = percentile(series["floor"], q) * ms
            result[f"{name}_{label}_direct_ms"] = round(direct, 3)
            result[f"{name}_{label}_proxy_ms"] = round(proxy, 3)
            result[f"{name}_{label}_added_ms"] = round(proxy - direct, 3)
            # The bare starlette + httpx relay (bench/floor_proxy.py): the stack's own cost.
            result[f"{name}_{label}_floor_added_ms"] = round(floor - direct, 3)
            result[f"{name}_{label}_added_over_floor"] = _ratio(proxy - direct, floor - direct)
            for arm in befores:  # the same proxy arm from a --before-tree
                other = percentile(series[arm], q) * ms
                result[f"{name}_{label}_{arm}_ms"] = round(other, 3)
                result[f"{name}_{label}_{arm}_added_ms"] = round(other - direct, 3)
                result[f"{name}_{label}_{arm}_added_over_floor"] = _ratio(other - direct,
                                                                         floor - direct)
        for arm in befores:
            result[f"{name}_proxy_minus_{arm}"] = paired_median_ms(series["proxy"],
                                                                   series[arm])
        for later, arm in zip(befores[1:], befores, strict=False):  # tree by tree
            result[f"{name}_{later}_minus_{arm}"] = paired_median_ms(series[later],
                                                                     series[arm])
    result["relay_events_per_s_direct"] = round(statistics.median(throughput["direct"]))
    result["relay_events_per_s_proxy"] = round(statistics.median(throughput["proxy"]))
    result["relay_events_per_s_floor"] = round(statistics.median(throughput["floor"]))
    result["relay_ratio_proxy_over_direct"] = round(
        result["relay_events_per_s_proxy"] / result["relay_events_per_s_direct"], 3)
    for arm in befores:
        result[f"relay_events_per_s_{arm}"] = round(statistics.median(throughput[arm]))
        result[f"relay_ratio_{arm}_over_direct"] = round(
            result[f"relay_events_per_s_{arm}"] / result["relay_events_per_s_direct"], 3)
        result[f"relay_ratio_proxy_over_{arm}"] = round(statistics.median(
            a / b for a, b in zip(throughput["proxy"], throughput[arm], strict=True)), 3)
    # Issue 18: the short streamed request's added latency (p50: to its first data event
    # and to its last byte) within FLOOR_TARGET of the floor's, in the same run.
    ratios = {key: result[key] for key in ("first_event_p50_added_over_floor",
                                           "last_byte_p50_added_over_floor")}
    result["floor_target"] = {"ratio": FLOOR_TARGET, **ratios, "met": all(
        r is not None and r <= FLOOR_TARGET for r in ratios.values())}
    return result


def _ratio(added: float, floor: float) -> float | None:
    return round(added / floor, 3) if floor > 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--streams", type=int, default=3,
                        help="long streams per arm for the relay throughput (default 3)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/overhead"))
    parser.add_argument("--before-tree", type=Path, metavar="PATH", action="append",
                        default=[],
                        help="also run the proxy arm from this source tree (e.g. a git "
                             "worktree of an older commit), as arm 'before'; again for arms "
                             "'before2', 'before3', ...")
    args = parser.parse_args()
    before = [Tree.other(path) for path in args.before_tree]
    load_start = os.getloadavg()
    result = run(args.requests, args.events, before, args.streams)
    result["command"] = "python " + " ".join(sys.argv)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "platform": platform.platform(), "load_average_start": load_start,
                         "load_average_end": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

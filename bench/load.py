"""Load: 256 concurrent streams through one proxy process, side by side with direct.

A fast fake llama-server (``proxy.testing.fake_llama --sequence``: every event carries
``"seq"``, its index in its stream; real uvicorn, its own process, as many slots as
streams) serves both arms; prefixpin runs in its own process in front of it (``prefixpin
serve``, features at their defaults). Each round opens all streams at once, each with its
own conversation (so nothing is joined in flight), asking for progress and usage so that
every engine event reaches the client. Rounds alternate direct / proxy so that machine
noise hits both arms alike.

    python bench/load.py [--streams 32,64,128,256] [--events 100] [--token-delay-ms 20]
                         [--rounds 3] [--out bench/results/load]

``--streams`` takes a list: each level runs with fresh processes, so that the scaling of
the added latency with concurrency is seen side by side; the largest level is the one the
issue asks for (256).

Per stream, the client (raw asyncio sockets, its own parser) checks that the events'
``seq`` run 0, 1, ..., n-1 with no gap, repeat or inversion, that n is the same for every
stream and arm, and that the stream ends with ``[DONE]``. It reports the proxy's peak RSS
(``VmHWM`` from /proc) and its RSS after every round (bounded: it must not grow with the
number of streams served), and the added latency: the proxy arm's percentile minus the
direct arm's, for the first data event and for the last byte of a stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from proxy.testing.servers import free_port

SEQ = re.compile(rb'"seq":(\d+)')
HOST = "127.0.0.1"


@dataclass(slots=True)
class Stream:
    """What one client saw of one stream."""

    status: int = 0
    seqs: list[int] = field(default_factory=list)
    done: bool = False
    first_event_s: float | None = None
    last_byte_s: float = 0.0
    error: str | None = None

    def problems(self) -> dict[str, int]:
        """Lost, duplicated and reordered events, from the sequence numbers alone."""
        seen = set(self.seqs)
        expected = max(self.seqs) + 1 if self.seqs else 0
        return {
            "lost": expected - len(seen),
            "duplicated": len(self.seqs) - len(seen),
            "reordered": sum(1 for a, b in zip(self.seqs, self.seqs[1:], strict=False)
                             if b < a),
        }


async def run_stream(port: int, body: bytes, timeout_s: float) -> Stream:
    """POST one streaming chat request over a fresh connection and read it to the end."""
    result = Stream()
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(HOST, port)
            try:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
                             b"content-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                await _read_response(reader, result, start)
            finally:
                writer.close()
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.last_byte_s = time.perf_counter() - start
    return result


async def _read_response(reader: asyncio.StreamReader, result: Stream, start: float) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    result.status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" not in head.lower():
        raise ValueError(f"expected a chunked event stream, got {head[:200]!r}")
    buffer = b""
    while True:
        size = int((await reader.readline()).strip(), 16)
        if size == 0:
            await reader.readline()
            return
        buffer += (await reader.readexactly(size + 2))[:-2]
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            _record(event, result, start)


def _record(event: bytes, result: Stream, start: float) -> None:
    if not event.startswith(b"data: "):
        return  # the proxy's comments (first byte, heartbeats)
    if result.first_event_s is None:
        result.first_event_s = time.perf_counter() - start
    if event == b"data: [DONE]":
        result.done = True
    elif match := SEQ.search(event):
        result.seqs.append(int(match.group(1)))
    else:
        raise ValueError(f"an event without a sequence number: {event[:200]!r}")


def body_of(arm: str, round_: int, stream: int, events: int) -> bytes:
    """A conversation of its own per stream and round: nothing is shared or joined."""
    return json.dumps({
        "messages": [{"role": "system", "content": "You answer load tests."},
                     {"role": "user", "content": f"{arm} round {round_} stream {stream}"}],
        "max_tokens": events, "stream": True, "return_progress": True,
        "stream_options": {"include_usage": True}}).encode()


async def run_round(port: int, arm: str, round_: int, streams: int, events: int,
                    timeout_s: float) -> list[Stream]:
    return list(await asyncio.gather(*(run_stream(port, body_of(arm, round_, i, events),
                                                  timeout_s) for i in range(streams))))


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def process(args: list[str], health_url: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                detail = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"{args} exited: {detail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health_url, timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{args} did not start")
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(streams: int, events: int, token_delay_ms: float, rounds: int,
        timeout_s: float) -> dict[str, Any]:
    fake_port, proxy_port = free_port(), free_port()
    fake_cmd = [sys.executable, "-m", "proxy.testing.fake_llama", "--port", str(fake_port),
                "--reply-words", str(events), "--slots", str(streams), "--sequence",
                "--token-delay-ms", str(token_delay_ms)]
    proxy_cmd = [sys.executable, "-m", "proxy.cli", "serve", "--upstream",
                 f"http://{HOST}:{fake_port}", "--port", str(proxy_port),
                 "--log-level", "warning"]
    ports = {"direct": fake_port, "proxy": proxy_port}
    seen: dict[str, list[Stream]] = {"direct": [], "proxy": []}
    rss_after_round: list[int] = []
    with process(fake_cmd, f"http://{HOST}:{fake_port}/health") as fake, \
            process(proxy_cmd, f"http://{HOST}:{proxy_port}/healthz") as proxy:
        for arm, port in ports.items():  # warm both paths (connections, code, slots)
            asyncio.run(run_round(port, f"warm-{arm}", 0, 16, 4, timeout_s))
        rss_idle = proc_status(proxy.pid)["VmRSS"]
        cpu = {"proxy": cpu_seconds(proxy.pid), "fake": cpu_seconds(fake.pid)}
        walls: list[float] = []
        for round_ in range(1, rounds + 1):
            for arm, port in ports.items():
                started = time.perf_counter()
                seen[arm] += asyncio.run(run_round(port, arm, round_, streams, events,
                                                   timeout_s))
                walls.append(time.perf_counter() - started)
                if arm == "proxy":
                    rss_after_round.append(proc_status(proxy.pid)["VmRSS"])
        cpu = {"proxy": cpu_seconds(proxy.pid) - cpu["proxy"],
               "fake": cpu_seconds(fake.pid) - cpu["fake"]}
        peak = proc_status(proxy.pid)["VmHWM"]
    return summarise(seen, rss_idle, rss_after_round, peak, cpu, streams, events,
                     token_delay_ms, rounds, walls)


def summarise(seen: dict[str, list[Stream]], rss_idle: int, rss_after_round: list[int],
              peak: int, cpu: dict[str, float], streams: int, events: int,
              token_delay_ms: float, rounds: int, walls: list[float]) -> dict[str, Any]:
    result: dict[str, Any] = {
        "streams_per_round": streams, "rounds_per_arm": rounds,
        "reply_words_per_stream": events, "fake_token_delay_ms": token_delay_ms,
    }
    lengths = {len(s.seqs) for arm in seen.values() for s in arm if s.error is None}
    for arm, arm_streams in seen.items():
        problems = {"lost": 0, "duplicated": 0, "reordered": 0}
        for stream in arm_streams:
            for name, value in stream.problems().items():
                problems[name] += value
        failed = [s for s in arm_streams if s.error or s.status != 200 or not s.done]
        result[arm] = {
            "streams": len(arm_streams),
            "events_checked": sum(len(s.seqs) for s in arm_streams),
            **problems,
            "streams_failed": len(failed),
            "first_failure": next((s.error or f"status {s.status}, done={s.done}"
                                   for s in failed), None),
        }
    result["events_per_stream"] = sorted(lengths)
    ok = all(result[arm][k] == 0 for arm in seen
             for k in ("lost", "duplicated", "reordered", "streams_failed"))
    result["verdict"] = "ok" if ok and len(lengths) == 1 else "FAILED"
    ms = 1000.0
    for name, key in (("first_event", "first_event_s"), ("last_byte", "last_byte_s")):
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            values = {arm: [getattr(s, key) or 0.0 for s in arm_streams if s.error is None]
                      for arm, arm_streams in seen.items()}
            direct = percentile(values["direct"], q) * ms
            proxy = percentile(values["proxy"], q) * ms
            result[f"{name}_{label}_direct_ms"] = round(direct, 1)
            result[f"{name}_{label}_proxy_ms"] = round(proxy, 1)
            result[f"{name}_{label}_added_ms"] = round(proxy - direct, 1)
    result["round_wall_s_median"] = round(statistics.median(walls), 2)
    result["proxy_rss_idle_mib"] = round(rss_idle / 1024, 1)
    result["proxy_rss_after_each_round_mib"] = [round(r / 1024, 1) for r in rss_after_round]
    result["proxy_peak_rss_mib"] = round(peak / 1024, 1)
    events_via_proxy = max(1, result["proxy"]["events_checked"])
    result["cpu_s"] = {k: round(v, 2) for k, v in cpu.items()}
    result["proxy_cpu_us_per_event"] = round(cpu["proxy"] / events_via_proxy * 1e6, 1)
    return result


def render(runs: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Load: concurrent streams through one proxy process", "",
        "```", command, "```", "",
        f"- date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"{platform.platform()}; load average at end {os.getloadavg()[0]:.2f} (the machine "
        "may be shared; the client, the fake and the proxy share its cores)",
        f"- per level: all streams at once, {runs[0]['rounds_per_arm']} rounds per arm, "
        f"alternating direct / proxy, fresh processes; the fake writes "
        f"{runs[0]['reply_words_per_stream']} words {runs[0]['fake_token_delay_ms']} ms apart",
        "- added = proxy percentile minus direct percentile, over every stream of the level",
        "",
        "| streams | verdict | events checked (both arms) | lost / dup / reordered | "
        "first event p99 added (ms) | last byte p99 added (ms) | proxy peak RSS (MiB) | "
        "proxy µs per event |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run_ in runs:
        checked = run_["direct"]["events_checked"] + run_["proxy"]["events_checked"]
        bad = "/".join(str(run_["direct"][k] + run_["proxy"][k])
                       for k in ("lost", "duplicated", "reordered"))
        lines.append(f"| {run_['streams_per_round']} | {run_['verdict']} | {checked} | {bad} | "
                     f"{run_['first_event_p99_added_ms']} | {run_['last_byte_p99_added_ms']} | "
                     f"{run_['proxy_peak_rss_mib']} | {run_['proxy_cpu_us_per_event']} |")
    for run_ in runs:
        lines += ["", *render_run(run_)]
    lines += ["", "Raw figures: `result.json`.", ""]
    return "\n".join(lines)


def render_run(result: dict[str, Any]) -> list[str]:
    lines = [
        f"## {result['streams_per_round']} streams", "",
        f"- events per stream (progress, role, words, finish, usage): "
        f"{result['events_per_stream']}; verdict **{result['verdict']}**", "",
        "| arm | streams | events checked | lost | duplicated | reordered | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in ("direct", "proxy"):
        r = result[arm]
        lines.append(f"| {arm} | {r['streams']} | {r['events_checked']} | {r['lost']} | "
                     f"{r['duplicated']} | {r['reordered']} | {r['streams_failed']} |")
    lines += ["", "| latency (ms) | direct | proxy | added |", "|---|---|---|---|"]
    for name in ("first_event", "last_byte"):
        for q in ("p50", "p99"):
            lines.append(f"| {name.replace('_', ' ')} {q} | {result[f'{name}_{q}_direct_ms']} | "
                         f"{result[f'{name}_{q}_proxy_ms']} | "
                         f"{result[f'{name}_{q}_added_ms']} |")
    lines += [
        "",
        f"- proxy RSS: {result['proxy_rss_idle_mib']} MiB idle after warm-up; after each "
        f"proxy round {result['proxy_rss_after_each_round_mib']} MiB; peak (VmHWM) "
        f"{result['proxy_peak_rss_mib']} MiB",
        f"- CPU seconds over the measured rounds: {result['cpu_s']}; proxy "
        f"{result['proxy_cpu_us_per_event']} µs per event relayed",
        f"- median wall time of a round: {result['round_wall_s_median']} s",
    ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="32,64,128,256",
                        help="concurrent streams per round; a comma-separated list sweeps")
    parser.add_argument("--events", type=int, default=100, help="reply words per stream")
    parser.add_argument("--token-delay-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per arm")
    parser.add_argument("--timeout", type=float, default=120.0, help="per stream, seconds")
    parser.add_argument("--out", type=Path, default=Path("bench/results/load"))
    args = parser.parse_args()
    levels = [int(n) for n in str(args.streams).split(",")]
    runs = [run(n, args.events, args.token_delay_ms, args.rounds, args.timeout)
            for n in levels]
    command = "python " + " ".join(sys.argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps({"command": command, "runs": runs},
                                                     indent=2) + "\n")
    (args.out / "RUN.md").write_text(render(runs, command))
    print(render(runs, command))
    return 0 if all(r["verdict"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""An engine that crashes never takes the proxy down.

Two crashes, each a real process dying by SIGSEGV:

- a fake llama-server in its own process (``python -m tests.fakes.fake_llama --die-at``)
  that kills itself mid-prefill or mid-stream, as a llama.cpp fault does, one lane beside
  another: the client gets an OpenAI error event and the end of its stream, the other lane
  keeps serving, and ``/healthz`` names the lost engine (503 when it is the only one);
- the embedded engine's worker (the real llama.cpp, SmolLM2) killed by SIGSEGV mid-stream:
  the same clean end, the worker restarted by the proxy, and a session parked before the
  crash is restored from its park file on its next turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixpin.adapters.embedded import EmbeddedAdapter
from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.settings import Settings
from tests.app.conftest import ProxyClient, clients_of, lanes_ready
from tests.app.test_faults import Capture, chat, read, sessions_when, wait_until
from tests.app.test_parking import ask, cached, conversation, index_dir, metric, prompt
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer

pytestmark = pytest.mark.anyio

OTHER = "http://other-llama:8080"
WAIT_S = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def dying_fake(die_at: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A fake llama-server process that kills itself (SIGSEGV) at ``die_at``."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.fake_llama", "--port", str(port),
         "--die-at", die_at, "--reply-words", "400", "--token-delay-ms", "5",
         "--prefill-ms-per-token", "2", "--batch", "16", "--slots", "1"])
    try:
        for _ in range(200):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.1):
                break
            assert process.poll() is None, "the fake engine did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


async def healthz(client: ProxyClient) -> tuple[int, dict[str, Any]]:
    response = await client.get("/healthz")
    return response.status_code, response.json()


@pytest.mark.parametrize("die_at", ["prefill", "stream"])
async def test_an_engine_process_that_crashes_ends_its_streams_and_the_other_lane_serves(
        die_at: str) -> None:
    """Two lanes: the crashing fake's stream ends in an error event within the client's
    deadline; the in-process fake lane answers the next session at once, and /healthz
    names the crashed lane as unreachable with what to try."""
    other = FakeLlamaServer(FakeLlamaConfig(n_slots=1, cache_ram=0))
    with dying_fake(die_at) as (url, process):
        config = Settings(upstream=url, upstreams=[OTHER], heartbeat_s=0.05,
                          health_interval_s=0.2, overload_occupancy=1.0)
        apps = create_apps(config, transports={OTHER: StreamingASGITransport(other.app())})
        app = apps.tenant
        async with app.router.lifespan_context(app), clients_of(apps, timeout=30) as client:
            await lanes_ready(app, timeout_s=WAIT_S)
            # Two new sessions at once: one per lane (a lane's one slot is taken).
            captures = [Capture(), Capture()]
            body = chat("tell me a long story " * 40, stream=True)
            await asyncio.gather(*(read(client, body, capture, {"x-session-id": f"s{i}"})
                                   for i, capture in enumerate(captures)))
            assert process.wait(timeout=10) == -signal.SIGSEGV
            [crashed] = [c for c in captures if c.data and c.data[-1][1] != "[DONE]"]
            [finished] = [c for c in captures if c is not crashed]
            error = crashed.final_error()
            assert error["code"] == "upstream_unavailable", error
            assert finished.data[-1][1] == "[DONE]"
            served = await client.post("/v1/chat/completions", headers={"x-session-id": "b"},
                                       json=chat("are you there", max_tokens=3))
            assert served.status_code == 200, served.text
            assert served.json()["choices"][0]["message"]["content"]
            status, health = await healthz(client)
            assert status == 200  # one lane still serves
            lost = next(u for u in health["upstreams"] if u["label"] == url[7:])
            assert lost["status"] == "unreachable", lost
            assert lost["down_since"], lost
            assert "--no-repack" in lost["hint"], lost


async def test_a_lone_crashed_engine_turns_healthz_503_naming_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """The only engine dies mid-stream: /healthz is 503 naming the lane, with what to try,
    and the log says it was lost, once."""
    caplog.set_level(logging.INFO, "prefixpin")
    with dying_fake("stream") as (url, process):
        apps = create_apps(Settings(upstream=url, heartbeat_s=0.05, health_interval_s=0.2))
        app = apps.tenant
        async with app.router.lifespan_context(app), clients_of(apps, timeout=30) as client:
            await read(client, chat("hello", stream=True), Capture())
            process.wait(timeout=10)
            status, health = await healthz(client)
    assert status == 503
    assert health["status"] == "degraded"
    assert health["upstream"]["status"] == "unreachable"
    assert health["upstream"]["label"] == url[7:]
    assert "--no-repack" in health["upstream"]["hint"]
    [lost] = [r for r in caplog.records if r.getMessage() == "upstream lost"]
    assert "--no-repack" in lost.fields["hint"]  # type: ignore[attr-defined]


@pytest.mark.embedded
async def test_the_embedded_worker_killed_by_sigsegv_comes_back_and_parked_sessions_restore(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One slot of the real embedded engine: B's turn evicts A (parked). B's next stream
    dies with the worker (SIGSEGV): B's client gets an error event and the end of its
    stream; the worker is restarted; the proxy sees the restart; A's next turn is restored
    from A's park file (all of A's first prompt cached)."""
    from tests.rig.models import ensure_model

    caplog.set_level(logging.INFO, "prefixpin")
    config = Settings(model=ensure_model("smollm2"), slots=1, ctx_size=2048, threads=2,
                      park_dir=tmp_path / "slots", park_index_dir=index_dir(tmp_path / "slots"),
                      park_min_tokens=20, park_ahead=False, heartbeat_s=0.1,
                      health_interval_s=0.2)
    apps = create_apps(config)
    app = apps.tenant
    async with app.router.lifespan_context(app), clients_of(apps, timeout=300) as client:
        await lanes_ready(app, timeout_s=WAIT_S)
        [lane] = app.state.prefixpin.router.lanes
        adapter = lane.service.backend.adapter
        assert isinstance(adapter, EmbeddedAdapter)
        first_pid = adapter.supervisor.pid
        a1 = await ask(client, conversation("A", 1), "A", temperature=0)
        await ask(client, conversation("B", 1), "B", temperature=0)
        assert await metric(client, "prefixpin_parks_total", outcome="parked") >= 1

        dying = Capture()
        body = {"messages": conversation("B", 2), "max_tokens": 400, "stream": True,
                "temperature": 0, "ignore_eos": True}
        stream = asyncio.create_task(read(client, body, dying, {"x-session-id": "B"}))
        await wait_until(dying.saw_output)
        assert first_pid is not None
        os.kill(first_pid, signal.SIGSEGV)
        await stream
        error = dying.final_error()
        assert error["code"] == "upstream_unavailable", error
        assert all(d != "[DONE]" for _, d in dying.data)

        await sessions_when(client, lambda s: any(
            x["last_reason"] == "engine restarted" for x in s))
        assert adapter.supervisor.pid not in (None, first_pid)
        assert adapter.fault() is None
        status, health = await healthz(client)
        assert status == 200, health
        crash_lines = [r.getMessage() for r in caplog.records
                       if "killed by SIGSEGV" in r.getMessage()]
        assert crash_lines, "the crash was not logged"

        a2 = await ask(client, conversation("A", 2), "A", temperature=0)
        assert await metric(client, "prefixpin_restores_total", outcome="restored") >= 1
        assert cached(a2) >= prompt(a1)


@pytest.mark.embedded
async def test_a_worker_that_dies_while_loading_is_a_clear_error(tmp_path: Path) -> None:
    """Not a GGUF llama.cpp can use: the worker says why and the open fails with it."""
    from prefixpin.adapters.embedded import EngineConfig, ModelLoadError

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match=r"bad\.gguf"):
        await EmbeddedAdapter.open(EngineConfig(model_path=bad), httpx.Timeout(30))

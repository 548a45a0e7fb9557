"""Parking against the real llama-server (2 slots, --slot-save-path = the proxy's
--park-dir): three sessions on two slots, restarts of the engine and of the proxy, damaged
park files, a full disk budget, a failing save, and the bounded queue. Every answer after a
restore or a fault is checked against the engine's own cold answer to the same request."""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.parking import INDEX_NAME, PARK_PREFIX, ParkManager
from prefixpin.proxy.settings import Settings
from tests.e2e.helpers import filler, stream_chat
from tests.fakes.servers import ServedURL, serve_proxy
from tests.rig.llama_process import LlamaServerProcess, restart, run_llama_server
from tests.rig.scrape import metric

pytestmark = pytest.mark.llama

Json = dict[str, Any]
ProxyRunner = Callable[..., AbstractContextManager[str]]


@pytest.fixture(scope="module")
def park_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("park")


@pytest.fixture(scope="module")
def engine(park_dir: Path) -> Iterator[LlamaServerProcess]:
    with run_llama_server("smollm2", slots=2, ctx_per_slot=4096,
                          slot_save_path=park_dir) as handle:
        yield handle


@pytest.fixture
def clean(engine: LlamaServerProcess, park_dir: Path) -> Path:
    """Empty slots and an empty park directory (no proxy runs between tests)."""
    for slot in range(2):
        httpx.post(f"{engine.url}/slots/{slot}", params={"action": "erase"}, json={},
                   timeout=30).raise_for_status()
    for path in park_dir.iterdir():
        if path.is_file():
            path.unlink()
        else:
            path.rmdir()
    shutil.rmtree(index_dir(park_dir), ignore_errors=True)
    return park_dir


def index_dir(park_dir: Path) -> Path:
    """prefixpin's own directory for the park index (not the engine's save directory)."""
    return park_dir.with_name(f"{park_dir.name}-prefixpin")


@contextmanager
def proxy(engine: LlamaServerProcess, park_dir: Path, *,
          on_start: Callable[[ParkManager], None] | None = None,
          **settings: Any) -> Iterator[ServedURL]:
    config = Settings(upstream=engine.url, park_dir=park_dir, health_interval_s=0.2,
                      **{"park_min_tokens": 128, "park_index_dir": index_dir(park_dir),
                         **settings})
    apps = create_apps(config)
    with serve_proxy(apps) as url:
        if on_start is not None:
            planner = apps.tenant.state.prefixpin.service.planner
            on_start(planner.parking)
        yield url


class Sessions:
    """Agent sessions with distinct ~200-token system prompts; each turn appends the
    model's real reply, so the next request extends exactly what was committed."""

    def __init__(self) -> None:
        self.histories: dict[str, list[Json]] = {}
        self.last_body: dict[str, Json] = {}
        self.first_body: dict[str, Json] = {}

    def turn(self, url: str, name: str, number: int) -> Json:
        history = self.histories.setdefault(name, [
            {"role": "system", "content": f"You are agent {name}. " + filler(130, seed=ord(name))}])
        history.append({"role": "user",
                        "content": f"Turn {number}: " + filler(25, seed=ord(name) * 10 + number)})
        body = {"messages": list(history), "max_tokens": 8, "temperature": 0}
        self.last_body[name] = body
        self.first_body.setdefault(name, body)
        response = httpx.post(f"{url}/v1/chat/completions", json=body,
                              headers={"x-session-id": f"ses-{name}"}, timeout=300)
        assert response.status_code == 200, response.text
        answer: Json = response.json()
        history.append({"role": "assistant",
                        "content": answer["choices"][0]["message"]["content"]})
        return answer


def cached(answer: Json) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def prompt(answer: Json) -> int:
    return int(answer["usage"]["prompt_tokens"])


def text(answer: Json) -> str:
    return str(answer["choices"][0]["message"]["content"])


def cold_answer(engine: LlamaServerProcess, body: Json) -> str:
    """The engine's own answer with nothing reused (slot 1, no prompt cache)."""
    response = httpx.post(f"{engine.url}/v1/chat/completions",
                          json={**body, "cache_prompt": False, "id_slot": 1}, timeout=300)
    response.raise_for_status()
    return text(response.json())


def resident_answer(engine: LlamaServerProcess, first: Json, then: Json) -> str:
    """The answer to ``then`` from a slot that ran ``first`` just before (never evicted)."""
    httpx.post(f"{engine.url}/v1/chat/completions", timeout=300,
               json={**first, "cache_prompt": False, "id_slot": 1}).raise_for_status()
    response = httpx.post(f"{engine.url}/v1/chat/completions", timeout=300,
                          json={**then, "id_slot": 1})
    response.raise_for_status()
    return text(response.json())




def events(caplog: pytest.LogCaptureFixture, name: str) -> list[Json]:
    return [dict(getattr(r, "fields", {})) for r in caplog.records if r.getMessage() == name]


def park_files(park_dir: Path) -> list[Path]:
    return sorted(p for p in park_dir.glob(f"{PARK_PREFIX}*.bin") if p.is_file())


def three_sessions(url: str, sessions: Sessions) -> dict[str, Json]:
    """A, B, C on two slots: C's first turn evicts A, which is parked."""
    return {name: sessions.turn(url, name, 1) for name in "ABC"}


def wait_for_restart_seen(url: ServedURL, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = httpx.get(f"{url.admin}/sessions", timeout=10).json()
        if all(slot["session"] is None for slot in view["slots"]):
            return
        time.sleep(0.1)
    raise AssertionError("the proxy never saw the engine restart")


def test_parked_sessions_are_restored_after_a_llama_server_restart(
        engine: LlamaServerProcess, clean: Path) -> None:
    """A is parked when C takes its slot; llama-server restarts (every slot empty); A's
    next turn is restored from its file: the engine reports A's whole first prompt cached,
    and the answer is the engine's cold answer to the same request."""
    sessions = Sessions()
    with proxy(engine, clean) as url:
        first = three_sessions(url, sessions)
        assert len(park_files(clean)) == 1
        restart(engine)
        wait_for_restart_seen(url)
        a2 = sessions.turn(url, "A", 2)
        b2 = sessions.turn(url, "B", 2)  # was in a slot at the restart: re-prefilled
        assert metric(url.admin, "prefixpin_restores_total", outcome="restored") == 1
    assert cached(a2) >= prompt(first["A"])
    assert cached(b2) < prompt(first["B"]) // 2
    assert text(a2) == cold_answer(engine, sessions.last_body["A"])


def test_parked_sessions_are_restored_after_a_proxy_restart(
        engine: LlamaServerProcess, clean: Path) -> None:
    """A is parked by eviction, B and C at the proxy's clean shutdown; a new proxy over the
    same park directory rebuilds them from the index and restores them."""
    sessions = Sessions()
    with proxy(engine, clean) as url:
        first = three_sessions(url, sessions)
    assert len(park_files(clean)) == 3
    assert (index_dir(clean) / INDEX_NAME).exists()
    with proxy(engine, clean) as url:
        a2 = sessions.turn(url, "A", 2)
        c2 = sessions.turn(url, "C", 2)
        assert metric(url.admin, "prefixpin_park_revivals_total") == 2
        assert metric(url.admin, "prefixpin_restores_total", outcome="restored") == 2
        view = httpx.get(f"{url.admin}/sessions", timeout=10).json()
    assert cached(a2) >= prompt(first["A"])
    assert cached(c2) >= prompt(first["C"])
    assert text(a2) == cold_answer(engine, sessions.last_body["A"])
    reasons = [s["last_reason"] for s in view["namespaces"]["anon"]]
    assert all("from the park index" in r for r in reasons), reasons


def _flip_kv_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0x5A
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


@pytest.mark.parametrize(("damage", "outcome"), [
    (Path.unlink, "missing"), (_truncate, "truncated"), (_flip_kv_byte, "corrupted")])
def test_a_damaged_park_file_ends_in_the_cold_answer_with_a_logged_reason(
        engine: LlamaServerProcess, clean: Path, caplog: pytest.LogCaptureFixture,
        damage: Callable[[Path], None], outcome: str) -> None:
    caplog.set_level(logging.INFO, "prefixpin")
    sessions = Sessions()
    with proxy(engine, clean) as url:
        three_sessions(url, sessions)
        [path] = park_files(clean)
        damage(path)
        a2 = sessions.turn(url, "A", 2)
        assert metric(url.admin, "prefixpin_restores_total", outcome=outcome) == 1
    assert text(a2) == cold_answer(engine, sessions.last_body["A"])
    [declined] = events(caplog, "restore declined")
    assert declined["outcome"] == outcome
    assert declined["reason"].endswith("re-prefilling")


def test_a_save_that_fails_ends_in_the_cold_answer_with_a_logged_reason(
        engine: LlamaServerProcess, clean: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The engine cannot write the park file (a directory is in the way: its fopen fails,
    it answers 500 "Unable to save slot"); the evicted session re-prefills on return."""
    caplog.set_level(logging.INFO, "prefixpin")
    blocked = f"{PARK_PREFIX}blocked.bin"
    (clean / blocked).mkdir()

    def block_saves(parking: ParkManager) -> None:
        parking.filenames = lambda: blocked

    sessions = Sessions()
    with proxy(engine, clean, on_start=block_saves) as url:
        three_sessions(url, sessions)
        a2 = sessions.turn(url, "A", 2)
        assert metric(url.admin, "prefixpin_parks_total", outcome="failed") >= 1
        assert metric(url.admin, "prefixpin_restores_total", outcome="restored") == 0
    assert text(a2) == cold_answer(engine, sessions.last_body["A"])
    skipped = events(caplog, "park skipped")
    assert "Unable to save slot" in skipped[0]["reason"]
    notes = [e["park"] for e in events(caplog, "request") if e.get("park")]
    assert any("save failed" in note for note in notes), notes


def test_a_full_disk_budget_drops_the_least_recently_used_park(
        engine: LlamaServerProcess, clean: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Room for about one parked session: when D's first turn parks B, the budget removes
    A's older file; A comes back to a clean re-prefill, and the log says why."""
    sessions = Sessions()
    with proxy(engine, clean) as url:  # the size of one parked session, measured
        sessions.turn(url, "A", 1)
        sessions.turn(url, "B", 1)
        sessions.turn(url, "C", 1)
        one_file = min(p.stat().st_size for p in park_files(clean))
    for path in park_files(clean):
        path.unlink()
    (index_dir(clean) / INDEX_NAME).unlink()
    caplog.set_level(logging.INFO, "prefixpin")
    budget = int(one_file * 1.5)
    sessions = Sessions()
    with proxy(engine, clean, park_max_bytes=budget) as url:
        three_sessions(url, sessions)  # C parks A
        sessions.turn(url, "D", 1)  # D parks B; A's file goes for the budget
        a2 = sessions.turn(url, "A", 2)
        assert metric(url.admin, "prefixpin_park_bytes") <= budget
        assert metric(url.admin, "prefixpin_restores_total", outcome="restored") == 0
    assert text(a2) == cold_answer(engine, sessions.last_body["A"])
    parked_first = events(caplog, "parked")[0]["session"]  # A, when C took its slot
    removed = [e for e in events(caplog, "park removed") if e["reason"] == "budget"]
    assert removed[0]["session"] == parked_first
    notes = [e["park"] for e in events(caplog, "request") if e.get("park")]
    assert any("--park-max-bytes" in note for note in notes), notes


def test_a_request_finding_every_slot_busy_waits_with_heartbeats_then_gets_503(
        engine: LlamaServerProcess, clean: Path) -> None:
    """Both slots generate for a long time; a third session waits (SSE heartbeats say it is
    queued) and after --queue-timeout gets queue_timeout: a 503 with Retry-After for a
    plain request, an error event for a stream whose headers went out at once."""
    long_body = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    with proxy(engine, clean, queue_timeout_s=3, heartbeat_s=0.5) as url:
        runners = []
        for name in "XY":
            body = {**long_body, "messages": [{"role": "user", "content": f"Count, {name}."}]}
            thread = threading.Thread(
                target=lambda b=body, n=name: _post_until_closed(url, b, n), daemon=True)
            thread.start()
            runners.append(thread)
        _wait_busy(engine)
        started = time.monotonic()
        plain = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                           headers={"x-session-id": "Z"},
                           json={"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 4})
        waited = time.monotonic() - started
        streamed = stream_chat(url, {"messages": [{"role": "user", "content": "hello"}],
                                     "max_tokens": 4})
        assert metric(url.admin, "prefixpin_requests_total", api="openai", endpoint="chat",
                      outcome="queue_timeout") == 2
    for thread in runners:
        thread.join(60)
    assert plain.status_code == 503
    assert plain.headers["retry-after"].isdigit()
    assert plain.json()["error"]["code"] == "queue_timeout"
    assert 2.5 <= waited <= 20
    assert streamed.status == 200
    assert streamed.first_byte_s is not None
    assert streamed.first_byte_s < 1.0
    assert any("queued: all 2 slots busy" in c for _, c in streamed.comments), streamed.comments
    errors = [d for d in streamed.payloads() if isinstance(d, dict) and "error" in d]
    assert errors
    assert errors[-1]["error"]["code"] == "queue_timeout"


def _post_until_closed(url: str, body: Json, name: str) -> None:
    """A long generation through the proxy, given up after a while (the proxy cancels it)."""
    deadline = time.monotonic() + 15
    with contextlib.suppress(httpx.HTTPError), httpx.stream(
            "POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
            headers={"x-session-id": name}, timeout=60) as response:
        for _ in response.iter_raw():
            if time.monotonic() > deadline:
                break


def _wait_busy(engine: LlamaServerProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slots = httpx.get(f"{engine.url}/slots", timeout=5).json()
        if all(s["is_processing"] for s in slots):
            return
        time.sleep(0.05)
    raise AssertionError("the long generations never occupied both slots")


@contextmanager
def gemma(park: Path, *extra: str) -> Iterator[LlamaServerProcess]:
    """Gemma 3 270M: sliding-window attention (512 tokens)."""
    with run_llama_server("gemma3", slots=2, ctx_per_slot=4096, slot_save_path=park,
                          extra=["-b", "64", "-ub", "64", *extra]) as handle:
        yield handle


def test_a_sliding_window_model_without_swa_full_is_not_parked(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Without --swa-full, llama-server re-processes a restored slot from its first token,
    even for an exact extension of the tokens it holds (every reuse of a sliding-window slot
    goes through a context checkpoint, and a restore clears them): shown here straight on
    the engine. The proxy, which reads the engine's flags and the GGUF, leaves parking off
    and says why."""
    caplog.set_level(logging.INFO, "prefixpin")
    with gemma(tmp_path) as engine:
        with proxy(engine, tmp_path):
            pass
        [off] = events(caplog, "parking off")
        assert "sliding-window attention (512 tokens)" in off["reason"]
        assert "--swa-full" in off["reason"]
        first = filler(150, seed=5) + "\n\n"
        cold = httpx.post(f"{engine.url}/v1/completions", timeout=600, json={
            "prompt": first, "max_tokens": 1, "temperature": 0, "id_slot": 0}).json()
        saved = httpx.post(f"{engine.url}/slots/0", params={"action": "save"},
                           json={"filename": "probe.bin"}, timeout=60).json()
        httpx.post(f"{engine.url}/slots/1", params={"action": "restore"},
                   json={"filename": "probe.bin"}, timeout=60).raise_for_status()
        extended = httpx.post(f"{engine.url}/v1/completions", timeout=600, json={
            "prompt": first + "More words.", "max_tokens": 1, "temperature": 0,
            "id_slot": 1}).json()
    assert saved["n_saved"] == cold["usage"]["prompt_tokens"]  # the slot held the prompt
    assert extended["timings"]["cache_n"] == 0


def test_a_sliding_window_model_with_swa_full_is_parked_and_restored(
        tmp_path: Path) -> None:
    sessions = Sessions()
    with gemma(tmp_path, "--swa-full") as engine:
        with proxy(engine, tmp_path) as url:
            first = three_sessions(url, sessions)
            a2 = sessions.turn(url, "A", 2)
            assert metric(url.admin, "prefixpin_restores_total", outcome="restored") == 1
            assert metric(url.admin, "prefixpin_restores_total", outcome="not_reused") == 0
        # Gemma's template renders "model\n" + reply: the newline may merge with the reply's
        # first token, so reuse can stop a token before the first prompt's end.
        assert cached(a2) >= prompt(first["A"]) - 2
        # Gemma 270M's greedy answer from a cached prefix differs from its cold answer (the
        # batches differ): the reference is the slot that was never evicted.
        assert text(a2) == resident_answer(engine, sessions.first_body["A"],
                                           sessions.last_body["A"])

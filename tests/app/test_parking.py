"""Parking in process: the proxy in front of a fake llama-server whose slots save and
restore real llama-server slot files (the same header and packed token list; its "KV" part
is derived from the tokens, so a file restored with the wrong bytes is caught by the fake
as it would be by the engine). What the real engine does with a restored slot is tested in
tests/e2e/test_parking_llama.py."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import json
import logging
import os
import re
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from prefixpin.proxy.parking import INDEX_NAME, PARK_PREFIX, SLOT_FILE_MAGIC, SLOT_FILE_VERSION
from tests.app.conftest import ProxyClient, running_proxy
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer

pytestmark = pytest.mark.anyio

SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 10}
KV_BYTES_PER_TOKEN = 32


class SlotFileFakeLlama(FakeLlamaServer):
    """The fake engine with --slot-save-path: save, restore and erase as llama-server.

    Words are the fake's tokens; each gets an id on first sight. A file is the engine's
    format: magic, version, packed token list, then a KV part the fake derives from the
    tokens (32 bytes a token), which restore checks as the engine checks its state."""

    def __init__(self, slot_dir: Path, config: FakeLlamaConfig | None = None) -> None:
        super().__init__(config or FakeLlamaConfig(n_slots=1))
        self.slot_dir = slot_dir
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []
        self.slot_faults: list[str] = []  # "save": the next save fails (disk error)
        # As llama-server with a sliding-window model and no --swa-full: a restore succeeds
        # but the slot cannot be reused (the next prompt is re-processed from the start).
        self.reprocess_restored = False
        self.linger_s = 0.0  # the stream stays open this long after [DONE], as over TCP
        self.actions: list[tuple[str, int, str]] = []

    async def _stream(self, body: Mapping[str, Any], slot: Any, tokens: list[str], chat: bool,
                      fault: str) -> AsyncIterator[bytes]:
        async for event in super()._stream(body, slot, tokens, chat, fault):
            yield event
        await asyncio.sleep(self.linger_s)

    async def _slot_action(self, request: Request) -> Response:
        action = request.query_params.get("action")
        if action not in ("save", "restore"):
            return await super()._slot_action(request)
        slot = self.slots[request.path_params["id"] % len(self.slots)]
        filename = str((await request.json()).get("filename", ""))
        self.actions.append((action, slot.id, filename))
        path = self.slot_dir / filename
        async with slot.busy:  # deferred while the slot is busy, as in llama-server
            if action == "save":
                if self.slot_faults and self.slot_faults[0] == "save":
                    self.slot_faults.pop(0)
                    return _error(500, "Unable to save slot", "server_error")
                ids = [self._id(word) for word in slot.tokens]
                data = _slot_file(ids)
                path.write_bytes(data)
                return JSONResponse({"id_slot": slot.id, "filename": filename,
                                     "n_saved": len(ids), "n_written": len(data),
                                     "timings": {"save_ms": 0.1}})
            slot.tokens.clear()
            restored = _read_slot_file(path)
            if restored is None:
                return _error(400, "Unable to restore slot: No available space in KV cache or "
                                   "invalid slot save file", "invalid_request_error")
            if not self.reprocess_restored:
                slot.tokens.extend(self.words[i] for i in restored)
            return JSONResponse({"id_slot": slot.id, "filename": filename,
                                 "n_restored": len(restored),
                                 "n_read": path.stat().st_size,
                                 "timings": {"restore_ms": 0.1}})

    def _id(self, word: str) -> int:
        if word not in self.vocab:
            self.vocab[word] = len(self.words)
            self.words.append(word)
        return self.vocab[word]

    def restart(self) -> None:
        """As a new engine process: empty slots, another start time."""
        for slot in self.slots:
            slot.tokens.clear()
        for clock in ("started", "start_us"):  # what /metrics reports as the start time
            if hasattr(self, clock):
                setattr(self, clock, getattr(self, clock) + 1)


def _kv(ids: list[int]) -> bytes:
    return b"".join(hashlib.blake2b(struct.pack("<i", t), digest_size=KV_BYTES_PER_TOKEN)
                    .digest() for t in ids)


def _slot_file(ids: list[int]) -> bytes:
    packed = [-1, 1, len(ids), *ids, 0]
    return (struct.pack("<III", SLOT_FILE_MAGIC, SLOT_FILE_VERSION, len(packed))
            + struct.pack(f"<{len(packed)}i", *packed) + _kv(ids))


def _read_slot_file(path: Path) -> list[int] | None:
    try:
        data = path.read_bytes()
        _, _, n = struct.unpack_from("<III", data)
        packed = list(struct.unpack_from(f"<{n}i", data, 12))
    except (OSError, struct.error):
        return None
    ids = packed[3:-1]
    return ids if data[12 + 4 * n:] == _kv(ids) else None


def _error(status: int, message: str, kind: str) -> Response:
    return JSONResponse({"error": {"code": status, "message": message, "type": kind}},
                        status_code=status)


def conversation(name: str, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [SYSTEM]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{name} asks question {turn} " * 16})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"{name} answer {turn}"})
    return messages


async def ask(client: httpx.AsyncClient, messages: list[dict[str, Any]], key: str | None,
              **fields: Any) -> dict[str, Any]:
    headers = {"x-session-id": key} if key else {}
    response = await client.post("/v1/chat/completions", headers=headers,
                                 json={"messages": messages, "max_tokens": 2, **fields})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def prompt(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens"])


async def metric(client: ProxyClient, name: str, **labels: str) -> float:
    text = (await client.admin.get("/metrics")).text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = rf"^{name}(?:\{{{re.escape(wanted)}\}})? (\S+)$" if wanted else rf"^{name} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def park_files(park: Path) -> list[Path]:
    return sorted(p for p in park.glob(f"{PARK_PREFIX}*.bin"))


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [dict(getattr(r, "fields", {})) for r in caplog.records if r.getMessage() == name]


def index_dir(park: Path) -> Path:
    """prefixpin's own directory for the park index: beside the engine's, never in it."""
    return park.with_name(f"{park.name}-prefixpin")


def settings(park: Path, **more: Any) -> dict[str, Any]:
    # Parking ahead saves a slot after its turn once it idles 0.2 s, a race with the test's
    # next request: off here, tested on its own below.
    return {"park_dir": park, "park_index_dir": index_dir(park), "park_min_tokens": 20,
            "park_ahead": False, **more}


async def test_an_evicted_session_is_parked_and_restored_when_it_returns(
        tmp_path: Path) -> None:
    """One slot, A then B: A is saved before B takes the slot; A's next turn restores it
    first, so everything A's slot held is cached again."""
    engine = SlotFileFakeLlama(tmp_path)
    async with running_proxy(engine, **settings(tmp_path)) as (client, _):
        first = await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")
        assert len(park_files(tmp_path)) == 1
        again = await ask(client, conversation("A", 2), "A")  # parks B, restores A
        assert await metric(client, "prefixpin_parks_total", outcome="parked") == 2
        assert await metric(client, "prefixpin_restores_total", outcome="restored") == 1
        assert await metric(client, "prefixpin_park_bytes") == sum(
            p.stat().st_size for p in park_files(tmp_path))
        view = (await client.admin.get("/sessions")).json()
        actions = [a[0] for a in engine.actions if "probe" not in a[2]]
    assert actions == ["save", "save", "restore"]  # A when B came, B when A came back, A
    assert cached(again) == prompt(first)  # all of it: the reply differs from the transcript
    assert "cache_prompt" not in engine.requests[-1]
    assert view["parking"]["files"] == 2
    assert (index_dir(tmp_path) / INDEX_NAME).exists()
    assert not (tmp_path / INDEX_NAME).exists()  # the engine's save directory holds files only


async def test_a_rewound_request_never_restores(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Same key, last user message edited: the parked file holds the old message, so it
    is not restored (a sliding-window model could not rewind it); the request re-prefills."""
    engine = SlotFileFakeLlama(tmp_path)
    caplog.set_level(logging.INFO, "prefixpin")
    async with running_proxy(engine, **settings(tmp_path)) as (client, _):
        history = conversation("A", 2)
        await ask(client, history, "A")
        await ask(client, conversation("B", 1), "B")
        edited = [*history[:-1], {"role": "user", "content": "an edited question " * 16}]
        body = await ask(client, edited, "A")
        assert await metric(client, "prefixpin_restores_total", outcome="diverged") == 1
        assert await metric(client, "prefixpin_restores_total", outcome="restored") == 0
    assert [a[0] for a in engine.actions].count("restore") == 0
    assert cached(body) < prompt(body) // 2  # at most the system prompt B's slot shares
    declined = events(caplog, "restore declined")
    assert declined
    assert "does not extend the parked history" in declined[0]["reason"]


async def test_small_histories_are_not_parked(tmp_path: Path) -> None:
    engine = SlotFileFakeLlama(tmp_path)
    async with running_proxy(engine, **settings(tmp_path, park_min_tokens=500)) as (client, _):
        await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")
        assert await metric(client, "prefixpin_parks_total", outcome="small") == 1
    assert park_files(tmp_path) == []
    assert [a for a in engine.actions if "probe" not in a[2]] == []


async def test_parking_off_switch(tmp_path: Path) -> None:
    """PREFIXPIN_PARKING=0: an evicted session is simply lost, nothing is written."""
    engine = SlotFileFakeLlama(tmp_path)
    async with running_proxy(engine, **settings(tmp_path, parking=False)) as (client, _):
        await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")
        again = await ask(client, conversation("A", 2), "A")
    assert engine.actions == []
    assert not (index_dir(tmp_path) / INDEX_NAME).exists()
    assert cached(again) < prompt(again) // 2


async def test_a_restarted_proxy_resumes_parked_sessions_from_the_index(
        tmp_path: Path) -> None:
    """A is parked by eviction, B at the proxy's clean shutdown; a new proxy over the same
    park directory rebuilds both sessions from the index (explicit key for A, none for B:
    its committed messages repeated as the prefix) and restores them."""
    engine = SlotFileFakeLlama(tmp_path)
    async with running_proxy(engine, **settings(tmp_path)) as (client, _):
        a_first = await ask(client, conversation("A", 1), "A")
        b_first = await ask(client, conversation("B", 1), None)
    assert len(park_files(tmp_path)) == 2
    async with running_proxy(engine, **settings(tmp_path)) as (client, _):
        a_again = await ask(client, conversation("A", 2), "A")
        b_again = await ask(client, conversation("B", 2), None)
        assert await metric(client, "prefixpin_park_revivals_total") == 2
        assert await metric(client, "prefixpin_restores_total", outcome="restored") == 2
        sessions = (await client.admin.get("/sessions")).json()["namespaces"]["anon"]
    assert cached(a_again) == prompt(a_first)
    assert cached(b_again) == prompt(b_first)
    assert {s["key"]: s["last_decision"] for s in sessions} == {"A": "resumed", None: "resumed"}


async def test_another_tenant_never_revives_a_parked_session(
        tmp_path: Path, tenant_file: Callable[..., Path]) -> None:
    # several tenants on one engine: its cache per slot
    engine = SlotFileFakeLlama(tmp_path, FakeLlamaConfig(n_slots=1, cache_ram=0))
    tenants = {**settings(tmp_path), "tenants_file": tenant_file("mine", "someone-else")}
    mine = {"authorization": "Bearer mine"}
    async with running_proxy(engine, **tenants) as (client, _):
        first = await client.post("/v1/chat/completions", headers={**mine, "x-session-id": "A"},
                                  json={"messages": conversation("A", 1), "max_tokens": 2})
        assert first.status_code == 200, first.text
        await client.post("/v1/chat/completions", headers={**mine, "x-session-id": "B"},
                          json={"messages": conversation("B", 1), "max_tokens": 2})
    async with running_proxy(engine, **tenants) as (client, _):
        response = await client.post(
            "/v1/chat/completions",
            headers={"x-session-id": "A", "authorization": "Bearer someone-else"},
            json={"messages": conversation("A", 2), "max_tokens": 2})
        assert response.status_code == 200
        assert await metric(client, "prefixpin_park_revivals_total") == 0
    assert cached(response.json()) == 0
    assert [a[0] for a in engine.actions].count("restore") == 0


async def test_an_engine_restart_restores_parked_sessions(tmp_path: Path) -> None:
    """The engine restarts (empty slots, new start time): a parked session's next turn is
    restored from its file, with everything it held cached."""
    engine = SlotFileFakeLlama(tmp_path)
    async with running_proxy(engine, **settings(tmp_path, health_interval_s=0.02)) as (
            client, _):
        first = await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")
        engine.restart()
        for _ in range(200):
            if (await client.admin.get("/sessions")).json()["slots"][0]["session"] is None:
                break
            await asyncio.sleep(0.01)
        again = await ask(client, conversation("A", 2), "A")
    assert cached(again) == prompt(first)


@pytest.mark.parametrize(("damage", "outcome"), [
    ("delete", "missing"), ("truncate", "truncated"), ("tokens", "mismatched"),
    ("kv", "corrupted"), ("kv-hidden", "corrupted")])
async def test_a_damaged_park_file_is_caught_and_the_request_re_prefills(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, outcome: str) -> None:
    """Deleted, cut short, another token list, or flipped KV bytes (also with the file's
    times set back, as the proxy reads the content again only for a file whose stat
    changed): the proxy notices before the engine sees the file, drops it, says why, and
    the answer comes from a re-prefill."""
    engine = SlotFileFakeLlama(tmp_path)
    caplog.set_level(logging.INFO, "prefixpin")
    async with running_proxy(engine, **settings(tmp_path)) as (client, _):
        await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")
        [path] = park_files(tmp_path)
        _damage(path, damage)
        again = await ask(client, conversation("A", 2), "A")
        assert await metric(client, "prefixpin_restores_total", outcome=outcome) == 1
        assert await metric(client, "prefixpin_park_removals_total", reason="invalid") == 1
    assert again["choices"][0]["message"]["content"]
    assert cached(again) < prompt(again) // 2
    assert [a[0] for a in engine.actions].count("restore") == 0
    assert not path.exists()
    [declined] = events(caplog, "restore declined")
    assert declined["outcome"] == outcome
    assert declined["reason"].endswith("re-prefilling")


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "tokens":
        data[12 + 4 * 4] ^= 0x01  # the second token of the packed list
        path.write_bytes(bytes(data))
    elif how == "kv":
        data[-5] ^= 0x40
        path.write_bytes(bytes(data))
    elif how == "kv-hidden":
        times = path.stat()
        data[-5] ^= 0x40
        path.write_bytes(bytes(data))
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
        assert path.stat().st_mtime_ns == times.st_mtime_ns


async def test_a_failed_save_is_logged_and_the_session_re_prefills(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = SlotFileFakeLlama(tmp_path)
    caplog.set_level(logging.INFO, "prefixpin")
    async with running_proxy(engine, **settings(tmp_path)) as (client, _):
        await ask(client, conversation("A", 1), "A")
        engine.slot_faults.append("save")
        await ask(client, conversation("B", 1), "B")
        again = await ask(client, conversation("A", 2), "A")
        assert await metric(client, "prefixpin_parks_total", outcome="failed") == 1
        notes = [e for e in events(caplog, "request") if e.get("park")]
        assert len(park_files(tmp_path)) == 1  # B's, parked when A came back
    assert again["choices"][0]["message"]["content"]
    assert cached(again) < prompt(again) // 2
    [skipped] = events(caplog, "park skipped")
    assert "save failed" in skipped["reason"]
    assert any("not parked when evicted" in n["park"] for n in notes)


async def test_the_disk_budget_removes_the_least_recently_used_park(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Room for one file: parking B removes A's file (least recently used); A then
    re-prefills and the log says why, B restores."""
    engine = SlotFileFakeLlama(tmp_path)
    caplog.set_level(logging.INFO, "prefixpin")
    one_file = len(_slot_file(list(range(200))))
    async with running_proxy(engine, **settings(tmp_path, park_max_bytes=one_file)) as (
            client, _):
        await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")  # parks A
        await ask(client, conversation("C", 1), "C")  # parks B, removes A
        assert len(park_files(tmp_path)) == 1
        a_again = await ask(client, conversation("A", 2), "A")  # parks C, removes B
        assert await metric(client, "prefixpin_park_removals_total", reason="budget") >= 1
        assert await metric(client, "prefixpin_park_bytes") <= one_file
    assert cached(a_again) < prompt(a_again) // 2
    removed = events(caplog, "park removed")
    assert removed[0]["reason"] == "budget"
    notes = [e["park"] for e in events(caplog, "request") if e.get("park")]
    assert any("--park-max-bytes" in n for n in notes)


async def test_orphan_files_and_rows_without_files_are_swept_at_start(tmp_path: Path) -> None:
    engine = SlotFileFakeLlama(tmp_path)
    async with running_proxy(engine, **settings(tmp_path)) as (client, _):
        await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")
    files = park_files(tmp_path)
    assert len(files) == 2
    files[0].unlink()
    orphan = tmp_path / f"{PARK_PREFIX}0123abcd.bin"
    orphan.write_bytes(b"x" * 100)
    unrelated = tmp_path / "someone-elses.bin"
    unrelated.write_bytes(b"y")
    not_ours = tmp_path / f"{PARK_PREFIX}orphan.bin"  # the prefix, but not a name we write
    not_ours.write_bytes(b"z")
    async with running_proxy(engine, **settings(tmp_path)) as (client, _):
        view = (await client.admin.get("/sessions")).json()["parking"]
        assert await metric(client, "prefixpin_park_removals_total", reason="orphan") == 1
    assert view["files"] == 1
    assert not orphan.exists()
    assert unrelated.exists()
    assert not_ours.exists()


@pytest.mark.parametrize("name", ["../outside.bin", INDEX_NAME, "pp-../../x.bin", "pp-ab.bin/"])
async def test_the_deleter_never_trusts_the_file_name_in_an_index_row(
        tmp_path: Path, name: str) -> None:
    """A row (the sqlite index, or Redis: writable by others) naming a file parking never
    writes: the row goes, the file stays, and nothing is restored from it."""
    import sqlite3

    park = tmp_path / "park"
    park.mkdir()
    engine = SlotFileFakeLlama(park)
    async with running_proxy(engine, **settings(park)) as (client, _):
        await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")
    assert len(park_files(park)) == 2
    decoys = [park / INDEX_NAME, tmp_path / "outside.bin", index_dir(park) / INDEX_NAME]
    for decoy in decoys[:2]:
        decoy.write_bytes(b"precious")
    db = sqlite3.connect(index_dir(park) / INDEX_NAME)
    db.execute("UPDATE parked SET filename = ? WHERE rowid = (SELECT MIN(rowid) FROM parked)",
               (name,))
    db.commit()
    db.close()
    async with running_proxy(engine, **settings(park)) as (client, _):
        view = (await client.admin.get("/sessions")).json()["parking"]
        await ask(client, conversation("A", 2), "A")  # the row named A or B: never restored
    assert view["files"] == 1  # the bad row is gone
    assert all(d.exists() for d in decoys)
    assert decoys[0].read_bytes() == decoys[1].read_bytes() == b"precious"


async def test_no_park_dir_means_parking_off_said_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = SlotFileFakeLlama(tmp_path)
    caplog.set_level(logging.INFO, "prefixpin")
    async with running_proxy(engine) as (client, _):
        await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")
    [off] = events(caplog, "parking off")
    assert "--park-dir is not set" in off["reason"]
    assert engine.actions == []


async def test_a_shared_park_directory_needs_a_park_dir(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = SlotFileFakeLlama(tmp_path)
    caplog.set_level(logging.INFO, "prefixpin")
    async with running_proxy(engine, park_shared=True) as (client, _):
        await ask(client, conversation("A", 1), "A")
    [off] = events(caplog, "parking off")
    assert "--park-shared needs --park-dir" in off["reason"]
    assert engine.actions == []


async def test_a_park_dir_the_engine_does_not_write_to_turns_parking_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine_dir, proxy_dir = tmp_path / "engine", tmp_path / "proxy"
    engine_dir.mkdir()
    proxy_dir.mkdir()
    engine = SlotFileFakeLlama(engine_dir)
    caplog.set_level(logging.INFO, "prefixpin")
    async with running_proxy(engine, **settings(proxy_dir)) as (client, _):
        await ask(client, conversation("A", 1), "A")
    [off] = events(caplog, "parking off")
    assert "--slot-save-path as this proxy sees it" in off["reason"]


async def stream_ask(client: httpx.AsyncClient, messages: list[dict[str, Any]], key: str,
                     then: Callable[[], Awaitable[Any]] | None = None) -> dict[str, Any]:
    """A streaming turn; returns its usage. ``then`` starts as soon as ``[DONE]`` arrives,
    as an agent sends its next request, while the proxy is still finishing this one (the
    slot frees once the engine's answer is read; the commit follows)."""
    usage: dict[str, Any] = {}
    follow: asyncio.Task[Any] | None = None
    async with client.stream("POST", "/v1/chat/completions", headers={"x-session-id": key},
                             json={"messages": messages, "max_tokens": 2, "stream": True,
                                   "stream_options": {"include_usage": True}}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[6:])["usage"]
            if line == "data: [DONE]" and then is not None:
                follow = asyncio.ensure_future(then())
    if follow is not None:
        await follow
    return usage


async def test_a_session_parked_again_and_again_is_restored_every_time(
        tmp_path: Path) -> None:
    """One slot, A and B streaming turns back to back (B's request leaves as A's answer
    ends): each is parked and restored on every turn; each new file replaces the last and
    the session keeps the newest (every return reuses all of its previous prompt)."""
    engine = SlotFileFakeLlama(tmp_path)
    engine.linger_s = 0.05
    a_turns: list[dict[str, Any]] = []
    async with running_proxy(engine, **settings(tmp_path)) as (client, _):
        for turn in (1, 2, 3, 4):
            a_turns.append(await stream_ask(
                client, conversation("A", turn), "A",
                then=functools.partial(stream_ask, client, conversation("B", turn), "B")))
    for before, after in itertools.pairwise(a_turns):  # every return is restored
        assert after["prompt_tokens_details"]["cached_tokens"] >= before["prompt_tokens"]


async def test_parking_pauses_itself_when_the_engine_re_processes_restored_slots(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An engine that accepts restores but re-processes the restored slot anyway (llama-server
    with a sliding-window model and no --swa-full, when its flags are not readable here):
    after two such restores in a row parking pauses, says why, and stops writing files."""
    engine = SlotFileFakeLlama(tmp_path)
    engine.reprocess_restored = True
    caplog.set_level(logging.INFO, "prefixpin")
    async with running_proxy(engine, **settings(tmp_path)) as (client, _):
        await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")
        await ask(client, conversation("A", 2), "A")  # restored, not reused
        await ask(client, conversation("B", 2), "B")  # restored, not reused: pause
        saves = [a for a in engine.actions if a[0] == "save"]
        await ask(client, conversation("C", 1), "C")
        assert await metric(client, "prefixpin_restores_total", outcome="not_reused") == 2
        assert await metric(client, "prefixpin_parks_total", outcome="off") == 1
        view = (await client.admin.get("/sessions")).json()["parking"]
        assert [a for a in engine.actions if a[0] == "save"] == saves
    [paused] = events(caplog, "parking paused")
    assert "re-processed 2 restored slots" in paused["reason"]
    assert view["on"] is False


@pytest.mark.embedded
async def test_the_embedded_engine_parks_and_restores_its_own_slot_files(
        tmp_path: Path) -> None:
    """The embedded llama.cpp engine (one slot): its files go to Settings.slot_dir(), the
    index beside them; A is parked when B comes, restored when A returns, and restored
    again by a new proxy after a restart (a clean shutdown parked it)."""
    from prefixpin.proxy.listen.app import create_app
    from prefixpin.proxy.settings import Settings
    from tests.asgi_transport import StreamingASGITransport
    from tests.rig.models import ensure_model

    config = Settings(model=ensure_model("smollm2"), slots=1, ctx_size=2048, threads=2,
                      park_dir=tmp_path, park_min_tokens=64)

    async def session(turns: list[tuple[str, int]]) -> list[dict[str, Any]]:
        app = create_app(config)
        answers = []
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=StreamingASGITransport(app), base_url="http://proxy",
                timeout=300) as client:
            for name, turn in turns:
                answers.append(await ask(client, conversation(name, turn), name,
                                         temperature=0))
        return answers

    a1, _, a2 = await session([("A", 1), ("B", 1), ("A", 2)])
    [a3] = await session([("A", 3)])
    assert cached(a2) >= prompt(a1)
    assert cached(a3) >= prompt(a2)
    assert park_files(config.slot_dir())
    assert (tmp_path / INDEX_NAME).exists()


async def saves_settle(engine: SlotFileFakeLlama, count: int, timeout_s: float = 5.0) -> None:
    """Wait until the engine saw ``count`` saves (parking ahead runs in the background)."""
    for _ in range(int(timeout_s / 0.01)):
        if slot_actions(engine).count("save") >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{count} saves expected, the engine saw {slot_actions(engine)}")


def slot_actions(engine: SlotFileFakeLlama) -> list[str]:
    return [a[0] for a in engine.actions if "probe" not in a[2]]


async def test_a_slot_is_parked_ahead_so_its_eviction_saves_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One slot: B evicts A (A saved then, on B's path). After B's turn, with the engine
    idle and short of slots, B's slot is saved in the background; A's return then finds
    B's file current (no save on A's path: only A's restore), and B's return restores the
    file parked ahead, all of B's previous prompt cached."""
    engine = SlotFileFakeLlama(tmp_path)
    caplog.set_level(logging.INFO, "prefixpin")
    async with running_proxy(engine, **settings(tmp_path, park_ahead=True)) as (client, _):
        await ask(client, conversation("A", 1), "A")
        b_first = await ask(client, conversation("B", 1), "B")
        await saves_settle(engine, 2)  # A at eviction, B ahead
        assert slot_actions(engine) == ["save", "save"]
        await ask(client, conversation("A", 2), "A")
        assert slot_actions(engine)[2] == "restore"  # B's eviction saved nothing
        assert await metric(client, "prefixpin_parks_total", outcome="unchanged") == 1
        b_again = await ask(client, conversation("B", 2), "B")
        assert await metric(client, "prefixpin_restores_total", outcome="restored") == 2
    assert cached(b_again) >= prompt(b_first)
    # Its turn had committed: no later commit is owed to the file (the fake's slot holds
    # one token more than the pool's estimate, which must not read as a pending turn).
    ahead = [e for e in events(caplog, "parked") if e["reason"] == "ahead"]
    assert ahead
    assert all(e["awaiting_commit"] is False for e in ahead), ahead


async def test_nothing_is_parked_ahead_while_every_session_has_a_slot(tmp_path: Path) -> None:
    """Two slots, two sessions: no slot ever changed hands, so nothing is saved."""
    engine = SlotFileFakeLlama(tmp_path, FakeLlamaConfig(n_slots=2))
    async with running_proxy(engine, **settings(tmp_path, park_ahead=True)) as (client, _):
        await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")
        await ask(client, conversation("A", 2), "A")
        await asyncio.sleep(0.5)  # past the idle delay of a park ahead
        assert slot_actions(engine) == []


async def test_parking_ahead_never_pushes_a_parked_session_out_of_the_budget(
        tmp_path: Path) -> None:
    """Room for one file: A's (parked when B evicted it) is its only copy; B's slot still
    holds B, so B is not parked ahead at the price of A's file."""
    engine = SlotFileFakeLlama(tmp_path)
    async with running_proxy(engine, **settings(tmp_path)) as (client, _):
        await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")
        [a_file] = park_files(tmp_path)
    budget = int(a_file.stat().st_size * 1.5)
    for path in park_files(tmp_path):
        path.unlink()
    (index_dir(tmp_path) / INDEX_NAME).unlink()
    engine = SlotFileFakeLlama(tmp_path)
    async with running_proxy(engine, **settings(tmp_path, park_ahead=True,
                                                park_max_bytes=budget)) as (client, _):
        await ask(client, conversation("A", 1), "A")
        await ask(client, conversation("B", 1), "B")
        [a_parked] = park_files(tmp_path)
        await asyncio.sleep(0.5)
        assert slot_actions(engine) == ["save"]  # A's, at its eviction
        assert park_files(tmp_path) == [a_parked]

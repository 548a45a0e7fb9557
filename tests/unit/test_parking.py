"""Parking's pure parts: the engine's slot file read back (sans-IO), the park index, and
what the engine's command line and model say about restoring."""

from __future__ import annotations

import sqlite3
import struct
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from prefixpin.adapters.base import EngineInfo
from prefixpin.proxy.parking import (
    DEFAULT_INDEX_ROOT,
    INDEX_NAME,
    SCHEMA_VERSION,
    SLOT_FILE_MAGIC,
    SLOT_FILE_VERSION,
    EngineLimits,
    ParkIndex,
    ParkRecord,
    SlotFileError,
    SqliteParkIndex,
    engine_limits,
    file_digest,
    index_dir,
    parse_header,
    read_slot_tokens,
    scope_of,
    tokens_digest,
    unpack_tokens,
)
from prefixpin.proxy.session.history import Committed
from prefixpin.proxy.settings import Settings


def slot_file(tokens: list[int], kv: bytes = b"kv-state", *, packed: bool = True) -> bytes:
    """What llama_state_seq_save_file writes for a text-only llama-server slot."""
    items = [-1, 1, len(tokens), *tokens, 0] if packed else tokens
    return (struct.pack("<III", SLOT_FILE_MAGIC, SLOT_FILE_VERSION, len(items))
            + struct.pack(f"<{len(items)}i", *items) + kv)


# ---------------------------------------------------------------- the slot file

def test_tokens_are_read_back_from_a_packed_slot_file(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(slot_file([1, 49152, 7, 0]))
    assert read_slot_tokens(path) == [1, 49152, 7, 0]


def test_a_plain_token_list_from_older_builds_is_read_as_is(tmp_path: Path) -> None:
    path = tmp_path / "old.bin"
    path.write_bytes(slot_file([5, 6, 7], packed=False))
    assert read_slot_tokens(path) == [5, 6, 7]


@pytest.mark.parametrize(("packed", "fault"), [
    ([-1, 2, 1, 5, 0], "mismatched"),  # unknown packed version
    ([-1, 1, 3, 5, 0], "mismatched"),  # count says 3, one token present
    ([-1, 1, 1, 5, 1], "mismatched"),  # media chunks
    ([-1, 1], "mismatched"),
])
def test_a_malformed_packed_list_is_refused(packed: list[int], fault: str) -> None:
    with pytest.raises(SlotFileError) as caught:
        unpack_tokens(packed)
    assert caught.value.fault == fault


def test_empty_and_foreign_headers() -> None:
    with pytest.raises(SlotFileError, match="shorter than a slot file header") as short:
        parse_header(b"gg", 2)
    assert short.value.fault == "truncated"
    wrong = struct.pack("<III", 0x67676C61, SLOT_FILE_VERSION, 0)
    with pytest.raises(SlotFileError, match="not a slot state file") as foreign:
        parse_header(wrong, 12)
    assert foreign.value.fault == "mismatched"
    old = struct.pack("<III", SLOT_FILE_MAGIC, 2, 0)
    with pytest.raises(SlotFileError, match="version 2"):
        parse_header(old, 12)
    assert parse_header(struct.pack("<III", SLOT_FILE_MAGIC, SLOT_FILE_VERSION, 0), 12) == 0


def test_a_token_list_running_past_the_end_is_truncated(tmp_path: Path) -> None:
    data = slot_file(list(range(100)))
    path = tmp_path / "cut.bin"
    path.write_bytes(data[:200])
    with pytest.raises(SlotFileError) as caught:
        read_slot_tokens(path)
    assert caught.value.fault == "truncated"
    with pytest.raises(SlotFileError) as gone:
        read_slot_tokens(tmp_path / "missing.bin")
    assert gone.value.fault == "missing"


def test_digests_change_with_any_token_or_byte(tmp_path: Path) -> None:
    assert tokens_digest([1, 2, 3]) != tokens_digest([1, 2, 4])
    assert tokens_digest([1, 2, 3]) == tokens_digest([1, 2, 3])
    assert len(tokens_digest([])) == 16
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(slot_file([1, 2], b"\x00" * 4096))
    b.write_bytes(slot_file([1, 2], b"\x00" * 4095 + b"\x01"))
    assert file_digest(a) != file_digest(b)
    assert file_digest(a) == file_digest(a)


# ---------------------------------------------------------------- the park index

def record(park_id: str, *, namespace: str = "ns", key: str | None = "k", last_use: float = 1.0,
           messages: int = 2, size: int = 1000) -> ParkRecord:
    body = {"model": "m", "tools": [{"type": "function", "function": {"name": "grep"}}],
            "messages": [{"role": "user", "content": f"message {i} ü"}
                         for i in range(messages)]}
    committed = Committed.of_chat(body)
    return ParkRecord(park_id, namespace, key, "main", committed, prompt_tokens=300,
                      n_tokens=310, filename=f"pp-{park_id}.bin", size=size,
                      tokens_digest=b"t" * 16, content_digest=b"c" * 16, model="model.gguf",
                      created=0.5, last_use=last_use)


def test_a_record_round_trips_through_sqlite_and_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / INDEX_NAME
    index = ParkIndex.open(path)
    original = record("a")
    index.insert(original)
    index.close()
    reopened = ParkIndex.open(path)
    assert reopened.get("a") == original
    assert reopened.get("a") is not None
    back = reopened.get("a")
    assert back is not None
    assert back.committed.digests == original.committed.digests
    assert back.committed.body == original.committed.body
    assert reopened.filenames() == {"pp-a.bin"}
    reopened.close()


def test_completions_histories_keep_their_prompt(tmp_path: Path) -> None:
    index = ParkIndex.open(tmp_path / INDEX_NAME)
    committed = Committed.of_completion({"prompt": "Once upon a time", "model": "m"})
    base = record("p")
    index.insert(ParkRecord(**{**{f: getattr(base, f) for f in ParkRecord.__slots__},
                               "committed": committed}))
    back = index.get("p")
    assert back is not None
    assert back.committed == committed


def test_lookups_by_namespace_and_key_and_lru_order(tmp_path: Path) -> None:
    index = ParkIndex.open(tmp_path / INDEX_NAME)
    index.insert(record("a", last_use=3.0))
    index.insert(record("b", key=None, last_use=1.0, size=500))
    index.insert(record("c", namespace="other", last_use=2.0))
    assert [r.park_id for r in index.under("ns", "k")] == ["a"]
    assert [r.park_id for r in index.under("ns", None)] == ["b"]
    assert index.under("other", None) == []
    assert [r.park_id for r in index.oldest_first()] == ["b", "c", "a"]
    index.touch("b", 9.0)
    assert [r.park_id for r in index.oldest_first()] == ["c", "a", "b"]
    assert index.total_bytes() == 2500
    assert index.count() == 3
    index.delete("c")
    assert index.count() == 2


def test_rows_that_do_not_decode_are_reported_not_returned(tmp_path: Path) -> None:
    """A hand-edited row (messages that no longer match their digests) never rebuilds a
    session: it is skipped, and the start-up sweep deletes it."""
    path = tmp_path / INDEX_NAME
    index = ParkIndex.open(path)
    index.insert(record("good"))
    index.insert(record("bad"))
    index.close()
    with closing(sqlite3.connect(path)) as db, db:
        db.execute("""UPDATE parked SET messages = '[{"role": "user", "content": "forged"}]'
                      WHERE park_id = 'bad'""")
    index = ParkIndex.open(path)
    assert [r.park_id for r in index.oldest_first()] == ["good"]
    assert index.invalid_ids() == ["bad"]


def test_an_index_of_another_schema_version_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / INDEX_NAME
    index = ParkIndex.open(path)
    index.insert(record("a"))
    index.close()
    with closing(sqlite3.connect(path)) as db:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with closing(ParkIndex.open(path)) as reopened:
        assert reopened.count() == 0


def test_the_index_uses_write_ahead_logging(tmp_path: Path) -> None:
    with closing(ParkIndex.open(tmp_path / INDEX_NAME)) as index:
        index.insert(record("a"))
        with closing(sqlite3.connect(tmp_path / INDEX_NAME)) as db:
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# ---------------------------------------------------------------- engine limits

def info(engine: str = "llama-server", n_swa: int = 0, model_path: str = "") -> EngineInfo:
    return EngineInfo(engine, "model.gguf", 2, 4096, slot_save_path=True, n_swa=n_swa,
                      props={"model_path": model_path})


def test_limits_from_the_probe_when_nothing_local_is_readable() -> None:
    remote = Settings(upstream="http://10.0.0.7:8080")
    limits = engine_limits(remote, info(n_swa=1))
    assert limits.sliding_window == 1
    assert limits.cache_ram_mib is None
    assert "a restored slot has no context checkpoints" in limits.notes()[0]
    assert engine_limits(remote, info()).notes() == []


def test_the_embedded_engine_has_a_full_size_window_and_no_ram_cache() -> None:
    limits = engine_limits(Settings(), info(engine="embedded", n_swa=1))
    assert limits == EngineLimits(source=limits.source)
    assert limits.notes() == []


def test_notes_name_the_ram_cache_and_idle_slot_clearing() -> None:
    limits = EngineLimits(cache_ram_mib=8192, clears_idle_slots=True)
    notes = " ".join(limits.notes())
    assert "--cache-ram 8192 MiB" in notes
    assert "empties idle slots" in notes
    assert "no limit" in " ".join(EngineLimits(cache_ram_mib=-1).notes())


# ---------------------------------------------------------------- where the sqlite index lives

def test_the_sqlite_index_lives_in_prefixpins_own_directory(tmp_path: Path) -> None:
    """Never in the engine's save directory: --park-index-dir, else one directory per park
    directory under ~/.cache/prefixpin/park-index; the embedded engine's beside its slots."""
    engine_dir = tmp_path / "engine-slots"
    own = tmp_path / "prefixpin"
    assert index_dir(Settings(park_index_dir=own), info(), engine_dir) == own
    default = index_dir(Settings(), info(), engine_dir)
    assert default.parent == DEFAULT_INDEX_ROOT
    assert engine_dir not in (default, *default.parents)
    assert index_dir(Settings(), info(), engine_dir) == default  # stable across restarts
    assert index_dir(Settings(), info(), tmp_path / "other") != default
    embedded = tmp_path / "park" / "slots"
    assert index_dir(Settings(), info(engine="embedded"), embedded) == tmp_path / "park"
    with closing(SqliteParkIndex.in_directory(own)) as index:
        index.insert(record("a"))
    assert (own / INDEX_NAME).is_file()
    assert not engine_dir.exists()


def test_sqlite_scopes_keep_each_directory_apart(tmp_path: Path) -> None:
    def at(park_id: str, lane: str, shared: bool = False, **more: Any) -> ParkRecord:
        base = record(park_id, **more)
        return ParkRecord(**{**{f: getattr(base, f) for f in ParkRecord.__slots__},
                             "lane": lane, "shared": shared})

    with closing(SqliteParkIndex.in_directory(tmp_path)) as index:
        index.insert(at("a", "e1:1", last_use=3.0, size=100))
        index.insert(at("b", "e2:2", last_use=1.0, size=200))
        index.insert(at("c", "e2:2", shared=True, last_use=2.0, size=400))
        assert [r.park_id for r in index.oldest_first(scope_of("e1:1", False))] == ["a"]
        assert [r.park_id for r in index.oldest_first(scope_of("e1:1", True))] == ["c"]
        assert index.total_bytes(scope_of("e2:2", False)) == 200
        assert index.count(scope_of("e2:2", False)) == 1
        assert index.total_bytes() == 700
        assert index.filenames() == {"pp-a.bin", "pp-b.bin", "pp-c.bin"}
        back = index.get("c")
        assert back is not None
        assert (back.lane, back.shared, back.scope) == ("e2:2", True, "shared")


def test_an_owner_is_this_process_s_session_only(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --redis session ids restart with the process ("s1" again): a park another
    run of the proxy owned reads as ownerless, never as the new "s1"'s."""
    path = tmp_path / INDEX_NAME
    base = record("a")
    with closing(ParkIndex.open(path)) as index:
        index.insert(ParkRecord(**{**{f: getattr(base, f) for f in ParkRecord.__slots__},
                                   "owner": "s1"}))
        index.insert(ParkRecord(**{**{f: getattr(base, f) for f in ParkRecord.__slots__},
                                   "park_id": "b", "filename": "pp-b.bin", "owner": "s1"}))
        owned = index.owned_by("s1")
        assert owned is not None
        assert owned.park_id == "b"  # one park per session: the latest
        first = index.get("a")
        assert first is not None
        assert first.owner is None
    monkeypatch.setattr("prefixpin.proxy.parking.index._PROCESS", "another-run")
    with closing(ParkIndex.open(path)) as index:
        assert index.owned_by("s1") is None
        again = index.get("b")
        assert again is not None
        assert again.owner is None
        index.set_owner("b", "s1")
        owned = index.owned_by("s1")
        assert owned is not None
        assert owned.park_id == "b"

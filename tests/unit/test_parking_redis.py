"""The park index in Redis (``RedisParkIndex``) against a real redis-server: what one
replica's connection writes, another's reads; records are JSON, never pickle; a session owns
its latest park; and, through ``ParkManager``, the two layouts: per-engine save directories
refuse a record another lane wrote, a directory every engine shares takes it. A session
parked by one replica is restored by another, and an evicted session only another replica
committed is read from the shared session table to be parked."""

from __future__ import annotations

import itertools
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from prefixpin.adapters.base import Adapter, SlotFileResult
from prefixpin.proxy.cluster.core import Cluster
from prefixpin.proxy.cluster.park_index import RedisParkIndex
from prefixpin.proxy.cluster.sessions import SharedSessions
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.parking import ParkConfig, ParkManager, ParkRecord, read_slot_tokens, scope_of
from prefixpin.proxy.session.history import Committed, digest
from prefixpin.proxy.session.placement import Eviction
from prefixpin.proxy.session.sessions import Session, SessionStore
from tests.rig.redis_process import RedisProcess, run_redis_server
from tests.unit.test_parking import record, slot_file

pytestmark = pytest.mark.usefixtures("redis_server_binary")

LOG = logging.getLogger("prefixpin")
E1, E2 = "127.0.0.1:8081", "127.0.0.1:8082"
MODEL = "model.gguf"
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisProcess]:
    with run_redis_server() as handle:
        yield handle


@pytest.fixture
def replicas(redis_server: RedisProcess) -> Iterator[tuple[Cluster, Cluster]]:
    """Two replicas' connections to one Redis, under a fresh key prefix."""
    prefix = f"parktest{next(_prefixes)}"
    pair = (Cluster(redis_server.url, prefix, "replica-a", LOG),
            Cluster(redis_server.url, prefix, "replica-b", LOG))
    yield pair
    for cluster in pair:
        cluster.sync.close()


def keys_of(cluster: Cluster) -> list[str]:
    found: Any = cluster.sync.keys(cluster.key("park", "*"))
    return sorted(k.decode() for k in found)


def placed(park_id: str, *, lane: str = E1, shared: bool = False, owner: str | None = None,
           **more: Any) -> ParkRecord:
    base = record(park_id, **more)
    fields = {f: getattr(base, f) for f in ParkRecord.__slots__}
    return ParkRecord(**{**fields, "lane": lane, "shared": shared, "owner": owner})


# ---------------------------------------------------------------- the index itself

def test_a_record_written_through_one_replica_is_read_through_another(
        replicas: tuple[Cluster, Cluster]) -> None:
    a, b = RedisParkIndex(replicas[0]), RedisParkIndex(replicas[1])
    original = placed("a", owner="s1", last_use=2.0)
    a.insert(original)
    assert b.get("a") == original
    assert b.under("ns", "k") == [original]
    assert b.under("ns", None) == []
    assert b.owned_by("s1") == original
    assert b.filenames() == {"pp-a.bin"}
    assert (b.count(), b.total_bytes()) == (1, 1000)
    b.touch("a", 7.5)
    back = a.get("a")
    assert back is not None
    assert back.last_use == 7.5
    assert back.committed.digests == original.committed.digests
    b.delete("a")
    assert a.get("a") is None
    assert a.owned_by("s1") is None
    assert a.under("ns", "k") == []
    assert keys_of(replicas[0]) == []  # nothing left behind


def test_records_are_json_and_a_pickled_value_is_never_unpickled(
        replicas: tuple[Cluster, Cluster]) -> None:
    cluster = replicas[0]
    index = RedisParkIndex(cluster)
    index.insert(placed("a", owner="s1"))
    raw: Any = cluster.sync.get(cluster.key("park", "r", "a"))
    data = orjson.loads(raw)
    assert data["messages"][0]["content"] == "message 0 ü"
    assert data["lane"] == E1
    entries: Any = cluster.sync.hgetall(cluster.key("park", "all"))
    assert {k.decode(): orjson.loads(v) for k, v in entries.items()} == {
        "a": {"f": "pp-a.bin", "b": 1000, "d": scope_of(E1, False)}}
    # Whoever can write to Redis plants a pickle: it must read as a broken record, and
    # nothing may run.
    cluster.sync.set(cluster.key("park", "r", "evil"), pickle.dumps(_Payload()))
    cluster.sync.hset(cluster.key("park", "all"), "evil",
                      orjson.dumps({"f": "pp-evil.bin", "b": 1, "d": scope_of(E1, False)}))
    cluster.sync.sadd(cluster.key("park", "keyless", "ns"), "evil")
    assert index.get("evil") is None
    assert index.under("ns", None) == []
    assert index.invalid_ids(scope_of(E1, False)) == ["evil"]
    index.delete("evil")
    assert UNPICKLED == []
    assert index.count() == 1


UNPICKLED: list[str] = []


def _unpickled() -> None:
    UNPICKLED.append("code ran")


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickled, ())


def test_a_session_owns_its_latest_park_only(replicas: tuple[Cluster, Cluster]) -> None:
    a, b = RedisParkIndex(replicas[0]), RedisParkIndex(replicas[1])
    a.insert(placed("old", owner="s1", last_use=1.0))
    b.insert(placed("new", owner="s1", last_use=2.0))
    newest = a.owned_by("s1")
    assert newest is not None
    assert newest.park_id == "new"
    old = a.get("old")
    assert old is not None
    assert old.owner is None
    b.set_owner("old", "s2")  # a session rebuilt from the old park
    revived = a.owned_by("s2")
    assert revived is not None
    assert revived.park_id == "old"
    b.delete("new")
    assert a.owned_by("s1") is None
    b.set_owner("gone", "s3")  # no such record: nothing is written
    assert a.owned_by("s3") is None


def test_budgets_and_sweeps_see_one_directory_lookups_see_all(
        replicas: tuple[Cluster, Cluster]) -> None:
    index = RedisParkIndex(replicas[0])
    index.insert(placed("e1", lane=E1, last_use=3.0, size=100))
    index.insert(placed("e2", lane=E2, last_use=1.0, size=200))
    index.insert(placed("s", lane=E2, shared=True, last_use=2.0, size=400))
    assert [r.park_id for r in index.oldest_first()] == ["e2", "s", "e1"]
    assert [r.park_id for r in index.oldest_first(scope_of(E1, False))] == ["e1"]
    assert [r.park_id for r in index.oldest_first(scope_of(E1, True))] == ["s"]
    assert index.total_bytes(scope_of(E2, False)) == 200
    assert index.count(scope_of(E2, False)) == 1
    assert index.total_bytes() == 700
    assert index.filenames() == {"pp-e1.bin", "pp-e2.bin", "pp-s.bin"}
    assert {r.park_id for r in index.under("ns", "k")} == {"e1", "e2", "s"}


def test_a_late_commit_updates_the_history_and_a_forged_one_is_refused(
        replicas: tuple[Cluster, Cluster]) -> None:
    cluster = replicas[0]
    index = RedisParkIndex(cluster)
    index.insert(placed("a", messages=2))
    longer = Committed.of_chat({"messages": [{"role": "user", "content": f"m{i}"}
                                             for i in range(3)]})
    index.update_history("a", longer, 321)
    back = index.get("a")
    assert back is not None
    assert (back.committed, back.prompt_tokens) == (longer, 321)
    key = cluster.key("park", "r", "a")
    raw: Any = cluster.sync.get(key)
    forged = orjson.loads(raw)
    forged["messages"][0]["content"] = "forged"
    cluster.sync.set(key, orjson.dumps(forged))
    assert index.get("a") is None
    assert index.invalid_ids() == ["a"]


# ---------------------------------------------------------------- layouts, through ParkManager

class SlotFiles:
    """save_slot and restore_slot as llama-server with --slot-save-path ``directory``."""

    def __init__(self, directory: Path, tokens: list[int]) -> None:
        self.directory = directory
        self.tokens = tokens
        self.restored: list[str] = []

    async def save_slot(self, slot: int, filename: str) -> SlotFileResult:
        data = slot_file(self.tokens)
        (self.directory / filename).write_bytes(data)
        return SlotFileResult(slot, filename, len(self.tokens), len(data), 1.0)

    async def restore_slot(self, slot: int, filename: str) -> SlotFileResult:
        path = self.directory / filename
        tokens = read_slot_tokens(path)
        self.restored.append(filename)
        return SlotFileResult(slot, filename, len(tokens), path.stat().st_size, 1.0)


def manager(cluster: Cluster, directory: Path, lane: str, *, shared: bool = False,
            store: SessionStore | None = None, model: str = MODEL,
            resolve: bool = False) -> tuple[ParkManager, SlotFiles]:
    engine = SlotFiles(directory, list(range(300)))
    store = store if store is not None else SessionStore()
    fetch = SharedSessions(cluster, store, LOG).fetch if resolve else None
    parking = ParkManager(RedisParkIndex(cluster), ParkConfig(directory, 10**9, 1, True),
                          cast(Adapter, engine), store, Metrics(), LOG, model=model, lane=lane,
                          shared=shared, resolve=fetch)
    return parking, engine


MESSAGES = [{"role": "system", "content": "an agent"}, {"role": "user", "content": "first"}]


def committed_session(store: SessionStore, name: str = "A") -> Session:
    session = store.create("ns", name, "main")
    session.committed = Committed.of_chat({"messages": MESSAGES})
    session.prompt_tokens = 290
    return session


def returning(session: Session) -> tuple[dict[str, Any], list[bytes]]:
    """The session's next request: its committed history and one more message."""
    messages = [*MESSAGES, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "second"}]
    return {"messages": messages}, [digest(m) for m in messages]


def files_in(directory: Path) -> list[Path]:
    return list(directory.iterdir())


async def park(parking: ParkManager, session: Session) -> ParkRecord:
    await parking.park(Eviction(0, session.id, "main", 300, "worth"))
    parked = parking.index.owned_by(session.id)
    assert parked is not None
    return parked


@pytest.mark.anyio
async def test_a_session_parked_by_one_replica_is_restored_by_another(
        replicas: tuple[Cluster, Cluster], tmp_path: Path) -> None:
    """Per-engine directories, one engine (E1) behind two replicas: A parks, B restores."""
    store_a, store_b = SessionStore(), SessionStore()
    at_a, _ = manager(replicas[0], tmp_path, E1, store=store_a)
    at_b, engine_b = manager(replicas[1], tmp_path, E1, store=store_b)
    session = committed_session(store_a)
    parked = await park(at_a, session)
    assert parked.lane == E1
    store_b.put(session)  # the shared session table brought it to B
    body, _ = returning(session)
    result = await at_b.restore(session, body, slot=1)
    assert result is not None
    assert result.ok, result.note
    assert engine_b.restored == [parked.filename]


@pytest.mark.anyio
async def test_per_engine_directories_refuse_a_record_another_lane_wrote(
        replicas: tuple[Cluster, Cluster], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "prefixpin")
    (tmp_path / "e1").mkdir()
    (tmp_path / "e2").mkdir()
    store_a = SessionStore()
    on_e1, _ = manager(replicas[0], tmp_path / "e1", E1, store=store_a)
    on_e2, engine_e2 = manager(replicas[1], tmp_path / "e2", E2)
    session = committed_session(store_a)
    parked = await park(on_e1, session)
    body, digests = returning(session)
    result = await on_e2.restore(session, body, slot=0)
    assert result is not None
    assert result.outcome == "other_lane"
    assert f"parked by {E1}" in result.note
    assert on_e2.lookup("ns", "A", body, digests) is None  # no live owner on B: still not
    [skipped] = [r for r in caplog.records if r.getMessage() == "parked history not revived"]
    assert "does not read" in getattr(skipped, "fields", {})["reason"]
    assert engine_e2.restored == []
    assert (tmp_path / "e1" / parked.filename).exists()  # left for its own lane
    assert on_e1.index.get(parked.park_id) is not None
    on_e2.sweep()  # E2's sweep never touches E1's directory or records
    assert on_e1.index.get(parked.park_id) is not None


@pytest.mark.anyio
async def test_a_directory_every_engine_shares_lets_another_engine_restore(
        replicas: tuple[Cluster, Cluster], tmp_path: Path) -> None:
    store_a = SessionStore()
    on_e1, _ = manager(replicas[0], tmp_path, E1, shared=True, store=store_a)
    on_e2, engine_e2 = manager(replicas[1], tmp_path, E2, shared=True)
    other_model, _ = manager(replicas[1], tmp_path, E2, shared=True, model="other.gguf")
    session = committed_session(store_a)
    parked = await park(on_e1, session)
    body, digests = returning(session)
    declined = await other_model.restore(session, body, slot=0)
    assert declined is not None
    assert declined.outcome == "other_model"  # same model only
    found = on_e2.lookup("ns", "A", body, digests)
    assert found is not None
    assert found.park_id == parked.park_id
    result = await on_e2.restore(session, body, slot=0)
    assert result is not None
    assert result.ok, result.note
    assert engine_e2.restored == [parked.filename]


@pytest.mark.anyio
async def test_an_evicted_session_another_replica_committed_is_parked(
        replicas: tuple[Cluster, Cluster], tmp_path: Path) -> None:
    """B committed the session (the shared table has it); A's pool evicts it: A reads it
    from Redis and parks it. Without the shared table A would know nothing to park."""
    store_b = SessionStore()
    session = committed_session(store_b, "B")
    assert SharedSessions(replicas[1], store_b, LOG).publish(session)
    blind, _ = manager(replicas[0], tmp_path, E1)
    await blind.park(Eviction(0, session.id, "main", 300, "worth"))
    assert blind.index.owned_by(session.id) is None
    assert files_in(tmp_path) == []
    store_a = SessionStore()
    at_a, _ = manager(replicas[0], tmp_path, E1, store=store_a, resolve=True)
    try:
        parked = await park(at_a, session)
    finally:
        await replicas[0].r.aclose()  # the fetch read through the async client
    assert session.committed is not None
    assert parked.committed.digests == session.committed.digests
    assert store_a.get(session.id) is not None

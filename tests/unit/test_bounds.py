"""Per-namespace bounds (issue 16): sessions, committed bytes, queued requests, and what a
committed history keeps of each message."""

from __future__ import annotations

import asyncio

import pytest

from prefixpin.proxy.session.history import Committed, decide, digest, rendered
from prefixpin.proxy.session.placement import QueueFullError, QueueGate, SlotPool, Want
from prefixpin.proxy.session.sessions import SessionStore


def test_a_namespace_cycling_keys_evicts_only_its_own_sessions() -> None:
    store = SessionStore(max_sessions=10, max_per_namespace=4)
    victims = [store.create("t-victim", f"v{i}", "main") for i in range(3)]
    for i in range(50):
        store.create("t-attacker", f"a{i}", "main")
    assert all(store.get(v.id) is v for v in victims)
    assert store.count("t-attacker") == 4


def test_a_full_store_evicts_from_the_namespace_holding_the_most() -> None:
    store = SessionStore(max_sessions=6, max_per_namespace=6)
    victims = [store.create("t-victim", f"v{i}", "main") for i in range(2)]
    for i in range(20):
        store.create("t-attacker", f"a{i}", "main")
    assert len(store) == 6
    assert all(store.get(v.id) is v for v in victims)
    # Every namespace at one session: the least recently used goes.
    small = SessionStore(max_sessions=2)
    first, second = small.create("a", None, "main"), small.create("b", None, "main")
    small.create("c", None, "main")
    assert small.get(first.id) is None
    assert small.get(second.id) is second


def test_committed_bytes_are_bounded_per_namespace() -> None:
    store = SessionStore(max_committed_bytes=10_000)
    other = store.create("t-other", "o", "main")
    other.committed = Committed.of_chat({"messages": [{"role": "user", "content": "x" * 3000}]})
    store.touch(other)
    sessions = []
    for i in range(5):
        session = store.create("t-big", f"k{i}", "main")
        session.committed = Committed.of_chat(
            {"messages": [{"role": "user", "content": f"{i}" * 4000}]})
        store.touch(session)
        sessions.append(session)
    assert store.committed_bytes("t-big") <= 10_000
    assert store.get(sessions[-1].id) is sessions[-1]
    assert store.get(sessions[0].id) is None
    assert store.get(other.id) is other
    assert other.committed is not None
    alone = store.create("t-huge", None, "main")
    alone.committed = Committed.of_chat({"messages": [{"role": "user", "content": "y" * 20_000}]})
    store.touch(alone)
    assert store.committed_bytes("t-huge") == 0
    assert store.get(alone.id) is alone
    assert getattr(alone, "committed") is None  # noqa: B009 (assigned above: mypy narrows)


def test_the_reply_a_session_keeps_counts_in_its_namespaces_committed_bytes() -> None:
    """Repair keeps the reply a session was last given (a long answer, or a flood of
    megabytes): it counts in the namespace's budget with the history, and a session over
    the budget alone keeps neither."""
    store = SessionStore(max_committed_bytes=10_000)
    older = store.create("t", "older", "main")
    older.repair.remember_reply({"role": "assistant", "content": "a" * 4000})
    store.touch(older)
    assert 4000 < store.committed_bytes("t") < 4100
    newer = store.create("t", "newer", "main")
    newer.committed = Committed.of_chat({"messages": [{"role": "user", "content": "q"}]})
    newer.repair.remember_reply({"role": "assistant", "content": "b" * 7000})
    store.touch(newer)
    assert store.get(older.id) is None  # its reply made room for the newer one's
    assert store.committed_bytes("t") == newer.committed.size + newer.repair.reply_size
    newer.repair.remember_reply({"role": "assistant", "content": "c" * 20_000})
    store.touch(newer)
    assert store.get(newer.id) is newer
    assert (newer.repair.last_reply, newer.repair.reply_size) == (None, 0)
    assert store.committed_bytes("t") == 0


def test_a_committed_history_keeps_only_what_the_template_renders() -> None:
    junk = "j" * (1 << 20)
    messages = [{"role": "user", "content": "hi", "junk": junk},
                {"role": "assistant", "content": "", "reasoning_content": "r", "x": junk,
                 "tool_calls": [{"id": "c1", "type": "function", "y": junk,
                                 "function": {"name": "f", "arguments": "{}", "z": junk}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    committed = Committed.of_chat({"model": "m", "messages": messages})
    assert committed.size < 2000
    assert committed.messages[0] == {"role": "user", "content": "hi"}
    assert committed.messages[1]["reasoning_content"] == "r"
    assert committed.messages[1]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert committed.messages[2] is messages[2]  # nothing to drop: kept as is
    assert committed.body is not None
    assert committed.body["messages"] == list(committed.messages)
    # Digests are those of the messages as forwarded: bytes decide as before.
    assert committed.digests == tuple(digest(m) for m in messages)
    extended = {"model": "m", "messages": [*messages, {"role": "user", "content": "next"}]}
    assert decide(committed, extended).extends
    assert not decide(committed, {"model": "m", "messages": [
        {"role": "user", "content": "hi"}, *messages[1:], {"role": "user", "content": "n"}]}
    ).extends
    assert rendered({"role": "user", "content": "a"}) == {"role": "user", "content": "a"}


@pytest.mark.anyio
async def test_queued_requests_are_capped_per_namespace_and_per_lane() -> None:
    pool = SlotPool(1)
    gate = QueueGate(max_queued=3, max_queued_per_namespace=2, retry_after_s=7)
    want = Want("s1", "main", None)
    gate.admit("a", would_wait=pool.would_wait(want))  # a free slot: never refused

    async def waiter(namespace: str, session: str) -> None:
        with gate.queued(namespace) as leased:
            async with pool.lease(Want(session, "main", None), timeout_s=5):
                leased()
                await asyncio.sleep(0.2)

    holder = asyncio.create_task(waiter("a", "s0"))
    await asyncio.sleep(0.01)
    assert pool.would_wait(want)
    queued = [asyncio.create_task(waiter("a", f"q{i}")) for i in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFullError) as refused:
        gate.admit("a", would_wait=True)
    assert refused.value.code == "queue_full_namespace"
    assert refused.value.status_code == 429
    assert refused.value.headers() == {"Retry-After": "7"}
    gate.admit("b", would_wait=True)  # another namespace still queues
    queued.append(asyncio.create_task(waiter("b", "b0")))
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFullError) as full:
        gate.admit("c", would_wait=True)
    assert full.value.code == "queue_full_lane"
    await asyncio.gather(holder, *queued)
    assert gate.waiting == 0
    assert gate.by_namespace == {}

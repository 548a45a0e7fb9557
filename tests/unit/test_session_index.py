"""The session store's indexes (``SessionStore.nominees``, ``with_key``) give the planner the
same candidates, in the same order, as reading every session of the namespace did."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from prefixpin.fingerprint import Chain, chain
from prefixpin.proxy.session.affinity import AffinityPlanner, ranked
from prefixpin.proxy.session.history import Committed, digest
from prefixpin.proxy.session.sessions import Session, SessionStore

OPENERS = [1]
NAMESPACES = ("anon", "t-other")
KEYS = (None, None, "k1", "k2")
TEXTS = ("sys", "hi", "hello", "bye")


def scanned(store: SessionStore, namespace: str, chain_: Chain | None,
            digests: Sequence[bytes], prompt: object) -> list[Session]:
    """The candidates as the planner found them before the index: every keyless session,
    ranked as the planner ranks what its index gives it."""
    return ranked(store.keyless(namespace), chain_, digests, prompt)


def random_messages(rng: random.Random) -> list[dict[str, str]]:
    return [{"role": rng.choice(("system", "user", "assistant")), "content": rng.choice(TEXTS)}
            for _ in range(rng.randint(1, 4))]


def random_chain(rng: random.Random) -> Chain:
    tokens: list[int] = []
    for _ in range(rng.randint(0, 5)):
        tokens += [1, rng.choice((5, 6)), rng.choice((7, 8))]
    if rng.random() < 0.2:
        tokens = [9, 9, *tokens]  # a leading segment without an opener
    return chain(tokens, OPENERS)


def random_committed(rng: random.Random) -> Committed | None:
    roll = rng.random()
    if roll < 0.15:
        return None
    if roll < 0.3:
        return Committed.of_completion({"prompt": rng.choice(("ab", "abc", "x"))})
    return Committed.of_chat({"messages": random_messages(rng)})


@pytest.mark.parametrize("seed", range(40))
def test_the_index_nominates_what_a_scan_of_every_session_did(seed: int) -> None:
    rng = random.Random(seed)
    store = SessionStore(max_sessions=rng.choice((8, 30, 200)),
                         max_committed_bytes=rng.choice((None, None, 900)))
    planner = AffinityPlanner.__new__(AffinityPlanner)
    planner.store = store
    for _ in range(300):
        roll = rng.random()
        live = list(store)
        if roll < 0.35 or not live:
            session = store.create(rng.choice(NAMESPACES), rng.choice(KEYS), "main")
            if rng.random() < 0.7:  # a first turn committed (touch reindexes)
                session.committed = random_committed(rng)
                session.chain = random_chain(rng) if rng.random() < 0.8 else None
                store.touch(session)
        elif roll < 0.6:  # a later turn: a new history, a new chain
            session = rng.choice(live)
            session.committed = random_committed(rng)
            if rng.random() < 0.5:
                session.chain = random_chain(rng)
            store.touch(session)
        elif roll < 0.7:  # revived from the park index: committed, then reindexed
            session = store.create(rng.choice(NAMESPACES), rng.choice(KEYS), "main")
            session.committed = random_committed(rng)
            store.reindex(session)
        elif roll < 0.8:
            store.touch(rng.choice(live))
        else:  # a replica's copy replaces the local one
            old = rng.choice(live)
            copy = Session(old.id, old.namespace, old.key, old.kind)
            copy.committed, copy.chain = random_committed(rng), random_chain(rng)
            store.put(copy)
        for namespace in NAMESPACES:
            for key in ("k1", "k2"):
                assert store.with_key(namespace, key) == [
                    s for s in reversed(list(store)) if s.namespace == namespace
                    and s.key == key]
            messages = random_messages(rng)
            digests = [digest(m) for m in messages]
            prompt = rng.choice((None, "abcd", "xyz"))
            request_chain = random_chain(rng) if rng.random() < 0.8 else None
            assert planner._nominated(namespace, request_chain, digests, prompt) == scanned(
                store, namespace, request_chain, digests, prompt)

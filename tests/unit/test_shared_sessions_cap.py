"""The session table in Redis keeps at most ``max_per_namespace`` records per namespace
(its least recently used go first), against a real redis-server: one tenant cycling session
keys cannot grow Redis without bound, nor push out another namespace's records."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from prefixpin.proxy.cluster.core import Cluster
from prefixpin.proxy.cluster.sessions import SharedSessions
from prefixpin.proxy.session.sessions import Session, SessionStore
from tests.rig.redis_process import RedisProcess, run_redis_server

pytestmark = pytest.mark.usefixtures("redis_server_binary")

LOG = logging.getLogger("prefixpin")


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisProcess]:
    with run_redis_server() as handle:
        yield handle


def records(cluster: Cluster) -> set[str]:
    found: Any = cluster.sync.keys(cluster.key("s", "*"))
    return {k.decode().rsplit(":", 1)[1] for k in found}


def test_a_namespace_keeps_its_newest_records_and_no_more(redis_server: RedisProcess) -> None:
    cluster = Cluster(redis_server.url, "captest", "replica-a", LOG)
    try:
        shared = SharedSessions(cluster, SessionStore(), LOG, max_per_namespace=3)
        other = Session("o1", "t-other", "keep", "main", last_used=1.0)
        assert shared.publish(other)
        for i in range(6):
            session = Session(f"s{i}", "t-cycler", f"key-{i}", "main", last_used=10.0 + i)
            assert shared.publish(session)
        assert records(cluster) == {"o1", "s3", "s4", "s5"}
    finally:
        cluster.sync.close()

"""The in-flight registry across replicas: a retry that lands on another replica joins the
generation already running (or waits for it to be planned) instead of prefilling again.

    inflight:<key>     the claim: which replica runs (or is planning) the request with this
                       in-flight key, and the name of its frame stream; set with NX, expires
                       unless its owner renews it (a dead replica's claim goes away)
    gen:<key>:<nonce>  a Redis stream: "started" (or "abandoned"), the head (status), every
                       frame, then "end" (completed, or the error): replayed from the start
    join:<replica>     pub/sub channel: "publish this generation's frames, someone joins",
                       with the joiner's retry intent (``proxy.pipeline.inflight.JoinIntent``)
    joinreply:<nonce>  the origin's answer to one join: ok, refused (the request is no
                       retry of that generation: it runs its own) or abandoned
    watch:<key>        set by joining replicas while their clients read: the running
                       generation stays alive for them as for a local client

Choice: the joining replica replays the stream from its first entry into a local *mirror*
generation, so its client gets what a local joiner gets: heartbeats at once, everything
produced so far, then the live frames, the same error if it fails. Frames are published
only once someone joins (a generation nobody joins costs one SET and one DEL in Redis). A
claim whose owner's heartbeat is gone, or whose request failed to plan ("abandoned"), is
dropped and the request is planned where it landed. A mirror whose origin replica dies
mid-stream ends with an error within ``REPLICA_TTL_S`` (its client retries; the retry is
planned afresh and resumes the session from its last commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

import orjson
import redis

from prefixpin.adapters.base import Frame, FrameKind, Progress
from prefixpin.core.errors import (
    GenerationCancelledError,
    ProxyError,
    UpstreamStatusError,
    UpstreamUnavailableError,
)
from prefixpin.proxy.cluster.core import REPLICA_TTL_S, Cluster
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.pipeline.generation import Generation, Head
from prefixpin.proxy.pipeline.inflight import Entry, InFlight, JoinIntent

CLAIM_TTL_S = 10.0  # renewed every third while planning or running
WATCH_TTL_S = 6.0
STREAM_TTL_S = 120.0  # a finished generation's stream stays replayable this long
READ_BLOCK_MS = 500
CLAIM_ATTEMPTS = 3
REFUSED = object()  # the origin refused a join: the request is no retry of its generation


@dataclass(frozen=True, slots=True)
class Claim:
    replica: str
    stream: str
    token: str

    def value(self) -> bytes:
        return orjson.dumps({"r": self.replica, "s": self.stream, "t": self.token})


class ClusterInFlight(InFlight):
    def __init__(self, cluster: Cluster, logger: logging.Logger, *, grace_s: float) -> None:
        super().__init__()
        self.cluster = cluster
        self.log = logger
        self.grace_s = grace_s
        self._claims: dict[bytes, Claim] = {}
        self._claimed: dict[bytes, Entry] = {}  # the local entry each claim stands for
        self._tasks: set[asyncio.Task[None]] = set()
        self._tapped: set[bytes] = set()
        self._listener: asyncio.Task[None] | None = None

    # -- claiming -------------------------------------------------------------------------

    async def claim(self, key: bytes, intent: JoinIntent | None = None
                    ) -> Generation | asyncio.Future[Generation]:
        intent = intent or JoinIntent()
        for _ in range(CLAIM_ATTEMPTS):
            running = await self.find(key, intent)
            if running is not None:
                return running
            if key in self._claims:
                break  # ours runs here and this request is no retry of it: its own sample
            token = self.cluster.token()
            stream = self.cluster.key("gen", key.hex(), token.rsplit("/", 1)[1])
            claim = Claim(self.cluster.replica, stream, token)
            try:
                if await self.cluster.r.set(self._claim_key(key), claim.value(), nx=True,
                                            px=int(CLAIM_TTL_S * 1000)):
                    return self._reserve_claimed(key, claim, intent)
                other = await self._current_claim(key)
                if other is None:
                    continue
                mirror = await self._join_remote(key, other, intent)
            except (redis.RedisError, OSError) as exc:
                log_event(self.log, logging.WARNING, "in-flight registry unreachable",
                          error=str(exc))
                break
            if mirror is REFUSED:
                break  # running there, but this request is no retry of it
            if isinstance(mirror, Generation):
                return mirror
        return self.reserve(key, intent)  # planned here, without a shared claim

    def _reserve_claimed(self, key: bytes, claim: Claim, intent: JoinIntent
                         ) -> asyncio.Future[Generation]:
        reservation = self.reserve(key, intent)
        entry = self._find_entry(key, reservation)
        assert entry is not None
        self._claims[key] = claim
        self._claimed[key] = entry
        self._spawn(self._keep_claim(key, claim))
        return reservation

    def release(self, key: bytes, reservation: asyncio.Future[Generation]) -> None:
        claimed = self._holds_claim(key, reservation)
        super().release(key, reservation)
        if claimed:
            self._drop_claim(key)

    def remove(self, key: bytes, generation: Generation) -> None:
        claimed = self._holds_claim(key, generation)
        super().remove(key, generation)
        if claimed:
            self._drop_claim(key)

    def _holds_claim(self, key: bytes, target: object) -> bool:
        entry = self._claimed.get(key)
        return entry is not None and entry.target is target

    def _drop_claim(self, key: bytes) -> None:
        self._claimed.pop(key, None)
        claim = self._claims.pop(key, None)
        if claim is not None:
            self._spawn(self._delete_claim(key, claim))

    async def _keep_claim(self, key: bytes, claim: Claim) -> None:
        while self._claims.get(key) is claim:
            await asyncio.sleep(CLAIM_TTL_S / 3)
            if self._claims.get(key) is not claim:
                return
            with contextlib.suppress(redis.RedisError, OSError):
                await self.cluster.expire_if(keys=[self._claim_key(key)],
                                             args=[claim.value(), int(CLAIM_TTL_S * 1000)])

    async def _delete_claim(self, key: bytes, claim: Claim) -> None:
        with contextlib.suppress(redis.RedisError, OSError):
            await self.cluster.delete_if(keys=[self._claim_key(key)], args=[claim.value()])

    async def _current_claim(self, key: bytes) -> Claim | None:
        raw = await self.cluster.r.get(self._claim_key(key))
        if raw is None:
            return None
        data = orjson.loads(raw)
        claim = Claim(str(data["r"]), str(data["s"]), str(data["t"]))
        if claim.replica == self.cluster.replica or not await self.cluster.is_alive(
                claim.replica):
            # Ours but no longer running here, or its replica is gone: stale.
            await self.cluster.delete_if(keys=[self._claim_key(key)], args=[raw])
            log_event(self.log, logging.INFO, "in-flight claim dropped", replica=claim.replica,
                      reason="replica gone" if claim.replica != self.cluster.replica
                      else "not running here")
            return None
        return claim

    def _claim_key(self, key: bytes) -> str:
        return self.cluster.key("inflight", key.hex())

    # -- joining a generation running on another replica ------------------------------------

    async def _join_remote(self, key: bytes, claim: Claim,
                           intent: JoinIntent) -> Generation | object | None:
        """The mirror of the generation running there; ``REFUSED`` when the request is
        no retry of it (the origin decides: only it knows whether its clients left); None
        when it is gone or was not planned."""
        r = self.cluster.r
        watch = self.cluster.key("watch", key.hex())
        await r.set(watch, self.cluster.replica, px=int(WATCH_TTL_S * 1000))
        reply = self.cluster.key("joinreply", self.cluster.token().rsplit("/", 1)[1])
        asked = await r.publish(self.cluster.key("join", claim.replica),
                                orjson.dumps({"k": key.hex(), "s": claim.stream, "j": reply,
                                              **intent.wire()}))
        if not asked:
            return None  # nobody listens there: the replica is gone
        answered: Any = await r.blpop([reply], timeout=REPLICA_TTL_S * 2)
        answer = answered[1] if answered else None
        if answer == b"refused":
            return REFUSED
        reader = StreamReader(self.cluster, claim, watch)
        first = await reader.next() if answer == b"ok" else None
        if first is None or first.get(b"t") != b"started":
            log_event(self.log, logging.INFO, "in-flight claim abandoned",
                      replica=claim.replica, reason="its request was not planned"
                      if first is not None else "replica gone")
            return None
        mirror = Generation(lambda g: _mirror(reader), grace_s=self.grace_s)
        self.entry(key, mirror, intent)
        mirror.on_done(lambda g: InFlight.remove(self, key, g))
        mirror.start()
        log_event(self.log, logging.INFO, "joined in flight on another replica",
                  replica=claim.replica)
        return mirror

    # -- publishing a generation for replicas that join it ---------------------------------

    async def start(self) -> None:
        pubsub = self.cluster.r.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.cluster.key("join", self.cluster.replica))
        self._listener = asyncio.create_task(self._listen(pubsub), name="prefixpin-joins")

    async def aclose(self) -> None:
        tasks = [t for t in (self._listener, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _listen(self, pubsub: Any) -> None:
        try:
            while True:
                try:
                    message = await pubsub.get_message(timeout=5.0)
                except (redis.RedisError, OSError) as exc:
                    log_event(self.log, logging.WARNING, "join channel lost", error=str(exc))
                    await asyncio.sleep(1.0)
                    continue
                if message is None or message.get("type") != "message":
                    continue
                data = orjson.loads(message["data"])
                self._spawn(self._serve_join(bytes.fromhex(data["k"]), str(data["s"]),
                                             str(data["j"]), JoinIntent.from_wire(data)))
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def _serve_join(self, key: bytes, stream: str, reply: str,
                          intent: JoinIntent) -> None:
        """Answer one joiner on its own reply list (``ok``, ``refused`` or ``abandoned``),
        then publish the generation's frames if nobody publishes them yet."""
        claim, entry = self._claims.get(key), self._claimed.get(key)
        generation = None
        if claim is not None and entry is not None and claim.stream == stream:
            generation = await self.joinable_of(entry, intent)
        if generation is None:
            target = entry.target if entry is not None else None
            planned = isinstance(target, Generation) or (
                isinstance(target, asyncio.Future) and not target.cancelled())
            await self._answer_join(reply, "refused" if planned else "abandoned")
            return
        # Published from its first frame, and read there by its own index: kept whole from
        # now on (before this awaits: a long reply lets go of read frames otherwise).
        generation.keep_whole()
        await self._answer_join(reply, "ok")
        if key in self._tapped:
            return  # already publishing: the joiner replays the stream from its start
        self._tapped.add(key)
        try:
            await _tap(self.cluster, generation, stream, self.cluster.key("watch", key.hex()))
        finally:
            self._tapped.discard(key)

    async def _answer_join(self, reply: str, answer: str) -> None:
        async with self.cluster.r.pipeline(transaction=False) as pipe:
            pipe.rpush(reply, answer)
            pipe.expire(reply, int(WATCH_TTL_S))
            await pipe.execute()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log_event(self.log, logging.WARNING, "in-flight task failed", error=repr(exc))


async def _tap(cluster: Cluster, generation: Generation, stream: str, watch: str) -> None:
    """Publish a generation's head, frames and end to its stream, from the first frame. While
    a joining replica watches, this holds a subscription: the generation is not cancelled
    for lack of local clients."""
    r = cluster.r
    subscriber = generation.subscribe()  # (kept whole: ``_serve_join``)
    held, checked = True, time.monotonic()
    position, head_sent = 0, False
    try:
        await r.xadd(stream, {"t": "started"})
        while True:
            changed = generation.changed()
            finished = generation.finished
            batch: list[dict[str, Any]] = []
            if not head_sent and generation.head.done():
                batch.append(_head_fields(generation.head.result()))
                head_sent = True
            if head_sent:
                frames = generation.frames[position:]
                position += len(frames)
                batch += [_frame_fields(f) for f in frames]
                if finished:
                    batch.append(_end_fields(generation))
            if batch:
                async with r.pipeline(transaction=False) as pipe:
                    for fields in batch:
                        pipe.xadd(stream, cast(Any, fields))
                    pipe.expire(stream, int(STREAM_TTL_S))
                    await pipe.execute()
            if finished and head_sent:
                return
            waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(changed.wait())]
            if not head_sent:
                waits.append(generation.head)
            await asyncio.wait(waits, timeout=WATCH_TTL_S / 3,
                               return_when=asyncio.FIRST_COMPLETED)
            waits[0].cancel()
            if held and time.monotonic() - checked > WATCH_TTL_S / 3:
                checked = time.monotonic()
                if not await r.exists(watch):
                    subscriber.close()  # nobody watches from elsewhere any more
                    held = False
    finally:
        subscriber.close()


class StreamReader:
    """Reads a generation's stream from its first entry; raises when the replica running
    it is gone and the stream has no end."""

    def __init__(self, cluster: Cluster, claim: Claim, watch: str) -> None:
        self.cluster = cluster
        self.claim = claim
        self.watch = watch
        self._last = b"0-0"
        self._buffer: deque[dict[bytes, bytes]] = deque()
        self._watched = time.monotonic()
        self._silent_since = time.monotonic()

    async def next(self) -> dict[bytes, bytes] | None:
        """The next entry; None when the origin replica is gone."""
        r = self.cluster.r
        while not self._buffer:
            if time.monotonic() - self._watched > WATCH_TTL_S / 3:
                await r.set(self.watch, self.cluster.replica, px=int(WATCH_TTL_S * 1000))
                self._watched = time.monotonic()
            reply: Any = await r.xread({self.claim.stream: self._last}, count=512,
                                       block=READ_BLOCK_MS)
            if not reply:
                silent = time.monotonic() - self._silent_since
                if silent > REPLICA_TTL_S and not await self.cluster.is_alive(
                        self.claim.replica):
                    return None
                continue
            for entry_id, fields in reply[0][1]:
                self._buffer.append(fields)
                self._last = entry_id
            self._silent_since = time.monotonic()
        return self._buffer.popleft()


@dataclass(slots=True)
class MirrorStream:
    """The origin's response, as the joining replica's generation reads it."""

    reader: StreamReader
    status_code: int
    content_type: str | None = None

    @property
    def pusher(self) -> None:
        return None  # read from Redis by a task: nothing pushes its frames

    async def aread_error(self) -> bytes:
        return b""

    async def aiter_frames(self) -> AsyncIterator[Frame]:
        while True:
            fields = await self.reader.next()
            if fields is None:
                raise _origin_gone(self.reader.claim)
            kind = fields.get(b"t")
            if kind == b"f":
                yield _frame_of(fields)
            elif kind == b"end":
                if fields.get(b"ok") != b"1":
                    raise _error_of(fields)
                return


@asynccontextmanager
async def _mirror(reader: StreamReader) -> AsyncIterator[MirrorStream]:
    while True:
        fields = await reader.next()
        if fields is None:
            raise _origin_gone(reader.claim)
        if fields.get(b"t") == b"head":
            break
    if fields.get(b"error"):
        raise _error_of(fields)
    yield MirrorStream(reader, int(fields[b"status"]))


def _origin_gone(claim: Claim) -> ProxyError:
    return UpstreamUnavailableError(f"replica {claim.replica}, which ran this generation, "
                                    "stopped: retry the request")


def _head_fields(head: Head) -> dict[str, Any]:
    fields: dict[str, Any] = {"t": "head", "status": head.status_code}
    if head.error is not None:
        fields.update(_error_fields(head.error))
    return fields


def _end_fields(generation: Generation) -> dict[str, Any]:
    if generation.completed:
        return {"t": "end", "ok": "1"}
    error = generation.error or GenerationCancelledError("generation ended without an answer")
    return {"t": "end", "ok": "0", **_error_fields(error)}


def _error_fields(error: ProxyError) -> dict[str, Any]:
    fields: dict[str, Any] = {"error": error.message or "error", "cls": type(error).__name__,
                              "status": error.status_code, "etype": error.error_type,
                              "code": error.code or ""}
    if isinstance(error, UpstreamStatusError):
        fields.update(body=error.raw_body, ctype=error.content_type or "")
    return fields


def _error_of(fields: Mapping[bytes, bytes]) -> ProxyError:
    status = int(fields.get(b"status") or 502)
    if fields.get(b"cls") == b"UpstreamStatusError":
        ctype = (fields.get(b"ctype") or b"").decode() or None
        return UpstreamStatusError(status, fields.get(b"body") or b"", ctype)
    error = ProxyError((fields.get(b"error") or b"error").decode())
    error.status_code = status
    error.error_type = (fields.get(b"etype") or b"server_error").decode()
    error.code = (fields.get(b"code") or b"").decode() or None
    return error


def _frame_fields(frame: Frame) -> dict[str, Any]:
    fields: dict[str, Any] = {"t": "f", "k": frame.kind.value, "r": frame.raw,
                              "o": "1" if frame.has_output else ""}
    if frame.data is not None:
        fields["d"] = orjson.dumps(frame.data)
    if frame.progress is not None:
        p = frame.progress
        fields["p"] = orjson.dumps([p.total, p.cache, p.processed, p.time_ms])
    return fields


def _frame_of(fields: Mapping[bytes, bytes]) -> Frame:
    data = orjson.loads(fields[b"d"]) if b"d" in fields else None
    progress = Progress(*orjson.loads(fields[b"p"])) if b"p" in fields else None
    return Frame(FrameKind(fields[b"k"].decode()), fields.get(b"r") or b"", data, progress,
                 fields.get(b"o") == b"1")

"""The manager: parks evicted sessions, restores returning ones, keeps the index in budget.

``park`` is the slot pool's ``on_evict``: it saves the slot under a random ``pp-….bin``
name, checks the file, and writes the record (owner: the evicted session, which may have
been committed by another replica: it is read through the shared session table then).
``restore`` runs before a session's request goes to a slot that does not hold it;
``lookup`` finds a parked history no live session owns (what a restart left behind).

A manager serves one lane (engine). It restores, budgets and sweeps only records whose file
is in its directory (the record's scope): with per-engine save directories, the records its
own engine wrote; with one directory every engine shares (``--park-shared``), any record of
the same model. A record from another lane's directory is skipped with a logged reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixpin.adapters.base import Adapter, EngineInfo
from prefixpin.core.errors import ProxyError
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.parking.anchor import (
    CONTENDED_WITHIN_S,
    Anchorer,
    prompt_opening,
    prompt_tokens,
    when_idle,
)
from prefixpin.proxy.parking.index import ParkIndexStore, ParkRecord, scope_of
from prefixpin.proxy.parking.limits import EngineLimits
from prefixpin.proxy.parking.renderings import Conversation
from prefixpin.proxy.parking.slotfile import (
    PARK_PREFIX,
    SlotFileError,
    age_of,
    file_digest,
    free_bytes,
    read_slot_tokens,
    size_of,
    stat_identity,
    tokens_digest,
    unlink,
)
from prefixpin.proxy.parking.snapshot import Book, Speeds, Verdict, judge
from prefixpin.proxy.session.history import Committed, decide
from prefixpin.proxy.session.placement import Eviction, SlotEntry, SlotPool
from prefixpin.proxy.session.sessions import Session, SessionStore
from prefixpin.proxy.session.tokens import common_prefix

EXIT_PARK_TIMEOUT_S = 30.0
SESSION_NOTES = 4096  # per-session notes kept (the session store's default bound)
NOT_REUSED_LIMIT = 2  # restores in a row the engine re-processed before parking pauses
DISK_HEADROOM = 1.1  # free space wanted before a save, over the estimated file size
# A replicated index: another replica may have saved a file it has not recorded yet, so the
# start-up sweep leaves unrecorded files younger than this alone.
ORPHAN_MIN_AGE_S = 600.0
# Parking ahead (once the slot idles: ``anchor.when_idle``), only while its engine is short
# of slots: a slot changed hands within this long.
PARK_AHEAD_WITHIN_S = CONTENDED_WITHIN_S

Resolver = Callable[[str], Awaitable[Session | None]]


@dataclass(frozen=True, slots=True)
class ParkConfig:
    files_dir: Path  # the engine's --slot-save-path, as this proxy sees it
    max_bytes: int
    min_tokens: int
    verify_content: bool
    # Save a slot after its turn, while the engine is idle, when it is likely to be evicted
    # next: the eviction then finds its file current and costs the next request nothing.
    park_ahead: bool = False


@dataclass(frozen=True, slots=True)
class RestoreResult:
    outcome: str  # restored | diverged | other_model | other_lane | missing | truncated |
    #               mismatched | corrupted | failed | not_parked
    note: str
    tokens: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome == "restored"


def random_filename() -> str:
    return f"{PARK_PREFIX}{secrets.token_hex(10)}.bin"


_PARK_NAME = re.compile(rf"{re.escape(PARK_PREFIX)}[0-9a-f]{{1,64}}\.bin")


def is_park_filename(name: str) -> bool:
    """A name parking itself writes (``random_filename``): nothing else is ever deleted,
    restored or read, whatever an index row (sqlite or Redis, either writable by others)
    says."""
    return _PARK_NAME.fullmatch(name) is not None


def park_path(files_dir: Path, name: str) -> Path | None:
    """The park file ``name`` in ``files_dir``; None for a name parking never writes."""
    return files_dir / name if is_park_filename(name) else None


class ParkManager:
    """Parks evicted sessions, restores returning ones, keeps the index within budget."""

    def __init__(self, index: ParkIndexStore, config: ParkConfig, adapter: Adapter,
                 store: SessionStore, metrics: Metrics, logger: logging.Logger, *, model: str,
                 lane: str = "", shared: bool = False, limits: EngineLimits | None = None,
                 filenames: Callable[[], str] = random_filename,
                 resolve: Resolver | None = None, anchorer: Anchorer | None = None) -> None:
        self.index = index
        self.config = config
        self.adapter = adapter
        self.store = store
        self.metrics = metrics
        self.log = logger
        self.model = model
        self.lane = lane  # the engine this manager parks for (its lane label)
        self.shared = shared  # its save directory is the one every engine shares
        self.scope = scope_of(lane, shared)
        self.limits = limits or EngineLimits()
        self.filenames = filenames
        # A session id -> the session, read through the shared session table when another
        # replica committed it (None: this replica's store only).
        self.resolve = resolve
        # Anchors a slot before it is parked ahead (recurrent/hybrid memory): None elsewhere.
        self.anchorer = anchorer
        self.suspended: str | None = None  # why parking is paused (engine lost its save path)
        self._unparked: dict[str, str] = {}  # session id -> why it has no file
        self._bytes_per_token: float | None = None
        self._restored: dict[str, int] = {}  # session id -> tokens restored, until its commit
        self._late_commit: dict[str, str] = {}  # session id -> park id awaiting its commit
        self._not_reused = 0  # restores in a row the engine re-processed anyway
        # Park file name -> its stat identity when this process hashed it: a restore of a file
        # with that identity still is not written since (any write moves its ctime).
        self._hashed: dict[str, tuple[int, ...]] = {}
        self._ahead: set[asyncio.Task[None]] = set()  # parks ahead under way
        self.snapshots = Book(SESSION_NOTES)  # each session's prompt-end snapshot
        self.speeds = Speeds()  # the engine's prefill and the park disk, as measured
        self._update_gauges()

    # -- eviction: save ---------------------------------------------------------------

    async def park(self, eviction: Eviction,
                   held: Callable[[], Awaitable[bool]] | None = None) -> None:
        """SlotPool's ``on_evict``: save the slot before it changes hands. Never raises.
        ``held``: for a slot saved without a lease (at shutdown, a slot table other replicas
        share), whether the slot still held the session once the save was done."""
        await self._save(eviction, held)

    async def _save(self, eviction: Eviction,
                    held: Callable[[], Awaitable[bool]] | None = None) -> ParkRecord | None:
        """``park``: the record that now holds what the slot held (the new file, or the
        current one when nothing changed since it), None when the slot was not parked."""
        session = await self._session_of(eviction.session_id)
        if session is None or session.committed is None:
            return None
        skip = self._not_worth(session)
        if skip is not None:
            outcome, reason = skip
            self._skipped(session, eviction.slot, outcome, reason, logging.DEBUG)
            return None
        try:
            current = self._current(session)
            if (current is not None and current.scope == self.scope
                    and eviction.tokens == current.n_tokens
                    and _same_history(current.committed, session.committed)):
                # The slot holds what the file holds (restored, nothing committed since).
                self.metrics.parks.labels("unchanged").inc()
                self.index.touch(current.park_id, time.time())
                return current
        except self.index.errors as exc:
            self._skipped(session, eviction.slot, "failed", f"park index: {exc}",
                          logging.WARNING)
            return None
        eviction = await self._anchored(eviction)
        started = time.monotonic()
        filename = self.filenames()
        try:
            result = await self.adapter.save_slot(eviction.slot, filename)
        except ProxyError as exc:
            self._skipped(session, eviction.slot, "failed", f"save failed: {exc.message}",
                          logging.WARNING)
            return None
        self.speeds.saw_save(result.n_bytes, time.monotonic() - started)
        path = self.config.files_dir / filename
        if held is not None and not await held():
            await asyncio.to_thread(unlink, path)  # perhaps another session's state
            self._skipped(session, eviction.slot, "changed", "another replica gave the slot "
                          "to another session while it was saved", logging.INFO)
            return None
        try:
            record = await self._checked_record(session, path, result.n_tokens, result.n_bytes)
        except SlotFileError as exc:
            await asyncio.to_thread(unlink, path)
            self._skipped(session, eviction.slot, "failed", f"saved file unusable: {exc.reason}",
                          logging.WARNING)
            return None
        if record.n_tokens < session.prompt_tokens:
            await asyncio.to_thread(unlink, path)
            self._skipped(session, eviction.slot, "empty",
                          f"the slot held {record.n_tokens} tokens, fewer than the session's "
                          f"{session.prompt_tokens}: the engine emptied it", logging.WARNING)
            return None
        try:
            self._adopt_new(session, record)
        except self.index.errors as exc:
            await asyncio.to_thread(unlink, path)
            self._skipped(session, eviction.slot, "failed", f"park index: {exc}",
                          logging.WARNING)
            return None
        # The slot can hold a turn whose commit has not run yet (the slot is free once the
        # engine's answer is read; the commit follows): the file then holds more than the
        # committed history says, and that turn's commit brings the record up to date. A
        # park ahead follows its turn's commit, so none is pending there.
        late = eviction.reason != "ahead" and record.n_tokens > eviction.tokens
        if late:
            _bounded_set(self._late_commit, session.id, record.park_id)
        seconds = time.monotonic() - started
        self.metrics.parks.labels("parked").inc()
        self.metrics.park_seconds.observe(seconds)
        log_event(self.log, logging.INFO, "parked", session=session.id, slot=eviction.slot,
                  reason=eviction.reason, tokens=record.n_tokens, bytes=record.size,
                  file=record.filename, lane=self.lane, ms=round(seconds * 1000, 1),
                  awaiting_commit=late)
        try:
            await self._enforce_budget(keep=record.park_id)
        except self.index.errors as exc:
            log_event(self.log, logging.WARNING, "park budget not applied", error=str(exc))
        return record

    async def _anchored(self, eviction: Eviction) -> Eviction:
        """The slot anchored before it is saved, when its session's turn left it as
        generated (recurrent/hybrid memory: the turn that evicts it came before the slot
        idled): a few tokens on the evicting request's path, which the session's return
        would otherwise pay with its whole prompt. The slot is the evicting lease's here."""
        anchorer = self.anchorer
        if anchorer is None or not anchorer.unanchored_turn(eviction.slot, eviction.session_id,
                                                            eviction.tokens):
            return eviction
        if self.limits.exact_extension_only:
            rolled_back = await self._take_snapshot(eviction.slot, eviction.session_id)
            if rolled_back is not None:
                eviction = dataclasses.replace(eviction, tokens=rolled_back)
        held = await anchorer.anchor(eviction.slot, eviction.session_id)
        return dataclasses.replace(eviction, tokens=held) if held is not None else eviction

    def park_ahead(self, pool: SlotPool, slot: int, session_id: str) -> None:
        """After a session's turn on an engine short of slots, once its slot stays idle:
        on memory that cannot roll back, anchor it (``Anchorer.anchor``), and save it, so
        that its eviction by the next session's request finds the file current (``park``'s
        unchanged case) instead of saving on that request's path. Nothing while every
        session keeps its slot: there the engine's own checkpoints cover the next request,
        and an anchor would have the engine render the whole conversation after every turn.
        Never for a slot table replicas share (its copy here may be stale)."""
        if (self.suspended is not None or _shared_table(pool) is not None
                or not pool.contended(PARK_AHEAD_WITHIN_S)):
            return
        save = self.config.park_ahead
        if not (save or self.anchorer is not None):
            return

        async def work(entry: SlotEntry) -> None:
            await self._park_ahead(entry, slot, session_id, save=save)

        task = asyncio.get_running_loop().create_task(
            when_idle(pool, slot, session_id, work), name=f"prefixpin-park-ahead-{slot}")
        self._ahead.add(task)
        task.add_done_callback(self._ahead.discard)

    async def _park_ahead(self, entry: SlotEntry, slot: int, session_id: str, *,
                          save: bool) -> None:
        if self.anchorer is not None:
            if save and self.limits.exact_extension_only:
                rolled_back = await self._take_snapshot(slot, session_id)
                entry.tokens = rolled_back if rolled_back is not None else entry.tokens
            anchored = await self.anchorer.anchor(slot, session_id)
            if anchored is not None:
                entry.tokens = anchored
        if save and self._fits_ahead(session_id, entry.tokens):
            record = await self._save(
                Eviction(slot, session_id, entry.kind, entry.tokens, "ahead"))
            if record is not None:
                # The slot holds exactly what the file holds (it stayed busy while
                # saved): the file's count, which the unchanged case compares at the
                # eviction, where the pool had its estimate.
                entry.tokens = record.n_tokens

    def _fits_ahead(self, session_id: str, tokens: int) -> bool:
        """A file parked ahead is a spare copy of a history the slot still holds: it never
        pushes another session's file (perhaps its only copy) out of the disk budget."""
        estimate = self._estimate_bytes(tokens)
        session = self.store.get(session_id)
        if estimate is None or session is None:
            return False  # (no park measured a file's size yet)
        try:
            current = self._current(session)
            replaced = current.size if current is not None and current.scope == self.scope else 0
            total = self.index.total_bytes(self.scope)
        except self.index.errors:
            return False
        return total - replaced + estimate <= self.config.max_bytes

    def _texts(self, session_id: str) -> Conversation | None:
        """The session's renderings, windowed and tokenized past what its last one shares
        (the anchorer keeps them); None without anchoring (each is whole)."""
        return self.anchorer.renderings.of(session_id) if self.anchorer is not None else None

    async def _session_of(self, session_id: str) -> Session | None:
        if self.resolve is not None:
            return await self.resolve(session_id)
        return self.store.get(session_id)

    def _not_worth(self, session: Session) -> tuple[str, str] | None:
        if self.suspended is not None:
            return "off", self.suspended
        if session.prompt_tokens < self.config.min_tokens:
            return "small", (f"{session.prompt_tokens} tokens, under --park-min-tokens "
                             f"{self.config.min_tokens}")
        estimate = self._estimate_bytes(session.prompt_tokens)
        if estimate is not None and estimate > self.config.max_bytes:
            return "budget", (f"about {estimate} bytes, over the whole --park-max-bytes "
                              f"{self.config.max_bytes}")
        if estimate is not None:
            free = free_bytes(self.config.files_dir)
            if free is not None and free < estimate * DISK_HEADROOM:
                return "disk_full", f"{free} bytes free on the park disk, about {estimate} needed"
        return None

    async def _checked_record(self, session: Session, path: Path, n_tokens: int,
                              n_bytes: int) -> ParkRecord:
        size = await asyncio.to_thread(size_of, path)
        if size is None:
            raise SlotFileError("missing", f"the engine wrote {path.name}, but it is not in "
                                           f"{self.config.files_dir} (--park-dir must be the "
                                           "engine's --slot-save-path as this proxy sees it)")
        if size != n_bytes:
            raise SlotFileError("truncated", f"{size} bytes on disk, the engine wrote {n_bytes}")
        tokens = await asyncio.to_thread(read_slot_tokens, path)
        if len(tokens) != n_tokens:
            raise SlotFileError("mismatched", f"{len(tokens)} tokens in the file, the engine "
                                              f"saved {n_tokens}")
        content = (await asyncio.to_thread(self._hash_file, path)
                   if self.config.verify_content else None)
        committed = session.committed
        assert committed is not None
        now = time.time()
        return ParkRecord(
            park_id=secrets.token_hex(8), namespace=session.namespace, key=session.key,
            kind=session.kind, committed=committed, prompt_tokens=session.prompt_tokens,
            n_tokens=len(tokens), filename=path.name, size=size,
            tokens_digest=tokens_digest(tokens), content_digest=content, model=self.model,
            created=now, last_use=now, lane=self.lane, shared=self.shared, owner=session.id)

    def _hash_file(self, path: Path) -> bytes:
        """The file's content digest, and its stat identity noted when it did not change
        while it was read (blocking: run it in a thread)."""
        before = stat_identity(path)
        digest = file_digest(path)
        if before is not None and stat_identity(path) == before:
            _bounded_set(self._hashed, path.name, before)
        return digest

    def _adopt_new(self, session: Session, record: ParkRecord) -> None:
        previous = self._current(session)
        self.index.insert(record)  # the session owns the new file from now on
        self._unparked.pop(session.id, None)
        if record.n_tokens:
            self._bytes_per_token = record.size / record.n_tokens
        if previous is not None and previous.scope == self.scope:
            # (a file in another lane's directory stays there, ownerless: that lane's
            # manager may still revive it, and its budget removes it in time)
            self._remove(previous, "replaced")
        self._update_gauges()

    def _skipped(self, session: Session, slot: int, outcome: str, reason: str,
                 level: int) -> None:
        self.metrics.parks.labels(outcome).inc()
        _bounded_set(self._unparked, session.id,
                     f"not parked when evicted from slot {slot}: {reason}")
        log_event(self.log, level, "park skipped", session=session.id, slot=slot,
                  outcome=outcome, reason=reason)

    # -- return: restore --------------------------------------------------------------

    async def restore(self, session: Session, body: Mapping[str, Any],
                      slot: int) -> RestoreResult | None:
        """Before a session's request goes to a slot that does not hold it: restore its
        parked file if the request extends (or resends) exactly what the file holds.
        None when there is nothing to say (the session was never parked)."""
        try:
            record = self._current(session)
        except self.index.errors as exc:
            self.metrics.restores.labels("failed").inc()
            log_event(self.log, logging.WARNING, "restore skipped", session=session.id,
                      reason=f"park index: {exc}")
            return RestoreResult("failed", f"not restored: park index unreachable ({exc})")
        if record is None:
            why = self._unparked.pop(session.id, None)
            return RestoreResult("not_parked", why) if why else None
        if self.suspended is not None:
            return RestoreResult("not_parked", f"parking paused: {self.suspended}")
        if record.scope != self.scope:
            return self._declined(session, record, "other_lane", self._elsewhere(record),
                                  level=logging.INFO)
        verdict = decide(record.committed, body)
        if not verdict.resumable:
            return self._declined(session, record, "diverged",
                                  f"the request does not extend the parked history "
                                  f"({verdict.reason()})", level=logging.INFO)
        if record.model != self.model:
            return self._declined(session, record, "other_model",
                                  f"parked under model {record.model}, the engine runs "
                                  f"{self.model}", level=logging.INFO)
        started = time.monotonic()
        path = park_path(self.config.files_dir, record.filename)
        if path is None:
            self._remove_quietly(record, "invalid")
            return self._declined(session, record, "mismatched",
                                  "the index names a file parking never writes",
                                  level=logging.WARNING)
        try:
            tokens = await asyncio.to_thread(_check_file, path, record,
                                             self.config.verify_content,
                                             self._hashed.get(record.filename))
        except SlotFileError as fault:
            self._remove_quietly(record, "invalid")
            return self._declined(session, record, fault.fault, fault.reason,
                                  level=logging.WARNING)
        if self.limits.exact_extension_only:
            extended = await self._extended_by(session, body, record, tokens)
            if isinstance(extended, str):
                return self._declined(session, record, "diverged", extended,
                                      level=logging.INFO)
            record = extended
        from_snapshot = self.snapshots.holds(record.park_id)
        try:
            result = await self.adapter.restore_slot(slot, record.filename)
        except ProxyError as exc:
            self._remove_quietly(record, "invalid")
            return self._declined(session, record, "failed", f"restore failed: {exc.message}",
                                  level=logging.WARNING)
        if result.n_tokens != record.n_tokens:
            # The engine validated the tokens it loaded, and its KV matches them: the reuse
            # is still right, only less than planned. Say so and drop the record.
            self._remove_quietly(record, "invalid")
            return self._declined(session, record, "mismatched",
                                  f"the engine restored {result.n_tokens} tokens, the file "
                                  f"held {record.n_tokens}", level=logging.WARNING)
        seconds = time.monotonic() - started
        with contextlib.suppress(*self.index.errors):
            self.index.touch(record.park_id, time.time())
        _bounded_set(self._restored, session.id, result.n_tokens)
        self.metrics.restores.labels("restored").inc()
        self.metrics.restore_seconds.observe(seconds)
        if from_snapshot:
            self.metrics.snapshots.labels("restored").inc()
        note = f"restored {result.n_tokens} tokens in {seconds * 1000:.0f} ms"
        log_event(self.log, logging.INFO, "restored", session=session.id, slot=slot,
                  tokens=result.n_tokens, bytes=record.size, file=record.filename,
                  lane=self.lane, ms=round(seconds * 1000, 1), engine_ms=round(result.ms, 1),
                  snapshot=from_snapshot)
        return RestoreResult("restored", note, result.n_tokens, seconds)

    def _elsewhere(self, record: ParkRecord) -> str:
        """Why a record in another directory is not restored by this lane's engine."""
        if record.shared:
            return (f"parked by {record.lane} in the shared park directory; this lane "
                    f"({self.lane}) parks in its engine's own save directory (--park-shared "
                    "is off here)")
        if self.shared:
            return (f"parked by {record.lane} in that engine's own save directory; this lane "
                    f"({self.lane}) parks in the shared directory")
        return (f"parked by {record.lane}, whose save directory this lane's engine "
                f"({self.lane}) does not read (per-engine save directories; --park-shared "
                "when every engine saves to one directory)")

    async def _extended_by(self, session: Session, body: Mapping[str, Any],
                           record: ParkRecord, held: list[int]) -> ParkRecord | str:
        """The longest parked state the request's prompt extends (the engine would
        re-process anything else: no checkpoint survives a restore): the anchored file
        ``record`` holding ``held``, else the session's prompt-end snapshot; else why not."""
        texts = self._texts(session.id)
        try:
            prompt = await prompt_tokens(self.adapter, body, texts)
        except ProxyError as exc:
            return f"cannot compare the request's tokens with the file's ({exc.message})"
        if prompt is None:
            return "the request's prompt is not text: its tokens cannot be compared"
        if texts is not None:
            texts.keep()
        if _extends(prompt, held):
            return record
        snapshot = await self._snapshot_extended(session, body, prompt)
        if snapshot is not None:
            return snapshot
        return (f"the request's tokens leave the parked ones at token "
                f"{common_prefix(prompt, held)} of {len(held)}; with {self.limits.memory} "
                "a restored slot would be re-processed from the start")

    def _declined(self, session: Session, record: ParkRecord, outcome: str, reason: str, *,
                  level: int) -> RestoreResult:
        self.metrics.restores.labels(outcome).inc()
        log_event(self.log, level, "restore declined", session=session.id,
                  file=record.filename, outcome=outcome, reason=f"{reason}; re-prefilling")
        return RestoreResult(outcome, f"not restored: {reason}")

    # -- the index as a session directory ---------------------------------------------

    def lookup(self, namespace: str, key: str | None, body: Mapping[str, Any],
               digests: Sequence[bytes]) -> ParkRecord | None:
        """A parked history no live session owns whose committed history the request
        repeats exactly as its prefix (longest first): what a proxy restart left behind.
        Only records whose file this lane's engine can restore (its directory)."""
        best: ParkRecord | None = None
        if self.suspended is not None:
            return None
        try:
            records = self.index.under(namespace, key)
        except self.index.errors as exc:
            log_event(self.log, logging.WARNING, "park index unreachable", error=str(exc))
            return None
        for record in records:
            if record.model != self.model or self._owned_by_live(record):
                continue
            committed = record.committed
            if committed.prompt is None and not _digest_prefix(committed.digests, digests):
                continue
            if not decide(committed, body, digests).resumable:
                continue
            if record.scope != self.scope:
                log_event(self.log, logging.INFO, "parked history not revived",
                          file=record.filename, key=key, reason=self._elsewhere(record))
                continue
            if best is None or len(committed.digests) > len(best.committed.digests):
                best = record
        return best

    def adopt(self, session_id: str, record: ParkRecord) -> None:
        """``session_id`` now owns ``record`` (a session rebuilt from it)."""
        self.index.set_owner(record.park_id, session_id)

    def revived(self, session: Session, record: ParkRecord) -> None:
        """A session rebuilt from the index (no live session had this history)."""
        try:
            self.adopt(session.id, record)
        except self.index.errors as exc:
            log_event(self.log, logging.WARNING, "park owner not recorded", session=session.id,
                      file=record.filename, error=str(exc))
        self.metrics.park_revivals.inc()
        log_event(self.log, logging.INFO, "revived from the park index", session=session.id,
                  key=session.key, messages=len(record.committed.messages),
                  tokens=record.n_tokens, file=record.filename)

    def touch(self, session_id: str) -> None:
        """A committed turn (synchronous: the commit hook): the session's parked file stays
        recent for the LRU budget, and a restore is judged by what the engine reused."""
        session = self.store.get(session_id)
        late = self._late_commit.pop(session_id, None)
        try:
            record = self._current(session) if session is not None else None
            if session is not None and record is not None:
                self.index.touch(record.park_id, time.time())
                if late == record.park_id:
                    self._catch_up(session, record)
        except self.index.errors as exc:
            log_event(self.log, logging.WARNING, "park not touched", session=session_id,
                      error=str(exc))
        if session is not None and session.turns:
            turn = session.turns[-1]
            self.speeds.saw_turn(turn.prompt_tokens, turn.cached_tokens,
                                 turn.prefill_ms or turn.ttft_ms)
        restored = self._restored.pop(session_id, None)
        if restored is not None and session is not None and session.turns:
            self._judge_reuse(session, restored, session.turns[-1].cached_tokens)

    def forget(self, session_id: str) -> None:
        """The client ended ``session_id``: its parked file, if any, is removed with its
        record (reason "final"), never to be restored or revived."""
        self._unparked.pop(session_id, None)
        self._restored.pop(session_id, None)
        self._late_commit.pop(session_id, None)
        if self.anchorer is not None:
            self.anchorer.renderings.forget(session_id)
        snapshot = self.snapshots.forget(session_id)
        try:
            record = self.index.owned_by(session_id)
            if record is not None:
                self._remove(record, "final")
            snapshot_record = self.index.get(snapshot) if snapshot is not None else None
            if snapshot_record is not None:
                self._remove(snapshot_record, "final")
        except self.index.errors as exc:
            log_event(self.log, logging.WARNING, "park not removed", session=session_id,
                      reason="final", error=str(exc))

    def _catch_up(self, session: Session, record: ParkRecord) -> None:
        """The turn the parked file already holds has committed: the record takes its
        history (the file holds at least that prompt, so the history is still a prefix)."""
        if session.committed is None:
            return
        if session.prompt_tokens > record.n_tokens:
            return  # the file holds less than this commit's prompt: keep the older history
        self.index.update_history(record.park_id, session.committed, session.prompt_tokens)
        log_event(self.log, logging.DEBUG, "park caught up", session=session.id,
                  file=record.filename, messages=len(session.committed.messages))

    def _judge_reuse(self, session: Session, restored: int, cached: int | None) -> None:
        """An engine that re-processes restored slots (a sliding-window model without
        --swa-full, whose flags this proxy could not read) makes every park a waste: after
        two such restores in a row, parking pauses and says why."""
        if cached is None:
            return
        if cached * 100 >= restored:
            self._not_reused = 0
            return
        self._not_reused += 1
        self.metrics.restores.labels("not_reused").inc()
        log_event(self.log, logging.WARNING, "restore not reused", session=session.id,
                  restored=restored, cached=cached)
        if self._not_reused >= NOT_REUSED_LIMIT and self.suspended is None:
            self.suspended = (f"the engine re-processed {self._not_reused} restored slots in a "
                              "row (sliding-window model without --swa-full?)")
            log_event(self.log, logging.WARNING, "parking paused", reason=self.suspended)

    def parked_view(self) -> dict[str, Any]:
        view: dict[str, Any] = {
            "on": self.suspended is None, "paused": self.suspended, "lane": self.lane,
            "shared_dir": self.shared, "dir": str(self.config.files_dir),
            "budget_bytes": self.config.max_bytes, "limits": self.limits.notes()}
        try:
            records = self.index.oldest_first(self.scope)
        except self.index.errors as exc:
            return {**view, "bytes": None, "files": None, "parked": [], "error": str(exc)}
        return {
            **view, "bytes": sum(r.size for r in records), "files": len(records),
            "parked": [{"session": r.owner, "key": r.key, "namespace": r.namespace,
                        "kind": r.kind, "tokens": r.n_tokens, "lane": r.lane,
                        "messages": len(r.committed.messages), "bytes": r.size,
                        "last_use": round(r.last_use, 3)} for r in reversed(records)],
        }

    # -- prompt-end snapshots (recurrent/hybrid memory: see ``snapshot``) -----------------

    async def _take_snapshot(self, slot: int, session_id: str) -> int | None:
        """Roll ``slot`` (held, its session's last turn in it) back to where that turn's
        reply starts, and save it beside the anchored file, when ``snapshot.judge`` says
        it pays. The tokens the slot holds once rolled back (the anchor that follows
        extends them again); None when it was left as it was."""
        session = await self._session_of(session_id)
        if session is None or session.committed is None or session.committed.body is None:
            return None
        texts = self._texts(session.id)
        try:
            rendered = await prompt_opening(self.adapter, session.committed.body, texts)
        except ProxyError as exc:
            self._snapshot_skipped(session, "failed", f"prompt not rendered: {exc.message}")
            return None
        if rendered is None:
            return None
        if texts is not None:
            texts.keep()
        prompt, opening = rendered
        current = self._snapshot_holding(session, opening)
        if current is not None:  # a regenerate: the same prompt, restored from it
            self.metrics.snapshots.labels("kept").inc()
            return await self._rolled_back_to(slot, current)
        verdict = self._snapshot_verdict(session, len(prompt), len(opening))
        if not verdict.take:
            self._snapshot_skipped(session, "skipped", verdict.rule)
            return None
        started = time.monotonic()
        record = await self._saved_snapshot(session, slot, opening)
        if record is None:
            return len(opening)  # rolled back, not saved
        seconds = time.monotonic() - started
        self.metrics.snapshots.labels("taken").inc()
        log_event(self.log, logging.INFO, "snapshot taken", session=session.id, slot=slot,
                  tokens=record.n_tokens, prompt=len(prompt), bytes=record.size,
                  file=record.filename, lane=self.lane, ms=round(seconds * 1000, 1),
                  rule=verdict.rule)
        return record.n_tokens

    async def _saved_snapshot(self, session: Session, slot: int,
                              opening: list[int]) -> ParkRecord | None:
        """The slot rolled back to ``opening`` (the engine resumes from its checkpoint
        near the prompt's end), saved, checked and recorded as the session's snapshot."""
        filename = self.filenames()
        try:
            await self.adapter.prefill(slot, opening)
            saving = time.monotonic()
            result = await self.adapter.save_slot(slot, filename)
            self.speeds.saw_save(result.n_bytes, time.monotonic() - saving)
        except ProxyError as exc:
            self._snapshot_skipped(session, "failed", exc.message)
            return None
        path = self.config.files_dir / filename
        try:
            record = await self._checked_record(session, path, result.n_tokens, result.n_bytes)
            if record.n_tokens != len(opening):
                raise SlotFileError("mismatched", f"the slot held {record.n_tokens} tokens, "
                                                  f"the prompt's opening {len(opening)}")
        except SlotFileError as exc:
            await asyncio.to_thread(unlink, path)
            self._snapshot_skipped(session, "failed", exc.reason)
            return None
        record = dataclasses.replace(record, owner=None)  # its session owns its anchored file
        try:
            self.index.insert(record)
            previous = self.snapshots.note(session.id, record.park_id)
            replaced = self.index.get(previous) if previous is not None else None
            if replaced is not None:
                self._remove(replaced, "replaced")
            await self._enforce_budget(keep=record.park_id)
        except self.index.errors as exc:
            self._snapshot_skipped(session, "failed", f"park index: {exc}")
            return None
        return record

    def _snapshot_holding(self, session: Session, opening: list[int]) -> ParkRecord | None:
        """The session's snapshot, when it holds ``opening`` already (it was restored for
        a regenerate, whose turn ends where the last one did)."""
        snapshot = self._snapshot_record(session)
        if (snapshot is not None and snapshot.n_tokens == len(opening)
                and snapshot.tokens_digest == tokens_digest(opening)):
            return snapshot
        return None

    async def _rolled_back_to(self, slot: int, snapshot: ParkRecord) -> int | None:
        """The slot rolled back by restoring ``snapshot`` (a turn that prefilled only the
        few tokens after it left the engine no checkpoint to roll back to: a prefill would
        re-read the whole prompt); the tokens it then holds, None if not restored."""
        path = park_path(self.config.files_dir, snapshot.filename)
        if path is None:
            return None
        try:
            await asyncio.to_thread(_check_file, path, snapshot, self.config.verify_content,
                                    self._hashed.get(snapshot.filename))
            return (await self.adapter.restore_slot(slot, snapshot.filename)).n_tokens
        except SlotFileError as fault:
            self._remove_quietly(snapshot, "invalid")
            log_event(self.log, logging.WARNING, "snapshot unusable", file=snapshot.filename,
                      reason=fault.reason)
        except ProxyError as exc:
            log_event(self.log, logging.WARNING, "snapshot not restored",
                      file=snapshot.filename, error=exc.message)
        return None

    def _snapshot_verdict(self, session: Session, prompt: int, opening: int) -> Verdict:
        estimate = self._estimate_bytes(opening)
        try:
            current = self._snapshot_record(session)
            total = self.index.total_bytes(self.scope)
        except self.index.errors as exc:
            return Verdict(False, f"park index: {exc}")
        replaced = current.size if current is not None else 0
        fits = estimate is None or total - replaced + estimate <= self.config.max_bytes
        cached = session.turns[-1].cached_tokens if session.turns else None
        return judge(prompt=prompt, opening=opening, cached=cached, estimate_bytes=estimate,
                     fits=fits, speeds=self.speeds)

    def _snapshot_record(self, session: Session) -> ParkRecord | None:
        """The session's snapshot, while its record is in this lane's directory."""
        park_id = self.snapshots.of(session.id)
        record = self.index.get(park_id) if park_id is not None else None
        if record is None or record.scope != self.scope or record.model != self.model:
            return None
        return record

    async def _snapshot_extended(self, session: Session, body: Mapping[str, Any],
                                 prompt: list[int]) -> ParkRecord | None:
        """The session's snapshot when the request's prompt extends it (checked on disk
        as the anchored file is)."""
        try:
            snapshot = self._snapshot_record(session)
        except self.index.errors:
            return None
        if snapshot is None or not decide(snapshot.committed, body).resumable:
            return None
        path = park_path(self.config.files_dir, snapshot.filename)
        if path is None:
            return None
        try:
            held = await asyncio.to_thread(_check_file, path, snapshot,
                                           self.config.verify_content,
                                           self._hashed.get(snapshot.filename))
        except SlotFileError as fault:
            self._remove_quietly(snapshot, "invalid")
            log_event(self.log, logging.WARNING, "snapshot unusable", session=session.id,
                      file=snapshot.filename, reason=fault.reason)
            return None
        return snapshot if _extends(prompt, held) else None

    def _snapshot_skipped(self, session: Session, outcome: str, reason: str) -> None:
        self.metrics.snapshots.labels(outcome).inc()
        log_event(self.log, logging.WARNING if outcome == "failed" else logging.INFO,
                  "snapshot skipped", session=session.id, outcome=outcome, rule=reason)

    # -- budget, removal, start-up sweep ------------------------------------------------

    async def _enforce_budget(self, keep: str) -> None:
        """Oldest first, every snapshot before any anchored file: a snapshot only serves
        a changed last reply, its session's anchored file every other next request."""
        total = self.index.total_bytes(self.scope)
        records = self.index.oldest_first(self.scope)
        for record in sorted(records, key=lambda r: not self.snapshots.holds(r.park_id)):
            if total <= self.config.max_bytes:
                break
            if record.park_id == keep:
                continue
            self._remove(record, "budget")
            total -= record.size
        if total > self.config.max_bytes:  # the new file alone is over the budget
            kept = self.index.get(keep)
            if kept is not None:
                self._remove(kept, "budget")

    def _remove(self, record: ParkRecord, reason: str) -> None:
        """Record first, then the file: a crash in between leaves an orphan file (swept).
        Only records in this lane's directory come here."""
        self.index.delete(record.park_id)
        self.snapshots.dropped(record.park_id)
        path = park_path(self.config.files_dir, record.filename)
        if path is None:
            log_event(self.log, logging.WARNING, "park file not deleted", file=record.filename,
                      reason="not a name parking writes")
        elif record.scope == self.scope:
            unlink(path)
        owner = record.owner  # the file was its owner's latest park
        if owner is not None and reason == "budget":
            _bounded_set(self._unparked, owner, "its parked file was removed to stay within "
                                                "--park-max-bytes")
        self.metrics.park_removals.labels(reason).inc()
        if reason != "replaced":
            log_event(self.log, logging.INFO, "park removed", file=record.filename,
                      session=owner, reason=reason, bytes=record.size)
        self._update_gauges()

    def _remove_quietly(self, record: ParkRecord, reason: str) -> None:
        try:
            self._remove(record, reason)
        except self.index.errors as exc:
            log_event(self.log, logging.WARNING, "park not removed", file=record.filename,
                      reason=reason, error=str(exc))

    def sweep(self) -> None:
        """Start-up: drop records (of this directory) that do not decode or whose file is
        gone, delete orphan files (a save no index recorded), then apply the budget."""
        for park_id in self.index.invalid_ids(self.scope):
            self.index.delete(park_id)
            self.metrics.park_removals.labels("invalid").inc()
        for record in self.index.oldest_first(self.scope):
            path = park_path(self.config.files_dir, record.filename)
            if path is None or size_of(path) != record.size:
                self._remove(record, "invalid")
        known = self.index.filenames()  # every directory's: never another lane's file
        now = time.time()
        for path in self.config.files_dir.glob(f"{PARK_PREFIX}*.bin"):
            if path.name in known or not is_park_filename(path.name) or not path.is_file():
                continue
            if self.index.replicated and (age_of(path, now) or 0.0) < ORPHAN_MIN_AGE_S:
                continue  # perhaps another replica's save, not recorded yet
            unlink(path)
            self.metrics.park_removals.labels("orphan").inc()
        total = self.index.total_bytes(self.scope)
        for record in self.index.oldest_first(self.scope):
            if total <= self.config.max_bytes:
                break
            self._remove(record, "budget")
            total -= record.size
        self._update_gauges()

    # -- engine restarts and shutdown ----------------------------------------------------

    async def engine_restarted(self, before: EngineInfo, after: EngineInfo) -> None:
        """Parked files outlive the engine; only a model change or a lost --slot-save-path
        makes them unusable (kept on disk, restored again if the model comes back)."""
        if after.model != self.model:
            log_event(self.log, logging.WARNING, "parking: engine model changed",
                      before=self.model, after=after.model,
                      reason="files parked under the old model are not restored")
            self.model = after.model
        if not after.slot_save_path:
            self.suspended = "the engine restarted without --slot-save-path"
            log_event(self.log, logging.WARNING, "parking paused", reason=self.suspended)
        elif self.suspended is not None:  # perhaps restarted with --slot-save-path, --swa-full
            self.suspended = None
            self._not_reused = 0
            log_event(self.log, logging.INFO, "parking resumed", reason="engine restarted")
        self._update_gauges()

    async def aclose(self, pool: SlotPool | None) -> None:
        """Clean shutdown: park what idle slots hold (a restarted proxy restores it), then
        close the index."""
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(EXIT_PARK_TIMEOUT_S):
                    # a slot parked ahead is busy meanwhile: let those saves end first
                    await asyncio.gather(*self._ahead, return_exceptions=True)
                    if pool is not None and self.suspended is None:
                        await self.park_resident(pool)
        finally:
            for task in self._ahead:
                task.cancel()
            with contextlib.suppress(*self.index.errors):
                self.index.close()

    async def park_resident(self, pool: SlotPool) -> None:
        """Park what idle slots hold. A slot table replicas share (``--redis``) is read
        again before each save and after it: this replica's copy may be long out of date
        (another replica gave the slot to another session since, and saving it under the
        old occupant's name would replace that session's good park with another session's
        state, restored into its next request), and another replica may lease the slot
        while it is saved (no lock is taken): a slot that changed meanwhile is not parked."""
        table = _shared_table(pool)
        for entry in pool.entries:
            if table is not None and not await table.read(self.log):
                return
            if entry.occupant is None or entry.busy:
                continue
            held = (table.still(entry.index, entry.occupant, entry.tokens, self.log)
                    if table is not None else None)
            entry.busy = True  # nobody here takes the slot while it is saved
            try:
                await self.park(Eviction(entry.index, entry.occupant, entry.kind,
                                         entry.tokens, "shutdown"), held)
            finally:
                entry.busy = False

    # -- helpers --------------------------------------------------------------------------

    def _current(self, session: Session) -> ParkRecord | None:
        """The session's latest park (the index knows its owner: another replica's park
        of this session is found too), never one of another namespace or key."""
        record = self.index.owned_by(session.id)
        if record is None or (record.namespace, record.key) != (session.namespace, session.key):
            return None
        return record

    def _owned_by_live(self, record: ParkRecord) -> bool:
        return record.owner is not None and self.store.get(record.owner) is not None

    def _estimate_bytes(self, tokens: int) -> int | None:
        return int(tokens * self._bytes_per_token) if self._bytes_per_token else None

    def _update_gauges(self) -> None:
        """The whole index's figures (every lane's managers agree on them)."""
        with contextlib.suppress(*self.index.errors):
            self.metrics.park_bytes.set(self.index.total_bytes())
            self.metrics.parked_files.set(self.index.count())


@dataclass(frozen=True, slots=True)
class _SharedTable:
    """The slot table of a ``proxy.cluster.slots.SharedSlotPool`` (Redis), read again into
    the pool's copy (``SlotPool.shared_table``: this package never imports the redis
    client)."""

    pool: SlotPool
    refresh: Callable[[], Awaitable[None]]
    errors: tuple[type[BaseException], ...]

    async def read(self, log: logging.Logger) -> bool:
        try:
            await self.refresh()
        except self.errors as exc:
            log_event(log, logging.WARNING, "shutdown parks skipped",
                      reason=f"the shared slot table is unreachable: {exc}")
            return False
        return True

    def still(self, slot: int, occupant: str, tokens: int,
              log: logging.Logger) -> Callable[[], Awaitable[bool]]:
        async def held() -> bool:
            if not await self.read(log):
                return False
            entry = self.pool.entries[slot]
            return (entry.occupant, entry.tokens) == (occupant, tokens)
        return held


def _shared_table(pool: SlotPool) -> _SharedTable | None:
    shared = pool.shared_table()
    if shared is None:
        return None
    refresh, errors = shared
    return _SharedTable(pool, refresh, errors)


def _bounded_set(table: dict[str, Any], key: str, value: Any) -> None:
    """Per-session notes whose session may never come back: the oldest go first."""
    table.pop(key, None)
    table[key] = value
    while len(table) > SESSION_NOTES:
        del table[next(iter(table))]


def _extends(prompt: Sequence[int], held: Sequence[int]) -> bool:
    """The prompt holds every token ``held`` holds, and more (one at least is evaluated)."""
    return len(prompt) > len(held) and common_prefix(prompt, held) == len(held)


def _same_history(a: Committed, b: Committed) -> bool:
    return a.digests == b.digests and a.shape == b.shape and a.prompt == b.prompt


def _digest_prefix(committed: Sequence[bytes], incoming: Sequence[bytes]) -> bool:
    n = len(committed)
    return 0 < n <= len(incoming) and tuple(incoming[:n]) == tuple(committed)


def _check_file(path: Path, record: ParkRecord, verify_content: bool,
                hashed: tuple[int, ...] | None = None) -> list[int]:
    """The file's tokens, if it is still the one parked; else SlotFileError (blocking:
    run it in a thread). ``hashed``: the file's stat identity when this process hashed it;
    unchanged, the content is not read again (a write, or a ``utime`` hiding one, moves
    its ctime; a file put in its place has another inode or ctime)."""
    size = size_of(path)
    if size is None:
        raise SlotFileError("missing", f"park file {record.filename} is gone")
    if size < record.size:
        raise SlotFileError("truncated", f"park file {record.filename} has {size} of "
                                         f"{record.size} bytes")
    if size > record.size:
        raise SlotFileError("mismatched", f"park file {record.filename} grew to {size} "
                                          f"bytes from {record.size}")
    tokens = read_slot_tokens(path)
    if len(tokens) != record.n_tokens or tokens_digest(tokens) != record.tokens_digest:
        raise SlotFileError("mismatched", f"park file {record.filename} holds another token "
                                          "list than the one parked")
    if (verify_content and record.content_digest is not None
            and (hashed is None or stat_identity(path) != hashed)
            and file_digest(path) != record.content_digest):
        raise SlotFileError("corrupted", f"park file {record.filename} changed since it "
                                         "was parked (content digest)")
    return tokens


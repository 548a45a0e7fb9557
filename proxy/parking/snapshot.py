"""Prompt-end snapshots: a second parked file per hybrid session, for a next request that
does not send the last reply back as the engine generated it.

On recurrent/hybrid memory a restored slot serves only a request whose tokens extend all
it holds (``limits.EngineLimits.exact_extension_only``). The anchored file (``anchor``)
ends after the reply as generated, so a client that sends that reply back changed
(interrupted and kept as received, regenerated, edited, its reasoning or tool calls
rewritten) leaves it, and its whole conversation is re-read. The snapshot ends where the
reply starts: the prompt up to the assistant turn as the template renders an earlier one
(``anchor.prompt_opening``), a prefix of every next request of the conversation.

How it is taken, off the request path: once the turn's slot idles on an engine short of
slots (parking ahead), the slot is rolled back to that opening by a prefill request of
its tokens (nothing generated). llama-server resumes it from the context checkpoint it
made 4 tokens before the prompt's end (``server-context.cpp``: ``checkpoint_offsets``
``{4 + n_ubatch, 4}``), so the rollback re-reads a few tokens; the slot is saved, then
anchored (the anchor extends the opening by the reply) and parked ahead as before.

When it pays (``judge``): the slot must hold that checkpoint (the turn prefilled past it;
else the rollback would re-read the prompt), the file must fit the park budget without
pushing any other file out, and re-reading its tokens at the engine's measured speed must
take longer than writing the file and reading it back at the measured disk speed.
"""

from __future__ import annotations

from dataclasses import dataclass

# llama-server checkpoints a prompt this many tokens before its end (and 4 + n_ubatch):
# a rollback to at most this far back resumes from that checkpoint.
CHECKPOINT_BEFORE_END = 4
# Disk speed assumed before this process timed a save (bytes a second).
ASSUMED_WRITE_BPS = 200e6
# A turn's prefill speed is measured from turns that prefilled at least this much (a
# shorter one is mostly the engine's fixed cost per request).
MIN_MEASURED_TOKENS = 64
_SMOOTHING = 0.3  # weight of the latest measure in a running speed


@dataclass(slots=True)
class Speeds:
    """What the engine and the park disk were measured to do, as running averages."""

    prefill_tps: float | None = None  # prompt tokens a second (new tokens over TTFT)
    write_bps: float | None = None  # bytes a second a slot save wrote

    def saw_turn(self, prompt_tokens: int | None, cached_tokens: int | None,
                 prefill_ms: float | None) -> None:
        """A turn's figures: its new tokens over the time they took: the engine's own
        prompt time where it reports one, else the time to first token (which also holds
        the queue and the first token: a speed on the low side, favouring snapshots)."""
        if prompt_tokens is None or cached_tokens is None or not prefill_ms:
            return
        new = prompt_tokens - cached_tokens
        if new >= MIN_MEASURED_TOKENS:
            self.prefill_tps = _smoothed(self.prefill_tps, new * 1000 / prefill_ms)

    def saw_save(self, n_bytes: int, seconds: float) -> None:
        if n_bytes > 0 and seconds > 0:
            self.write_bps = _smoothed(self.write_bps, n_bytes / seconds)


@dataclass(frozen=True, slots=True)
class Verdict:
    take: bool
    rule: str  # why, in words: logged with each snapshot taken or skipped


def judge(*, prompt: int, opening: int, cached: int | None, estimate_bytes: int | None,
          fits: bool, speeds: Speeds) -> Verdict:
    """Whether a snapshot of ``opening`` tokens (of a ``prompt`` whose turn read
    ``cached`` from cache) pays for the ``estimate_bytes`` it writes."""
    if opening < prompt - CHECKPOINT_BEFORE_END:
        return Verdict(False, f"the reply starts {prompt - opening} tokens before the prompt's "
                              "end, before the engine's last checkpoint: the rollback would "
                              "re-read the prompt")
    if cached is None or cached >= prompt - CHECKPOINT_BEFORE_END:
        return Verdict(False, "the turn prefilled too little for the engine to checkpoint its "
                              "prompt's end: the rollback would re-read the prompt")
    if not fits:
        return Verdict(False, "it would push another parked file out of --park-max-bytes")
    if estimate_bytes is None or speeds.prefill_tps is None:
        return Verdict(True, "no size or prefill speed measured yet")
    disk_s = 2 * estimate_bytes / (speeds.write_bps or ASSUMED_WRITE_BPS)  # write + read
    prefill_s = opening / speeds.prefill_tps
    figures = (f"re-reading {opening} tokens at {speeds.prefill_tps:.0f} tok/s: "
               f"{prefill_s * 1000:.1f} ms; writing and reading {estimate_bytes} bytes: "
               f"{disk_s * 1000:.1f} ms")
    return Verdict(prefill_s > disk_s, figures)


def _smoothed(previous: float | None, latest: float) -> float:
    return latest if previous is None else previous + _SMOOTHING * (latest - previous)


class Book:
    """Which parked file is which session's snapshot. A snapshot's record in the index
    has no owner (a session owns one record: its anchored file), so this note is what
    pairs them; it lives in memory: after a restart a snapshot is a parked history like
    any other, revived by a request that extends its history. At most ``bound`` sessions:
    past it the oldest note goes (its file stays, for the budget to remove)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._by_session: dict[str, str] = {}  # session id -> park id
        self._by_park: dict[str, str] = {}  # park id -> session id

    def note(self, session_id: str, park_id: str) -> str | None:
        """``park_id`` is now the session's snapshot; the one it replaces, if any."""
        previous = self.forget(session_id)
        self._by_session[session_id] = park_id
        self._by_park[park_id] = session_id
        while len(self._by_session) > self.bound:
            self.forget(next(iter(self._by_session)))
        return previous

    def of(self, session_id: str) -> str | None:
        return self._by_session.get(session_id)

    def holds(self, park_id: str) -> bool:
        return park_id in self._by_park

    def dropped(self, park_id: str) -> None:
        """The record ``park_id`` is gone (budget, invalid, replaced)."""
        session_id = self._by_park.pop(park_id, None)
        if session_id is not None:
            self._by_session.pop(session_id, None)

    def forget(self, session_id: str) -> str | None:
        park_id = self._by_session.pop(session_id, None)
        if park_id is not None:
            self._by_park.pop(park_id, None)
        return park_id

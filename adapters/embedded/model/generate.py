"""One completion on one slot: prefix reuse, batched prefill, sampling, stop handling.

A port of the parts of llama-server's ``update_slots``/``process_token`` that decide what
a client sees (tools/server/server-context.cpp): the longest-common-prefix reuse with its
one re-evaluated token, the prompt-progress points, the timing clock, the stop-word and
UTF-8 hold-back rules, and the token list the slot keeps afterwards (prompt plus every
decoded generated token; the final sampled token is never decoded).

On recurrent/hybrid memory, which cannot cut its tokens in the middle, the prefill stops
a few tokens before the prompt's end to take a context checkpoint, and a next prompt that
leaves the slot's tokens earlier than their end rolls back to the latest checkpoint at or
before where it leaves them (``checkpoints``; llama-server's ctx checkpoints).

``run_generation`` is synchronous and runs on the slot's worker thread. It reports through
``emit`` (thread-safe, supplied by the caller) and checks ``cancel`` between prefill
batches and between generated tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixpin.adapters.embedded.errors import ApiError, EngineBackendError
from prefixpin.adapters.embedded.model.checkpoints import CHECKPOINT_BEFORE_END, Checkpoints
from prefixpin.adapters.embedded.model.context import Sampler, SamplingParams, SlotContext
from prefixpin.adapters.embedded.model.llama import LlamaModel

STOP_NONE, STOP_EOS, STOP_WORD, STOP_LIMIT = "none", "eos", "word", "limit"


def now_us() -> int:
    return time.perf_counter_ns() // 1000


@dataclass(slots=True)
class SlotStats:
    """llama-server's server_slot_stats: counters plus a start -> prompt -> gen clock (us)."""

    n_prompt_cached: int = 0
    n_prompt_processed: int = 0
    n_gen: int = 0
    t_start: int = 0
    t_prompt_last: int = 0
    t_gen_last: int = 0

    def t_prompt_ms(self) -> float:
        return 0.0 if self.t_prompt_last == 0 else (self.t_prompt_last - self.t_start) / 1000.0

    def t_gen_ms(self) -> float:
        if self.t_gen_last == 0:
            return 0.0
        # clamped to 1 us: the first token can land in the same us as the prompt's end
        return max(1, self.t_gen_last - self.t_prompt_last) / 1000.0

    def n_gen_steps(self) -> int:
        # the first token is free: it comes from the logits of the last prompt batch
        return max(0, self.n_gen - 1)

    def timings(self) -> dict[str, float | int]:
        """The ``timings`` object, field for field (server-common.cpp, server_slot_stats)."""
        t_prompt, t_gen, steps = self.t_prompt_ms(), self.t_gen_ms(), self.n_gen_steps()
        processed = self.n_prompt_processed
        return {
            "cache_n": self.n_prompt_cached,
            "prompt_n": processed,
            "prompt_ms": t_prompt,
            "prompt_per_token_ms": t_prompt / processed if processed else 0.0,
            "prompt_per_second": 1e3 / t_prompt * processed if t_prompt > 0 else 0.0,
            "predicted_n": self.n_gen,
            "predicted_ms": t_gen,
            "predicted_per_token_ms": t_gen / steps if steps else 0.0,
            "predicted_per_second": 1e3 / t_gen * steps if t_gen > 0 else 0.0,
        }


@dataclass(frozen=True, slots=True)
class GenerationTask:
    """What the worker needs: prompt tokens and the honoured request fields."""

    id_task: int
    prompt: Sequence[int]
    n_predict: int
    sampling: SamplingParams
    stop: Sequence[str]
    cache_prompt: bool
    report_progress: bool


@dataclass(frozen=True, slots=True)
class PromptStarted:
    """The slot is assigned and the cached prefix decided; prefill has not begun."""

    total: int
    cache: int


@dataclass(frozen=True, slots=True)
class PromptProgress:
    """llama-server's ``prompt_progress`` (processed counts cached tokens too)."""

    total: int
    cache: int
    processed: int
    time_ms: int


@dataclass(frozen=True, slots=True)
class TokenOut:
    """One sampled token's text to send (may be empty: held back or an end token)."""

    text: str
    n_decoded: int
    timings: dict[str, float | int] | None  # set only when a stop word ended generation


@dataclass(frozen=True, slots=True)
class Finished:
    content: str
    stop_type: str
    stopping_word: str
    truncated: bool
    n_prompt: int
    stats: SlotStats


@dataclass(frozen=True, slots=True)
class Failed:
    error: ApiError


Event = PromptStarted | PromptProgress | TokenOut | Finished | Failed


@dataclass(slots=True)
class SlotState:
    """What a slot holds between requests: the tokens in its KV cache and its last figures."""

    tokens: list[int] = field(default_factory=list)
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    stats: SlotStats = field(default_factory=SlotStats)
    n_remain: int = -1
    has_next_token: bool = False
    has_new_line: bool = False


def common_prefix(cached: Sequence[int], prompt: Sequence[int]) -> int:
    limit = min(len(cached), len(prompt))
    for index in range(limit):
        if cached[index] != prompt[index]:
            return index
    return limit


def find_partial_stop(text: str, word: str) -> int | None:
    """Start of the longest suffix of ``text`` that is a proper start of ``word``."""
    for length in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:length]):
            return len(text) - length
    return None


@dataclass(slots=True)
class _Decoder:
    """The running text state of one generation (server_slot's generated_text & co.)."""

    stop_words: Sequence[str]
    raw: bytearray = field(default_factory=bytearray)
    text: str = ""
    n_sent: int = 0
    stop_type: str = STOP_NONE
    stopping_word: str = ""

    def find_full_stop(self, tail: str, last_size: int) -> int | None:
        best: int | None = None
        for word in self.stop_words:
            start = max(0, len(tail) - (len(word) + last_size))
            pos = tail.find(word, start)
            if pos >= 0 and (best is None or pos < best):
                best, self.stopping_word = pos, word
                self.stop_type = STOP_WORD
        return best

    def find_partial(self, tail: str) -> int | None:
        found = [p for w in self.stop_words if (p := find_partial_stop(tail, w)) is not None]
        return min(found) if found else None

    def push(self, piece: bytes, is_end_token: bool) -> str | None:
        """Append a token's bytes; return the text to send now, or None if UTF-8 is open."""
        self.raw += piece
        try:
            self.text = self.raw.decode("utf-8")
        except UnicodeDecodeError:
            return None  # an incomplete character: wait for the next token
        piece_len = len(piece.decode("utf-8", "replace"))
        pos = min(self.n_sent, len(self.text))
        tail = self.text[pos:]
        send = True
        stop_pos = self.find_full_stop(tail, piece_len)
        if stop_pos is not None:
            self.text = self.text[: pos + stop_pos]
            self.raw = bytearray(self.text.encode("utf-8"))
            pos = min(self.n_sent, len(self.text))
        elif not is_end_token:
            send = self.find_partial(tail) is None
        if not send:
            return ""
        out = self.text[pos:]
        self.n_sent += len(out)
        return out


class _Run:
    """State of one ``run_generation`` call; methods mirror llama-server's phases."""

    def __init__(self, model: LlamaModel, context: SlotContext, state: SlotState,
                 task: GenerationTask, emit: Callable[[Event], None]) -> None:
        self.model, self.context, self.state, self.task, self.emit = (
            model, context, state, task, emit)
        self.stats = SlotStats(t_start=now_us())
        self.decoder = _Decoder(task.stop)
        self.truncated = False

    def start(self) -> int:
        """Keep the reusable prefix, drop the rest; returns n_past."""
        state, prompt = self.state, self.task.prompt
        n_past = common_prefix(state.tokens, prompt) if self.task.cache_prompt else 0
        if n_past == len(prompt) and n_past > 0:
            n_past -= 1  # logits are needed to sample: re-evaluate one token [TAG_PROMPT_LOGITS]
        n_past = self.cut_to(n_past)
        del state.tokens[n_past:]
        state.stats = self.stats
        state.has_new_line = False
        self.stats.n_prompt_cached = n_past
        self.emit(PromptStarted(total=len(prompt), cache=n_past))
        return n_past

    def cut_to(self, n_past: int) -> int:
        """Drop the slot's memory from ``n_past`` on; returns where the prefill resumes:
        ``n_past``, else (memory that cannot cut in the middle: recurrent state) the latest
        checkpoint at or before it, else 0."""
        context, checkpoints = self.context, self.state.checkpoints
        if context.keep_first(n_past):
            checkpoints.forget_after(n_past)
            return n_past
        checkpoint = checkpoints.latest_within(n_past)
        if checkpoint is not None and context.roll_back_to(checkpoint):
            checkpoints.forget_after(checkpoint.n_tokens)
            return checkpoint.n_tokens
        context.clear()
        checkpoints.clear()
        return 0

    def checkpoint_at(self, n_past: int) -> int | None:
        """Where this prefill takes a checkpoint (None: nowhere)."""
        at = len(self.task.prompt) - CHECKPOINT_BEFORE_END
        return at if self.context.needs_checkpoints and at > n_past else None

    def progress(self) -> None:
        if self.task.report_progress:
            self.emit(PromptProgress(
                total=len(self.task.prompt), cache=self.stats.n_prompt_cached,
                processed=len(self.state.tokens),
                time_ms=(now_us() - self.stats.t_start) // 1000))

    def prefill(self, n_past: int, cancel: threading.Event) -> bool:
        # the first progress point (processed == cache) is the PromptStarted event
        prompt, n_batch = self.task.prompt, self.context.n_batch
        checkpoint_at = self.checkpoint_at(n_past)
        begin = n_past
        while begin < len(prompt):
            if cancel.is_set():
                return False
            end = min(begin + n_batch, len(prompt))
            if checkpoint_at is not None and begin < checkpoint_at < end:
                end = checkpoint_at  # the batch stops where the checkpoint is taken
            chunk = prompt[begin:end]
            self.context.decode(chunk, begin, logits_last=end == len(prompt))
            self.state.tokens.extend(chunk)
            if end == checkpoint_at:
                self.state.checkpoints.add(self.context.take_checkpoint(end))
            self.stats.n_prompt_processed += len(chunk)
            self.stats.t_prompt_last = now_us()
            self.progress()
            begin = end
        return True

    def generate(self, cancel: threading.Event) -> None:
        sampler = Sampler(self.model.lib, self.task.sampling)
        try:
            while True:
                token = sampler.sample(self.context)
                if not self.accept(token) or cancel.is_set():
                    return
                self.context.decode([token], len(self.state.tokens), logits_last=True)
                self.state.tokens.append(token)
        finally:
            sampler.close()

    def accept(self, token: int) -> bool:
        """Account one sampled token (process_token); False when generation must stop."""
        stats, state = self.stats, self.state
        stats.n_gen += 1
        if stats.n_gen == 1:
            stats.t_prompt_last = now_us()
        stats.t_gen_last = now_us()
        is_end = self.model.is_eog(token)
        text = self.decoder.push(self.model.piece(token, special=False), is_end)
        if text is not None:
            with_timings = self.decoder.stop_type == STOP_WORD
            self.emit(TokenOut(text, stats.n_gen, stats.timings() if with_timings else None))
            state.has_new_line = state.has_new_line or "\n" in text
        has_next = self.decoder.stop_type != STOP_WORD or text is None
        if len(state.tokens) + 1 >= self.context.n_ctx:
            self.truncated, has_next = True, False
            self.decoder.stop_type = STOP_LIMIT
        if has_next and self.task.n_predict >= 0 and stats.n_gen >= self.task.n_predict:
            has_next = False
            self.decoder.stop_type = STOP_LIMIT
        if is_end:
            has_next = False
            self.decoder.stop_type = STOP_EOS
        state.has_next_token = has_next
        state.n_remain = -1 if self.task.n_predict < 0 else self.task.n_predict - stats.n_gen
        return has_next

    def finish(self) -> None:
        decoder = self.decoder
        content = decoder.raw.decode("utf-8", "replace")
        self.emit(Finished(content=content, stop_type=decoder.stop_type,
                           stopping_word=decoder.stopping_word, truncated=self.truncated,
                           n_prompt=len(self.task.prompt), stats=self.stats))


def run_generation(model: LlamaModel, context: SlotContext, state: SlotState,
                   task: GenerationTask, emit: Callable[[Event], None],
                   cancel: threading.Event) -> None:
    """Serve ``task`` on a slot; always ends with ``Finished`` or ``Failed`` unless cancelled."""
    run = _Run(model, context, state, task, emit)
    state.has_next_token = True
    state.n_remain = task.n_predict
    try:
        n_past = run.start()
        if run.prefill(n_past, cancel) and not cancel.is_set():
            run.generate(cancel)
            if not cancel.is_set() or run.decoder.stop_type != STOP_NONE:
                run.finish()
    except EngineBackendError as exc:
        emit(Failed(ApiError(str(exc), "server_error")))
    finally:
        state.has_next_token = False

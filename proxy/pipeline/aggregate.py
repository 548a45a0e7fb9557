"""Fold a streamed generation into the one JSON object a non-streaming client expects.

The proxy always streams from the engine (so that it sees progress and usage, and so that
streaming and non-streaming clients can share one generation); a non-streaming client gets
the chunks folded into what the engine would have answered it directly. The folding is
generic, so that a field the proxy has no rule for reaches the client too; the rules, by
where the field is in a chunk:

top level
    ``choices``: folded per ``index`` (below). ``object``: ``chat.completion`` or
    ``text_completion``. ``prompt_progress``: dropped (``STREAM_ONLY``: a progress report
    the proxy asks for; a non-streamed answer has none). ``__verbose`` (llama-server's
    debug object, asked with ``verbose: true``): the last one, completed as below.
    ``usage``, ``timings``: the last object (``OBJECTS``; a value that is not an object is
    not kept). Every other field (``id``, ``created``, ``model``, ``system_fingerprint``,
    whatever an engine adds): the last value that is not null (null when every chunk had
    null).
a choice
    ``finish_reason`` and every field without a rule: the last value that is not null.
    ``text`` (completions): concatenated. ``logprobs``: concatenated, list by list
    (``content``, ``refusal``; the legacy ``tokens``, ``token_logprobs``, ...), null when
    no chunk had any; completions always carry the key, chat only when a chunk did.
    ``delta`` (chat): folded into ``message``.
a chat ``delta``
    ``content``: concatenated (null when no chunk had text). ``tool_calls``: merged by
    ``index`` (``id``, ``type`` last; ``name``, ``arguments`` concatenated). Every other
    field (``reasoning_content``, Ollama's ``reasoning``, ...): strings concatenated, lists
    extended, objects merged by these same rules, other values the last; ``role``,
    ``index`` and ``type`` the last (``role`` is ``assistant`` unless a chunk says
    otherwise).

``__verbose`` of a stream is its final result's: no ``content`` (the text went out in the
chunks), no ``completion_probabilities``, ``generation_settings.stream`` true. The folded
one gets the whole text of its choice as ``content``, the choice's logprobs as
``completion_probabilities`` (llama-server fills both from the same list) and ``stream``
false, as llama-server's own non-streamed answer has them.

What cannot be folded back, because llama-server's stream does not carry it (from its
source, tools/server/server-task.cpp and server-context.cpp; the two logprobs cases are
measured against its direct non-streamed answers in ``tests/e2e/test_dropin_llama.py``):

- chat logprobs of a token that produced no text delta: the end-of-generation token (a
  direct answer that ends with ``stop`` lists it last) and tokens held back while they
  might start a stop string. llama-server attaches a token's logprobs to its delta, and a
  token without one is not streamed at all;
- completions ended by a stop string: the direct answer drops the logprobs of the stop
  string's tokens, the stream sends them (with empty text), and the stream does not say
  whether a stop string or the end-of-generation token ended it;
- ``__verbose.content`` of a chat answer with reasoning or tool calls (the raw generated
  text, markup included; the stream carries it parsed), ``__verbose.tokens`` with
  ``return_tokens`` (never in a chat stream), and every timing (``timings``, the
  ``__verbose`` one too), which measures the run it came from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefixpin.adapters.base import Frame, FrameKind
from prefixpin.core.figures import may_carry_figures

# Top-level chunk fields a non-streamed answer never has.
STREAM_ONLY = frozenset({"prompt_progress"})
# Delta fields that are replaced, never concatenated (as in the OpenAI SDK's accumulator).
REPLACED = frozenset({"role", "index", "type"})
VERBOSE = "__verbose"  # llama-server's debug object
# Top-level fields kept only as objects (the last one; anything else is not kept).
OBJECTS = frozenset({"usage", "timings"})


def aggregate(frames: Sequence[Frame], *, chat: bool) -> dict[str, Any]:
    envelope: dict[str, Any] = {}
    choices: dict[int, _Choice] = {}
    verbose: Mapping[str, Any] | None = None
    for frame in frames:
        if frame.kind not in (FrameKind.CHUNK, FrameKind.USAGE) or frame.data is None:
            continue
        for key, value in frame.data.items():
            if key == "choices":
                for choice in value if isinstance(value, list) else ():
                    if isinstance(choice, Mapping):
                        _choice_of(choices, choice, chat).fold(choice)
            elif key == VERBOSE:
                if isinstance(value, Mapping):
                    verbose = value
            elif key in OBJECTS:
                if isinstance(value, Mapping):
                    envelope[key] = value
            elif key not in STREAM_ONLY and key != "object":
                _keep_last(envelope, key, value)
    folded = [choices[i].finish() for i in sorted(choices)]
    result: dict[str, Any] = {"choices": folded, **envelope,
                              "object": "chat.completion" if chat else "text_completion"}
    if verbose is not None:
        result[VERBOSE] = _whole_verbose(verbose, choices)
    return result


def assistant_message(frames: Sequence[Frame]) -> dict[str, Any] | None:
    """The first choice's ``message``, as ``aggregate`` folds it, from the deltas alone:
    what a turn commits (``Codec.reply``), read at the end of every chat generation, so
    nothing else of a chunk (its envelope, logprobs) is folded. None without a choice."""
    choices: dict[int, _Choice] = {}
    first: _Choice | None = None  # choice 0's, once a plain chunk named it
    chunk = FrameKind.CHUNK
    for frame in frames:
        if frame.kind is not chunk:
            continue
        field, text = frame.delta_field, frame.delta_text
        if field is not None and text is not None:
            # its adapter read the one text field of choice 0's delta: no parse
            if first is None:
                first = _state_at(choices, 0, True)
            if field == "content":  # ``_fold_field``'s first case, the bulk of a reply
                if (content := first.content) is None:
                    content = first.content = []
                content.append(text)
            else:
                first._fold_field(field, text)
            continue
        data = frame.data
        listed = data.get("choices") if data is not None else None
        for choice in listed if isinstance(listed, list) else ():
            if isinstance(choice, Mapping):
                delta = choice.get("delta")
                state = _choice_of(choices, choice, True)
                if isinstance(delta, Mapping):
                    state._fold_delta(delta)
    if not choices:
        return None
    return choices[min(choices)].finish()["message"]  # type: ignore[no-any-return]


def fold_read(frames: Sequence[Frame]) -> list[Frame]:
    """What a generation's log keeps of ``frames``, which every client has read, once it
    lets go of them (``proxy.pipeline.generation``): what the reply folds to and the figures are
    read from, not the bytes. Each run of plain text deltas of one field (a token chunk
    whose adapter read its one text field: ``Frame.delta_field``) becomes one chunk of
    their joined text, so ``assistant_message`` and ``aggregate`` fold the same message;
    every frame figures may be read from, and every other output chunk (a role, a tool
    call's delta, a finish), stays as it came; progress reports and keep-alives go."""
    kept: list[Frame] = []
    run: list[str] = []
    run_field: str | None = None

    def end_run() -> None:
        if run_field is not None:
            kept.append(text_chunk(run_field, "".join(run)))
            run.clear()

    for frame in frames:
        field, text = frame.delta_field, frame.delta_text
        if field is not None and text is not None and frame.figured is not True:
            if field != run_field:
                end_run()
                run_field = field
            run.append(text)
            continue
        if frame.kind in (FrameKind.PROGRESS, FrameKind.PING) and not may_carry_figures(frame):
            continue
        end_run()
        run_field = None
        kept.append(frame)
    end_run()
    return kept


def text_chunk(field: str, text: str) -> Frame:
    """An output chunk whose only content is ``text`` in choice 0's delta ``field``: the
    folded run of many (``fold_read``). No client reads its bytes (there are none)."""
    frame = Frame(FrameKind.CHUNK, b"", {"choices": [{"index": 0, "delta": {field: text}}]},
                  has_output=True, finish=False)
    frame.delta_field, frame.delta_text, frame.figured = field, text, False
    return frame


def _keep_last(into: dict[str, Any], key: str, value: object) -> None:
    """The last value that is not null (the key kept, null, when every value was)."""
    if value is not None or key not in into:
        into[key] = value


def _choice_of(choices: dict[int, _Choice], choice: Mapping[str, Any], chat: bool) -> _Choice:
    index = choice.get("index")
    key = index if isinstance(index, int) and not isinstance(index, bool) else 0
    return _state_at(choices, key, chat)


def _state_at(choices: dict[int, _Choice], index: int, chat: bool) -> _Choice:
    state = choices.get(index)
    if state is None:
        state = choices[index] = _Choice(index, chat)
    return state


class _Choice:
    """One choice's chunks, folded as they come."""

    def __init__(self, index: int, chat: bool) -> None:
        self.index = index
        self.chat = chat
        self.finish_reason: object = None
        self.text: list[str] = []  # completions
        self.logprobs: dict[str, Any] | None = None
        self.logprobs_seen = False
        self.fields: dict[str, Any] = {}  # a choice's fields without a rule
        self.message: dict[str, Any] = {}  # chat: every delta field but these two
        self.content: list[str] | None = None
        self.tool_calls: dict[int, dict[str, Any]] = {}

    def fold(self, choice: Mapping[str, Any]) -> None:
        for key, value in choice.items():
            if key == "index":
                continue
            if key == "finish_reason":
                if value is not None:
                    self.finish_reason = value
            elif key == "logprobs":
                self._fold_logprobs(value)
            elif key == "text" and not self.chat:
                if isinstance(value, str):
                    self.text.append(value)
            elif key == "delta" and self.chat:
                if isinstance(value, Mapping):
                    self._fold_delta(value)
            else:
                _keep_last(self.fields, key, value)

    def _fold_logprobs(self, value: object) -> None:
        self.logprobs_seen = True
        if not isinstance(value, Mapping):
            return
        if self.logprobs is None:
            self.logprobs = {}
        for key, part in value.items():
            held = self.logprobs.get(key)
            if isinstance(part, list):
                if isinstance(held, _Owned):
                    held.extend(part)  # in place: a copy per chunk would be quadratic
                else:
                    self.logprobs[key] = _Owned([*held, *part] if isinstance(held, list)
                                                else part)
            else:
                _keep_last(self.logprobs, key, part)

    def _fold_delta(self, delta: Mapping[str, Any]) -> None:
        for key, value in delta.items():
            self._fold_field(key, value)

    def _fold_field(self, key: str, value: object) -> None:
        """One field of a delta onto the message."""
        if key == "content":
            if isinstance(value, str):
                if self.content is None:
                    self.content = []
                self.content.append(value)
        elif key == "tool_calls":
            for call in value if isinstance(value, list) else ():
                if isinstance(call, Mapping):
                    _fold_tool_call(self.tool_calls, call)
        else:
            held = self.message.get(key)
            if isinstance(value, str) and key not in REPLACED:
                # Text fields (reasoning_content, ...) collect their pieces, joined once
                # at the end: a string grown per chunk would be copied per chunk.
                if isinstance(held, _Pieces):
                    held.append(value)
                    return
                if isinstance(held, str):
                    self.message[key] = _Pieces((held, value))
                    return
            elif isinstance(held, _Pieces):
                self.message[key] = "".join(held)  # merged by the rules from here on
            merge_delta(self.message, key, value)

    def logprob_list(self) -> list[Any]:
        content = (self.logprobs or {}).get("content")
        return list(content) if isinstance(content, list) else []

    def whole_text(self) -> str:
        return "".join(self.content or ()) if self.chat else "".join(self.text)

    def finish(self) -> dict[str, Any]:
        if not self.chat:
            return {"text": "".join(self.text), "index": self.index,
                    "logprobs": _plain(self.logprobs),
                    "finish_reason": self.finish_reason, **self.fields}
        fields = {key: "".join(value) if isinstance(value, _Pieces) else value
                  for key, value in self.message.items()}
        message: dict[str, Any] = {"role": "assistant", **fields,
                                   "content": None if self.content is None
                                   else "".join(self.content)}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        choice: dict[str, Any] = {"finish_reason": self.finish_reason, "index": self.index,
                                  "message": message}
        if self.logprobs_seen:
            choice["logprobs"] = _plain(self.logprobs)
        return {**choice, **self.fields}


class _Pieces(list[str]):
    """A delta's text field while it is folded: its pieces, joined at the end."""


class _Owned(list[Any]):
    """A logprobs list the fold made itself (extended in place; never a chunk's own)."""


def _plain(logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    return {key: list(value) if isinstance(value, _Owned) else value
            for key, value in logprobs.items()}


def merge_delta(into: dict[str, Any], key: str, value: object) -> None:
    """One field of a delta onto what the earlier deltas built: strings concatenated,
    lists extended, objects merged field by field, anything else (and ``REPLACED``)
    replaced; a null changes nothing (the key is kept, null, when every value was)."""
    held = into.get(key)
    if value is None:
        into.setdefault(key, None)
    elif key in REPLACED:
        into[key] = value
    elif isinstance(held, str) and isinstance(value, str):
        into[key] = held + value
    elif isinstance(held, list) and isinstance(value, list):
        into[key] = [*held, *value]
    elif isinstance(held, dict) and isinstance(value, Mapping):
        for name, part in value.items():
            merge_delta(held, name, part)
    elif isinstance(value, Mapping):
        merged: dict[str, Any] = {}
        for name, part in value.items():
            merge_delta(merged, name, part)
        into[key] = merged
    else:
        into[key] = list(value) if isinstance(value, list) else value


def _fold_tool_call(calls: dict[int, dict[str, Any]], delta: Mapping[str, Any]) -> None:
    index = int(delta.get("index") or 0)
    call = calls.setdefault(index, {"type": "function", "function": {"name": "", "arguments": ""}})
    if delta.get("id"):
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    function = delta.get("function")
    if isinstance(function, Mapping):
        if function.get("name"):
            call["function"]["name"] += str(function["name"])
        if function.get("arguments"):
            call["function"]["arguments"] += str(function["arguments"])


def _whole_verbose(verbose: Mapping[str, Any], choices: Mapping[int, _Choice]) -> dict[str, Any]:
    """The stream's final ``__verbose`` as llama-server's non-streamed answer has it: the
    whole text, the logprobs as ``completion_probabilities``, ``stream`` false."""
    whole = dict(verbose)
    index = whole.get("index")
    choice = choices.get(index if isinstance(index, int) else 0)
    if choice is not None:
        whole["content"] = choice.whole_text()
        if probabilities := choice.logprob_list():
            whole["completion_probabilities"] = probabilities
    settings = whole.get("generation_settings")
    if isinstance(settings, Mapping) and "stream" in settings:
        whole["generation_settings"] = {**settings, "stream": False}
    return whole

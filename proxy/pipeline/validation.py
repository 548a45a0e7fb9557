"""Parse and validate client bodies before anything is forwarded (step 1 of the request path).

Every rejection is a ``ClientError`` with a message that names the field, so a client sees
a clear OpenAI-shaped 4xx and the engine never sees the request.

Beyond the schema, a body must be JSON that every later step can handle: no ``NaN`` or
``Infinity`` (not JSON; the engine request could not be encoded), no lone UTF-16 surrogate
escapes (not encodable as UTF-8), and at most ``MAX_JSON_DEPTH`` levels of nesting (the
digests, fingerprints and the engine request walk the body).

Bodies are bounded one by one (``--max-body``) and all together (``--max-bodies``: a
``BodyBudget`` of the bytes every connection's body being read and parsed holds at once).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self

import orjson
from starlette.requests import ClientDisconnect

from prefixpin.core.errors import (
    BadRequestError,
    BodiesFullError,
    ClientDisconnectedError,
    PayloadTooLargeError,
)
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.pipeline.body_memo import CHAT, BodyMemo, Parsed, Wire

Endpoint = Literal["chat", "completions", "infill"]
# The wire format a client speaks (ollama: /api/chat, ...; anthropic: /v1/messages;
# responses: /v1/responses). The last two are read into an OpenAI chat body (their codecs
# convert), so everything after parsing sees one conversation shape.
Api = Literal["openai", "ollama", "anthropic", "responses", "llama"]

KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

MAX_JSON_DEPTH = 100  # tool schemas nest a dozen levels; nothing real nests a hundred

# The OpenAI request fields the proxy checks, by endpoint; null always passes (clients send
# it for "unset"). Any other field is the engine's to judge and goes through unchanged.
JSON_INT, JSON_NUMBER, JSON_STR = "an integer", "a number", "a string"
JSON_BOOL, JSON_OBJECT, JSON_ARRAY = "a boolean", "an object", "an array"
_COMMON_FIELDS: dict[str, tuple[str, ...]] = {
    "model": (JSON_STR,), "max_tokens": (JSON_INT,), "n": (JSON_INT,), "seed": (JSON_INT,),
    "temperature": (JSON_NUMBER,), "top_p": (JSON_NUMBER,), "presence_penalty": (JSON_NUMBER,),
    "frequency_penalty": (JSON_NUMBER,), "stop": (JSON_STR, JSON_ARRAY), "user": (JSON_STR,),
    "logit_bias": (JSON_OBJECT,),
}
FIELD_TYPES: dict[Endpoint, dict[str, tuple[str, ...]]] = {
    "chat": {**_COMMON_FIELDS, "max_completion_tokens": (JSON_INT,), "tools": (JSON_ARRAY,),
             "tool_choice": (JSON_STR, JSON_OBJECT), "parallel_tool_calls": (JSON_BOOL,),
             "response_format": (JSON_OBJECT,), "logprobs": (JSON_BOOL,),
             "top_logprobs": (JSON_INT,),
             "metadata": (JSON_OBJECT,)},
    "completions": {**_COMMON_FIELDS, "logprobs": (JSON_INT,), "echo": (JSON_BOOL,),
                    "suffix": (JSON_STR,), "best_of": (JSON_INT,)},
}
MESSAGE_STRING_FIELDS = ("name", "tool_call_id", "reasoning_content")

# Ollama's native request fields (api.ChatRequest, api.GenerateRequest): ``stream`` defaults
# to true there, ``/api/generate``'s ``logprobs`` is a boolean and its ``context`` a token list.
_NATIVE_COMMON: dict[str, tuple[str, ...]] = {
    "model": (JSON_STR,), "format": (JSON_STR, JSON_OBJECT), "options": (JSON_OBJECT,),
    "keep_alive": (JSON_STR, JSON_NUMBER), "think": (JSON_BOOL, JSON_STR), "logprobs": (JSON_BOOL,),
    "top_logprobs": (JSON_INT,),
}
NATIVE_FIELD_TYPES: dict[Endpoint, dict[str, tuple[str, ...]]] = {
    "chat": {**_NATIVE_COMMON, "tools": (JSON_ARRAY,)},
    "completions": {**_NATIVE_COMMON, "suffix": (JSON_STR,), "system": (JSON_STR,),
                    "template": (JSON_STR,), "context": (JSON_ARRAY,), "raw": (JSON_BOOL,),
                    "images": (JSON_ARRAY,)},
}

# A UTF-16 surrogate escape (\uD800-\uDFFF) in the raw JSON: only then can the parsed body
# hold a lone surrogate, so only then is it searched for one.
SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_HUGE = 2.0**63  # orjson reads integers from here on (unsigned: 2**64) as floats


@dataclass(frozen=True, slots=True)
class ClientRequest:
    endpoint: Endpoint
    path: str
    body: dict[str, Any]
    stream: bool
    wants_usage: bool
    wants_progress: bool
    api: Api = "openai"
    # Ollama's model load or unload request (no messages, an empty prompt): forwarded as it
    # came, its body unchecked, never generated from.
    lifecycle: bool = False
    # The client's own body when ``body`` is a conversion of it (Anthropic Messages and
    # OpenAI Responses become a chat body): what the codec answers from (model, ids, the
    # fields a Responses object echoes). None when ``body`` is the client's own.
    source: dict[str, Any] | None = None


class BodyBudget:
    """The request-body bytes held at once across every connection of the tenant listener
    (``--max-bodies``): each body reserves its bytes while it is read and parsed (its
    declared Content-Length up front, else its chunks as they arrive) through a
    ``BodyReservation``, which gives them all back when its block ends, however it ends. A
    reservation that would pass the limit is refused (``BodiesFullError``: a 503 with
    Retry-After) and logged. Used on the event loop only: ``reserve`` and ``release``
    never await, so no lock."""

    def __init__(self, limit: int, logger: logging.Logger, *, retry_after_s: int = 1) -> None:
        self.limit = limit
        self.held = 0  # bytes reserved now, by every body being read or parsed
        self.log = logger
        self.retry_after_s = retry_after_s

    def reserve(self, size: int) -> None:
        """``size`` more bytes held, or ``BodiesFullError`` (nothing reserved)."""
        if size < 0:
            raise ValueError(f"a reservation of {size} bytes")
        if self.held + size > self.limit:
            log_event(self.log, logging.WARNING, "request body refused", limit="bodies",
                      max_bodies=self.limit, held=self.held, wanted=size)
            raise BodiesFullError(
                f"the request bodies being read at once would hold more than {self.limit} "
                "bytes with this one (--max-bodies): try again shortly",
                retry_after_s=self.retry_after_s)
        self.held += size

    def release(self, size: int) -> None:
        if not 0 <= size <= self.held:
            raise ValueError(f"{size} bytes released of {self.held} held")
        self.held -= size

    def reservation(self) -> BodyReservation:
        return BodyReservation(self)


class BodyReservation:
    """One body's share of a ``BodyBudget``: grown as the body is read, given back whole
    when its ``with`` block ends (a return, an error, a disconnect, a cancellation)."""

    __slots__ = ("budget", "size")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.size = 0

    def grow_to(self, size: int) -> None:
        """Hold ``size`` bytes in all (nothing more when it holds that many already)."""
        if size > self.size:
            self.budget.reserve(size - self.size)
            self.size = size

    def release(self) -> None:
        size, self.size = self.size, 0
        self.budget.release(size)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


async def read_body(chunks: AsyncIterator[bytes], declared_length: str | None,
                    max_bytes: int, reservation: BodyReservation | None = None, *,
                    max_values: int | None = None) -> bytes:
    """The request body, refused as soon as it is known to exceed ``max_bytes`` (a 413),
    to hold more than ``max_values`` JSON values (a 413: ``separators_in``, counted
    chunk by chunk, so a body of millions of tiny values is refused before it is all
    read), or to pass its ``reservation``'s budget (a 503: ``BodyBudget``). The
    reservation grows to the declared length before anything is read, else chunk by chunk
    before each is kept; the caller releases it (its ``with`` block)."""
    declared = int(declared_length) if declared_length and declared_length.isdigit() else None
    if declared is not None and declared > max_bytes:
        raise _too_large(max_bytes)
    if declared is not None and reservation is not None:
        reservation.grow_to(declared)
    # The chunks as they came, joined once at the end: a buffer grown chunk by chunk is
    # copied whole each time it outgrows its allocation, every copy a stall of the loop.
    chunks_read: list[bytes] = []
    size = 0
    values: int | None = None  # counted once the body could hold too many
    try:
        async for chunk in chunks:
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            if max_values is not None and size > max_values:
                # Each value takes a byte at least: a body no longer than the bound is
                # within it, and most are never counted.
                if values is None:
                    values = sum(separators_in(read) for read in chunks_read)
                values += separators_in(chunk)
                if values > max_values:
                    raise _too_many_values(max_values)
            if reservation is not None:
                reservation.grow_to(size)
            chunks_read.append(chunk)
        return b"".join(chunks_read)
    except ClientDisconnect:  # a client gone mid-upload is its own outcome, not a crash
        raise ClientDisconnectedError("the client disconnected before sending its whole "
                                      "body") from None
    finally:
        # Read, refused or cancelled, its bytes go now: an error's traceback holds this
        # frame, in a cycle the collector would free only at its next pass.
        chunks_read.clear()


def parse_request(raw: bytes, endpoint: Endpoint, path: str, *, max_messages: int,
                  memo: BodyMemo | None = None) -> ClientRequest:
    """``memo``: the parses of earlier bodies, whose messages a resent history reuses
    (checked then: only the messages it adds are checked again); this body joins them
    once every check passed."""
    chat = endpoint == "chat"
    body, resent = parse_resent(raw, memo if chat else None, CHAT)
    if chat:
        check_messages(body.get("messages"), max_messages,
                       start=resent.reused if resent is not None else 0)
    else:
        _check_prompt(body.get("prompt"))
    check_field_types(body, FIELD_TYPES[endpoint])
    _check_one_choice(body)
    stream = optional_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise BadRequestError("'stream_options' must be an object", param="stream_options")
    wants_usage = bool(options.get("include_usage")) if isinstance(options, Mapping) else False
    if memo is not None and endpoint == "chat":
        memo.keep(raw, resent if resent is not None else body)
    return ClientRequest(endpoint, path, body, stream, wants_usage,
                         optional_bool(body, "return_progress"))


def parse_resent(raw: bytes, memo: BodyMemo | None, wire: Wire, *,
                 converts: bool = False) -> tuple[dict[str, Any], Parsed | None]:
    """``parse_checked(raw)``, or with ``memo`` the parse that reuses an earlier body's
    messages (``BodyMemo.loads``), its new parts checked; with it, the ``Parsed`` that lent
    them (None: parsed whole). ``converts``: the format converts its messages, so a body
    is reused only with what the earlier one's conversion made of them."""
    resent = memo.loads(raw, wire) if memo is not None else None
    if (resent is None or (converts and resent.converted is None)
            or not checked_added(resent)):
        return parse_checked(raw), None
    return without_engine_controls(resent.value), resent


def check_converted(messages: list[Any], max_messages: int, *, opening: int,
                    reused: int) -> None:
    """``check_messages`` of a converted format's chat messages: those before ``opening``
    (made from the body's other fields) and those after the ``reused`` ones that follow
    them (an earlier body's conversions, checked with it)."""
    check_messages(messages[:opening], max_messages)
    check_messages(messages, max_messages, start=opening + reused)


def checked_added(resent: Parsed) -> bool:
    """``parse_checked``'s checks of a resent body's new parts (its fields and the
    messages it adds), False where it must be parsed whole (a huge float: maybe an
    integer to read exactly)."""
    value, array = resent.value, resent.wire.array
    return not _checked_holds_huge_float({**value, array: value[array][resent.reused:]})


def _check_one_choice(body: Mapping[str, Any]) -> None:
    """``n`` above 1 is refused: llama-server reads ``n`` as ``n_cmpl`` and runs each extra
    choice on another slot, over whichever session that slot holds (the pinning and the
    tenant guard would not see it)."""
    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequestError("'n' must be 1 through prefixpin: each further choice would "
                              "run on another engine slot, over the session it holds; send "
                              "n requests instead", param="n")


def parse_native_request(raw: bytes, endpoint: Endpoint, path: str, *,
                         max_messages: int) -> ClientRequest:
    """An Ollama native body (``/api/chat``: messages; ``/api/generate``: a prompt). A
    body with no messages or an empty prompt (and no images) is a model load/unload
    request: marked ``lifecycle``, the rest of its body unchecked (Ollama judges it)."""
    body = parse_object(raw)
    empty = not body.get("messages") if endpoint == "chat" else not body.get("prompt")
    if empty and not body.get("images"):
        return ClientRequest(endpoint, path, body, False, False, False, "ollama",
                             lifecycle=True)
    check_structure(body, surrogates=SURROGATE_ESCAPE.search(raw) is not None)
    if endpoint == "chat":
        check_messages(body.get("messages"), max_messages)
    elif not isinstance(body.get("prompt"), str):
        raise BadRequestError("'prompt' must be a string", param="prompt")
    check_field_types(body, NATIVE_FIELD_TYPES[endpoint])
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequestError("'stream' must be a boolean", param="stream")
    return ClientRequest(endpoint, path, body, stream is not False, False, False, "ollama")


# llama-server's slot and cache controls are the proxy's alone: a tenant that chose the slot
# (``id_slot``), the number of completions sharing its prompt (``n_cmpl``) or whether a
# slot's cache is reused (``cache_prompt``) could read or overwrite another tenant's prefix.
ENGINE_CONTROLS = ("id_slot", "n_cmpl", "cache_prompt")


def without_engine_controls(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body minus ``ENGINE_CONTROLS``, the one place they are dropped: every
    body of the pipeline is parsed here before anything plans or forwards it."""
    for key in ENGINE_CONTROLS:
        body.pop(key, None)
    return body


def parse_checked(raw: bytes) -> dict[str, Any]:
    """``parse_object``, then ``check_structure``. A body orjson parsed holds no lone
    surrogate (orjson refuses one), so only a body the standard library parsed has its
    strings searched (the raw bytes' search alone costs half of orjson's parse)."""
    _check_not_empty(raw)
    value = _orjson_or_none(raw)
    if isinstance(value, dict) and not _checked_holds_huge_float(value):
        return without_engine_controls(value)
    body = without_engine_controls(_parse_strict(raw))
    check_structure(body, surrogates=SURROGATE_ESCAPE.search(raw) is not None)
    return body


def _checked_holds_huge_float(body: dict[str, Any]) -> bool:
    """``check_structure``'s depth check and ``_holds_huge_float`` in one walk, level by
    level (each value visited once: a long conversation's thousands of them are the cost)."""
    level: list[Any] = [body]
    depth = 0
    huge = False
    while level:
        depth += 1
        _check_depth(depth)
        below: list[Any] = []
        for container in level:
            for value in container.values() if type(container) is dict else container:
                kind = type(value)
                if kind is dict or kind is list:
                    below.append(value)
                elif kind is float and abs(value) >= _HUGE:
                    huge = True
        level = below
    return huge


def parse_object(raw: bytes) -> dict[str, Any]:
    _check_not_empty(raw)
    value = _parse_fast(raw)
    if isinstance(value, dict):
        return without_engine_controls(value)
    return without_engine_controls(_parse_strict(raw))


def _parse_fast(raw: bytes) -> Any:
    """orjson's parse (a 120 kB history in a third of the standard library's time), or
    None where the standard library must decide: whatever orjson refuses (the standard
    library's verdict and message are the ones clients get), and any body holding a float
    of 2**63 or more, which may be an integer orjson read as a float (parsed again exactly)."""
    value = _orjson_or_none(raw)
    return None if _holds_huge_float(value) else value


def _check_not_empty(raw: bytes) -> None:
    if not raw.strip():
        raise BadRequestError("request body is empty; expected a JSON object")


def _orjson_or_none(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _holds_huge_float(value: Any) -> bool:
    level: list[Any] = [value]
    while level:
        below: list[Any] = []
        for item in level:
            if type(item) is dict:
                below += item.values()
            elif type(item) is list:
                below += item
            elif type(item) is float and abs(item) >= _HUGE:
                return True
        level = below
    return False


def _parse_strict(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")  # RFC 8259: JSON on the wire is UTF-8, never sniffed
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"request body is not valid UTF-8: {exc.reason} at byte "
                              f"{exc.start}") from exc
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise BadRequestError("request body nests JSON too deeply") from exc
    except ValueError as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise BadRequestError("request body must be a JSON object")
    return value


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _check_depth(depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise BadRequestError(f"request body nests JSON too deeply (more than "
                              f"{MAX_JSON_DEPTH} levels)")


def check_structure(body: dict[str, Any], *, surrogates: bool) -> None:
    """Nesting depth, level by level over the containers only (no recursion: a hostile
    body cannot exhaust the stack here either; strings are not visited, so a large
    conversation costs little), and lone surrogates when the raw body has escapes."""
    level: list[Any] = [body]
    depth = 0
    while level:
        depth += 1
        _check_depth(depth)
        below: list[Any] = []
        for container in level:
            values = container.values() if type(container) is dict else container
            below += [v for v in values if type(v) is dict or type(v) is list]
        level = below
    if surrogates:
        _check_surrogates(body)


def _check_surrogates(body: dict[str, Any]) -> None:
    stack: list[Any] = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack += value.keys()
            stack += value.values()
        elif isinstance(value, list):
            stack += value
        elif isinstance(value, str) and _LONE_SURROGATE.search(value):
            raise BadRequestError("request body has a lone UTF-16 surrogate escape "
                                  "(\\uD800-\\uDFFF): not valid Unicode text")


def check_field_types(body: Mapping[str, Any], types: Mapping[str, tuple[str, ...]]) -> None:
    # The body's own fields looked up in ``types`` (a short body has a handful of the
    # dozen-odd checked ones); only on a failure is ``types`` walked in its own order, so
    # the field named is the same one whatever order the body lists them in.
    for name, value in body.items():
        allowed = types.get(name)
        if allowed is not None and value is not None and not any(
                _is_type(value, kind) for kind in allowed):
            break
    else:
        return
    for name, allowed in types.items():
        value = body.get(name)
        if value is not None and not any(_is_type(value, kind) for kind in allowed):
            raise BadRequestError(f"'{name}' must be {' or '.join(allowed)}, got "
                                  f"{_json_type(value)}", param=name)


def _is_type(value: object, kind: str) -> bool:
    if isinstance(value, bool):
        return kind == JSON_BOOL
    if kind == JSON_INT:
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if kind == JSON_NUMBER:
        return isinstance(value, int | float)
    if kind == JSON_STR:
        return isinstance(value, str)
    if kind == JSON_OBJECT:
        return isinstance(value, dict)
    return kind == JSON_ARRAY and isinstance(value, list)


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return JSON_BOOL
    if isinstance(value, int | float):
        return JSON_NUMBER
    if isinstance(value, str):
        return JSON_STR
    return JSON_OBJECT if isinstance(value, dict) else JSON_ARRAY


def check_messages(messages: object, max_messages: int, *, start: int = 0) -> None:
    """``start``: the messages before it were checked with an earlier body."""
    if not isinstance(messages, list):
        raise BadRequestError("'messages' is required and must be an array", param="messages")
    # An empty list is the engine's to judge: llama-server renders the template's empty
    # prompt and generates, Ollama answers 400 (relayed as it says).
    if len(messages) > max_messages:
        raise BadRequestError(f"'messages' has {len(messages)} entries; the limit is "
                              f"{max_messages}", param="messages")
    for index in range(start, len(messages)):
        _check_message(index, messages[index])


def _check_message(index: int, message: object) -> None:
    # Runs for every message of every request (hundreds in a long agent session): the
    # common, valid case is a few type checks; the error text is built only on failure.
    if not isinstance(message, dict):
        raise BadRequestError(f"'messages[{index}]' must be an object",
                              param=f"messages[{index}]")
    role = message.get("role")
    if not isinstance(role, str) or role not in KNOWN_ROLES:
        where = f"messages[{index}]"
        raise BadRequestError(f"'{where}.role' must be one of {sorted(KNOWN_ROLES)}, "
                              f"got {role!r}", param=f"{where}.role")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        _check_content_parts(f"messages[{index}]", content)
    for name in MESSAGE_STRING_FIELDS:
        value = message.get(name)
        if value is not None and not isinstance(value, str):
            where = f"messages[{index}]"
            raise BadRequestError(f"'{where}.{name}' must be a string", param=f"{where}.{name}")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        _check_tool_calls(f"messages[{index}]", tool_calls)


def _check_content_parts(where: str, content: object) -> None:
    if not isinstance(content, list):
        raise BadRequestError(f"'{where}.content' must be a string, an array of parts or null",
                              param=f"{where}.content")
    if not all(isinstance(part, dict) for part in content):
        raise BadRequestError(f"'{where}.content' parts must be objects", param=f"{where}.content")


def _check_tool_calls(where: str, tool_calls: object) -> None:
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise BadRequestError(f"'{where}.tool_calls' must be an array",
                              param=f"{where}.tool_calls")
    for index, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{index}]"
        if not isinstance(call, dict):
            raise BadRequestError(f"'{at}' must be an object", param=at)
        function = call.get("function")
        if function is not None and not isinstance(function, dict):
            raise BadRequestError(f"'{at}.function' must be an object", param=f"{at}.function")


def _check_prompt(prompt: object) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt and all(
        isinstance(item, str | int) and not isinstance(item, bool) for item in prompt
    ):
        return
    raise BadRequestError("'prompt' is required: a string, or an array of strings or token ids",
                          param="prompt")


def optional_bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequestError(f"'{name}' must be a boolean", param=name)
    return value


class TooManyValuesError(PayloadTooLargeError):
    code = "too_many_values"
    limit = "json_values"


def separators_in(raw: bytes | bytearray) -> int:
    """How many JSON values ``raw`` may hold, at most, past its first: every value but the
    first follows a ``,`` or opens with ``[`` or ``{`` (a count of bytes, C-fast;
    separators inside strings count too, so ``--max-json-values`` errs towards refusing
    only bodies far past any agent's). Parsing allocates per value, and tens of millions
    of tiny ones (``[0,0,...]``) would take seconds and gigabytes: such a body is refused
    by this count before it is parsed, indeed before it is all read (``read_body``). A
    byte absent is looked for (memchr) rather than counted: ten times faster, and a body
    of filler has none."""
    return sum(raw.count(byte) for byte in _SEPARATORS if byte in raw)


_SEPARATORS = (b",", b"[", b"{")


def _too_many_values(max_values: int) -> TooManyValuesError:
    return TooManyValuesError(f"request body holds more than {max_values} JSON values "
                              "(--max-json-values)")


def _too_large(max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"request body exceeds the limit of {max_bytes} bytes "
                                "(--max-body)")


# llama-server's native completion API (``/completion``, ``/completions``, ``/infill``). Its
# fields are llama-server's to judge (``logit_bias`` as pairs, ``n_probs``, ``samplers``,
# ...): only what the proxy itself reads is checked here. ``n`` is llama-server's alias of
# ``n_cmpl`` on these paths, an engine control like it (``ENGINE_CONTROLS``).
LLAMA_NATIVE_CONTROLS = ("n",)


def parse_llama_request(raw: bytes, endpoint: Endpoint, path: str) -> ClientRequest:
    """A body of llama-server's native API: ``endpoint`` "completions" (``/completion``,
    ``/completions``: a ``prompt``, in any of the forms llama-server reads) or "infill"
    (``/infill``: ``input_prefix``, ``input_suffix``, optional ``input_extra`` chunks and
    ``prompt``). ``stream`` defaults to false, as on llama-server."""
    body = parse_object(raw)
    for key in LLAMA_NATIVE_CONTROLS:
        body.pop(key, None)
    check_structure(body, surrogates=SURROGATE_ESCAPE.search(raw) is not None)
    if endpoint == "infill":
        _check_infill(body)
    else:
        _check_native_prompt(body.get("prompt"))
    return ClientRequest(endpoint, path, body, optional_bool(body, "stream"), False,
                         optional_bool(body, "return_progress"), "llama")


def _check_native_prompt(prompt: object) -> None:
    """A string, an array (token ids and strings mixed, or several prompts: strings, token
    lists, objects), or an object with ``prompt_string`` (and ``multimodal_data``): the
    elements are llama-server's to read."""
    if isinstance(prompt, str | list | dict):
        return
    raise BadRequestError("'prompt' is required: a string, an array of token ids and "
                          "strings, an array of prompts, or an object with 'prompt_string'",
                          param="prompt")


def _check_infill(body: Mapping[str, Any]) -> None:
    """llama-server's own checks of ``/infill`` (``post_infill``); the prefix and suffix
    may be token arrays there too (tokenized as a mixed prompt)."""
    for name in ("input_prefix", "input_suffix"):
        value = body.get(name)
        if not isinstance(value, str) and not _is_mixed_prompt(value):
            raise BadRequestError(f"\"{name}\" is required: a string (or an array of token "
                                  "ids and strings)", param=name)
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise BadRequestError("\"prompt\" must be a string", param="prompt")
    extra = body.get("input_extra")
    if extra is None:
        return
    if not isinstance(extra, list):
        raise BadRequestError("\"input_extra\" must be an array of {\"filename\": string, "
                              "\"text\": string}", param="input_extra")
    for index, chunk in enumerate(extra):
        where = f"input_extra[{index}]"
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise BadRequestError("extra_context chunk must contain a \"text\" field with a "
                                  "string value", param=where)
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise BadRequestError("extra_context chunk's \"filename\" field must be a string",
                                  param=f"{where}.filename")


def _is_mixed_prompt(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, str | int) and not isinstance(item, bool) for item in value)

"""Anthropic Messages bodies read as OpenAI chat bodies, and answers written back as
Anthropic content blocks (sans-IO: dicts in, dicts out).

``convert_request`` is a port of llama-server's own ``server_chat_convert_anthropic_to_oai``
(tools/server/server-chat.cpp), so that a body sent through the proxy renders the prompt
llama-server renders when it serves ``/v1/messages`` itself:

- ``system``: a string, or the text of its ``text`` blocks concatenated (no separator),
  each with Claude Code's billing line normalized (``cch=<5 chars>;`` becomes
  ``cch=fffff;``: it changes on every request and would end every cache hit there; and
  ``cc_version``'s suffix, ``2.1.328.b7f`` becoming ``2.1.328.fff``: a hash of the first
  user message, it differs per conversation and per sub-agent, and would keep sessions
  from sharing their system prompt and tools: ``proxy.parking.openings``);
- each message: string content as it came (a ``system`` role inside ``messages``, which
  Claude Code 2.1 sends, included); block content as one message of the same role with
  the ``text`` blocks as content parts, ``image`` blocks as ``image_url`` parts,
  ``thinking`` blocks joined as ``reasoning_content``, ``tool_use`` blocks as
  ``tool_calls`` (``input`` serialized compactly, in the client's key order), then one
  ``tool`` message per ``tool_result`` (its text joined, or its parts when it holds an
  image); an assistant message without content, and a message whose blocks leave nothing,
  are dropped;
- ``tools`` as functions, ``tool_choice`` (auto: "auto"; any or tool: "required"),
  ``stop_sequences`` as ``stop``, ``max_tokens`` (4096 when absent), ``temperature``,
  ``top_p``, ``top_k``, ``stream`` and ``chat_template_kwargs`` as they came, and
  ``thinking: {"type": "enabled"}`` as ``thinking_budget_tokens`` (10000 by default).

Where this differs from llama-server, on purpose:

- ``cache_control`` is dropped from the text blocks kept as content parts. No chat
  template renders it (llama-server reads only ``type`` and ``text`` of a part), but
  Claude Code moves the marker to the latest message on every turn, so kept, it would
  make every earlier message's bytes differ from what the session committed;
- ``metadata`` is kept as the client sent it (llama-server turns it into
  ``__metadata_user_id``): ``proxy.session.identity`` reads Claude Code's session there;
- ``model`` is kept: an engine that routes by model, or requires one (Ollama), needs it;
- with ``stop_sequences``, llama-server is asked for the stop string that ended the answer
  (``ask_stopping_word``): its own ``/v1/messages`` answers it as ``stop_sequence``, and its
  chat stream says it only there.

``check_request`` is what the proxy refuses before converting, naming the field.
``answer_blocks`` writes an assistant chat message (an aggregated answer) as the content
blocks llama-server's ``to_json_anthropic`` answers with: thinking (with an empty
signature), text, then one ``tool_use`` per call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from prefixpin.core.errors import BadRequestError
from prefixpin.proxy.pipeline.validation import (
    JSON_ARRAY,
    JSON_BOOL,
    JSON_INT,
    JSON_NUMBER,
    JSON_OBJECT,
    JSON_STR,
    check_field_types,
)

BILLING_PREFIX = "x-anthropic-billing-header:"
_CCH_LENGTH = 5
_CC_VERSION = re.compile(r"(cc_version=\d+\.\d+\.\d+\.)([0-9a-f]{1,8})(?=;)")
DEFAULT_MAX_TOKENS = 4096
DEFAULT_THINKING_BUDGET = 10000
PASSED_THROUGH = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
ROLES = ("user", "assistant", "system")  # "system": Claude Code 2.1 sends one in messages

# The Anthropic request fields the proxy checks; null passes (the engine's default).
FIELD_TYPES: dict[str, tuple[str, ...]] = {
    "model": (JSON_STR,), "max_tokens": (JSON_INT,), "stream": (JSON_BOOL,),
    "system": (JSON_STR, JSON_ARRAY),
    "tools": (JSON_ARRAY,), "tool_choice": (JSON_OBJECT,), "stop_sequences": (JSON_ARRAY,),
    "temperature": (JSON_NUMBER,), "top_p": (JSON_NUMBER,), "top_k": (JSON_INT,),
    "metadata": (JSON_OBJECT,), "thinking": (JSON_OBJECT,), "chat_template_kwargs": (JSON_OBJECT,),
}


# -- the request -------------------------------------------------------------------------


def normalize_billing_header(text: str) -> str:
    """Claude Code's ``x-anthropic-billing-header: cc_version=2.1.328.b7f; ...; cch=a5145;``
    with its per-request ``cch`` stamp and its per-conversation version suffix made
    constant (``cch=fffff;``, ``2.1.328.fff``); any other text as it is. The stamp as
    llama-server does: only when the text starts with the header and five characters and a
    ``;`` follow the first ``cch=`` after it."""
    if not text.startswith(BILLING_PREFIX):
        return text
    text = _CC_VERSION.sub(lambda m: m[1] + "f" * len(m[2]), text, count=1)
    at = text.find("cch=", len(BILLING_PREFIX))
    if at == -1:
        return text
    start = at + 4
    end = start + _CCH_LENGTH
    if end < len(text) and text[end] == ";":
        return text[:start] + "f" * _CCH_LENGTH + text[end:]
    return text


def convert_request(body: Mapping[str, Any],
                    converted: Sequence[Sequence[dict[str, Any]]] | None = None
                    ) -> dict[str, Any]:
    """The OpenAI chat body of an Anthropic Messages body (checked by ``check_request``);
    ``converted``: what each of its messages converts to (``convert_messages``), where the
    caller has it."""
    out: dict[str, Any] = {}
    if "model" in body:
        out["model"] = body["model"]
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": system_text(system)})
    for each in convert_messages(body["messages"]) if converted is None else converted:
        messages += each
    out["messages"] = messages
    tools = body.get("tools")
    if isinstance(tools, list):
        out["tools"] = [_tool(tool) for tool in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):
        kind = _text(choice, "type")
        if kind == "auto":
            out["tool_choice"] = "auto"
        elif kind in ("any", "tool"):
            out["tool_choice"] = "required"
    if "stop_sequences" in body:
        out["stop"] = body["stop_sequences"]
        if body["stop_sequences"]:
            # The chat stream does not say which stop string ended it; its final event's
            # debug object does, cut to that one field (the answer's ``stop_sequence``).
            out.update(ask_stopping_word())
    out["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    for key in PASSED_THROUGH:
        if key in body:
            out[key] = body[key]
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and _text(thinking, "type") == "enabled":
        out["thinking_budget_tokens"] = _integer(thinking.get("budget_tokens"),
                                                 DEFAULT_THINKING_BUDGET)
    if "metadata" in body:
        out["metadata"] = body["metadata"]
    return out


def ask_stopping_word() -> dict[str, Any]:
    """What makes llama-server name the stop string that ended its answer: its final chat
    chunk then carries ``"__verbose": {"stopping_word": ...}``, its debug object cut to that
    one field (engines that do not know the fields ignore them)."""
    return {"verbose": True, "response_fields": ["stopping_word"]}


def system_text(system: object) -> str:
    """The one system message's text: the string, or its text blocks' text joined."""
    if isinstance(system, str):
        return normalize_billing_header(system)
    if isinstance(system, list):
        return "".join(normalize_billing_header(_text(block, "text")) for block in system
                       if _text(block, "type") == "text")
    return ""


def convert_messages(messages: Sequence[Mapping[str, Any]],
                     earlier: tuple[tuple[dict[str, Any], ...], ...] = ()
                     ) -> tuple[tuple[dict[str, Any], ...], ...]:
    """What each message converts to. ``earlier``: what the first of them converted to
    with an earlier body, the same objects (``proxy.pipeline.body_memo``): a message's
    conversion reads that message alone, so only the rest are converted."""
    return (*earlier, *(tuple(convert_message(message))
                        for message in messages[len(earlier):]))


def convert_message(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages one Anthropic message becomes (none, one, or one and a tool
    message per tool result)."""
    role = _text(message, "role")
    if "content" not in message:
        return [] if role == "assistant" else [dict(message)]
    content = message["content"]
    if not isinstance(content, list):
        return [dict(message)]  # a string (a null is refused before)
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = _text(block, "type")
        if kind == "text":
            parts.append({k: v for k, v in block.items() if k != "cache_control"})
        elif kind == "thinking":
            reasoning += _text(block, "thinking")
        elif kind == "image":
            image = _image_part(block)
            if image is not None:
                parts.append(image)
        elif kind == "tool_use":
            arguments = block.get("input")
            calls.append({"id": _text(block, "id"), "type": "function", "function": {
                "name": _text(block, "name"),
                "arguments": dump_json({} if arguments is None else arguments)}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": _text(block, "tool_use_id"),
                            "content": _tool_result_content(block.get("content"))})
    out: list[dict[str, Any]] = []
    if parts or calls or reasoning:
        converted: dict[str, Any] = {"role": role, "content": _one_text(parts) or ""}
        if calls:
            converted["tool_calls"] = calls
        if reasoning:
            converted["reasoning_content"] = reasoning
        out.append(converted)
    return out + results


def _one_text(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A content of one plain text part as that text: every chat template renders the two
    alike (llama.cpp joins text parts into the string, or wraps a string as the one
    part), and Claude Code sends an earlier message as one block in one turn and as a
    string in the next (its environment message, once its cache_control moved on): the
    committed history must not see a change there (a parked session would be declined)."""
    if len(parts) == 1 and parts[0].keys() == {"type", "text"} and isinstance(
            parts[0]["text"], str):
        return str(parts[0]["text"])
    return parts


def dump_json(value: Any) -> str:
    """JSON as llama-server's ``dump()`` writes it: compact, in the given key order, UTF-8."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _tool(tool: Any) -> dict[str, Any]:
    schema = tool["input_schema"] if isinstance(tool, Mapping) and "input_schema" in tool \
        else {}
    return {"type": "function", "function": {"name": _text(tool, "name"),
                                             "description": _text(tool, "description"),
                                             "parameters": schema}}


def _image_part(block: Mapping[str, Any]) -> dict[str, Any] | None:
    source = block.get("source")
    kind = _text(source, "type")
    if kind == "base64":
        media_type = _text(source, "media_type", "image/jpeg")
        url = f"data:{media_type};base64,{_text(source, 'data')}"
    elif kind == "url":
        url = _text(source, "url")
    else:
        return None
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result_content(content: object) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    text: list[str] = []
    parts: list[dict[str, Any]] = []
    images = False
    for item in content:
        kind = _text(item, "type")
        if kind == "text":
            text.append(_text(item, "text"))
            parts.append({"type": "text", "text": text[-1]})
        elif kind == "image":
            images = True
            image = _image_part(item)
            if image is not None:
                parts.append(image)
    # Text only: one string, what every template renders; with an image, the parts.
    return parts if images else "".join(text)


def _text(value: object, key: str, default: str = "") -> str:
    """``json_value(value, key, default)`` for a string: the default when absent, null or
    of another type."""
    if isinstance(value, Mapping):
        found = value.get(key)
        if isinstance(found, str):
            return found
    return default


def _integer(value: object, default: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return int(value)


# -- what is refused ---------------------------------------------------------------------


def check_request(body: Mapping[str, Any], max_messages: int, *, start: int = 0) -> None:
    """The Anthropic body's own rules, each refusal naming its field. ``start``: the
    messages before it were checked with an earlier body (``check_messages``)."""
    check_field_types(body, FIELD_TYPES)
    check_messages(body.get("messages"), max_messages, start=start)
    system = body.get("system")
    if isinstance(system, list):
        for index, block in enumerate(system):
            where = f"system[{index}]"
            if not isinstance(block, Mapping) or block.get("type") != "text":
                _refuse(where, 'must be a text block ({"type": "text", "text": ...})')
            if not isinstance(block.get("text"), str):
                _refuse(f"{where}.text", "must be a string")
    tools = body.get("tools")
    if isinstance(tools, list):
        for index, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                _refuse(f"tools[{index}]", "must be an object")
    stop = body.get("stop_sequences")
    if isinstance(stop, list) and not all(isinstance(item, str) for item in stop):
        _refuse("stop_sequences", "must be an array of strings")


def check_messages(messages: object, max_messages: int, *, start: int = 0) -> None:
    """``start``: the messages before it were checked with an earlier body (a message's
    checks read that message alone)."""
    if not isinstance(messages, list):
        _refuse("messages", "is required and must be an array")
    # An empty list converts to an empty chat one, which the engine judges (llama-server
    # generates from the template's empty prompt, as its own /v1/messages does).
    if len(messages) > max_messages:
        _refuse("messages", f"has {len(messages)} entries; the limit is {max_messages}")
    for index in range(start, len(messages)):
        message = messages[index]
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            _refuse(where, "must be an object")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            _refuse(f"{where}.role",
                    f'must be "user" or "assistant" (or "system"), got {role!r}')
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            _refuse(f"{where}.content", "must be a string or an array of content blocks")
        for at, block in enumerate(content):
            _check_block(f"{where}.content[{at}]", block)


def _check_block(where: str, block: object) -> None:
    if not isinstance(block, Mapping):
        _refuse(where, "must be an object (a content block)")
    kind = block.get("type")
    if not isinstance(kind, str):
        _refuse(f"{where}.type", "must be a string")
    if kind == "text" and not isinstance(block.get("text"), str):
        _refuse(f"{where}.text", "must be a string")
    if kind == "tool_result":
        content = block.get("content")
        if isinstance(content, list):
            for at, item in enumerate(content):
                if not isinstance(item, Mapping) or not isinstance(item.get("type"), str):
                    _refuse(f"{where}.content[{at}]",
                            'must be an object with a string "type"')


def _refuse(field: str, what: str) -> NoReturn:
    raise BadRequestError(f"'{field}' {what}", param=field)


# -- the answer --------------------------------------------------------------------------


def answer_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An assistant chat message as Anthropic content blocks, in llama-server's order:
    thinking, text, tool_use (its ``input`` the parsed arguments, ``{}`` when they do not
    parse)."""
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    content = message.get("content")
    if isinstance(content, str) and content:
        blocks.append({"type": "text", "text": content})
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, Sequence) else ():
        if not isinstance(call, Mapping):
            continue
        function = call.get("function")
        function = function if isinstance(function, Mapping) else {}
        blocks.append({"type": "tool_use", "id": _text(call, "id"),
                       "name": _text(function, "name"),
                       "input": parse_arguments(function.get("arguments"))})
    return blocks


def parse_arguments(arguments: object) -> Any:
    """A tool call's arguments as the ``input`` llama-server answers: parsed, else ``{}``."""
    if not isinstance(arguments, str):
        return {}
    try:
        return json.loads(arguments)
    except ValueError:
        return {}

"""OpenAI Responses bodies as OpenAI chat-completions bodies, and back (sans-IO).

``to_chat`` is llama-server's own ``server_chat_convert_responses_to_chatcmpl``
(tools/server/server-chat.cpp, llama.cpp as vendored in llama-cpp-python 0.3.36), ported
branch by branch, so that the engine renders the prompt and samples exactly as its own
``/v1/responses`` would:

- ``instructions`` is a first ``system`` message; a string ``input`` one ``user`` message;
- input items, in order: a message of role user, system or developer (its string content
  read as one ``input_text`` part) keeps its role, its parts ``input_text`` -> ``text``,
  ``input_image`` -> ``image_url`` (``input_file`` is refused); an assistant output message
  (``output_text``/``input_text`` -> ``text``, ``refusal`` kept) is merged into the
  previous message when that is an assistant one; a ``function_call`` is a tool call of
  the previous assistant message (else of a new one), its ``call_id`` the tool call's id;
  a ``function_call_output`` is a ``tool`` message; a ``reasoning`` item is the
  ``reasoning_content`` of the previous assistant message (else of a new one, empty
  content);
- function tools only (``{"type": "function", "function": {...the rest, strict: true by
  default}}``; other tool types have no chat equivalent and are skipped, as llama-server
  skips them); ``max_output_tokens`` -> ``max_tokens``; ``reasoning.effort`` ->
  ``reasoning_effort``; every other field goes on as it came (llama-server copies the
  body), except the ones listed in ``DROPPED``.

Where this port deliberately differs, and why:

- Stored state the engine does not keep is refused, never silently ignored:
  ``previous_response_id``, ``conversation`` and ``prompt`` (a stored prompt template) are
  400s naming the field. (llama-server refuses ``previous_response_id`` too and ignores
  the other two, answering without the context they name.)
- A ``reasoning`` item without reasoning text (no ``content``, ``content: null`` or
  ``[]``: what OpenAI's encrypted reasoning, and Codex echoing it, carry) contributes
  nothing, where llama-server refuses the whole request: the engine has no text to render
  for it, and the model never saw it in this engine either. A ``summary`` is not needed.
- An assistant message without ``type`` (the SDK's ``EasyInputMessage``) is read as an
  output message; llama-server refuses it ("Cannot determine type of 'item'").
- Each converted message keeps only what llama.cpp renders. llama.cpp rebuilds every
  message from ``role``, ``content``, ``name``, ``tool_call_id``, ``tool_calls`` and
  ``reasoning_content`` (``common_chat_msgs_parse_oaicompat``) and the template sees
  nothing else, so an item's ``id``, ``status``, ``phase``, ``end_turn``... change no
  rendered byte; they are dropped so that the same turn echoed by different clients (the
  SDK keeps the ids, Codex drops them) is the same message for the proxy's byte
  comparisons. A content part keeps ``type`` and ``text`` (``image_url``/``refusal``).
- An assistant message's text parts are one string, joined with newlines as llama.cpp
  joins them (``_assistant_text``). llama.cpp makes that very string of the list for
  every string-only template, and the typed-content templates it ships render the two
  alike, except Kimi-K2's (moonshotai-Kimi-K2.jinja), which drops the list's text from a
  message with tool calls: the next turn's prompt then no longer extends what the model
  generated, and every tool-calling turn is prefilled again from that message on.
- Malformed values llama-server would trip over later (a non-string ``text``, a
  non-object item or tool, a function tool without a name) are 400s naming the field.

``reply_message`` builds the output items of a finished answer as the client sends them
back (``output_items``) and converts them with the same code, so the turn the planner
commits is byte for byte the message the next request's conversion will contain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixpin.core.errors import BadRequestError

# Fields of a Responses body that llama-server ignores (``params_from_json_cmpl`` and the
# chat parser read none of them), dropped so that they never reach the engine nor the
# proxy's digests of the body:
DROPPED = (
    "include",  # which extra output fields to return (encrypted reasoning): none exist here
    "store",  # whether OpenAI stores the response; nothing is stored (see the codec)
    "client_metadata",  # Codex's per-client bookkeeping, never part of the prompt
    "service_tier",  # an OpenAI billing tier
    "truncation",  # OpenAI's context overflow policy; llama-server refuses an over-long prompt
    "safety_identifier",  # an OpenAI abuse-monitoring id
    "background",  # OpenAI's asynchronous mode, which needs stored responses
)
# Kept, though some look like bookkeeping, because they change the answer or the proxy
# reads them: ``parallel_tool_calls`` and ``tool_choice`` (llama-server reads both: the
# tool-call grammar, and for some templates the prompt; a Responses-shaped object
# ``tool_choice`` is "auto" to llama-server, as it is here), ``prompt_cache_key`` and
# ``user`` (the session key, proxy.session.identity; Codex sets the first to its session id),
# ``metadata`` (identity reads ``metadata.user_id``), ``stream`` and ``stream_options``
# (the adapter sets its own), ``text``, ``top_logprobs`` and ``max_tool_calls``
# (llama-server ignores the first and the last, refuses ``top_logprobs`` without
# ``logprobs``: kept, so the engine answers as it does directly), and every llama.cpp
# sampling extension (``top_k``, ``min_p``, ``seed``, ``chat_template_kwargs``...).
# Stored state: the engine keeps none, so answering without it would be a wrong answer.
STATEFUL = ("previous_response_id", "conversation", "prompt")

INPUT_ROLES = frozenset({"user", "system", "developer"})
# An item's own keys a message keeps besides role and content: what else llama.cpp reads
# of an input or output message (common_chat_msgs_parse_oaicompat).
_RENDERED_KEYS = ("name",)


@dataclass(frozen=True, slots=True)
class Converted:
    """A Responses body as a chat body, with what the memo of resent bodies holds of it."""

    body: dict[str, Any]
    opened: tuple[dict[str, Any] | None, ...]  # per input item: ``convert_input``
    opening: int  # the chat messages before the input's (the instructions)
    reused: int  # the input's chat messages after them taken from an earlier body


def to_chat(source: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions body llama-server's ``/v1/responses`` would build from
    ``source``, the differences above included. ``BadRequestError`` naming the field."""
    return convert(source).body


def convert(source: Mapping[str, Any],
            earlier: Sequence[dict[str, Any] | None] = ()) -> Converted:
    """``to_chat``, the chat messages of the first input items taken from ``earlier``
    where they are final (``convert_input``)."""
    if "input" not in source:
        raise BadRequestError("'input' is required", param="input")
    for name in STATEFUL:
        value = source.get(name)
        if value is not None and value != "":
            raise BadRequestError(
                f"'{name}' is not supported: the engine behind this proxy keeps no stored "
                "responses, conversations or prompts; send the whole conversation in "
                "'input'", param=name)
    body: dict[str, Any] = {key: value for key, value in source.items()
                            if key not in DROPPED and key not in STATEFUL}
    body.pop("input", None)
    messages: list[dict[str, Any]] = []
    if "instructions" in source:
        instructions = body.pop("instructions")
        # llama-server: json_value(body, "instructions", ""), so null is an empty system
        # message (and a rendered one: it replaces a template's default system prompt).
        messages.append({"role": "system", "content": instructions or ""})
    opening = len(messages)
    opened, reused = convert_input(source["input"], messages, earlier)
    body["messages"] = messages
    if "tools" in body:
        tools = convert_tools(body.pop("tools"))
        if tools:
            body["tools"] = tools
    if "max_output_tokens" in body:
        limit = body.pop("max_output_tokens")
        if limit is not None:
            body["max_tokens"] = limit
    if "reasoning" in body:
        reasoning = body.pop("reasoning")
        if isinstance(reasoning, Mapping) and "effort" in reasoning:
            body["reasoning_effort"] = reasoning["effort"]
    return Converted(body, opened, opening, reused)


def convert_input(value: object, messages: list[dict[str, Any]],
                  earlier: Sequence[dict[str, Any] | None] = ()
                  ) -> tuple[tuple[dict[str, Any] | None, ...], int]:
    """Append the chat messages of a Responses ``input`` (a string, or a list of items).
    Returns, per item, the message it opened (None: it added to the message before it,
    or nothing), and how many messages were taken from ``earlier``.

    ``earlier``: what the first items opened with an earlier body whose first items were
    these (``proxy.pipeline.body_memo``). An item adds only to the last message, so once a
    later item opened another, a message is final: the messages before the last item of
    ``earlier`` that opened one are taken as they are (the same objects), and the items
    from that one on are converted again (it opens its message again: the same item after
    the same message)."""
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return (), 0
    if not isinstance(value, list):
        raise BadRequestError("'input' must be a string or an array of objects", param="input")
    resume = _last_opening(earlier)
    opened = list(earlier[:resume])
    kept = [message for message in opened if message is not None]
    messages += kept
    start = len(messages)
    for index in range(resume, len(value)):
        item = value[index]
        if not isinstance(item, Mapping):
            raise BadRequestError(f"'input[{index}]' must be an object", param=f"input[{index}]")
        count = len(messages)
        _convert_item(f"input[{index}]", item, messages)
        opened.append(messages[-1] if len(messages) > count else None)
    _assistant_text(messages, start)  # (the kept ones had theirs with the earlier body)
    return tuple(opened), len(kept)


def _last_opening(opened: Sequence[dict[str, Any] | None]) -> int:
    """The index of the last item that opened a message (0 where none did)."""
    for index in range(len(opened) - 1, -1, -1):
        if opened[index] is not None:
            return index
    return 0


def _assistant_text(messages: list[dict[str, Any]], start: int = 0) -> None:
    """An assistant message's text parts as one string, joined with newlines as llama.cpp
    joins them (``concat_content_parts``), and no parts as "" (what llama.cpp reads
    ``[]`` as). The same prompt for every template that renders a list of text parts as
    that string, which llama.cpp makes of the list itself for the string-only ones; and
    what the model generated, which the one template shipped with llama.cpp that does not
    (Kimi-K2: the text of a message with tool calls vanishes when it is a list) needs for
    the next turn's prompt to extend this one."""
    for message in messages[start:]:
        content = message.get("content")
        if message.get("role") == "assistant" and isinstance(content, list) and all(
                part.get("type") == "text" for part in content):
            message["content"] = "\n".join(part["text"] for part in content)


def _convert_item(where: str, item: Mapping[str, Any], messages: list[dict[str, Any]]) -> None:
    merge = bool(messages) and messages[-1].get("role") == "assistant"
    role, kind, content = item.get("role"), item.get("type"), item.get("content")
    if isinstance(content, str):
        # llama-server: only an input message has string content; read as one part.
        content = [{"text": content, "type": "input_text"}]
    if isinstance(content, list) and isinstance(role, str) and role in INPUT_ROLES:
        message: dict[str, Any] = {"role": role, "content": _input_parts(where, content)}
        _keep_rendered(item, message)
        messages.append(message)
    elif role == "assistant" and kind in ("message", None):
        parts = _output_parts(where, content)
        if merge:
            previous = messages[-1]
            if not isinstance(previous.get("content"), list):
                previous["content"] = []
            previous["content"].extend(parts)
        else:
            message = {"role": "assistant", "content": parts}
            _keep_rendered(item, message)
            messages.append(message)
    elif kind == "function_call":
        call = {"function": {"arguments": _string(where, item, "arguments"),
                             "name": _string(where, item, "name")},
                "id": _string(where, item, "call_id"), "type": "function"}
        if merge:
            calls = messages[-1].get("tool_calls")
            if not isinstance(calls, list):
                calls = messages[-1]["tool_calls"] = []
            calls.append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id = _string(where, item, "call_id")
        output = item.get("output")
        if not isinstance(output, str | list):
            raise BadRequestError(f"'{where}.output' must be a string or an array",
                                  param=f"{where}.output")
        messages.append({"content": output if isinstance(output, str) else _tool_output_parts(
            f"{where}.output", output), "role": "tool", "tool_call_id": call_id})
    elif kind == "reasoning":
        text = _reasoning_text(where, item)
        if text is None:
            return  # nothing the engine could render (encrypted or summary-only reasoning)
        if merge:
            messages[-1]["reasoning_content"] = text
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": text})
    else:
        raise BadRequestError(
            f"cannot determine the type of '{where}': expected a message (role user, system, "
            "developer or assistant), a function_call, a function_call_output or a "
            f"reasoning item, got type {kind!r}" + (f" role {role!r}" if role else ""),
            param=where)


def _keep_rendered(item: Mapping[str, Any], message: dict[str, Any]) -> None:
    for key in _RENDERED_KEYS:
        if isinstance(item.get(key), str):
            message[key] = item[key]


def _input_parts(where: str, content: list[Any]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if not isinstance(part, Mapping):
            raise BadRequestError(f"'{at}' must be an object", param=at)
        if kind == "input_text":
            if "text" not in part:
                raise BadRequestError(f"'{at}' (input_text) requires 'text'", param=f"{at}.text")
            parts.append({"text": _string(at, part, "text"), "type": "text"})
        elif kind == "input_image":
            # ``detail`` is optional and dropped, as llama-server drops it.
            if "image_url" not in part:
                raise BadRequestError(f"'{at}.image_url' is required", param=f"{at}.image_url")
            parts.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
        elif kind == "input_file":
            raise BadRequestError(f"'{at}': 'input_file' is not supported by llama.cpp",
                                  param=f"{at}.type")
        else:
            raise BadRequestError(f"'{at}.type' must be one of 'input_text', 'input_image' "
                                  f"or 'input_file', got {kind!r}", param=f"{at}.type")
    return parts


def _output_parts(where: str, content: object) -> list[dict[str, Any]]:
    if content is None:
        return []
    if not isinstance(content, list):
        raise BadRequestError(f"'{where}.content' must be a string or an array",
                              param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        if not isinstance(part, Mapping):
            raise BadRequestError(f"'{at}' must be an object", param=at)
        kind = part.get("type")
        if kind in ("output_text", "input_text"):
            parts.append({"text": _string(at, part, "text"), "type": "text"})
        elif kind == "refusal":
            parts.append({"refusal": _string(at, part, "refusal"), "type": "refusal"})
        else:
            raise BadRequestError(f"'{at}.type' must be one of 'output_text' or 'refusal', "
                                  f"got {kind!r}", param=f"{at}.type")
    return parts


def _tool_output_parts(where: str, output: list[Any]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(output):
        at = f"{where}[{index}]"
        if not isinstance(part, Mapping) or "type" not in part:
            raise BadRequestError(f"'{at}': the output of a tool call needs a 'type'", param=at)
        kind = part["type"]
        if kind == "input_text":
            parts.append({**part, "type": "text"})
        elif kind == "input_image":
            if "image_url" not in part:
                raise BadRequestError(f"'{at}.image_url' is required", param=f"{at}.image_url")
            parts.append({**part, "type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise BadRequestError(f"'{at}.type': the output of a tool call must be "
                                  f"'input_text' or 'input_image', got {kind!r}",
                                  param=f"{at}.type")
    return parts


def _reasoning_text(where: str, item: Mapping[str, Any]) -> str | None:
    """The text llama-server reads of a reasoning item (its first content part), or None
    when it has no content to read."""
    content = item.get("content")
    if content is None or content == []:
        return None
    if not isinstance(content, list):
        raise BadRequestError(f"'{where}.content' must be an array", param=f"{where}.content")
    first = content[0]
    if not isinstance(first, Mapping) or not isinstance(first.get("text"), str):
        raise BadRequestError(f"'{where}.content[0].text' must be a string",
                              param=f"{where}.content[0].text")
    text: str = first["text"]
    return text


def convert_tools(tools: object) -> list[dict[str, Any]]:
    """Responses function tools as chat tools; other tool types are skipped."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequestError("'tools' must be an array of objects", param="tools")
    converted: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise BadRequestError(f"'tools[{index}]' must be an object", param=f"tools[{index}]")
        if tool.get("type") != "function":
            continue  # web_search, local_shell, custom...: no chat equivalent (llama-server)
        function = {key: value for key, value in tool.items() if key != "type"}
        if not isinstance(function.get("name"), str):
            raise BadRequestError(f"'tools[{index}].name' must be a string",
                                  param=f"tools[{index}].name")
        function.setdefault("strict", True)
        converted.append({"type": "function", "function": function})
    return converted


def _string(where: str, item: Mapping[str, Any], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise BadRequestError(f"'{where}.{name}' must be a string", param=f"{where}.{name}")
    return value


# --- the answer, as output items and as the message they convert to ----------------------

def output_items(message: Mapping[str, Any], *, ids: Mapping[str, str] | None = None
                 ) -> list[dict[str, Any]]:
    """The output items of an assistant chat message, as llama-server's ``/v1/responses``
    writes them (``to_json_oaicompat_resp``): reasoning, then the message, then each
    function call; an empty part is no item. ``ids``: ``reasoning`` and ``message`` item
    ids (made up when absent); a function call's ids come from its tool call id."""
    ids = ids or {}
    items: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        items.append(reasoning_item(ids.get("reasoning", "rs_0"), reasoning, "completed"))
    content = message.get("content")
    if isinstance(content, str) and content:
        items.append(message_item(ids.get("message", "msg_0"), content, "completed"))
    for position, call in enumerate(message.get("tool_calls") or []):
        if not isinstance(call, Mapping):
            continue
        function: Mapping[str, Any] = (call["function"] if isinstance(call.get("function"),
                                                                      Mapping) else {})
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            call_id = fallback_call_id(position)
        items.append(function_call_item(call_id, str(function.get("name") or ""),
                                        str(function.get("arguments") or ""), "completed"))
    return items


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"text": text, "type": "reasoning_text"}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content,
            "encrypted_content": "", "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A function call item. Its ``call_id`` is the engine's tool call id as it is: the
    client sends it back as the ``call_id`` of the call and of its output, which become the
    tool call's ``id`` and the tool message's ``tool_call_id`` again, so a template that
    renders ids renders the engine's own (llama-server prefixes ``call_``, which changes
    them)."""
    return {"id": f"fc_{call_id}", "type": "function_call", "status": status,
            "arguments": arguments, "call_id": call_id, "name": name}


def fallback_call_id(position: int) -> str:
    """The call id of a tool call the engine gave none (llama-server and Ollama always
    do): the same in the stream, the whole answer and the reply."""
    return f"call_{position}"


def reply_message(items: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The assistant message the client's echo of ``items`` converts to (what the next
    request's ``input`` contains for this turn); None for an answer without items."""
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        _convert_item(f"output[{index}]", item, messages)
    _assistant_text(messages)
    if len(messages) != 1:
        return None  # no items; several messages never come of one answer's items
    return messages[0]

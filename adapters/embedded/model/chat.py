"""Chat prompt rendering from the GGUF's own Jinja template, the way llama-server feeds it.

The environment matches llama-cpp-python's ``Jinja2ChatFormatter`` (HF transformers rules:
sandboxed, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, a pass-through
``{% generation %}`` tag, non-ASCII ``tojson``). The messages are first normalized as
llama-server normalizes them (common/chat.cpp, ``common_chat_msg::to_json_oaicompat``):
``content`` becomes a string (text parts joined with newlines, null becomes ""), empty
``reasoning_content``/``name``/``tool_call_id`` are dropped, tool-call arguments become JSON
strings. The render context carries what llama-server's carries: ``messages``, ``tools``
(only when given), ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``enable_thinking``, ``date_string``/``datetime``, then ``chat_template_kwargs`` on top.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from prefixpin.adapters.embedded.api.wire import compact_json
from prefixpin.adapters.embedded.errors import ApiError

# llama-server's fallback when a GGUF carries no template (common/chat.cpp, CHATML_TEMPLATE_SRC).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}"
)


class _IgnoreGenerationTags(jinja2.ext.Extension):
    """HF's ``{% generation %}...{% endgeneration %}`` marks spans for training; render as-is."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API declares a plain set)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError("Invalid 'content' type: expected string or array, got "
                       + compact_json(content))
    texts = [part.get("text", "") for part in content
             if isinstance(part, dict) and part.get("type") == "text"]
    return "\n".join(str(text) for text in texts)


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    if "name" not in function:
        raise ApiError("Missing tool call name: " + compact_json(call))
    arguments = function.get("arguments", "")
    normalized: dict[str, Any] = {
        "type": "function",
        "function": {
            "name": function["name"],
            "arguments": arguments if isinstance(arguments, str) else compact_json(arguments),
        },
    }
    if call.get("id"):
        normalized["id"] = call["id"]
    return normalized


def normalize_message(message: Any) -> dict[str, Any]:
    """One OpenAI message as llama-server hands it to the template."""
    if not isinstance(message, dict):
        raise ApiError("Expected 'messages' to contain objects")
    role = message.get("role", "")
    if role != "assistant" and "content" not in message:
        raise ApiError("All non-assistant messages must contain 'content'")
    if role == "assistant" and "content" not in message and "tool_calls" not in message:
        raise ApiError("Assistant message must contain either 'content' or 'tool_calls'!")
    normalized: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"))}
    for key in ("reasoning_content", "name", "tool_call_id"):
        if message.get(key):
            normalized[key] = message[key]
    if message.get("tool_calls"):
        normalized["tool_calls"] = [_tool_call(call) for call in message["tool_calls"]]
    return normalized


class ChatTemplate:
    """A compiled chat template plus the special-token strings it is rendered with."""

    def __init__(self, source: str | None, *, bos_token: str, eos_token: str,
                 vocab_adds_bos: bool) -> None:
        self.source = source or CHATML_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.vocab_adds_bos = vocab_adds_bos
        environment = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
            extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols])
        environment.filters["tojson"] = _tojson
        self._template = environment.from_string(self.source)

    def render(self, body: Mapping[str, Any]) -> str:
        """The prompt llama-server's /apply-template would return for this request body."""
        messages = body.get("messages")
        if messages is None:
            raise ApiError("'messages' is required")
        if not isinstance(messages, list):
            raise ApiError("Expected 'messages' to be an array")
        context = self._context(body, [normalize_message(m) for m in messages])
        try:
            prompt = self._template.render(**context)
        except jinja2.TemplateError as exc:
            raise ApiError(f"chat template error: {exc}") from exc
        # the tokenizer adds BOS itself, so a BOS the template printed would be doubled
        if self.vocab_adds_bos and self.bos_token and prompt.startswith(self.bos_token):
            prompt = prompt[len(self.bos_token):]
        return prompt

    def _context(self, body: Mapping[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
        now = datetime.now()
        context: dict[str, Any] = {
            "messages": messages,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "enable_thinking": True,
            "datetime": now.strftime("%b %d %Y"),
            "date_string": now.strftime("%d %b %Y"),
            "raise_exception": _raise_exception,
            "strftime_now": lambda fmt: datetime.now().strftime(fmt),
        }
        tools = body.get("tools")
        if isinstance(tools, list) and tools:
            context["tools"] = tools
        kwargs = body.get("chat_template_kwargs")
        if isinstance(kwargs, dict):
            context.update(kwargs)
        if body.get("reasoning_effort") == "none":
            context["enable_thinking"] = False
        if body.get("add_generation_prompt", True):
            context["add_generation_prompt"] = True
        return context

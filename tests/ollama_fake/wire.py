"""Reading Ollama's recorded fixtures and comparing the shapes of what two servers sent.

A "shape" is the JSON structure with values replaced by their types (constants such as
``object`` or ``system_fingerprint`` keep their value). Chunks are grouped by "kind" (content,
thinking, done, finish, usage, ...) because each kind has its own key set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "ollama"

# Maps whose keys depend on the model or the tool, not on Ollama's wire format.
OPEN_MAPS = frozenset({"model_info", "arguments"})
# Keys whose values are part of the format itself.
CONSTANTS = frozenset({"object", "system_fingerprint", "role", "type"})


def load_fixture(name: str) -> dict[str, Any]:
    fixture: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return fixture


def all_fixture_names() -> list[str]:
    return sorted(str(p.relative_to(FIXTURES).with_suffix("")) for p in FIXTURES.rglob("*.json"))


def shape(value: Any, key: str = "") -> Any:
    if key in OPEN_MAPS:
        return "object"
    if key in CONSTANTS and isinstance(value, str):
        return ("const", value)
    if isinstance(value, dict):
        return {k: shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        shapes = {json.dumps(shape(item), sort_keys=True) for item in value}
        return ("list", sorted(shapes))
    if isinstance(value, bool):
        return "bool"
    if value is None:
        return "null"
    return type(value).__name__


@dataclass(frozen=True)
class Parsed:
    """A response body split into its units: NDJSON objects, SSE data payloads or one body."""

    units: list[Any]
    raw: bytes


def parse_body(framing: str, raw: bytes) -> Parsed:
    text = raw.decode()
    if framing == "ndjson":
        assert text.endswith("\n"), "NDJSON must end each object with a newline"
        lines = text[:-1].split("\n")
        assert all(lines), "no blank lines: Ollama's clients cannot parse them"
        return Parsed([json.loads(line) for line in lines], raw)
    if framing == "sse":
        frames = text.split("\n\n")
        assert frames[-1] == "", "SSE must end with a blank line"
        payloads: list[Any] = []
        for frame in frames[:-1]:
            assert frame.startswith("data: "), frame
            assert "\n" not in frame, "one data line per event"
            data = frame.removeprefix("data: ")
            payloads.append(data if data == "[DONE]" else json.loads(data))
        return Parsed(payloads, raw)
    if framing == "text":
        return Parsed([text], raw)
    return Parsed([json.loads(text)], raw)


def fixture_units(response: dict[str, Any]) -> list[Any]:
    """The fixture's body as a list of units, like ``parse_body`` returns them."""
    body = response["body"]
    return list(body) if response["framing"] in {"ndjson", "sse"} else [body]


def native_kind(unit: dict[str, Any]) -> str:
    if "error" in unit:
        return "error"
    if unit.get("done"):
        return "done"
    message = unit.get("message", unit)
    if message.get("tool_calls"):
        return "tool_calls"
    if message.get("thinking"):
        return "thinking"
    return "content"


def openai_kind(unit: Any) -> str:
    if unit == "[DONE]":
        return "done_marker"
    if not unit["choices"]:
        return "usage"
    choice = unit["choices"][0]
    if choice.get("finish_reason"):
        return "finish"
    if unit["model"] == "":
        return "late_error"
    delta = choice.get("delta", {})
    base = ("tool_calls" if delta.get("tool_calls") else
            "reasoning" if delta.get("reasoning") else "content")
    return base + ("+role" if "role" in delta else "")


def kinds(fixture: dict[str, Any], units: list[Any]) -> list[str]:
    framing = fixture["response"]["framing"]
    if framing == "ndjson":
        return [native_kind(u) for u in units]
    if framing == "sse":
        return [openai_kind(u) for u in units]
    return ["body"]


def compress(sequence: list[str]) -> list[str]:
    out: list[str] = []
    for item in sequence:
        if not out or out[-1] != item:
            out.append(item)
    return out


def shapes_by_kind(kind_list: list[str], units: list[Any]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = {}
    for kind, unit in zip(kind_list, units, strict=True):
        grouped.setdefault(kind, []).append(shape(unit))
    return grouped

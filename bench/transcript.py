"""A recorded agent session: the true history that the rewriting clients replay.

A transcript is OpenAI chat JSON (``tools`` plus ``messages``). Its *steps* are the points
where the assistant answers: step k is the k-th assistant message, and the request for
step k carries every message before it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

FORMAT = "prefixpin-bench-transcript/1"
ReasoningStyle = Literal["field", "inline"]
Message = dict[str, Any]
JSON = dict[str, Any]


class TranscriptError(ValueError):
    """A transcript file is malformed or does not match this format version."""


@dataclass(frozen=True, slots=True)
class Transcript:
    name: str
    seed: int
    reasoning_style: ReasoningStyle
    tools: tuple[JSON, ...]
    messages: tuple[Message, ...]

    @property
    def steps(self) -> tuple[int, ...]:
        """Indices of the assistant messages: one request is sent before each of them."""
        return tuple(i for i, message in enumerate(self.messages)
                     if message["role"] == "assistant")

    def history_before(self, step: int) -> list[Message]:
        """The true messages the client holds when it asks for answer number ``step``."""
        return [dict(message) for message in self.messages[: self.steps[step]]]

    def to_json(self) -> JSON:
        return {"format": FORMAT, "name": self.name, "seed": self.seed,
                "reasoning_style": self.reasoning_style, "tools": list(self.tools),
                "messages": list(self.messages)}

    def dumps(self) -> str:
        """Canonical file text: byte-identical for equal transcripts."""
        return json.dumps(self.to_json(), indent=1, ensure_ascii=False) + "\n"


def from_json(data: JSON) -> Transcript:
    if data.get("format") != FORMAT:
        raise TranscriptError(f"unknown transcript format {data.get('format')!r}, want {FORMAT}")
    style = data["reasoning_style"]
    if style not in ("field", "inline"):
        raise TranscriptError(f"unknown reasoning_style {style!r}")
    return Transcript(name=str(data["name"]), seed=int(data["seed"]), reasoning_style=style,
                      tools=tuple(data["tools"]), messages=tuple(data["messages"]))


def load(path: Path) -> Transcript:
    try:
        return from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError) as exc:
        raise TranscriptError(f"{path}: {exc}") from exc


def transcripts_dir() -> Path:
    return Path(__file__).resolve().parent / "transcripts"


def load_named(name: str, directory: Path | None = None) -> Transcript:
    return load((directory or transcripts_dir()) / f"{name}.json")

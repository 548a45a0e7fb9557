"""llama-server's native completion API, through the pipeline: ``/completion`` and bare
``/completions`` (one handler on llama-server), and ``/infill``, what the editor plugins
(llama.vim, llama.vscode) send. The engine is asked on the client's own path; its events
are ``adapters.llama_native``'s frames.

Streamed: the headers and a ``: prefixpin`` comment at once, ``: <what the proxy waits
for>`` comments while the engine is silent (an SSE comment, which llama-server's own
``sse_ping_interval`` pings are too), then llama-server's events unchanged and in order,
ending with each prompt's ``"stop": true`` event (there is no ``[DONE]``). The proxy always
asks for ``return_progress``; a client that did not gets no progress event, as from
llama-server itself. The proxy reads the final event whole (``response_fields`` is taken
off the engine request by the adapter), so a client's ``response_fields`` is applied here,
as llama-server's ``json_get_nested_values`` does: to the final event, which then holds the
named fields only (a path with ``/`` unnested under its own name). A failure after the
headers: an error event in llama-server's own mid-stream shape, ``data: {"error": {...}}``
(``core.errors.error_event``), and a clean end of stream.

Whole (``stream: false``, the default here, and what llama.vim asks): the stream folded
into the body llama-server answers without streaming, one object per prompt (an array for
several, by ``index``). The final event is that body with ``content`` and ``tokens`` empty
and ``generation_settings.stream`` true; the fold puts back the streamed text, the tokens
(with ``return_tokens``), ``completion_probabilities`` (with ``n_probs``) and
``"stream": false``, and replays llama-server's ``n_indent`` cut (the stream has already
sent the text that the cut removes from the whole answer). Compared field by field with
llama-server's own answer, every field is reproduced except:

- ``timings`` (another run's clock) and anything a different run samples differently;
- text llama-server held back as the start of a stop word when the generation then ended
  by its length or end of sequence: llama-server never streams it, so the fold cannot have
  it (the whole answer has it);
- ``completion_probabilities`` with ``stop_type: "word"``: llama-server drops as many
  trailing entries as the stop word has tokens by its own tokenizer; the fold drops the
  trailing events that carried no text (a stop word's tokens stream empty), at least one;
- around a token that ends in an incomplete UTF-8 character, llama-server streams no event
  (its text comes with the token that completes the character): such a token is missing
  from ``tokens`` (``return_tokens``), the ``n_indent`` replay does not see it, and a
  character still incomplete when the generation ends is never streamed (the whole answer
  shows it as U+FFFD).

Errors before any byte: an engine's own JSON error body byte for byte (llama-server's
``{"error": {"code": <status>, "message", "type"}}``, e.g. its 501 for ``/infill`` on a
model without fill-in-the-middle tokens); the proxy's own (a refused body, the shared-cache
gate, a full queue) in the OpenAI-like shape of ``core.errors``, ``{"error": {"message",
"type", "param", "code"}}``: llama-server's fields, but ``code`` is the proxy's reason
(``shared_prompt_cache``, ``queue_full_lane``, ...) rather than the HTTP status, which the
response has already. Usage: none of the OpenAI kind; the cache figures
are the engine's own fields in the final event (``tokens_evaluated``, ``timings.cache_n``,
read by ``core.figures``), passed on as sent: nothing is filled in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.responses import Response

from prefixpin.core.errors import ProxyError, error_event, error_response
from prefixpin.core.frames import Frame, FrameKind
from prefixpin.core.sse import encode_comment, encode_data
from prefixpin.proxy.codecs.openai_sse import OPENING, SSE_HEADERS, SSE_MEDIA_TYPE
from prefixpin.proxy.pipeline.body_memo import BodyMemo
from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.pipeline.validation import Api, ClientRequest, Endpoint, parse_llama_request

JSON_MEDIA_TYPE = "application/json; charset=utf-8"  # llama-server's own
_PROGRESS, _PING, _DONE, _CHUNK = (FrameKind.PROGRESS, FrameKind.PING, FrameKind.DONE,
                                   FrameKind.CHUNK)


class LlamaNativeCodec:
    """llama-server's native SSE, for ``endpoint`` "completions" (``/completion``,
    ``/completions``) or "infill" (``/infill``)."""

    api: Api = "llama"
    engine_api: Api = "llama"
    media_type = SSE_MEDIA_TYPE
    headers: Mapping[str, str] = SSE_HEADERS
    opening = OPENING

    def __init__(self, endpoint: Endpoint, routes: tuple[str, ...]) -> None:
        self.name: str = f"llama-{endpoint}"
        self.endpoint: Endpoint = endpoint
        self.routes = routes

    def __repr__(self) -> str:
        return f"LlamaNativeCodec({self.endpoint!r})"

    def parse(self, raw: bytes, path: str, *, max_messages: int,
              memo: BodyMemo | None = None) -> ClientRequest:
        return parse_llama_request(raw, self.endpoint, path)

    def stream(self, client: ClientRequest, generation: Generation, *,
               fill_cached: bool) -> NativeView:
        return NativeView(client)

    def heartbeat(self, text: str) -> bytes:
        return encode_comment(text)

    def late_error(self, exc: ProxyError) -> bytes:
        return error_event(exc)

    def whole(self, client: ClientRequest, generation: Generation, *,
              fill_cached: bool) -> Response:
        answers = fold(generation.frames, client.body)
        fields = response_fields(client.body)
        if fields is not None:
            answers = [nested_values(fields, answer) for answer in answers]
        body: Any = answers[0] if len(answers) == 1 else answers
        return Response(_dumps(body).encode(), media_type=JSON_MEDIA_TYPE)

    def error_response(self, exc: ProxyError) -> Response:
        return error_response(exc)  # an engine's own JSON body byte for byte

    def reply(self, frames: Sequence[Frame]) -> Mapping[str, Any] | None:
        return None  # a completion has no assistant message


class NativeView:
    """One streaming client's view: llama-server's events as they came, without the
    progress it did not ask for, each final event cut to its ``response_fields``."""

    raw_chunks = False  # (``StreamEncoder``): not every chunk as its own bytes

    def heartbeat(self, text: str) -> bytes:
        return encode_comment(text)  # anywhere in the stream

    def __init__(self, client: ClientRequest) -> None:
        self._progress = client.wants_progress
        self._fields = response_fields(client.body)

    def encode(self, frames: Sequence[Frame]) -> bytes:
        return b"".join(part for part in map(self._bytes_for, frames) if part)

    def flush(self) -> bytes | None:
        return None  # nothing is ever held back

    def _bytes_for(self, frame: Frame) -> bytes | None:
        kind = frame.kind
        if kind is _PING:
            return None  # the proxy sends its own heartbeats
        if kind is _PROGRESS:
            return frame.raw if self._progress else None
        if self._fields is not None and frame.data is not None and frame.data.get(
                "stop") is True:
            return encode_data(_dumps(nested_values(self._fields, frame.data)))
        return frame.raw


def response_fields(body: Mapping[str, Any]) -> list[str] | None:
    """The client's ``response_fields``; None without (llama-server reads anything but an
    array of strings as none)."""
    fields = body.get("response_fields")
    if isinstance(fields, list) and fields and all(isinstance(f, str) for f in fields):
        return fields
    return None


def nested_values(paths: Sequence[str], answer: Mapping[str, Any]) -> dict[str, Any]:
    """llama-server's ``json_get_nested_values``: each path's value under the path itself
    (``timings/prompt_n`` unnested); a path that names nothing is left out."""
    out: dict[str, Any] = {}
    for path in paths:
        current: Any = answer
        for key in path.split("/"):
            if not isinstance(current, Mapping) or key not in current:
                break
            current = current[key]
        else:
            out[path] = current
    return out


def fold(frames: Sequence[Frame], body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The whole answer of each prompt, by ``index``, from its streamed events and final
    event (see the module docstring for what the stream cannot give back)."""
    streams: dict[int, _Folding] = {}
    for frame in frames:
        data = frame.data
        if data is None or frame.kind not in (_CHUNK, _DONE):
            continue
        index = data.get("index")
        folding = streams.setdefault(index if isinstance(index, int) else 0, _Folding())
        if data.get("stop") is True:
            folding.final = data
        else:
            folding.add(data)
    return [streams[index].whole(body) for index in sorted(streams)
            if streams[index].final is not None]


class _Folding:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.tokens: list[Any] = []
        self.probs: list[Any] = []
        self.final: Mapping[str, Any] | None = None

    def add(self, data: Mapping[str, Any]) -> None:
        content = data.get("content")
        self.parts.append(content if isinstance(content, str) else "")
        tokens = data.get("tokens")
        if isinstance(tokens, list):
            self.tokens += tokens
        probs = data.get("completion_probabilities")
        if isinstance(probs, list):
            self.probs += probs

    def whole(self, body: Mapping[str, Any]) -> dict[str, Any]:
        final = dict(self.final or {})
        stop_type = final.get("stop_type")
        content = "".join(self.parts)
        n_indent = body.get("n_indent")
        if (stop_type == "limit" and isinstance(n_indent, int)
                and not isinstance(n_indent, bool) and n_indent > 0):
            content = _indent_cut(self.parts, n_indent, content)
        final["content"] = content
        final["tokens"] = list(self.tokens) if body.get("return_tokens") is True else []
        settings = final.get("generation_settings")
        if isinstance(settings, Mapping) and "stream" in settings:
            final["generation_settings"] = {**settings, "stream": False}
        probs = self.probs
        if probs and stop_type == "word":
            probs = probs[:len(probs) - _stop_word_tokens(self.parts, len(probs))]
        if probs:
            final["completion_probabilities"] = probs
        return final


def _stop_word_tokens(parts: Sequence[str], most: int) -> int:
    """How many trailing tokens were the stop word's: those that streamed no text (at
    least one: the token that completed the word)."""
    empty = 0
    for part in reversed(parts):
        if part:
            break
        empty += 1
    return min(most, max(1, empty))


def _indent_cut(parts: Sequence[str], n_indent: int, content: str) -> str:
    """llama-server's ``n_indent`` stop, replayed over the streamed tokens
    (``process_token``): once a new line has been sent, each token checks the line after
    the newline last found; a line that has text indented less than ``n_indent`` ends the
    generation and is cut before its text. Applied only when it ends at the last token
    (where llama-server stopped); otherwise the streamed text stands."""
    generated = ""
    has_new_line = False
    last_nl = 0
    for index, text in enumerate(parts):
        generated += text
        if has_new_line:
            if last_nl > 0:
                pos = last_nl
                while pos < len(generated) and generated[pos] in " \t":
                    pos += 1
                if pos < len(generated) and pos - last_nl < n_indent:
                    return generated[:pos] if index == len(parts) - 1 else content
            found = generated.find("\n", last_nl)
            if found != -1:
                last_nl = found + 1
        if "\n" in text:
            has_new_line = True
    return content


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)

"""The embedded engine's HTTP surface: llama-server's routes, bodies and status codes.

Errors leave as llama-server sends them: ``{"error": {"code", "message", "type"}}`` with
the code as HTTP status. A streaming request gets its headers once the slot is assigned
and the cached prefix decided (before prefill), exactly when llama-server sends them; an
error found before that point is a plain JSON error, one found later an SSE error event.
While a request waits for a slot or for its result, a client disconnect cancels it.
"""

from __future__ import annotations

import asyncio
import secrets
import string
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prefixpin.adapters.embedded.api.facts import (
    fs_validate_filename,
    metrics_text,
    server_models,
    server_props,
)
from prefixpin.adapters.embedded.api.request import (
    CompletionOptions,
    parse_json_body,
    parse_options,
)
from prefixpin.adapters.embedded.api.wire import (
    SSE_DONE,
    ChatRenderer,
    Renderer,
    ResultMeta,
    TextRenderer,
    compact_json,
    is_last,
    sse,
)
from prefixpin.adapters.embedded.errors import ApiError
from prefixpin.adapters.embedded.model.generate import (
    STOP_LIMIT,
    Event,
    Failed,
    Finished,
    SlotStats,
)
from prefixpin.adapters.embedded.model.job import Job
from prefixpin.core.streaming import wait_disconnect

if TYPE_CHECKING:
    from prefixpin.adapters.embedded.api.seam import EngineSurface


T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]

# llama-server's SSE response headers (tools/server/server-http.cpp)
SSE_HEADERS = {"Content-Type": "text/event-stream", "X-Accel-Buffering": "no"}
_ID_ALPHABET = string.digits + string.ascii_uppercase + string.ascii_lowercase


def completion_id() -> str:
    """gen_chatcmplid(): "chatcmpl-" and 32 alphanumerics, for chat and text completions."""
    return "chatcmpl-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(32))


class _Json(JSONResponse):
    """Compact UTF-8 JSON, as nlohmann's dump() writes it."""

    media_type = "application/json; charset=utf-8"

    def render(self, content: Any) -> bytes:
        return compact_json(content).encode("utf-8")


def error_response(error: ApiError) -> Response:
    return _Json({"error": error.to_json()}, status_code=error.status_code)


def guarded(handler: Handler) -> Handler:
    """Translate the engine's ``ApiError`` into llama-server's error body."""

    async def wrapper(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)

    return wrapper


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``await work``, or None if the client goes away first (then ``work`` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if task.done() and not task.cancelled() else None


class Routes:
    """Request handlers bound to one engine."""

    def __init__(self, engine: EngineSurface) -> None:
        self.engine = engine

    def meta(self, options: CompletionOptions) -> ResultMeta:
        return ResultMeta(
            completion_id=completion_id(), model=self.engine.model_name,
            system_fingerprint=self.engine.build_info, include_usage=options.include_usage,
            return_progress=options.stream and options.return_progress)

    # -- completions ------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        body = parse_json_body(await request.body())
        prompt = await asyncio.to_thread(self.engine.template.render, body)
        tokens = await asyncio.to_thread(self.engine.model.tokenize, prompt,
                                         add_special=True, parse_special=True)
        options = parse_options(body)
        return await self._complete(request, body, tokens, ChatRenderer(self.meta(options)))

    async def completions(self, request: Request) -> Response:
        body = parse_json_body(await request.body())
        tokens = await asyncio.to_thread(self._completion_prompt, body)
        options = parse_options(body)
        renderer = TextRenderer(self.meta(options))
        if not tokens:  # an empty string prompt: llama-server answers with an empty result
            return self._empty_completion(options, renderer)
        return await self._complete(request, body, tokens, renderer)

    @staticmethod
    def _empty_completion(options: CompletionOptions, renderer: TextRenderer) -> Response:
        result = Finished(content="", stop_type=STOP_LIMIT, stopping_word="", truncated=False,
                          n_prompt=0, stats=SlotStats())
        if not options.stream:
            return _Json(renderer.complete(result))
        body = "".join(sse(chunk) for chunk in renderer.stream(result)) + SSE_DONE
        return Response(body, headers=SSE_HEADERS)

    def _completion_prompt(self, body: Mapping[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.engine.model.tokenize(prompt, add_special=True, parse_special=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)  # token ids are used verbatim, no BOS added
        if prompt is None:
            raise ApiError("\"prompt\" is required")
        if prompt == []:
            raise ApiError("\"prompt\" must not be empty")
        raise ApiError("the embedded engine takes one prompt: a string or an array of token ids")

    async def _complete(self, request: Request, body: Mapping[str, Any], tokens: list[int],
                        renderer: Renderer) -> Response:
        if isinstance(body.get("n"), int) and body["n"] != 1:
            raise ApiError("the embedded engine generates one choice per request (n = 1)")
        options = parse_options(body)
        job = await unless_disconnected(request, self.engine.start(tokens, options))
        if job is None:
            return Response(status_code=499)  # nobody reads it; the slot is untouched
        if options.stream:
            return await self._stream(request, job, renderer)
        result = await unless_disconnected(request, job.result())
        if result is None:
            job.cancel.set()
            return Response(status_code=499)
        if isinstance(result, Failed):
            return error_response(result.error)
        return _Json(renderer.complete(result))

    async def _stream(self, request: Request, job: Job, renderer: Renderer) -> Response:
        first = await unless_disconnected(request, job.events.get())
        if first is None:
            job.cancel.set()
            return Response(status_code=499)
        if isinstance(first, Failed):
            return error_response(first.error)
        return StreamingResponse(_sse_events(request, job, first, renderer),
                                 headers=SSE_HEADERS)

    # -- slots ------------------------------------------------------------------------

    async def get_slots(self, request: Request) -> Response:
        slots = [slot.to_json() for slot in self.engine.pool.slots]
        if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in slots):
            raise ApiError("no slot available", "unavailable_error")
        return _Json(slots)

    async def post_slot(self, request: Request) -> Response:
        engine = self.engine
        if engine.config.slot_save_path is None:
            engine.slot_file("")  # raises llama-server's 501
        try:
            id_slot = int(request.path_params["id_slot"])
        except ValueError:
            raise ApiError("Invalid slot ID") from None
        action = request.query_params.get("action", "")
        if action == "erase":
            return _Json({"id_slot": id_slot, "n_erased": await engine.erase_slot(id_slot)})
        if action not in ("save", "restore"):
            raise ApiError("Invalid action")
        filename = parse_json_body(await request.body()).get("filename")
        if filename is None:
            raise ApiError("[json.exception.out_of_range.403] key 'filename' not found",
                           "server_error")
        if not isinstance(filename, str) or not fs_validate_filename(filename):
            raise ApiError("Invalid filename")
        path = engine.slot_file(filename)
        if action == "save":
            n_saved, n_written, ms = await engine.save_slot(id_slot, path)
            return _Json({"id_slot": id_slot, "filename": filename, "n_saved": n_saved,
                          "n_written": n_written, "timings": {"save_ms": ms}})
        n_restored, n_read, ms = await engine.restore_slot(id_slot, path)
        return _Json({"id_slot": id_slot, "filename": filename, "n_restored": n_restored,
                      "n_read": n_read, "timings": {"restore_ms": ms}})

    # -- tokens and templates ---------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        body = parse_json_body(await request.body())
        content = body.get("content")
        if content is None:
            return _Json({"tokens": []})
        tokens = await asyncio.to_thread(self._tokenize_mixed, content,
                                         body.get("add_special") is True,
                                         body.get("parse_special") is not False)
        if body.get("with_pieces") is True:
            return _Json({"tokens": [self._with_piece(token) for token in tokens]})
        return _Json({"tokens": tokens})

    def _tokenize_mixed(self, content: Any, add_special: bool, parse_special: bool) -> list[int]:
        parts = content if isinstance(content, list) else [content]
        tokens: list[int] = []
        for index, part in enumerate(parts):
            if isinstance(part, str):
                tokens += self.engine.model.tokenize(
                    part, add_special=add_special and index == 0, parse_special=parse_special)
            elif isinstance(part, int):
                tokens.append(part)
            else:
                raise ApiError("content must be a string or an array of strings and token ids")
        return tokens

    def _with_piece(self, token: int) -> dict[str, Any]:
        piece = self.engine.model.piece(token, special=True)
        try:
            return {"id": token, "piece": piece.decode("utf-8")}
        except UnicodeDecodeError:
            return {"id": token, "piece": list(piece)}

    async def detokenize(self, request: Request) -> Response:
        tokens = parse_json_body(await request.body()).get("tokens") or []
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError("tokens must be an array of token ids")
        valid = [t for t in tokens if self.engine.model.is_valid_token(t)]
        return _Json({"content": self.engine.model.detokenize(valid)})

    async def apply_template(self, request: Request) -> Response:
        body = parse_json_body(await request.body())
        prompt = await asyncio.to_thread(self.engine.template.render, body)
        return _Json({"prompt": prompt})

    # -- server facts -----------------------------------------------------------------

    async def health(self, _request: Request) -> Response:
        return _Json({"status": "ok"})

    async def props(self, _request: Request) -> Response:
        return _Json(server_props(self.engine))

    async def models(self, _request: Request) -> Response:
        return _Json(server_models(self.engine))

    async def metrics(self, _request: Request) -> Response:
        engine = self.engine
        return Response(metrics_text(engine), media_type="text/plain; version=0.0.4",
                        headers={"Process-Start-Time-Unix": str(engine.start_time)})


async def _sse_events(request: Request, job: Job, first: Event,
                      renderer: Renderer) -> AsyncIterator[str]:
    """The SSE body. Leaving it early cancels the generation; so does a disconnect seen
    while nothing is being sent (an ASGI 2.4 server reports it only on the next send)."""
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    watcher.add_done_callback(lambda _: job.cancel.set())
    try:
        event = first
        while True:
            for chunk in renderer.stream(event):
                yield sse(chunk)
            if is_last(event):
                break
            event = await job.events.get()
        yield SSE_DONE
    finally:
        watcher.cancel()
        job.cancel.set()


def build_routes(engine: EngineSurface) -> list[Route]:
    routes = Routes(engine)
    table: list[tuple[str, Handler, str]] = [
        ("/health", routes.health, "GET"), ("/v1/health", routes.health, "GET"),
        ("/props", routes.props, "GET"), ("/metrics", routes.metrics, "GET"),
        ("/models", routes.models, "GET"), ("/v1/models", routes.models, "GET"),
        ("/slots", routes.get_slots, "GET"), ("/slots/{id_slot}", routes.post_slot, "POST"),
        ("/v1/chat/completions", routes.chat_completions, "POST"),
        ("/chat/completions", routes.chat_completions, "POST"),
        ("/v1/completions", routes.completions, "POST"),
        ("/tokenize", routes.tokenize, "POST"), ("/detokenize", routes.detokenize, "POST"),
        ("/apply-template", routes.apply_template, "POST"),
    ]
    return [Route(path, guarded(handler), methods=[method]) for path, handler, method in table]

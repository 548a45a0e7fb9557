"""A fake llama-server that speaks its streaming dialect, for unit tests and the overhead
benchmark. Its chunk shapes follow the real server's (``tools/server/server-task.cpp``:
progress chunks with ``prompt_progress``, ``timings`` on the last chunk, the usage chunk
with ``choices: []``, ``data: [DONE]``) and are checked against a real llama-server in
``tests/e2e``. It has a toy prefix cache per slot so figures move like the real ones.

Faults are injected by queueing them: ``engine.faults.append("bad_json")`` makes the next
generation request fail that way (``FAULTS`` lists them). In ``sequence`` mode every JSON
event carries ``"seq"``, its index in the stream, so a load test can check per stream that
no event was lost, duplicated or reordered.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

WORD = re.compile(r"\s*\S+|\s+")

# Before the response: "reset" (the connection drops), "context" (a 400), "not_sse" (a 200
# that is an HTML page). Mid-stream, after the first word: "bad_json", "non_object" (a JSON
# event that is not an object), "close" (the body ends without [DONE]), "error_event",
# "huge_event" (an event that never ends), "crash" (an exception: the server drops the
# connection); after prefill: "hang"; after [DONE]: "linger" (the body ends LINGER_S later,
# as from a server still busy with its side of the request).
FAULTS = ("reset", "context", "not_sse", "bad_json", "non_object", "close", "error_event",
          "huge_event", "crash", "hang", "linger")
LINGER_S = 2.0
HUGE_EVENT_BYTES = 65 * 1024 * 1024  # past the proxy's SSE decoder limit (64 MiB)


@dataclass(slots=True)
class FakeLlamaConfig:
    reply: str = "Hello from the fake engine, one word at a time."
    n_slots: int = 2
    n_ctx: int = 8192
    batch: int = 512
    prefill_s_per_token: float = 0.0
    token_delay_s: float = 0.0
    events_per_write: int = 1  # >1 batches SSE events per socket write, as a busy server does
    model: str = "fake-model.gguf"
    sequence: bool = False  # every JSON event carries "seq", its index in the stream
    fault_at: int = 1  # the token index a mid-stream fault replaces
    stall_s: float = 0.0  # the "stall" fault: this long silent before that token
    # The --cache-ram this fake declares in /props (``cache_ram``, MiB): 0 says its prompt
    # cache stays per slot. None: not declared, and the proxy assumes a shared host cache
    # (its flags are not readable: proxy.engine.engines.read_engine).
    cache_ram: int | None = None
    # The process kills itself with SIGSEGV, as an engine crashing in llama.cpp does: after
    # its first prefill batch ("prefill") or at token fault_at ("stream"). Only for a fake
    # in its own process (``main``: --die-at), never one in the test's.
    die_at: str | None = None


@dataclass(slots=True)
class _Slot:
    id: int
    tokens: list[str] = field(default_factory=list)
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)
    id_task: int = -1
    last_used: float = 0.0
    claims: int = 0  # requests that chose this slot and have not finished


class FakeLlamaServer:
    def __init__(self, config: FakeLlamaConfig | None = None) -> None:
        self.config = config or FakeLlamaConfig()
        self.slots = [_Slot(i) for i in range(self.config.n_slots)]
        self.requests: list[dict[str, Any]] = []
        self.started = time.time()
        # As llama-server: its "Process-Start-Time-Unix" is ggml_time_us() at start, a
        # microsecond monotonic clock (so two starts in one second still differ).
        self.start_us = time.monotonic_ns() // 1000
        self._task_ids = 0
        self.prompt_tokens_processed = 0
        # The last prompt's tokens: a bench resending one long conversation must not time
        # the fake's own tokenizer (the prompt is compared whole, so the memo cannot lie).
        self._last_tokens: tuple[str, list[str]] = ("", [])
        self.faults: list[str] = []
        self.metrics_served = 0  # the /metrics answers (the proxy's engine probes)

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", self._health),
            Route("/props", self._props),
            Route("/v1/models", self._models),
            Route("/slots", self._slots),
            Route("/slots/{id:int}", self._slot_action, methods=["POST"]),
            Route("/metrics", self._metrics),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
        ])

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _props(self, request: Request) -> Response:
        return JSONResponse({
            "default_generation_settings": {"n_ctx": self.config.n_ctx, "params": {}},
            "total_slots": self.config.n_slots, "model_alias": "", "model_path": self.config.model,
            "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n"
                             "{{ m.content }}<|im_end|>\n{% endfor %}",
            "build_info": "fake", "bos_token": "", "eos_token": "<|im_end|>",
            **({} if self.config.cache_ram is None else {"cache_ram": self.config.cache_ram}),
        })

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "owned_by": "llamacpp",
             "meta": {"n_ctx_train": self.config.n_ctx}}]})

    async def _slots(self, request: Request) -> Response:
        return JSONResponse([
            {"id": s.id, "n_ctx": self.config.n_ctx, "is_processing": s.busy.locked(),
             "id_task": s.id_task, "n_prompt_tokens": len(s.tokens)} for s in self.slots])

    async def _slot_action(self, request: Request) -> Response:
        slot = self.slots[request.path_params["id"] % len(self.slots)]
        if request.query_params.get("action") == "erase":
            n = len(slot.tokens)
            slot.tokens.clear()
            return JSONResponse({"id_slot": slot.id, "n_erased": n})
        return JSONResponse({"error": {"code": 400, "message": "Invalid action",
                                       "type": "invalid_request_error"}}, status_code=400)

    async def _metrics(self, request: Request) -> Response:
        self.metrics_served += 1
        text = f"llamacpp:prompt_tokens_total {self.prompt_tokens_processed}\n"
        return Response(text, headers={"Process-Start-Time-Unix": str(self.start_us)})

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"tokens": list(range(len(WORD.findall(body.get("content", "")))))})

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        fault = self.faults.pop(0) if self.faults else ""
        if fault == "reset":
            raise ConnectionResetError("fault injected: reset")
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "Failed to parse JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        self.requests.append(body)
        if fault == "not_sse":
            return Response("<html><body>502 Bad Gateway</body></html>", media_type="text/html")
        prompt = _render(body, chat)
        if prompt != self._last_tokens[0]:
            self._last_tokens = (prompt, WORD.findall(prompt))
        tokens = list(self._last_tokens[1])
        if len(tokens) >= self.config.n_ctx or fault == "context":
            return _error(400, f"the request exceeds the available context size "
                          f"({len(tokens)} tokens, context size {self.config.n_ctx})",
                          "exceed_context_size_error")
        slot = self._choose(body, tokens)
        slot.claims += 1
        stream = self._stream(body, slot, tokens, chat, fault)
        if body.get("stream"):
            return StreamingResponse(_batched(stream, self.config.events_per_write),
                                     media_type="text/event-stream")
        return await _collect(stream, chat)

    def _choose(self, body: Mapping[str, Any], tokens: list[str]) -> _Slot:
        pinned = body.get("id_slot")
        if isinstance(pinned, int) and pinned >= 0:
            return self.slots[pinned % len(self.slots)]
        # A slot chosen by a request whose stream has not started yet is not idle either:
        # many requests arriving at once must not all pick the same slot and queue on it.
        idle = ([s for s in self.slots if not s.busy.locked() and not s.claims]
                or [s for s in self.slots if not s.busy.locked()] or self.slots)
        best: _Slot = max(idle, key=lambda s: _lcp(s.tokens, tokens) / max(1, len(tokens)))
        if _lcp(best.tokens, tokens) / max(1, len(tokens)) > 0.1:
            return best
        return min(idle, key=lambda s: (bool(s.tokens), s.last_used))

    async def _stream(self, body: Mapping[str, Any], slot: _Slot, tokens: list[str], chat: bool,
                      fault: str) -> AsyncIterator[bytes]:
        try:
            async for event in self._events(body, slot, tokens, chat, fault):
                yield event
        finally:
            slot.claims -= 1

    async def _events(self, body: Mapping[str, Any], slot: _Slot, tokens: list[str],
                      chat: bool, fault: str) -> AsyncIterator[bytes]:
        counter = itertools.count()

        def emit(payload: Mapping[str, Any]) -> bytes:
            if self.config.sequence:
                payload = {**payload, "seq": next(counter)}
            return _encode(payload)

        async with slot.busy:
            self._task_ids += 1
            slot.id_task = self._task_ids
            cache = min(_lcp(slot.tokens, tokens), max(0, len(tokens) - 1))
            if body.get("cache_prompt") is False:
                cache = 0
            del slot.tokens[cache:]
            envelope = {"id": f"chatcmpl-{self._task_ids}", "created": int(time.time()),
                        "model": self.config.model, "system_fingerprint": "b0-fake",
                        "object": "chat.completion.chunk" if chat else "text_completion"}
            started = time.monotonic()
            if body.get("return_progress"):
                yield emit({**_role_chunk(envelope, chat), "prompt_progress": _progress(
                    len(tokens), cache, cache, started)})
            done = cache
            while done < len(tokens):
                step = min(self.config.batch, len(tokens) - done)
                await asyncio.sleep(step * self.config.prefill_s_per_token)
                done += step
                slot.tokens.extend(tokens[done - step:done])
                if body.get("return_progress"):
                    yield emit({**_role_chunk(envelope, chat), "prompt_progress": _progress(
                        len(tokens), cache, done, started)})
                if self.config.die_at == "prefill" and done < len(tokens):
                    _die()
            self.prompt_tokens_processed += len(tokens) - cache
            prompt_ms = (time.monotonic() - started) * 1000
            if fault == "hang":
                await asyncio.sleep(3600)
            words = WORD.findall(self.config.reply)[:_max_tokens(body)]
            if chat:
                yield emit(_role_chunk(envelope, chat, role_only=True))
            for index, word in enumerate(words):
                if fault == "bad_json" and index == self.config.fault_at:
                    yield b"data: {not json\n\n"
                    return
                if fault == "non_object" and index == self.config.fault_at:
                    yield b"data: [1, 2, 3]\n\n"
                    return
                if fault == "huge_event" and index == self.config.fault_at:
                    yield b"data: {\"x\": \""
                    for _ in range(HUGE_EVENT_BYTES // 65536):
                        yield b"x" * 65536
                    await asyncio.sleep(3600)
                if fault == "crash" and index == self.config.fault_at:
                    raise RuntimeError("fault injected: the engine died mid-stream")
                if fault == "close" and index == self.config.fault_at:
                    return
                if fault == "error_event" and index == self.config.fault_at:
                    yield emit({"error": {"code": 500, "message": "fault injected",
                                          "type": "server_error"}})
                    return
                if self.config.die_at == "stream" and index == self.config.fault_at:
                    _die()
                if fault == "stall" and index == self.config.fault_at:
                    await asyncio.sleep(self.config.stall_s)
                if self.config.token_delay_s:
                    await asyncio.sleep(self.config.token_delay_s)
                yield emit(_delta_chunk(envelope, chat, word))
                slot.tokens.append(word)
            timings = {"cache_n": cache, "prompt_n": len(tokens) - cache, "prompt_ms": prompt_ms,
                       "predicted_n": len(words)}
            usage = {"completion_tokens": len(words), "prompt_tokens": len(tokens),
                     "total_tokens": len(words) + len(tokens),
                     "prompt_tokens_details": {"cached_tokens": cache}}
            options = body.get("stream_options")
            options = options if isinstance(options, Mapping) else {}
            # As llama-server: chat puts timings on the usage chunk when usage was asked for,
            # else on the finish chunk; completions put usage and timings on the finish chunk.
            if not chat:
                yield emit({**_finish_chunk(envelope, chat), "usage": usage, "timings": timings})
            elif options.get("include_usage"):
                yield emit(_finish_chunk(envelope, chat))
                yield emit({**envelope, "choices": [], "usage": usage, "timings": timings})
            else:
                yield emit({**_finish_chunk(envelope, chat), "timings": timings})
            yield b"data: [DONE]\n\n"
            if fault == "linger":
                await asyncio.sleep(LINGER_S)
            slot.last_used = time.monotonic()


async def _batched(stream: AsyncIterator[bytes], size: int) -> AsyncIterator[bytes]:
    batch: list[bytes] = []
    async for event in stream:
        batch.append(event)
        if len(batch) >= size:
            yield b"".join(batch)
            batch.clear()
    if batch:
        yield b"".join(batch)


def _render(body: Mapping[str, Any], chat: bool) -> str:
    if not chat:
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else " ".join(map(str, prompt or []))
    parts = []
    for message in body.get("messages") or []:
        content = message.get("content")
        text = content if isinstance(content, str) else json.dumps(content)
        parts.append(f"<|im_start|>{message.get('role')} {text} <|im_end|>")
    return " ".join(parts) + " <|im_start|>assistant"


def _lcp(a: list[str], b: list[str]) -> int:
    """Longest common prefix by bisection over slice comparisons (C speed): the fake's own
    cost must not grow with the prompt, or benches that use it as their baseline skew."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low] holds; a[:high+1] differs
    if a[:high] == b[:high]:
        return high
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _progress(total: int, cache: int, processed: int, started: float) -> dict[str, Any]:
    return {"total": total, "cache": cache, "processed": processed,
            "time_ms": round((time.monotonic() - started) * 1000, 3)}


def _role_chunk(envelope: dict[str, Any], chat: bool, role_only: bool = False) -> dict[str, Any]:
    if not chat:
        return {**envelope, "choices": [{"text": "", "index": 0, "logprobs": None,
                                         "finish_reason": None}]}
    delta: dict[str, Any] = {"role": "assistant", "content": None}
    if role_only:
        delta = {"role": "assistant", "content": None}
    return {**envelope, "choices": [{"finish_reason": None, "index": 0, "delta": delta}]}


def _delta_chunk(envelope: dict[str, Any], chat: bool, text: str) -> dict[str, Any]:
    if not chat:
        return {**envelope, "choices": [{"text": text, "index": 0, "logprobs": None,
                                         "finish_reason": None}]}
    return {**envelope, "choices": [{"finish_reason": None, "index": 0,
                                     "delta": {"content": text}}]}


def _finish_chunk(envelope: dict[str, Any], chat: bool) -> dict[str, Any]:
    if not chat:
        return {**envelope, "choices": [{"text": "", "index": 0, "logprobs": None,
                                         "finish_reason": "stop"}]}
    return {**envelope, "choices": [{"finish_reason": "stop", "index": 0, "delta": {}}]}


def _encode(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _max_tokens(body: Mapping[str, Any]) -> int:
    """As llama-server: a value of the wrong type is ignored (the default applies)."""
    for name in ("max_tokens", "max_completion_tokens", "n_predict"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 10**6


def _error(status: int, message: str, kind: str) -> Response:
    return JSONResponse({"error": {"code": status, "message": message, "type": kind}},
                        status_code=status)


async def _collect(stream: AsyncIterator[bytes], chat: bool) -> Response:
    text = []
    final: dict[str, Any] = {}
    async for raw in stream:
        if raw.startswith(b"data: {"):
            data = json.loads(raw[6:])
            for choice in data.get("choices") or []:
                text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
            final.update({k: data[k] for k in ("id", "created", "model", "usage", "timings")
                          if k in data})
    message = {"role": "assistant", "content": "".join(text)}
    choice = {"finish_reason": "stop", "index": 0, "message": message} if chat else {
        "text": "".join(text), "index": 0, "logprobs": None, "finish_reason": "stop"}
    return JSONResponse({**final, "object": "chat.completion" if chat else "text_completion",
                         "choices": [choice]})


def _die() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.fakes.fake_llama --port P [--reply-words N] [--slots N]
    [--token-delay-ms MS] [--sequence]``: serve the fake."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--reply-words", type=int, default=10)
    parser.add_argument("--events-per-write", type=int, default=1)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--die-at", choices=("prefill", "stream"), default=None,
                        help="crash (SIGSEGV) mid-prefill or at the second token")
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--sequence", action="store_true",
                        help="every JSON event carries its index in the stream as \"seq\"")
    args = parser.parse_args(argv)
    reply = " ".join(f"w{i}" for i in range(args.reply_words))
    engine = FakeLlamaServer(FakeLlamaConfig(
        reply=reply, events_per_write=args.events_per_write, n_slots=args.slots,
        token_delay_s=args.token_delay_ms / 1000, sequence=args.sequence, n_ctx=args.n_ctx,
        die_at=args.die_at, prefill_s_per_token=args.prefill_ms_per_token / 1000,
        batch=args.batch))
    # The backlog is raised for load tests: hundreds of clients connect at once.
    uvicorn.run(engine.app(), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False, backlog=4096)


if __name__ == "__main__":
    main()

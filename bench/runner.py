"""Send one scheduled request to an arm and measure it, resends included.

One attempt streams ``POST /v1/chat/completions`` and feeds every byte to the
``FirstTokenClock``. A client with a first-token timeout closes the connection when the
deadline passes without a token and sends the identical body again; the turn's TTFT is
then counted from the first attempt, which is what the user waits.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from bench.clients.base import Request
from bench.sse_clock import FirstTokenClock, StreamObservation

# httpx's read timeout bounds every wait for bytes, and llama-server sends none during a
# prefill: size it for the longest cold prefill of the bench, not for a chat.
HTTP_TIMEOUT = httpx.Timeout(connect=10.0, read=900.0, write=60.0, pool=60.0)


@dataclass(frozen=True, slots=True)
class Attempt:
    status: int
    timed_out: bool
    started_s: float  # from the turn's start
    observation: StreamObservation
    ended_s: float
    error: str | None


@dataclass(frozen=True, slots=True)
class Turn:
    attempts: tuple[Attempt, ...]

    @property
    def final(self) -> Attempt:
        return self.attempts[-1]

    @property
    def ttft_s(self) -> float | None:
        """From the first attempt's start to the first token of the answered attempt."""
        final = self.final
        first = final.observation.first_token_s
        if first is None:  # the model ended at once: the stream's end is the first output
            first = final.observation.last_event_s
        return None if first is None else final.started_s + first

    @property
    def ttft_source(self) -> str:
        return "token" if self.final.observation.first_token_s is not None else "end"

    @property
    def wall_s(self) -> float:
        return self.final.ended_s


async def send_turn(client: httpx.AsyncClient, base_url: str, request: Request) -> Turn:
    turn_start = time.perf_counter()
    attempts: list[Attempt] = []
    for number in range(1, request.max_attempts + 1):
        patient = number == request.max_attempts
        timeout = None if patient else request.first_token_timeout_s
        attempt = await _attempt(client, base_url, request, timeout, turn_start)
        attempts.append(attempt)
        if not attempt.timed_out:
            break
    return Turn(tuple(attempts))


async def _attempt(client: httpx.AsyncClient, base_url: str, request: Request,
                   timeout_s: float | None, turn_start: float) -> Attempt:
    started = time.perf_counter()
    clock = FirstTokenClock(started)
    status, error, timed_out = 0, None, False
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            async with client.stream("POST", f"{base_url}/v1/chat/completions",
                                     json=request.body, headers=request.headers) as response:
                status = response.status_code
                if status != 200:
                    error = (await response.aread()).decode("utf-8", "replace")[:300]
                else:
                    async for chunk in response.aiter_raw():
                        clock.feed(chunk, time.perf_counter())
                        if clock.stopped:
                            deadline.reschedule(None)  # the client got its first token
    except TimeoutError:
        timed_out = True
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    observation = clock.close(time.perf_counter())
    error = error or observation.error
    return Attempt(status=status, timed_out=timed_out, started_s=started - turn_start,
                   observation=observation, ended_s=time.perf_counter() - turn_start,
                   error=error)

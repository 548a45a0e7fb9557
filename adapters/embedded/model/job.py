"""A running completion: the bridge between a slot's worker thread and the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from prefixpin.adapters.embedded.errors import ApiError
from prefixpin.adapters.embedded.model.generate import (
    Event,
    Failed,
    Finished,
    GenerationTask,
    run_generation,
)
from prefixpin.adapters.embedded.model.llama import LlamaModel
from prefixpin.adapters.embedded.model.slots import Slot


class Job:
    """One completion running on a slot's thread; events arrive on ``events``.

    The slot is released when the final event reaches the event loop, before the client
    can read it (llama-server releases the slot as it sends the final result), so a
    follow-up request always finds it idle. The slot's single worker thread still orders
    the next job after this one. A cancelled job releases when its thread returns.
    """

    def __init__(self, model: LlamaModel, slot: Slot, task: GenerationTask,
                 on_release: Callable[[Job], None]) -> None:
        self.slot = slot
        self.cancel = threading.Event()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._on_release = on_release
        self._released = False
        loop = asyncio.get_running_loop()

        def emit(event: Event) -> None:  # worker thread -> event loop
            try:
                loop.call_soon_threadsafe(self._deliver, event)
            except RuntimeError:  # the loop is gone: nobody is listening
                self.cancel.set()

        future = loop.run_in_executor(slot.executor, run_generation, model, slot.context,
                                      slot.state, task, emit, self.cancel)
        future.add_done_callback(self._on_done)

    def _deliver(self, event: Event) -> None:
        if isinstance(event, Finished | Failed):
            self._release()
        self.events.put_nowait(event)

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._on_release(self)

    def _on_done(self, future: asyncio.Future[None]) -> None:
        if not future.cancelled() and (error := future.exception()) is not None:
            self._deliver(Failed(ApiError(f"generation failed: {error}", "server_error")))
        self._release()

    async def result(self) -> Finished | Failed:
        while True:
            event = await self.events.get()
            if isinstance(event, Finished | Failed):
                return event

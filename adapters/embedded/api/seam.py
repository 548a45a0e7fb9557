"""What the embedded engine's HTTP surface and its reports (``http``, ``facts``) read of
the engine: a seam, so that they need not import the engine that builds them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # (chat needs jinja2, imported when the engine opens)
    from prefixpin.adapters.embedded.api.request import CompletionOptions
    from prefixpin.adapters.embedded.model.chat import ChatTemplate
    from prefixpin.adapters.embedded.model.job import Job
    from prefixpin.adapters.embedded.model.llama import LlamaModel, ModelInfo
    from prefixpin.adapters.embedded.model.slots import SlotPool


class ConfigView(Protocol):
    @property
    def model_path(self) -> Path: ...

    @property
    def slot_save_path(self) -> Path | None: ...


class EngineSurface(Protocol):
    """``adapter.EmbeddedEngine``, as its routes and reports see it."""

    info: ModelInfo
    pool: SlotPool
    model: LlamaModel
    template: ChatTemplate
    model_name: str
    media_marker: str
    build_info: str
    counters: dict[str, float]
    start_time: float

    @property
    def config(self) -> ConfigView: ...

    @property
    def n_ctx_slot(self) -> int: ...

    async def start(self, prompt: Sequence[int], options: CompletionOptions) -> Job: ...

    def slot_file(self, filename: str) -> Path: ...

    async def save_slot(self, id_slot: int, path: Path) -> tuple[int, int, float]: ...

    async def restore_slot(self, id_slot: int, path: Path) -> tuple[int, int, float]: ...

    async def erase_slot(self, id_slot: int) -> int: ...

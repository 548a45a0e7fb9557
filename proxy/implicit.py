"""Implicit identity: the model's own tokenizer and the fingerprint chain of a request.

The tokenizer is loaded once (in a worker thread: Gemma's vocabulary takes seconds) from
``--tokenizer``, else from the model file the engine reports in ``/props`` when it is
readable here. Without one, implicit identity is off and only explicit session keys
nominate; that is said once at start-up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fingerprint import Chain, Markers, MessageTokenCache, chain, chain_for_messages
from fingerprint.tokenizer import ModelTokenizer, TokenizerLoadError, load_tokenizer, markers_for
from proxy.logs import log_event


class Fingerprinter:
    def __init__(self, tokenizer: ModelTokenizer, markers: Markers) -> None:
        self.tokenizer = tokenizer
        self.markers = markers
        self.cache = MessageTokenCache()

    async def chain_of_messages(self, messages: Sequence[Mapping[str, Any]]) -> Chain:
        # Off the event loop: a cold 30k-token conversation takes tens of milliseconds.
        return await asyncio.to_thread(chain_for_messages, messages, self.tokenizer,
                                       self.cache, self.markers)

    async def chain_of_prompt(self, prompt: str) -> Chain:
        tokens = await asyncio.to_thread(self.tokenizer.encode, prompt)
        return chain(tokens, self.markers.openers)


async def load_fingerprinter(explicit: Path | None, props: Mapping[str, Any] | None,
                             logger: logging.Logger) -> Fingerprinter | None:
    source = explicit or _model_path(props)
    if source is None:
        log_event(logger, logging.WARNING, "implicit identity off",
                  reason="no --tokenizer and the engine's model file is not readable here")
        return None
    try:
        tokenizer = await asyncio.to_thread(load_tokenizer, source)
    except TokenizerLoadError as exc:
        log_event(logger, logging.WARNING, "implicit identity off", reason=str(exc))
        return None
    markers = markers_for(tokenizer)
    if markers is None:
        log_event(logger, logging.WARNING, "implicit identity off",
                  reason=f"no known message markers in {source}")
        return None
    log_event(logger, logging.INFO, "implicit identity on", tokenizer=str(source),
              exact=tokenizer.exact)
    return Fingerprinter(tokenizer, markers)


def _model_path(props: Mapping[str, Any] | None) -> Path | None:
    if not props:
        return None
    path = props.get("model_path")
    if isinstance(path, str) and path and Path(path).is_file():
        return Path(path)
    return None

"""The collector held off around a check that objects go by reference counting alone: what
is still there afterwards is kept by a reference cycle (or a reference), not awaiting a
collection."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()

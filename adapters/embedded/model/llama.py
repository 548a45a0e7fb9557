"""A thin typed layer over llama-cpp-python's ctypes bindings (``llama_cpp.llama_cpp``):
loading the library and a model, llama.cpp's log, tokenizing.

One ``LlamaModel`` (weights mmapped once) serves many ``SlotContext`` objects
(``adapters.embedded.model.context``). Everything here is synchronous; loading runs off the
event loop.

llama-cpp-python is imported lazily (``load_bindings``) so that importing prefixpin never
loads the shared library, and a missing extra becomes a one-line ``ModelLoadError``.
Its ctypes annotations are too loose for ``mypy --strict``, so the module is handled as
``Any`` and every value crossing back is converted to a plain Python type here.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from prefixpin.adapters.embedded.errors import EngineBackendError, ModelLoadError

GGUF_MAGIC = b"GGUF"
_GGML_LOG_LEVEL_CONT = 5  # ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT


def load_bindings() -> Any:
    """Import ``llama_cpp.llama_cpp`` (loads libllama) or explain how to install it."""
    try:
        return importlib.import_module("llama_cpp.llama_cpp")
    except ImportError as exc:
        raise ModelLoadError(
            "the embedded engine needs llama-cpp-python: pip install 'prefixpin[embedded]' "
            f"({exc})"
        ) from None


def check_gguf_file(path: Path) -> None:
    """Fail with one clear line before llama.cpp sees a file it would reject noisily."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read model file {path}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF model file (bad magic {magic!r}): {path}")


class LlamaLog:
    """llama.cpp's log routed into Python logging (``prefixpin.embedded.llama``).

    llama.cpp has one process-wide log callback, so there is one ``LlamaLog`` per process
    (``llama_log``), installed on first use and never freed: freeing a callback llama.cpp
    may still call would crash the process. It replaces llama-cpp-python's, whose level
    table predates ggml's current enum and lets warnings through to stderr when quiet.
    """

    # llama.cpp's warnings are mostly advisory ("control-looking token ..."): INFO, so that
    # Python's last-resort handler (WARNING and up) keeps them off a quiet terminal
    _LEVELS: ClassVar[dict[int, int]] = {
        1: logging.DEBUG, 2: logging.DEBUG, 3: logging.INFO, 4: logging.ERROR}

    def __init__(self, lib: Any) -> None:
        self.logger = logging.getLogger("prefixpin.embedded.llama")
        self.echo = False  # True: llama.cpp's whole log on stderr, as llama-server prints it
        self._captured: list[str] | None = None
        self._last_level = logging.DEBUG
        self._callback = lib.llama_log_callback(self._on_log)
        lib.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes, _user: object) -> None:
        message = text.decode("utf-8", "replace")
        if level != _GGML_LOG_LEVEL_CONT:
            self._last_level = self._LEVELS.get(level, logging.DEBUG)
        if self.echo:
            sys.stderr.write(message)
        elif self._captured is not None and self._last_level >= logging.ERROR:
            self._captured.append(message.strip())
        elif message.strip():
            self.logger.log(self._last_level, "%s", message.rstrip())

    @contextlib.contextmanager
    def capturing_errors(self) -> Iterator[list[str]]:
        """Collect error lines instead of logging them (they become one exception message)."""
        self._captured = []
        try:
            yield self._captured
        finally:
            self._captured = None


@functools.cache
def llama_log(lib: Any) -> LlamaLog:
    return LlamaLog(lib)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts about the loaded model, as llama-server reports them in /props and /models."""

    vocab_type: int
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_params: int
    size: int
    n_swa: int
    ftype: str
    architecture: str
    description: str
    chat_template: str | None
    bos_token: str
    eos_token: str
    add_bos: bool


class LlamaModel:
    """One loaded GGUF model: weights, vocabulary and tokenizer."""

    def __init__(self, lib: Any, path: Path, progress: Callable[[float], None], *,
                 use_extra_bufts: bool) -> None:
        self.lib = lib
        self.path = path
        params = lib.llama_model_default_params()
        params.load_mode = lib.LLAMA_LOAD_MODE_MMAP  # one copy of the weights, shared by all slots
        # False is llama-server's --no-repack: no AMX or CPU_REPACK buffer (core.cpu says why)
        params.use_extra_bufts = use_extra_bufts

        def on_progress(fraction: float, _user: object) -> bool:
            progress(float(fraction))
            return True  # False would abort the load

        # The ctypes callback must outlive the call; a local suffices (the load is synchronous).
        c_progress = lib.llama_progress_callback(on_progress)
        params.progress_callback = c_progress
        with llama_log(lib).capturing_errors() as errors:
            model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            reason = errors[0] if errors else "llama.cpp rejected it"  # the root cause
            raise ModelLoadError(f"cannot load model {path}: {reason}")
        self._model = model
        self.vocab = lib.llama_model_get_vocab(model)
        self.info = self._read_info()

    @property
    def handle(self) -> Any:
        return self._model

    def _read_info(self) -> ModelInfo:
        lib, model, vocab = self.lib, self._model, self.vocab
        template = lib.llama_model_chat_template(model, None)
        description = ctypes.create_string_buffer(256)
        lib.llama_model_desc(model, description, 256)
        return ModelInfo(
            vocab_type=int(lib.llama_vocab_type(vocab)),
            n_vocab=int(lib.llama_vocab_n_tokens(vocab)),
            n_ctx_train=int(lib.llama_model_n_ctx_train(model)),
            n_embd=int(lib.llama_model_n_embd(model)),
            n_params=int(lib.llama_model_n_params(model)),
            size=int(lib.llama_model_size(model)),
            n_swa=int(lib.llama_model_n_swa(model)),
            ftype=bytes(lib.llama_ftype_name(lib.llama_model_ftype(model)) or b"").decode(),
            architecture=self.meta("general.architecture") or "",
            description=description.value.decode("utf-8", "replace"),
            chat_template=template.decode("utf-8") if template else None,
            bos_token=self.piece(int(lib.llama_vocab_bos(vocab)), special=True).decode(
                "utf-8", "replace"),
            eos_token=self.piece(int(lib.llama_vocab_eos(vocab)), special=True).decode(
                "utf-8", "replace"),
            add_bos=bool(lib.llama_vocab_get_add_bos(vocab)),
        )

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None if the key is absent."""
        buffer = ctypes.create_string_buffer(256)
        size = int(self.lib.llama_model_meta_val_str(self._model, key.encode(), buffer, 256))
        if size < 0:
            return None
        if size >= 256:
            buffer = ctypes.create_string_buffer(size + 1)
            self.lib.llama_model_meta_val_str(self._model, key.encode(), buffer, size + 1)
        return buffer.value.decode("utf-8", "replace")

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8  # never more tokens than bytes, plus BOS/EOS
        buffer = (self.lib.llama_token * capacity)()
        count = int(self.lib.llama_tokenize(
            self.vocab, data, len(data), buffer, capacity, add_special, parse_special))
        if count < 0:
            raise EngineBackendError(f"tokenization failed ({count})")
        return list(buffer[:count])

    def piece(self, token: int, *, special: bool) -> bytes:
        """The bytes of one token (llama-server's common_token_to_piece)."""
        buffer = ctypes.create_string_buffer(64)
        count = int(self.lib.llama_token_to_piece(self.vocab, token, buffer, 64, 0, special))
        if count < 0:
            buffer = ctypes.create_string_buffer(-count)
            count = int(self.lib.llama_token_to_piece(
                self.vocab, token, buffer, -count, 0, special))
        return buffer.raw[:count]

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Concatenated pieces with special tokens rendered, as llama-server's /detokenize."""
        data = b"".join(self.piece(token, special=True) for token in tokens)
        return data.decode("utf-8", "replace")

    def warm_up_tokens(self) -> list[int]:
        lib, vocab = self.lib, self.vocab
        tokens = [int(lib.llama_vocab_bos(vocab)), int(lib.llama_vocab_eos(vocab))]
        return [token for token in tokens if self.is_valid_token(token)] or [0]

    def has_recurrent_memory(self) -> bool:
        """Recurrent or hybrid (recurrent beside attention) layers: a sequence's memory
        cannot drop its last tokens, so going back needs a checkpoint."""
        lib, model = self.lib, self._model
        return bool(lib.llama_model_is_recurrent(model) or lib.llama_model_is_hybrid(model))

    def is_eog(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def is_valid_token(self, token: int) -> bool:
        return 0 <= token < self.info.n_vocab

    def close(self) -> None:
        if self._model:
            self.lib.llama_model_free(self._model)
            self._model = None

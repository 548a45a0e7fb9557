"""The model's own tokenizer, loaded for fingerprinting.

Built with the ``tokenizers`` library either from a ``tokenizer.json`` or, when a GGUF
file is all there is, from the vocabulary in its metadata, reproducing what llama.cpp
does with it (``src/llama-vocab.cpp`` of the llama.cpp tree vendored in
llama-cpp-python 0.3.36):

* ``gpt2`` (byte-level BPE): the GGUF's merges, the pre-tokenizer regexes that
  llama.cpp uses for ``tokenizer.ggml.pre``, GPT-2 byte mapping.
* ``llama`` (SentencePiece): llama.cpp merges adjacent symbols into the vocabulary
  token with the highest score, leftmost first. That is a BPE whose merge ranks are the
  scores of the merged tokens, so the merges are derived from the vocabulary and
  ordered by score. Unknown characters fall back to ``<0xXX>`` byte tokens.

In both, CONTROL, USER_DEFINED and UNKNOWN tokens are matched in the raw text first, as
llama.cpp does with ``parse_special``. The tokenizer is only the input of a
fingerprint, which needs determinism, not parity with the engine; what parity was
measured is in ``tests/fingerprint/README.md``.

This is the I/O side of the package: it reads files (GGUF metadata through
:mod:`fingerprint.gguf_metadata`). Load once per model, in the app's lifespan and off the event
loop (Gemma 3's 262k-token vocabulary takes seconds to build), never per request.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from prefixpin.fingerprint.gguf_metadata import read_metadata
from prefixpin.fingerprint.messages import Markers

__all__ = [
    "KNOWN_MARKERS",
    "GgufVocab",
    "ModelTokenizer",
    "TokenType",
    "TokenizerLoadError",
    "build_gguf_tokenizer",
    "load_tokenizer",
    "markers_for",
    "read_gguf_vocab",
]

# Turn markers of chat templates, as (text that opens a message, text that closes it).
# Each message's view is wrapped in the first pair whose marker tokens the vocabulary
# has as control tokens.
KNOWN_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|im_start|>", "<|im_end|>\n"),  # ChatML: SmolLM2, Qwen, ...
    ("<start_of_turn>", "<end_of_turn>\n"),  # Gemma
    ("<|start_header_id|>", "<|eot_id|>"),  # Llama 3
)


class TokenizerLoadError(Exception):
    """The file is missing, unreadable, or uses a tokenizer this module cannot build."""


class TokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


_KNOWN_TYPES = frozenset(TokenType)
# llama.cpp splits these out of the raw text before running the model's tokenizer.
_PARTITIONED = frozenset({TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN})

_GPT2_WORDS = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)")
_LLAMA3_WORDS = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                 r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_WORDS = _LLAMA3_WORDS.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass(frozen=True, slots=True)
class _PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False


# ``tokenizer.ggml.pre`` to llama.cpp's split regexes, applied in sequence (llama-vocab.cpp,
# ``llm_tokenizer_bpe``). Only ``smollm`` is measured against a real llama-server; the
# others are transcribed from the same source.
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"),
        _PreTokenizer((r"\p{N}", _GPT2_WORDS)),
    ),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"),
                    _PreTokenizer((_GPT2_WORDS,))),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "lfm2"),
                    _PreTokenizer((_LLAMA3_WORDS,), ignore_merges=True)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _PreTokenizer((_QWEN2_WORDS,))),
    "default": _PreTokenizer(
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_WORDS, r"\p{N}+", r"[0-9][0-9][0-9]")),
}
_SPM_SPACE = "\u2581"


@dataclass(frozen=True, slots=True)
class GgufVocab:
    """The tokenizer part of a GGUF file's metadata (``tokenizer.ggml.*``)."""

    model: str
    pre: str
    tokens: Sequence[str]
    token_types: Sequence[int]
    scores: Sequence[float] = ()
    merges: Sequence[str] = ()
    add_space_prefix: bool = False
    bos_id: int | None = None
    eos_id: int | None = None


class ModelTokenizer:
    """A model's tokenizer as the fingerprint uses it (see :class:`fingerprint.Encoder`).

    ``control_ids`` are the control tokens (GGUF token type CONTROL; special added
    tokens of a ``tokenizer.json``). ``exact`` is False when a GGUF names a
    pre-tokenizer this module does not know and the default one stands in: ids are
    still deterministic, but further from the engine's. ``bos_id`` and ``eos_id`` come
    from GGUF metadata (a ``tokenizer.json`` alone does not say).
    """

    def __init__(self, backend: Tokenizer, control_ids: frozenset[int], *, source: str,
                 exact: bool = True, bos_id: int | None = None,
                 eos_id: int | None = None) -> None:
        self.backend = backend
        self.control_ids = control_ids
        self.source = source
        self.exact = exact
        self.bos_id = bos_id
        self.eos_id = eos_id

    def __repr__(self) -> str:
        return (f"ModelTokenizer(source={self.source!r}, vocab={self.backend.get_vocab_size()},"
                f" controls={len(self.control_ids)}, exact={self.exact})")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: no BOS/EOS added, control-token text parsed as such.
        (``encode_batch_fast``: the same ids without the character offsets ``encode``
        tracks, which nothing here reads: a fifth to a third less CPU per message.)"""
        return self.backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)


def load_tokenizer(path: str | Path) -> ModelTokenizer:
    """Load from a ``.gguf`` file, a ``tokenizer.json``, or a directory holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerLoadError(f"{path}: no such file")
    if path.suffix == ".gguf":
        return build_gguf_tokenizer(read_gguf_vocab(path), source=str(path))
    return _load_tokenizer_json(path)


def _load_tokenizer_json(path: Path) -> ModelTokenizer:
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises bare Exception subclasses
        raise TokenizerLoadError(f"{path}: not a tokenizer.json ({exc})") from exc
    added = backend.get_added_tokens_decoder()
    controls = frozenset(token_id for token_id, token in added.items() if token.special)
    return ModelTokenizer(backend, controls, source=str(path))


def read_gguf_vocab(path: str | Path) -> GgufVocab:
    """The ``tokenizer.ggml.*`` metadata of a GGUF file (tensors are not read)."""
    try:
        metadata = read_metadata(path)
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"{path}: not a readable GGUF file ({exc})") from exc

    def value(key: str, default: object = None) -> object:
        return metadata.get(f"tokenizer.ggml.{key}", default)

    if "tokenizer.ggml.tokens" not in metadata:
        raise TokenizerLoadError(f"{path}: the GGUF has no tokenizer vocabulary")
    return GgufVocab(
        model=str(value("model", "")),
        pre=str(value("pre", "default")),
        tokens=_as_list(value("tokens")),
        token_types=_as_list(value("token_type", [])),
        scores=_as_list(value("scores", [])),
        merges=_as_list(value("merges", [])),
        add_space_prefix=bool(value("add_space_prefix", False)),
        bos_id=_as_id(value("bos_token_id")),
        eos_id=_as_id(value("eos_token_id")),
    )


def build_gguf_tokenizer(vocab: GgufVocab, *, source: str = "gguf") -> ModelTokenizer:
    """A ``tokenizers.Tokenizer`` that tokenizes as llama.cpp does with ``vocab``."""
    types = _token_types(vocab)
    if vocab.model == "gpt2":
        backend, exact = _byte_level_bpe(vocab)
    elif vocab.model == "llama":
        backend, exact = _sentencepiece_bpe(vocab, types), True
    else:
        raise TokenizerLoadError(
            f"{source}: tokenizer model {vocab.model!r} is not supported (gpt2 and llama are);"
            " pass a tokenizer.json instead")
    _add_partitioned_tokens(backend, vocab.tokens, types)
    controls = frozenset(i for i, kind in enumerate(types) if kind == TokenType.CONTROL)
    return ModelTokenizer(backend, controls, source=source, exact=exact,
                          bos_id=vocab.bos_id, eos_id=vocab.eos_id)


def markers_for(tokenizer: ModelTokenizer) -> Markers | None:
    """The message markers of the tokenizer's chat format, or None if none is known."""
    for open_text, close_text in KNOWN_MARKERS:
        marker_ids = {tokenizer.token_id(open_text), tokenizer.token_id(close_text.strip())}
        if marker_ids <= tokenizer.control_ids:
            openers = frozenset(tokenizer.encode(open_text)) & tokenizer.control_ids
            return Markers(open_text, close_text, openers)
    return None


def _as_list(value: object) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else []


def _as_id(value: object) -> int | None:
    return value if isinstance(value, int) else None


def _token_types(vocab: GgufVocab) -> list[TokenType]:
    # Tokens without a type are normal (llama.cpp's default when the key is missing).
    kinds = [*vocab.token_types, *[TokenType.NORMAL] * (len(vocab.tokens) - len(vocab.token_types))]
    return [TokenType(kind) if kind in _KNOWN_TYPES else TokenType.UNDEFINED for kind in kinds]


def _byte_level_bpe(vocab: GgufVocab) -> tuple[Tokenizer, bool]:
    pre = _PRE_TOKENIZERS.get(vocab.pre)
    exact = pre is not None
    pre = pre or _PRE_TOKENIZERS["default"]
    merges = [_split_merge(merge) for merge in vocab.merges]
    ids = {text: token_id for token_id, text in enumerate(vocab.tokens)}
    backend = Tokenizer(models.BPE(ids, merges, ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.regexes),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    return backend, exact


def _split_merge(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _sentencepiece_bpe(vocab: GgufVocab, types: Sequence[TokenType]) -> Tokenizer:
    ids = {text: token_id for token_id, text in enumerate(vocab.tokens)}
    merges = _merges_by_score(ids, vocab.scores, types)
    backend = Tokenizer(models.BPE(ids, merges, byte_fallback=True, fuse_unk=False))
    # llama.cpp escapes only U+0020; a space prefix goes before every raw fragment,
    # which is what a per-fragment Prepend does here.
    escape = normalizers.Replace(" ", _SPM_SPACE)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), escape])
                          if vocab.add_space_prefix else escape)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _merges_by_score(ids: dict[str, int], scores: Sequence[float],
                     types: Sequence[TokenType]) -> list[tuple[str, str]]:
    # Every way to build a token from two tokens, ranked by the merged token's score,
    # highest first. Partitioned tokens never occur in a raw fragment, so they are never
    # merge results.
    ranked: list[tuple[float, int, str, str]] = []
    for text, token_id in ids.items():
        if types[token_id] in _PARTITIONED:
            continue
        score = float(scores[token_id]) if token_id < len(scores) else 0.0
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in ids and right in ids:
                ranked.append((-score, token_id, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _add_partitioned_tokens(backend: Tokenizer, tokens: Sequence[str],
                            types: Sequence[TokenType]) -> None:
    # Matched in the raw text before normalization, as llama.cpp's partition does.
    backend.add_special_tokens([
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(types) if kind in (TokenType.CONTROL, TokenType.UNKNOWN)])
    backend.add_tokens([
        AddedToken(tokens[i], special=False, normalized=False)
        for i, kind in enumerate(types) if kind == TokenType.USER_DEFINED])

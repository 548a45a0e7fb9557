"""Loading tokenizers from tokenizer.json and GGUF files, and what llama.cpp rules they follow.

Small vocabularies are written to real GGUF files with the ``gguf`` writer; expected ids
are worked out by hand from llama.cpp's algorithms, never read back from our output.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import gguf
import pytest

from prefixpin.fingerprint.tokenizer import (
    GgufVocab,
    ModelTokenizer,
    TokenizerLoadError,
    TokenType,
    build_gguf_tokenizer,
    load_tokenizer,
    markers_for,
)

N, C, U, UD, B = (TokenType.NORMAL, TokenType.CONTROL, TokenType.UNKNOWN,
                  TokenType.USER_DEFINED, TokenType.BYTE)

# A SentencePiece vocabulary. "bc" outscores "ab", which outscores "▁a": llama.cpp merges by
# score, so "▁abc" becomes ▁a + bc, where merging leftmost first would give ▁ab + c.
SPM = [("<unk>", U, 0.0), ("<s>", C, 0.0), ("<turn>", C, 0.0), ("▁", N, -10.0), ("a", N, -11.0),
       ("b", N, -12.0), ("c", N, -13.0), ("ab", N, -2.0), ("▁a", N, -3.0), ("▁ab", N, -0.5),
       ("bc", N, -1.0), ("<0x21>", B, 0.0), ("  ", UD, 0.0)]
SPM_ID = {text: token_id for token_id, (text, _, _) in enumerate(SPM)}

# A byte-level BPE vocabulary: "Ġ" is GPT-2's byte for a space.
BPE_TOKENS = ["<|endoftext|>", "h", "i", "Ġ", "hi", "Ġhi", "1", "2"]
BPE_TYPES = [C, N, N, N, N, N, N, N]


def write_gguf(path: Path, model: str, tokens: Sequence[str], types: Sequence[int], *,
               scores: Sequence[float] = (), merges: Sequence[str] = (), pre: str | None = None,
               add_space_prefix: bool | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(list(tokens))
    writer.add_token_types(list(types))
    if scores:
        writer.add_token_scores(list(scores))
    if merges:
        writer.add_token_merges(list(merges))
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def spm_gguf(path: Path, add_space_prefix: bool) -> Path:
    texts, types, scores = zip(*SPM, strict=True)
    return write_gguf(path, "llama", texts, types, scores=scores, pre="default",
                      add_space_prefix=add_space_prefix)


def ids(*texts: str) -> list[int]:
    return [SPM_ID[text] for text in texts]


def test_sentencepiece_merges_by_score_not_position(tmp_path: Path) -> None:
    """The highest-scoring merge wins wherever it is, as in llama.cpp's SPM tokenizer."""
    tokenizer = load_tokenizer(spm_gguf(tmp_path / "spm.gguf", add_space_prefix=False))
    assert tokenizer.encode("abc") == ids("a", "bc")
    assert tokenizer.encode(" abc") == ids("▁a", "bc")
    assert tokenizer.encode("ab ab") == ids("ab", "▁ab")
    assert tokenizer.exact


def test_sentencepiece_space_prefix_goes_before_every_raw_fragment(tmp_path: Path) -> None:
    """With add_space_prefix, text at the start and after each special token gets '▁'."""
    tokenizer = load_tokenizer(spm_gguf(tmp_path / "spm.gguf", add_space_prefix=True))
    assert tokenizer.encode("ab ab") == ids("▁ab", "▁ab")
    assert tokenizer.encode("<turn>abc<turn>ab") == ids("<turn>", "▁a", "bc", "<turn>", "▁ab")


def test_sentencepiece_byte_fallback_and_user_defined_tokens(tmp_path: Path) -> None:
    """Unknown characters become <0xXX> tokens; user-defined tokens match raw text first."""
    tokenizer = load_tokenizer(spm_gguf(tmp_path / "spm.gguf", add_space_prefix=False))
    assert tokenizer.encode("ab!") == ids("ab", "<0x21>")
    assert tokenizer.encode("a  b") == ids("a", "  ", "b")
    assert tokenizer.control_ids == frozenset(ids("<s>", "<turn>"))
    assert tokenizer.decode(tokenizer.encode(" ab!")) == " ab!"


def test_byte_level_bpe_from_gguf(tmp_path: Path) -> None:
    """GGUF merges and the named pre-tokenizer's regexes reproduce the engine's split."""
    path = write_gguf(tmp_path / "bpe.gguf", "gpt2", BPE_TOKENS, BPE_TYPES,
                      merges=["h i", "Ġ hi"], pre="smollm")
    tokenizer = load_tokenizer(path)
    assert tokenizer.encode("hi hi<|endoftext|>12") == [4, 5, 0, 6, 7]
    assert tokenizer.control_ids == frozenset({0})
    assert tokenizer.exact
    assert tokenizer.decode([4, 5]) == "hi hi"


def test_unknown_pre_tokenizer_falls_back_to_the_default_and_says_so(tmp_path: Path) -> None:
    """An unknown tokenizer.ggml.pre still tokenizes deterministically, flagged inexact."""
    path = write_gguf(tmp_path / "bpe.gguf", "gpt2", BPE_TOKENS, BPE_TYPES,
                      merges=["h i", "Ġ hi"], pre="from-the-future")
    tokenizer = load_tokenizer(path)
    assert not tokenizer.exact
    assert tokenizer.encode("hi hi") == [4, 5]
    assert "exact=False" in repr(tokenizer)


def test_vocabulary_without_types_or_scores() -> None:
    """Missing token types mean normal tokens; missing scores rank merges by id."""
    vocab = GgufVocab(model="llama", pre="default", tokens=["a", "b", "ab", "x"],
                      token_types=[], scores=[])
    tokenizer = build_gguf_tokenizer(vocab)
    assert tokenizer.encode("abx") == [2, 3]
    assert tokenizer.control_ids == frozenset()


def test_unrecognized_token_types_are_undefined() -> None:
    """A token type llama.cpp does not know is treated as undefined (not split out)."""
    vocab = GgufVocab(model="llama", pre="default", tokens=["a", "b", "ab"],
                      token_types=[1, 1, 42], scores=[0.0, 0.0, -1.0])
    assert build_gguf_tokenizer(vocab).encode("ab") == [2]


def test_a_short_type_list_leaves_the_rest_normal() -> None:
    """Tokens past the end of the type list are normal, never an index error."""
    vocab = GgufVocab(model="llama", pre="default", tokens=["<s>", "a", "b", "ab"],
                      token_types=[3], scores=[0.0, 0.0, 0.0, -1.0])
    tokenizer = build_gguf_tokenizer(vocab)
    assert tokenizer.encode("<s>ab") == [0, 3]
    assert tokenizer.control_ids == frozenset({0})


def test_tokenizer_json_round_trip(smollm: ModelTokenizer, tmp_path: Path) -> None:
    """A tokenizer.json (file or directory) loads with its special tokens as controls."""
    smollm.backend.save(str(tmp_path / "tokenizer.json"))
    for source in (tmp_path, tmp_path / "tokenizer.json"):
        loaded = load_tokenizer(source)
        assert loaded.control_ids == smollm.control_ids
        text = "<|im_start|>user\nHello  wörld 123<|im_end|>\n"
        assert loaded.encode(text) == smollm.encode(text)


def test_markers_are_none_for_an_unknown_chat_format(tmp_path: Path) -> None:
    """A vocabulary without a known pair of turn markers yields no markers."""
    tokenizer = load_tokenizer(spm_gguf(tmp_path / "spm.gguf", add_space_prefix=False))
    assert markers_for(tokenizer) is None


@pytest.mark.parametrize(("name", "content"), [
    ("missing.gguf", None),
    ("tokenizer.json", b"not json"),
    ("garbage.gguf", b"not a gguf file" * 8),
    ("truncated.gguf", b"GGUF\x03\x00\x00\x00" + b"\xff" * 30),
    ("empty.gguf", b""),
])
def test_unloadable_files_raise_one_error_type(tmp_path: Path, name: str,
                                               content: bytes | None) -> None:
    """Missing or malformed files raise TokenizerLoadError naming the file."""
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TokenizerLoadError, match=name):
        load_tokenizer(path)


def test_gguf_without_vocabulary_is_refused(tmp_path: Path) -> None:
    """A GGUF that carries no tokenizer metadata cannot give a tokenizer."""
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), arch="llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TokenizerLoadError, match="no tokenizer vocabulary"):
        load_tokenizer(tmp_path / "bare.gguf")


def test_unsupported_tokenizer_model_is_refused(tmp_path: Path) -> None:
    """WordPiece, Unigram and other models are refused with a pointer to tokenizer.json."""
    path = write_gguf(tmp_path / "bert.gguf", "bert", ["[CLS]", "a"], [C, N])
    with pytest.raises(TokenizerLoadError, match=r"'bert' is not supported.*tokenizer\.json"):
        load_tokenizer(path)


def test_malformed_metadata_arrays_count_as_absent(tmp_path: Path) -> None:
    """A scalar where an array belongs is ignored, as if the key were missing."""
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_float32("tokenizer.ggml.scores", 1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert load_tokenizer(path).encode("ab") == [2]


def test_rig_models_name_their_bos_and_eos(model_name: str, tokenizer: ModelTokenizer) -> None:
    """BOS and EOS ids come from the GGUF metadata and are control tokens."""
    bos, eos = {"smollm2": (1, 2), "gemma3": (2, 1)}[model_name]
    assert (tokenizer.bos_id, tokenizer.eos_id) == (bos, eos)
    assert {bos, eos} <= tokenizer.control_ids


def test_tokenizer_json_does_not_guess_bos_and_eos(smollm: ModelTokenizer, tmp_path: Path
                                                   ) -> None:
    """A tokenizer.json alone leaves BOS and EOS unknown."""
    smollm.backend.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert (loaded.bos_id, loaded.eos_id) == (None, None)

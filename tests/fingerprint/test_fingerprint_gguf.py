"""The fast GGUF metadata reader, checked against the gguf package's own GGUFReader."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import pytest

from prefixpin.fingerprint.gguf_metadata import GgufFormatError, read_metadata
from tests.rig.models import ensure_model

SCALARS: list[tuple[str, Any]] = [
    ("uint8", 200), ("int8", -5), ("uint16", 60000), ("int16", -300), ("uint32", 4_000_000_000),
    ("int32", -7), ("float32", 1.5), ("uint64", 2**40), ("int64", -(2**40)), ("float64", 0.1),
    ("bool", True), ("string", "héllo ▁ 日本"),
]
ARRAYS: list[tuple[str, list[Any]]] = [
    ("ints", [1, 2, 3]), ("strings", ["a", "bé", ""]), ("floats", [0.5, -1.25]),
    ("bools", [True, False]),
]


def reference(path: Path) -> dict[str, Any]:
    """What gguf.GGUFReader reads, without its pseudo-keys for the header."""
    reader = gguf.GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}


def header(version: int = 3, tensors: int = 0, count: int = 1) -> bytes:
    return struct.pack("<IIQQ", gguf.GGUF_MAGIC, version, tensors, count)


def test_every_value_type_reads_as_the_reference_reader_does(tmp_path: Path) -> None:
    """Scalars of every type, strings and arrays equal GGUFReader's values."""
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for kind, value in SCALARS:
        getattr(writer, f"add_{kind}")(f"test.{kind}", value)
    for name, items in ARRAYS:
        writer.add_array(f"test.array.{name}", items)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = read_metadata(path)
    assert ours == reference(path)
    assert len(ours) == 1 + len(SCALARS) + len(ARRAYS)


def test_nested_arrays_keep_their_structure(tmp_path: Path) -> None:
    """An array of arrays reads as nested lists."""
    path = tmp_path / "nested.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_metadata(path)["test.nested"] == [[1, 2], [3]]


@pytest.mark.slow
def test_a_real_model_reads_as_the_reference_reader_does() -> None:
    """All metadata of the SmolLM2 GGUF, vocabulary included, equals GGUFReader's."""
    path = ensure_model("smollm2", quiet=True)
    ours = read_metadata(path)
    assert len(ours["tokenizer.ggml.tokens"]) == 49152
    assert ours == reference(path)


@pytest.mark.parametrize(("content", "reason"), [
    (b"GGML" + bytes(20), "bad magic"),
    (header(version=1), "version 1 is not supported"),
    (header()[:20], "truncated"),
    (header() + struct.pack("<Q", 1000) + b"key", "truncated"),
    (header() + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99), "99 is not a valid"),
])
def test_malformed_files_are_refused(tmp_path: Path, content: bytes, reason: str) -> None:
    """Bad magic, an old version, a cut-off file or an unknown type raise a ValueError."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=reason):
        read_metadata(path)


def test_truncation_is_a_format_error(tmp_path: Path) -> None:
    """A file cut inside the metadata raises GgufFormatError, not a struct error."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(header() + struct.pack("<Q", 4) + b"abcd" + struct.pack("<I", 4))
    with pytest.raises(GgufFormatError):
        read_metadata(path)

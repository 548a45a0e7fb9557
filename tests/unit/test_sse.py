"""The SSE decoder: spec examples, every chunk split, raw bytes preserved."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixpin.core.sse import SSEDecoder, encode_comment, encode_data

STREAM = (
    b": prefixpin\n\n"
    b'data: {"a":1}\n\n'
    b"event: ping\ndata: x\n\n"
    b"data: line one\ndata: line two\n\n"
    b"data: [DONE]\n\n"
)


def decode_all(chunks: list[bytes]) -> list[tuple[bytes, str, str, tuple[str, ...]]]:
    decoder = SSEDecoder()
    events = [e for chunk in chunks for e in decoder.feed(chunk)] + decoder.flush()
    return [(e.raw, e.data, e.event, e.comments) for e in events]


def test_whole_stream_decodes_into_events_with_raw_bytes() -> None:
    """Each event keeps the exact bytes it arrived as."""
    events = decode_all([STREAM])
    assert [raw for raw, *_ in events] == [
        b": prefixpin\n\n", b'data: {"a":1}\n\n', b"event: ping\ndata: x\n\n",
        b"data: line one\ndata: line two\n\n", b"data: [DONE]\n\n",
    ]
    assert events[0][3] == ("prefixpin",)
    assert events[2][1:3] == ("x", "ping")
    assert events[3][1] == "line one\nline two"


@pytest.mark.parametrize("split", range(1, len(STREAM)))
def test_every_two_way_split_gives_the_same_events(split: int) -> None:
    """A chunk boundary anywhere, even inside a separator, changes nothing."""
    assert decode_all([STREAM[:split], STREAM[split:]]) == decode_all([STREAM])


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=8, unique=True))
def test_any_number_of_splits_gives_the_same_events(cuts: list[int]) -> None:
    """Byte-at-a-time or in arbitrary pieces, the decoded events are identical."""
    points = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(points)]
    assert decode_all(chunks) == decode_all([STREAM])


@given(st.binary(max_size=12).map(lambda b: b.translate(bytes.maketrans(b"abcd", b"\n\r: "))),
       st.sampled_from([b"data: ", b"data:", b"event: x\ndata: ", b""]),
       st.sampled_from([b"\n\n", b"\n", b"\r\n\r\n", b"\n\ndata: y\n\n"]))
def test_a_read_of_one_whole_event_decodes_as_any_split_of_it(
        payload: bytes, prefix: bytes, end: bytes) -> None:
    """The decoder's shortcut for a read that is one one-line data event (a token) gives
    what the general path gives the same bytes in two pieces, for near misses too."""
    chunk = prefix + payload + end
    assert decode_all([chunk]) == decode_all([chunk[:1], chunk[1:]])


def test_crlf_and_cr_line_endings_are_separators() -> None:
    """The spec allows CRLF, LF and CR line endings."""
    events = decode_all([b"data: a\r\n\r\ndata: b\r\rdata: c\n\n"])
    assert [data for _, data, _, _ in events] == ["a", "b", "c"]


def test_only_one_leading_space_is_dropped() -> None:
    """As per the SSE spec, only a single space after the colon is removed."""
    assert decode_all([b"data:  two spaces\n\n"])[0][1] == " two spaces"
    assert decode_all([b"data:none\n\n"])[0][1] == "none"


def test_unterminated_trailing_event_is_flushed() -> None:
    """A stream cut before its blank line still yields its last event on flush."""
    decoder = SSEDecoder()
    assert decoder.feed(b"data: tail") == []
    (event,) = decoder.flush()
    assert event.data == "tail"
    assert decoder.flush() == []


def test_oversized_event_is_refused() -> None:
    """An engine that never ends an event cannot make the proxy buffer without bound."""
    decoder = SSEDecoder(max_event_bytes=16)
    with pytest.raises(ValueError, match="larger than"):
        decoder.feed(b"data: " + b"x" * 64)


def test_encoders_produce_frames_the_decoder_reads_back() -> None:
    """Heartbeat comments and data frames round-trip; newlines cannot break a comment."""
    (comment,) = decode_all([encode_comment("prefill 1/2\ncached 0")])
    assert comment[3] == ("prefill 1/2 cached 0",)
    assert comment[1] == ""
    assert decode_all([encode_data('{"x":1}')])[0][1] == '{"x":1}'

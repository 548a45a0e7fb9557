"""A stream's token events classified from the bytes around their text
(``adapters.openai_sse.SameShapeTokens``): every read gets exactly the frame
``classify_whole`` gives it, whatever the text holds, and the shortcut really takes the
reads of a llama-server stream."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import prefixpin.adapters.openai_sse as openai_sse
from prefixpin.adapters.openai_sse import SameShapeTokens, classify_whole
from prefixpin.core.frames import Frame

# A llama-server chat stream's envelope, as a real one sends it (llama.cpp at the pinned
# version: the fields after "choices", in this order; recorded from a run).
ENVELOPE = ('"created":1796196273,"id":"chatcmpl-4p4VSdn48VlSxKs2nS3KU4BY5gb2w7bC",'
            '"model":"/models/SmolLM2-135M-Instruct.Q4_1.gguf",'
            '"system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk"')


def token(text: str, envelope: str = ENVELOPE, field: str = "content") -> bytes:
    """A token event as llama-server writes it (compact JSON, non-ASCII as UTF-8)."""
    body = json.dumps(text, ensure_ascii=False)
    return (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"%s":%s}}],%s}\n\n'
            % (field.encode(), body.encode(), envelope.encode()))


def around(text: bytes, envelope: str = ENVELOPE) -> bytes:
    """The bytes of a token event with ``text`` put between its quotes as it is."""
    return (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"%s"}}],'
            b'%s}\n\n' % (text, envelope.encode()))


ROLE = (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
        b'"content":null}}],' + ENVELOPE.encode() + b"}\n\n")
FINISH = (b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],'
          + ENVELOPE.encode() + b"}\n\n")


def fields(frame: Frame | None) -> tuple[Any, ...] | None:
    if frame is None:
        return None
    return (frame.kind, frame.raw, frame.data, frame.progress, frame.has_output, frame.finish,
            frame.figured, frame.delta_field, frame.delta_text)


def assert_same_frames(reads: list[bytes]) -> None:
    """Each read through one stream's classifier gives ``classify_whole``'s frame."""
    assert_frames(reads, [fields(classify_whole(read)) for read in reads])


def counted_frames(reads: list[bytes], monkeypatch: pytest.MonkeyPatch) -> Counted:
    """``assert_same_frames``, with what the classifier did counted (not what the
    reference ``classify_whole`` did: its frames are made before the count starts)."""
    expected = [fields(classify_whole(read)) for read in reads]
    counted = Counted(monkeypatch)
    assert_frames(reads, expected)
    return counted


def assert_frames(reads: list[bytes], expected: list[tuple[Any, ...] | None]) -> None:
    shapes = SameShapeTokens()
    for read, frame in zip(reads, expected, strict=True):
        assert fields(shapes(read)) == frame, read


class Counted:
    """What a classifier did: the reads it parsed whole (the general path: the shortcut
    did not take them), and its checks of a shape (``_only_the_text_between``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.parsed = self.checks = 0
        whole, check = openai_sse._whole_object, openai_sse._only_the_text_between

        def counting_parses(chunk: bytes) -> Any:
            self.parsed += 1
            return whole(chunk)

        def counting_checks(*args: Any) -> bool:
            self.checks += 1
            return check(*args)

        monkeypatch.setattr(openai_sse, "_whole_object", counting_parses)
        monkeypatch.setattr(openai_sse, "_only_the_text_between", counting_checks)


TEXTS = [" Hello", " w1", "caf\u00e9", " \u2603\U0001F600", 'say "hi"', "a\\", "\\", '\\"',
         "line\nbreak", "tab\there", "\u0000", "\u2028", "}}],", '"}}],"x":"', "data: x",
         " ", "'", "/", "\u00e9" * 50]


def test_a_llama_server_stream_takes_the_shortcut_and_gets_the_same_frames(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reads = [ROLE, *(token(t) for t in TEXTS), token(" next second",
             ENVELOPE.replace("273", "274")), token(" again", ENVELOPE.replace("273", "274")),
             FINISH]
    counted = counted_frames(reads, monkeypatch)
    # The first two tokens, and the first two after "created" moved, parsed (the second
    # of each pair alike: checked once, the shape); the role and finish events parsed;
    # every other token taken by the shape.
    assert (counted.checks, counted.parsed) == (2, 6)


@pytest.mark.parametrize("middle", [
    b'a","x":"b',  # a second delta field: not a plain chunk
    b'a"}}],"error":{"message":"boom"},"q":[{"w":{"e":"',  # an error event
    b'a"}}],"prompt_progress":{"total":1,"cache":0,"processed":1,"time_ms":0},"q":{"w":"',
    b'a"},"finish_reason":"stop","q":{"e":"',  # a finish moved in
    b'a"}},{"index":1,"delta":{"content":"b',  # a second choice
    b"\xff",  # not UTF-8
    b"\xc3",  # a cut UTF-8 sequence
    b"a\nb",  # a raw line break: two lines
    b"a\x01b",  # a raw control character
    b"\\u12",  # a short escape
    b"\\q",  # no such escape
    b"\\",  # the closing quote escaped
    b'"',  # an empty text, then a stray quote
    b"",  # an empty text: not output
])
def test_bytes_between_that_are_not_one_string_leave_the_read_to_classify_whole(
        middle: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    read = around(middle)
    expected = classify_whole(read)
    shapes = SameShapeTokens()
    shapes(token(" learned"))
    shapes(token(" learned too"))
    counted = Counted(monkeypatch)
    assert fields(shapes(read)) == fields(expected)
    assert counted.parsed == 1  # the general path's, not the shortcut's


def test_the_deltas_key_again_later_in_the_event_is_left_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The delta's key twice in the event (again inside a key that holds it escaped): the
    shape is the first's, the delta's, and every read is classified as before."""
    envelope = ENVELOPE + r',"x\"content":"b"'
    reads = [token(f" t{i}", envelope) for i in range(5)]
    counted = counted_frames(reads, monkeypatch)
    assert (counted.checks, counted.parsed) == (1, 2)


def test_a_lookalike_key_elsewhere_with_the_same_text_teaches_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The delta's key not compact (no match), and one key that ends in the same bytes
    elsewhere, holding the token's text in two reads alike: the bytes around that other
    text are not the delta's (a text put there changes another field), so no shape; the
    next reads, where only that other field moves, keep the delta's real text."""
    def read(value: str) -> bytes:
        return (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content": '
                b'" same"}}],"x\\"content":"%s"}\n\n' % value.encode())

    reads = [read(" same"), read(" same"), *(read(f" v{i}") for i in range(4))]
    counted = counted_frames(reads, monkeypatch)
    assert (counted.checks, counted.parsed) == (1, 6)  # the check failed: no more tries


def test_a_shape_is_learned_from_a_text_with_escaped_quotes_and_backslashes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reads = [token('say \\"hi\\" \\\\'), token('\\" \\\\'), *(token(t) for t in TEXTS)]
    counted = counted_frames(reads, monkeypatch)
    assert (counted.checks, counted.parsed) == (1, 2)


def test_the_shortcuts_frames_say_whether_the_event_has_figures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that puts the same figures in every token event (``timings``): each
    frame says it has some, as the general path's do."""
    reads = [token(f" t{i}", ENVELOPE + ',"timings":{"predicted_n":3}') for i in range(4)]
    counted = counted_frames(reads, monkeypatch)
    assert counted.parsed == 2
    assert classify_whole(reads[-1]).figured is True  # type: ignore[union-attr]


def test_reasoning_text_has_its_own_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = [token(f" r{i}", field="reasoning_content") for i in range(4)]
    reads += [token(f" c{i}") for i in range(4)]
    counted = counted_frames(reads, monkeypatch)
    assert (counted.checks, counted.parsed) == (2, 4)


def test_events_that_differ_outside_their_text_are_never_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A counter in every token event (a fake's sequence number, per-token timings): no
    two tokens in a row are alike around their text, so no shape is ever checked."""
    reads = [token(f" w{i}", ENVELOPE + f',"seq":{i}') for i in range(200)]
    counted = counted_frames(reads, monkeypatch)
    assert (counted.checks, counted.parsed) == (0, 200)


def test_a_few_unalike_tokens_then_alike_ones_take_the_shortcut(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reads = [token(f" w{i}", ENVELOPE + f',"seq":{i}') for i in range(5)]
    reads += [token(f" s{i}") for i in range(20)]
    counted = counted_frames(reads, monkeypatch)
    assert (counted.checks, counted.parsed) == (1, 5 + 2)


def test_a_stream_unalike_for_long_stops_comparing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nine tokens in a row unlike the one before: the stream's token events are not of
    one shape; it stops comparing (alike ones after that are parsed, as before)."""
    reads = [token(f" w{i}", ENVELOPE + f',"seq":{i}') for i in range(9)]
    reads += [token(f" s{i}") for i in range(20)]
    counted = counted_frames(reads, monkeypatch)
    assert (counted.checks, counted.parsed) == (0, 29)


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.text(min_size=0, max_size=12), min_size=1, max_size=8),
       raw=st.lists(st.binary(max_size=8), max_size=4))
def test_any_text_or_bytes_between_get_classify_wholes_frame(texts: list[str],
                                                             raw: list[bytes]) -> None:
    reads = [token(" first")]
    reads += [token(t) for t in texts]
    reads += [around(b) for b in raw]
    assert_same_frames(reads)

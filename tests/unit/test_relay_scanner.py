"""The compiled relay's scanner (``scan`` in ``core/_relay.c``, the parser its socket loop
runs) on bytes alone: each reason it stops for, and, on generated wires, that however the
bytes are cut it takes what it takes from them whole, which is what the reference parser
(``tests/fuzz/reference.py``, written from the contract in plain Python) takes."""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz.reference import MAX_PENDING, MAX_SIZE_LINE, chunk, reference_scan, scan_in_pieces
from tests.rig.parts import require_compiled_relay

require_compiled_relay()

from prefixpin.core import _relay  # noqa: E402
from prefixpin.core._relay import Relay, scan  # noqa: E402

HEAD = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"'
TAIL = b'"}}],"created":1796000000,"id":"chatcmpl-x","object":"chat.completion.chunk"}\n\n'
FINISH = (b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],'
          b'"created":1796000000}\n\n')


def token(text: str) -> bytes:
    return HEAD + json.dumps(text, ensure_ascii=False)[1:-1].encode() + TAIL


A, B = token("a"), token("b")
CRLF = token("c").replace(b"\n\n", b"\r\n\r\n")
LONG = HEAD + b"v" * (MAX_PENDING - 10)  # an event not whole yet, near the bound

# (data, carry) -> (consumed, events, carry, stop)
TABLE: dict[str, tuple[bytes, bytes, tuple[int, list[bytes], bytes, str]]] = {
    "nothing yet": (b"", b"", (0, [], b"", "more")),
    "a size line not whole": (b"1f", b"", (0, [], b"", "more")),
    "a size line without its LF yet": (b"1f\r", b"", (0, [], b"", "more")),
    "a chunk not whole": (chunk(A) + chunk(B)[:-3], b"",
                          (len(chunk(A)), [A], b"", "more")),
    "an event spread over chunks": (chunk(A + B[:30]), b"",
                                    (len(chunk(A + B[:30])), [A], B[:30], "more")),
    "an event's end, in the next scan": (chunk(B[30:]), B[:30],
                                         (len(chunk(B[30:])), [B], b"", "more")),
    "an event of another shape": (chunk(A + FINISH + B) + chunk(B), b"",
                                  (len(chunk(A + FINISH + B)), [A], FINISH + B, "event")),
    "a CR in an event not whole": (chunk(A) + chunk(CRLF[:-2]), b"",
                                   (len(chunk(A) + chunk(CRLF[:-2])), [A], CRLF[:-2], "cr")),
    "a whole CRLF event": (chunk(CRLF), b"", (len(chunk(CRLF)), [], CRLF, "cr")),
    "a chunk extension": (chunk(A) + b"5;ext=1\r\nhello\r\n", b"",
                          (len(chunk(A)), [A], b"", "size")),
    "not hex": (b"zz\r\nhello\r\n", b"", (0, [], b"", "size")),
    "an empty size line": (b"\r\n", b"", (0, [], b"", "size")),
    "a CR without its LF": (b"5\rXhello\r\n", b"", (0, [], b"", "size")),
    "a space before the size": (b" 5\r\nhello\r\n", b"", (0, [], b"", "size")),
    "more digits than a size has": (b"1" * (MAX_SIZE_LINE + 1), b"", (0, [], b"", "size")),
    "the most digits a size has": (b"0" * (MAX_SIZE_LINE - 1) + b"1\r\nx\r\n", b"",
                                   (MAX_SIZE_LINE + 5, [], b"x", "more")),
    "data without its CRLF": (b"5\r\nhelloXX", b"", (0, [], b"", "framing")),
    "the body's end": (chunk(A) + b"0\r\n\r\n", b"", (len(chunk(A)), [A], b"", "end")),
    "the body's end, zeros": (b"0000\r\n", b"", (0, [], b"", "end")),
    "a chunk over the bound": (b"%x\r\n" % (MAX_PENDING + 1), b"", (0, [], b"", "too-long")),
    "the largest size": (b"f" * MAX_SIZE_LINE + b"\r\n", b"", (0, [], b"", "too-long")),
    "an event not whole over the bound": (
        chunk(b"v" * 20), LONG, (len(chunk(b"v" * 20)), [], LONG + b"v" * 20, "too-long")),
}


@pytest.mark.parametrize(("data", "carry", "expected"), TABLE.values(), ids=TABLE.keys())
def test_each_reason_to_stop(data: bytes, carry: bytes,
                             expected: tuple[int, list[bytes], bytes, str]) -> None:
    assert scan(data, HEAD, TAIL, carry) == expected
    ref = reference_scan(data, HEAD, TAIL, carry)
    assert (ref.consumed, ref.events, ref.carry, ref.stop) == expected


def test_the_stops_are_the_documented_ones() -> None:
    # "memory" (the relay out of memory) is the one no bytes can cause: scan() raises
    # MemoryError instead.
    assert _relay.STOPS == ("more", "event", "cr", "size", "framing", "end", "too-long",
                            "memory")
    assert {expected[-1] for _, _, expected in TABLE.values()} == set(_relay.STOPS) - {"memory"}
    assert (_relay.MAX_PENDING, _relay.MAX_SIZE_LINE) == (MAX_PENDING, MAX_SIZE_LINE)


def test_a_tail_whose_digits_moved_on_is_still_the_shape() -> None:
    later = token("t").replace(b"1796000000", b"1796000042")
    first_digit = token("t").replace(b"1796000000", b"2796000000")
    assert scan(chunk(later), HEAD, TAIL)[1] == [later]
    assert scan(chunk(first_digit), HEAD, TAIL)[3] == "event"


def test_any_bytes_like_input_and_a_shape_it_needs() -> None:
    wire = chunk(A + B)
    for data in (bytearray(wire), memoryview(wire)):
        assert scan(data, HEAD, TAIL) == (len(wire), [A, B], b"", "more")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="head and a tail"):
        scan(wire, b"", TAIL)
    with pytest.raises(ValueError, match="head and a tail"):
        scan(wire, HEAD, b"")
    with pytest.raises(TypeError):
        scan(wire.decode(), HEAD, TAIL)  # type: ignore[arg-type]


# ---- generated wires ----

texts = st.text(st.characters(codec="utf-8"), min_size=1, max_size=6).map(
    lambda t: json.dumps(t, ensure_ascii=False)[1:-1].encode())  # a control character: \u
events = st.one_of(
    texts.map(lambda t: HEAD + t + TAIL),
    texts.map(lambda t: HEAD + t + TAIL),
    st.binary(max_size=6).map(lambda b: HEAD + b + TAIL),  # any text, the lane's or not
    st.sampled_from([FINISH, b"data: [DONE]\n\n", b": ping\n\n", CRLF, b"\n\n"]),
)
SUFFIXES = [b"", b"", b"0\r\n\r\n", b"5;x\r\nhello\r\n", b"zz\r\n", b"5\r\nhelloXX", b"\r\n",
            b"1" * 17, b"%x\r\n" % (MAX_PENDING + 1), b"0\r"]


@st.composite
def wires(draw: st.DrawFn) -> bytes:
    """Events cut into chunks anywhere (an event in several chunks, several in one), the
    size lines spelled variously, then maybe something the lane does not take."""
    payload = b"".join(draw(st.lists(events, max_size=8)))
    cuts = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=6)))
    body = b""
    for start, end in zip([0, *cuts], [*cuts, len(payload)], strict=True):
        if end > start:
            digits = b"%x" % (end - start)
            body += draw(st.sampled_from([digits, digits.upper(), digits.rjust(4, b"0")]))
            body += b"\r\n" + payload[start:end] + b"\r\n"
    return body + draw(st.sampled_from(SUFFIXES)) + draw(st.binary(max_size=4))


@settings(max_examples=300, deadline=None)
@given(wire=wires(), sizes=st.one_of(st.just([1] * 2000),
                                     st.lists(st.integers(1, 64), max_size=40)))
def test_any_cutting_of_the_bytes_takes_what_the_whole_takes(
        wire: bytes, sizes: list[int]) -> None:
    """The socket's reads cut the bytes anywhere, down to one byte each: the same events,
    the same bytes consumed in all, the same carry and stop as the bytes whole."""
    whole = scan(wire, HEAD, TAIL)
    assert scan_in_pieces(scan, wire, HEAD, TAIL, sizes) == whole


@settings(max_examples=300, deadline=None)
@given(wire=st.one_of(wires(), st.binary(max_size=80)),
       carry=st.sampled_from([b"", HEAD, HEAD + b"x", b"\r", b"v" * MAX_PENDING]))
def test_the_scanner_takes_what_the_reference_takes(wire: bytes, carry: bytes) -> None:
    ref = reference_scan(wire, HEAD, TAIL, carry)
    assert scan(wire, HEAD, TAIL, carry) == (ref.consumed, ref.events, ref.carry, ref.stop)


@settings(max_examples=200, deadline=None)
@given(head=st.binary(min_size=1, max_size=3), tail=st.binary(min_size=1, max_size=3),
       wire=st.binary(max_size=60))
def test_any_shape_on_any_bytes_is_the_references(head: bytes, tail: bytes,
                                                  wire: bytes) -> None:
    ref = reference_scan(wire, head, tail)
    assert scan(wire, head, tail) == (ref.consumed, ref.events, ref.carry, ref.stop)


@settings(max_examples=100, deadline=None)
@given(wire=wires())
def test_the_socket_loop_runs_the_same_scanner(wire: bytes) -> None:
    """The relay, given the bytes whole on a socket: it relays the scan's events, and gives
    the stream back (or holds it) where the scan stops, with the scan's rest of the body."""
    consumed, taken, carry, stop = scan(wire, HEAD, TAIL)
    engine, engine_peer = socket.socketpair()
    client, client_peer = socket.socketpair()
    relay = Relay()
    try:
        relay.adopt(engine.fileno(), client.fileno(), HEAD, TAIL, None)
        engine_peer.sendall(wire)
        backs = relay.run()
        assert len(backs) == (stop != "more")
        back = backs[0] if backs else relay.reclaim(None)
        assert back is not None
        _, relayed, count, rest, unsent, _, _, texts = back
        assert (relayed, count, unsent) == (b"".join(taken), len(taken), b"")
        assert texts == b"".join(e[len(HEAD):-len(TAIL)] for e in taken)
        assert rest == (chunk(carry) if carry else b"") + wire[consumed:]
        client.close()
        assert client_peer.recv(1 << 20) == b"".join(chunk(e) for e in taken)
    finally:
        relay.close()
        for sock in (engine, engine_peer, client, client_peer):
            sock.close()

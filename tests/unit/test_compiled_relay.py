"""The compiled relay's C core (``core/_relay.c``) on real sockets: socket pairs stand for the
engine's connection and the client's. What it relays, what it gives back, and that the
two together are always exactly what the engine sent."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.rig.parts import require_compiled_relay

require_compiled_relay()

from prefixpin.core._relay import (  # noqa: E402
    MAX_READ_PER_RUN,
    MAX_RELAYED_HELD,
    MIN_READ_PER_RUN,
    Relay,
    plain_json_text,
)
from prefixpin.core.compiled_relay import CompiledRelay  # noqa: E402

HEAD = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"'
TAIL = b'"}}],"created":1796000000,"id":"chatcmpl-x","object":"chat.completion.chunk"}\n\n'


def token(text: str) -> bytes:
    return HEAD + json.dumps(text, ensure_ascii=False)[1:-1].encode() + TAIL


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


FINISH = (b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],'
          b'"created":1796000000}\n\n')
DONE = b"data: [DONE]\n\n"
# A hold no test's stream reaches: where what is measured is the reads, not deliveries.
NO_HOLD = 1 << 30
# What the relay gives a stream back as: (token, relayed, count, engine, unsent, last
# read, last write, texts); engine None: a delivery of relayed events, the stream kept.
Back = tuple[Any, bytes, int, bytes | None, bytes, float, float, bytes]


class Pair:
    """An engine socket and a client socket, each with its peer, and a compiled relay."""

    def __init__(self) -> None:
        self.engine, self.engine_peer = socket.socketpair()
        self.client, self.client_peer = socket.socketpair()
        for sock in (self.engine, self.client, self.client_peer):
            sock.setblocking(False)
        self.relay = Relay()
        self.hold = object()

    def adopt(self) -> None:
        self.relay.adopt(self.engine.fileno(), self.client.fileno(), HEAD, TAIL, self.hold)

    def send(self, data: bytes) -> None:
        self.engine_peer.sendall(data)

    def run(self) -> list[Back]:
        return list(self.relay.run())

    def widen(self) -> None:
        """Socket buffers of 4 MiB: megabytes ready at once."""
        for sock in (self.engine, self.engine_peer, self.client, self.client_peer):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)

    def first_back(self, runs: int = 100) -> Back:
        """The one stream given back within ``runs`` runs."""
        backs: list[Back] = []
        for _ in range(runs):
            backs += self.run()
            if backs:
                break
        (back,) = backs
        return back

    def received(self) -> bytes:
        out = b""
        while True:
            try:
                piece = self.client_peer.recv(1 << 20)
            except BlockingIOError:
                return out
            if not piece:
                return out
            out += piece

    def close(self) -> None:
        self.relay.close()
        for sock in (self.engine, self.engine_peer, self.client, self.client_peer):
            sock.close()


def unread(sock: socket.socket) -> bytes:
    """What a non-blocking socket holds now."""
    out = b""
    while True:
        try:
            piece = sock.recv(1 << 20)
        except BlockingIOError:
            return out
        if not piece:
            return out
        out += piece


@pytest.fixture
def pair() -> Iterator[Pair]:
    made = Pair()
    yield made
    made.close()


def test_token_events_relayed_chunk_framed_until_the_finish_which_comes_back(pair: Pair) -> None:
    pair.adopt()
    tokens = [token(t) for t in ("Hello", ", wörld", " \\ \"q\"\n", "🙂")]
    pair.send(b"".join(chunk(t) for t in tokens))
    assert pair.run() == []  # all relayed, nothing given back yet
    assert pair.received() == b"".join(chunk(t) for t in tokens)
    rest = chunk(FINISH) + chunk(DONE) + b"0\r\n\r\n"
    pair.send(chunk(token("!")) + rest)
    (back,) = pair.run()
    hold, relayed, count, engine, unsent, last_read, last_write, texts = back
    assert hold is pair.hold
    assert (relayed, count) == (b"".join(tokens) + token("!"), 5)
    # Their texts as the JSON string bodies they were, joined: one JSON string's body.
    assert texts == b"".join(t[len(HEAD):-len(TAIL)] for t in [*tokens, token("!")])
    assert json.loads(b'"' + texts + b'"') == "Hello, wörld \\ \"q\"\n🙂!"
    assert engine == rest  # whole chunks not taken come back as they were
    assert unsent == b""
    assert pair.received() == chunk(token("!"))
    assert last_read > 0
    assert last_write > 0
    assert pair.relay.held() == 0


def test_a_chunk_of_several_events_splits_at_the_first_other_event(pair: Pair) -> None:
    pair.adopt()
    body = token("a") + token("b") + FINISH + token("c")
    pair.send(chunk(body) + chunk(DONE))
    ((_, relayed, count, engine, _, _, _, _),) = pair.run()
    assert (relayed, count) == (token("a") + token("b"), 2)
    # The rest of that chunk comes back framed as a chunk of its own, then the next chunk.
    assert engine == chunk(FINISH + token("c")) + chunk(DONE)
    assert pair.received() == chunk(token("a")) + chunk(token("b"))


def test_reads_that_split_chunks_anywhere_wait_for_the_whole_chunk(pair: Pair) -> None:
    pair.adopt()
    wire = chunk(token("one")) + chunk(token("two"))
    for cut in (1, 2, 3, 40, len(wire) - 1):
        pair.send(wire[:cut])
        assert pair.run() == []
        pair.send(wire[cut:])
        assert pair.run() == []
    assert pair.received() == wire * 5


def test_an_event_spread_over_two_chunks_is_relayed_once_whole(pair: Pair) -> None:
    pair.adopt()
    event = token("spread")
    pair.send(chunk(event[:30]) + chunk(event[30:]))
    assert pair.run() == []
    assert pair.received() == chunk(event)


@pytest.mark.parametrize("text", ["\\u00e9", "bad\x01", 'a"b', "trailing\\", "\\x"])
def test_a_text_the_lane_does_not_take_gives_the_stream_back(pair: Pair, text: str) -> None:
    pair.adopt()
    event = HEAD + text.encode() + TAIL
    pair.send(chunk(event))
    ((_, relayed, count, engine, _, _, _, _),) = pair.run()
    assert (relayed, count, engine) == (b"", 0, chunk(event))
    assert pair.received() == b""


@pytest.mark.parametrize("wire", [
    b"5;ext=1\r\nhello\r\n",  # a chunk extension: the parser's to judge
    b"zz\r\nhello\r\n",  # not a size
    b"5\r\nhelloXX",  # no CRLF after the data
    b"\r\n",  # an empty size line
    b"0\r\n\r\n",  # the body's end
])
def test_chunks_it_does_not_take_come_back_byte_for_byte(pair: Pair, wire: bytes) -> None:
    pair.adopt()
    pair.send(chunk(token("x")) + wire)
    ((_, relayed, count, engine, _, _, _, _),) = pair.run()
    assert (relayed, count, engine) == (token("x"), 1, wire)


def test_the_engine_closing_gives_back_what_is_left(pair: Pair) -> None:
    pair.adopt()
    pair.send(chunk(token("x")) + b"7\r\npart")
    pair.engine_peer.shutdown(socket.SHUT_WR)
    ((_, relayed, count, engine, _, _, _, _),) = pair.run()
    assert (relayed, count, engine) == (token("x"), 1, b"7\r\npart")
    assert pair.engine.recv(10) == b""  # the end of file is still there for Python's read


def test_a_slow_client_holds_the_engine_back_and_gets_every_byte_in_order(
        pair: Pair) -> None:
    """A client whose socket is full: what the relay framed is kept, the engine is not
    read until the client's socket drains (no give-back, no growing buffer), and the
    client gets every event in order."""
    pair.client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    pair.adopt()
    events = [token("w" * 900 + str(i)) for i in range(60)]
    pair.send(b"".join(chunk(e) for e in events))
    assert pair.run() == []
    received = pair.received()
    assert len(received) < len(b"".join(chunk(e) for e in events))  # it had to wait
    for _ in range(1000):
        assert pair.run() == []  # the client's socket drains as it reads: on it goes
        received += pair.received()
        if len(received) == len(b"".join(chunk(e) for e in events)):
            break
    assert received == b"".join(chunk(e) for e in events)


def test_reclaiming_a_stream_held_back_by_its_client_gives_back_what_it_kept(
        pair: Pair) -> None:
    pair.client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    pair.adopt()
    events = [token("w" * 900 + str(i)) for i in range(60)]
    wire = b"".join(chunk(e) for e in events)
    pair.send(wire)
    assert pair.run() == []
    back = pair.relay.reclaim(pair.hold)
    assert back is not None
    (_, relayed, count, engine, unsent, _, _, _) = back
    written = pair.received()
    assert unsent  # kept for the client: Python's transport writes it next
    assert written + unsent == b"".join(chunk(e) for e in events[:count])
    assert relayed == b"".join(events[:count])
    # What it did not take is still the engine's: given back, then unread in the socket.
    assert engine + unread(pair.engine) == b"".join(chunk(e) for e in events[count:])


def test_a_client_gone_gives_the_stream_back_with_the_bytes_unwritten(pair: Pair) -> None:
    pair.adopt()
    pair.client_peer.close()
    pair.send(chunk(token("x")))
    ((_, relayed, count, engine, unsent, _, _, _),) = pair.run()
    assert (relayed, count, engine, unsent) == (token("x"), 1, b"", chunk(token("x")))
    pair.client_peer = socket.socket()  # (closed above: the fixture closes this one)


def test_reclaim_gives_back_now_and_drop_forgets(pair: Pair) -> None:
    pair.adopt()
    pair.send(chunk(token("x")) + b"3\r\nab")
    assert pair.run() == []
    back = pair.relay.reclaim(pair.hold)
    assert back is not None
    (hold, relayed, count, engine, unsent, _, _, _) = back
    assert (hold, relayed, count, engine, unsent) == (pair.hold, token("x"), 1, b"3\r\nab", b"")
    assert pair.relay.reclaim(pair.hold) is None
    pair.adopt()
    assert pair.relay.drop(pair.hold) is True
    assert pair.relay.held() == 0
    assert pair.relay.drop(pair.hold) is False


def test_the_lane_writes_to_its_own_duplicate_never_to_a_reused_descriptor(pair: Pair) -> None:
    """The loop may close a socket the compiled relay holds and the number be reused at once: the
    relay writes to the socket it adopted (a duplicate), not to whatever has the number."""
    pair.adopt()
    number = pair.client.fileno()
    pair.client.close()
    stranger, stranger_peer = socket.socketpair()
    try:
        if stranger.fileno() != number:  # make the number the stranger's
            import os

            os.dup2(stranger.fileno(), number)
        pair.send(chunk(token("secret")))
        assert pair.run() == []
        assert pair.received() == chunk(token("secret"))
        stranger_peer.setblocking(False)
        with pytest.raises(BlockingIOError):
            stranger_peer.recv(100)
    finally:
        stranger.close()
        stranger_peer.close()
    pair.client = socket.socket()


def test_plain_json_text_accepts_what_a_json_parser_reads_as_a_string() -> None:
    for ok in [b"a", "é".encode(), "🙂".encode(), b'\\"', b"\\\\", b"\\/\\b\\f\\n\\r\\t"]:
        assert plain_json_text(ok), ok
    for bad in [b"", b'"', b"\x1f", b"\\", b"\\u0041", b"\\a", b"\xff", b"\xc3",
                b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", "é".encode()[:1] + b"a"]:
        assert not plain_json_text(bad), bad


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=24))
def test_plain_json_text_never_accepts_what_json_refuses(data: bytes) -> None:
    if plain_json_text(data):
        assert isinstance(json.loads(b'"' + data + b'"'), str)


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=12),
       cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=8),
       finish_at=st.integers(min_value=0, max_value=12))
def test_relayed_and_given_back_are_exactly_what_the_engine_sent(
        texts: list[str], cuts: list[int], finish_at: int) -> None:
    """However the engine's bytes are cut into reads: what the client got is every token
    event before the first other event, framed, and what comes back is the rest."""
    made = Pair()
    try:
        made.adopt()
        events = [token(t) for t in texts]
        events.insert(min(finish_at, len(events)), FINISH)
        wire = b"".join(chunk(e) for e in events) + b"0\r\n\r\n"
        backs: list[Back] = []
        at = 0
        for cut in [*cuts, len(wire)]:
            made.send(wire[at:at + cut])
            at += cut
            backs += made.run()
            if backs or at >= len(wire):
                break
        if not backs:
            reclaimed = made.relay.reclaim(made.hold)
            assert reclaimed is not None
            backs = [reclaimed]
        ((_, relayed, count, engine, unsent, _, _, _),) = backs
        assert unsent == b""
        assert engine is not None
        taken = 0
        for event in events:
            if event == FINISH or not plain_json_text(event[len(HEAD):-len(TAIL)]):
                break
            taken += 1
        assert count == taken
        assert relayed == b"".join(events[:taken])
        assert made.received() == b"".join(chunk(e) for e in events[:taken])
        assert engine + wire[at:] == b"".join(chunk(e) for e in events[taken:]) + b"0\r\n\r\n"
    finally:
        made.close()


def test_a_tail_whose_digits_moved_on_is_still_the_shape(pair: Pair) -> None:
    """llama-server's ``created`` moves on every second: the same shape. A number's first
    digit, or anything not a digit, is another event."""
    pair.adopt()
    later = token("tick").replace(b'"created":1796000000', b'"created":1796000001')
    pair.send(chunk(later))
    assert pair.run() == []
    assert pair.received() == chunk(later)
    for other in (token("x").replace(b'"created":1796000000', b'"created":2796000000'),
                  token("x").replace(b'"chatcmpl-x"', b'"chatcmpl-y"')):
        pair.send(chunk(other))
        ((_, relayed, count, engine, _, _, _, _),) = pair.run()
        assert (count, engine) == (1 if relayed else 0, chunk(other))
        pair.adopt()


def test_one_turn_reads_a_fast_engine_only_so_far(pair: Pair) -> None:
    """An engine with megabytes ready does not hold one run() (every other stream, and
    the loop) until it is read dry: a turn reads at most a few reads' worth, and the next
    turns go on where it stopped, every byte in order."""
    pair.relay.close()
    pair.relay = Relay(hold_bytes=NO_HOLD)
    pair.widen()
    pair.adopt()
    one_run = MAX_READ_PER_RUN + MIN_READ_PER_RUN
    wire = b"".join(chunk(token("v" * 200 + str(i))) for i in range(700))
    assert 3 * one_run < len(wire)
    pair.engine_peer.setblocking(False)
    sent = pair.engine_peer.send(wire)
    assert sent == len(wire)  # ready at once
    assert pair.run() == []
    first = pair.received()
    assert 0 < len(first) <= one_run + 8192  # one run's reads, chunk-framed again
    received = first
    for _ in range(100):
        assert pair.run() == []
        received += pair.received()
        if len(received) == sent:
            break
    assert received == wire


def flood(relay: Relay, budget: int, *, slow: bool = True) -> None:
    """Four floods (engines with a quarter megabyte ready at once) and, with ``slow``, a
    stream that writes a token every run, through ``relay``, whose run reads ``budget``:
    what each run reads, that the slow stream's token goes out in the run it came, that
    every flood moves on within a few runs, and that every byte goes out in order."""
    socks: list[socket.socket] = []
    streams = []
    # ~0.24 MB each: many runs' reads (the relay's hold NO_HOLD: nothing is handed back)
    wire = b"".join(chunk(token("f" * 200 + str(i))) for i in range(700))
    assert 3 * budget < len(wire)
    count = 5 if slow else 4
    # What the clients may get in a run past what it read: the rest of a chunk each stream
    # read in an earlier run (its client gets whole events only).
    slack = count * len(chunk(token("f" * 200 + "699")))
    try:
        for _ in range(count):
            engine, engine_peer = socket.socketpair()
            client, client_peer = socket.socketpair()
            socks += (engine, engine_peer, client, client_peer)
            for sock in (engine, engine_peer, client, client_peer):
                sock.setblocking(False)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            relay.adopt(engine.fileno(), client.fileno(), HEAD, TAIL, object())
            streams.append((engine_peer, client_peer, bytearray()))
        floods = streams[:4]
        for engine_peer, _, _ in floods:
            assert engine_peer.send(wire) == len(wire)
        moved = [0] * len(floods)  # the last run each flood's client got bytes (or was done)
        for run in range(2000):
            if slow:
                token_chunk = chunk(token(f"slow {run}"))
                streams[4][0].send(token_chunk)
            assert list(relay.run()) == []
            this_run = 0
            for at, (_, peer, got) in enumerate(streams):
                try:
                    piece = peer.recv(4 << 20)
                except BlockingIOError:
                    piece = b""
                got += piece
                this_run += len(piece)
                if at < len(floods) and (piece or len(got) == len(wire)):
                    moved[at] = run
            if slow:
                assert streams[4][2].endswith(token_chunk)  # the slow one never waits
            # The budget goes to each flood in turn (the socket read first moves on every
            # run): each gets bytes in any round of the ready sockets, a run to spare.
            assert all(run - last <= count for last in moved), (run, moved)
            # One run's reads: the budget, and a floor for each stream not flooding. In
            # the first run no flood is known yet to flood; from the second a flood reads
            # only from the budget (no floor of its own on top), the slow stream its floor.
            floors = (1 if slow else 0) if run else count
            assert this_run <= budget + floors * MIN_READ_PER_RUN + slack, (run, this_run)
            if all(len(got) == len(wire) for _, _, got in floods):
                break
        assert [bytes(got) == wire for _, _, got in floods] == [True] * 4
    finally:
        relay.close()
        for sock in socks:
            sock.close()


def test_flooding_engines_share_one_run_s_reads_and_a_slow_stream_never_waits() -> None:
    """Four engines with megabytes ready and one writing a token at a time: one run()
    reads ``MAX_READ_PER_RUN`` of the floods all together (ten floods cost the loop about
    as much per turn as one), each in turn, and the slow one, which never fills what it may
    read, ``MIN_READ_PER_RUN`` past it, so its token goes out in the run it came; every
    byte in order."""
    flood(Relay(hold_bytes=NO_HOLD), MAX_READ_PER_RUN)


def test_a_relay_built_with_a_smaller_read_per_run_reads_that_much_in_a_run() -> None:
    """``read_per_run`` is the relay's own budget: half the default bounds what one run
    reads of four floods (the slow stream's floor on top), and every flood still moves on
    within a few runs."""
    budget = MAX_READ_PER_RUN // 2
    assert MIN_READ_PER_RUN <= budget < MAX_READ_PER_RUN
    flood(Relay(read_per_run=budget, hold_bytes=NO_HOLD), budget)


def test_a_flood_reads_no_floor_once_the_budget_is_spent() -> None:
    """A flood (its last read filled what it was given) reads from the budget alone: with
    a budget of one floor, four floods read one floor's worth a run all together once they
    are known to flood (not four floors, one each on top of the budget), each in turn."""
    flood(Relay(read_per_run=MIN_READ_PER_RUN, hold_bytes=NO_HOLD), MIN_READ_PER_RUN,
          slow=False)


def test_an_event_with_crlf_endings_comes_back_at_once(pair: Pair) -> None:
    """An engine that switches to CRLF event endings after the relay took its stream: the
    event is given back at once, not after 64 KiB pile up behind it."""
    pair.adopt()
    crlf = token("y").replace(b"\n\n", b"\r\n\r\n")
    pair.send(chunk(token("x")) + chunk(crlf))
    ((_, relayed, count, engine, _, _, _, _),) = pair.run()
    assert (relayed, count) == (token("x"), 1)
    assert engine == chunk(crlf)


def deliveries_until_drained(pair: Pair, size: int) -> tuple[list[Back], bytes]:
    """Runs until the client has ``size`` bytes: what the relay handed, and what it wrote."""
    backs: list[Back] = []
    received = b""
    for _ in range(1000):
        backs += pair.run()
        received += pair.received()
        if len(received) >= size:
            break
    return backs, received


def test_a_hold_delivers_its_relayed_events_at_their_bound_and_keeps_the_stream(
        pair: Pair) -> None:
    """The events a hold keeps for the generation's log are bounded: past
    ``MAX_RELAYED_HELD`` they are delivered (``engine`` None) and the stream stays, so a
    fast engine is relayed here to its end, every byte accounted for."""
    pair.widen()
    pair.adopt()
    events = [token("v" * 200 + str(i)) for i in range(6000)]  # ~1.4 MB
    wire = b"".join(chunk(e) for e in events)
    pair.engine_peer.setblocking(False)
    assert pair.engine_peer.send(wire) == len(wire)
    deliveries, received = deliveries_until_drained(pair, len(wire))
    assert received == wire
    assert len(deliveries) >= 4
    for (hold, relayed, count, engine, unsent, _, last_write, texts) in deliveries:
        assert (hold, engine, unsent) == (pair.hold, None, b"")
        assert MAX_RELAYED_HELD <= len(relayed) < MAX_RELAYED_HELD + 320_000
        assert relayed.count(b"data: ") == count
        assert texts == b"".join(e[len(HEAD):-len(TAIL)] for e in relayed.split(b"\n\n")[:-1]
                                 for e in [e + b"\n\n"])
        assert last_write > 0
    assert pair.relay.held() == 1  # still relaying
    pair.send(chunk(FINISH) + chunk(DONE) + b"0\r\n\r\n")
    (_, relayed, count, engine, _, _, _, _) = pair.first_back()
    assert engine == chunk(FINISH) + chunk(DONE) + b"0\r\n\r\n"
    assert b"".join(d[1] for d in deliveries) + relayed == b"".join(events)
    assert sum(d[2] for d in deliveries) + count == len(events)
    assert pair.relay.held() == 0


def test_a_relay_built_with_a_smaller_hold_delivers_at_that_bound(pair: Pair) -> None:
    """``hold_bytes`` is the relay's own bound on what a hold keeps: the relayed events
    are delivered once they reach it, not before, and not far past it (what one run reads
    of the engine at most); a reclaim then gives back the rest, every byte accounted for."""
    held = 32 * 1024
    pair.relay.close()
    pair.relay = Relay(hold_bytes=held)
    pair.widen()
    pair.adopt()
    event = chunk(token("v" * 200))
    wire = event * 2000  # ~0.7 MB: more than the default bound, ready at once
    assert len(wire) > MAX_RELAYED_HELD + MAX_READ_PER_RUN
    pair.engine_peer.setblocking(False)
    assert pair.engine_peer.send(wire) == len(wire)
    deliveries, received = deliveries_until_drained(pair, len(wire))
    assert received == wire
    assert len(deliveries) >= len(wire) // (held + MAX_READ_PER_RUN + len(event))
    for (_, relayed, count, engine, _, _, _, _) in deliveries:
        assert engine is None
        # Past the bound by at most one run's reads (and the part of a chunk read before it).
        assert held <= len(relayed) < held + MAX_READ_PER_RUN + len(event)
        assert relayed == token("v" * 200) * count
    back = pair.relay.reclaim(pair.hold)
    assert back is not None
    (_, relayed, count, engine, unsent, _, _, _) = back
    assert (engine, unsent) == (b"", b"")
    assert len(relayed) < held
    assert sum(d[2] for d in deliveries) + count == 2000


@pytest.mark.parametrize("kwargs", [
    {"read_per_run": MIN_READ_PER_RUN - 1},
    {"read_per_run": -1},
    {"hold_bytes": 0},
    {"hold_bytes": -1},
])
def test_a_relay_refuses_a_read_per_run_below_the_floor_and_a_hold_below_a_byte(
        kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Relay(**kwargs)
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            CompiledRelay(loop, **kwargs)
    finally:
        loop.close()
    Relay(read_per_run=MIN_READ_PER_RUN, hold_bytes=1).close()  # the least of each is a relay

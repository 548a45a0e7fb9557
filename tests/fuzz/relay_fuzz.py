"""Seeded fuzz cases for the compiled relay (``core/_relay.c``), its socket loop and its
scanner, each checked against the reference parser (``tests.fuzz.reference``).

    python -m tests.fuzz.relay_fuzz --cases 400 --seed 1 [--relay path/to/_relay.so]

``--relay`` loads that build of the extension as ``prefixpin.core._relay`` (the
sanitizers' build: ``tests/unit/test_relay_sanitizers.py``); without it, the installed one.
A failing case prints its number: ``--seed S --only N`` runs it alone.

A relay case adopts one to four streams in one ``Relay``, over socket pairs or TCP
loopback connections, and writes each engine's wire in reads of random sizes (down to a
byte each), running the relay between them, while each client reads at its own pace (a
full socket holds its stream back). Each wire is token events of a shape, mixed with
events of other shapes, CRLF endings, hostile size lines, bad framing, the body's end;
each stream may meet a reclaim, a drop, the engine's end of file or reset, the client's
close or reset, or the relay's close. Whatever gives a stream back, its bytes are all
accounted for: the events relayed are the reference's first events, the client's bytes and
those given back unsent are exactly those events chunk-framed, and the engine bytes given
back, followed by what the relay never read, are the reference's rest of the body at a
chunk's end. A scanner case checks ``scan`` on mutated wires and random bytes: the same as
the reference, however the bytes are cut.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import prefixpin.core
from tests.fuzz.reference import (
    MAX_PENDING,
    Scanned,
    chunk,
    plain_text,
    reference_scan,
    scan_in_pieces,
)

# (hold, relayed, count, engine, unsent, last read, last write, texts): a stream given back, or
# (engine None) relayed events delivered while the relay keeps it.
Back = tuple[Any, bytes, int, bytes | None, bytes, float, float, bytes]

SHAPES: list[tuple[bytes, bytes]] = [
    (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"',
     b'"}}],"created":1796000000,"id":"chatcmpl-x","object":"chat.completion.chunk"}\n\n'),
    (b'data: {"content":"', b'","stop":false,"id_slot":0,"tokens":[12]}\n\n'),
    (b'data: "', b'"7\n\n'),
    (b"x", b"\n\n"),
]
TEXTS = [b"a", b"Hello", b" ", "w\u00f6rld".encode(), "\U0001f642".encode(),
         "\u4e2d\u6587".encode(), b"\\n", b'\\"', b"\\\\", b"\\/", b"\\t", b"0", b"12",
         b"\x7f", "\u00e9".encode()]
# Texts the lane refuses (the event comes back), or that end the event early.
BAD_TEXTS = [b"\\u0041", b"\x01", b'"', b"\\", b"\\x", b"\xed\xa0\x80", b"\xc0\x80",
             b"\xff", b"\r", b"", "\u00e9".encode()[:1], b"\n\n"]
OTHER_EVENTS = [
    b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1}\n\n',
    b"data: [DONE]\n\n", b": keep-alive\n\n", b"event: ping\ndata: {}\n\n", b"\n\n",
]
HOSTILE = [b"5;ext=1\r\nhello\r\n", b"zz\r\nhello\r\n", b"\r\n", b"5\rXhello\r\n",
           b"1" * 17 + b"\r\n", b"ffffffffffffffff\r\n", b"-1\r\n", b" 5\r\n",
           b"5\r\nhelloXX", b"0\r\n\r\n", b"10000\r\n", b"0000000000000001\r\nx\r\n",
           b"\r\r\n", b"5\r\n\r\n"]


def load_relay(path: str | None) -> str:
    """The extension's file: with ``path``, that build stands for ``prefixpin.core._relay``
    (imported before anything else imports the installed one)."""
    if path is not None:
        spec = importlib.util.spec_from_file_location("prefixpin.core._relay", path)
        if spec is None or spec.loader is None:
            raise SystemExit(f"not an extension module: {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        prefixpin.core._relay = module
    from prefixpin.core import _relay

    return str(_relay.__file__)


# ---- wires ----

def text(rng: random.Random) -> bytes:
    return b"".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 6)))


def moved_tail(rng: random.Random, tail: bytes) -> bytes:
    """The tail with a digit after a run's first changed (a time that moved on)."""
    spots = [i for i in range(1, len(tail)) if tail[i - 1:i + 1].isdigit()]
    if not spots:
        return tail
    i = rng.choice(spots)
    return tail[:i] + str(rng.randint(0, 9)).encode() + tail[i + 1:]


def event(rng: random.Random, head: bytes, tail: bytes, clean: bool = False) -> bytes:
    roll = rng.random() * (0.88 if clean else 1)
    if roll < 0.82:
        return head + text(rng) + tail
    if roll < 0.88:
        return head + text(rng) + moved_tail(rng, tail)
    if roll < 0.92:
        return head + rng.choice(BAD_TEXTS) + tail
    if roll < 0.96:
        return rng.choice(OTHER_EVENTS)
    return (head + text(rng) + tail).replace(b"\n\n", b"\r\n\r\n")  # CRLF endings


def frame(rng: random.Random, payload: bytes) -> bytes:
    """``payload`` cut into chunks of random sizes, their size lines in varied spellings."""
    style = rng.random()
    out = []
    at = 0
    while at < len(payload):
        roll = rng.random()
        size = (rng.randint(1, 8) if roll < 0.25 else len(payload) if roll < 0.4
                else rng.randint(1, 300))
        data = payload[at:at + size]
        at += len(data)
        digits = b"%x" % len(data)
        if style < 0.2:
            digits = digits.upper()
        elif style < 0.3:
            digits = digits.rjust(rng.randint(len(digits), 16), b"0")
        out.append(digits + b"\r\n" + data + b"\r\n")
    return b"".join(out)


def wire(rng: random.Random, head: bytes, tail: bytes, most: int = 30) -> bytes:
    """An engine's chunked body, as a stream the relay took would read on: up to ``most``
    events, then its end, or something else."""
    clean = rng.random() < 0.5  # token events only, up to the end: long streams
    events = [event(rng, head, tail, clean) for _ in range(rng.randint(0, most))]
    if rng.random() < 0.03:  # an event past the lane's bound, never delimited
        events.insert(rng.randint(0, len(events)), head + b"v" * (MAX_PENDING + 10))
    body = frame(rng, b"".join(events))
    roll = rng.random()
    if roll < 0.3:
        body += b"0\r\n\r\n"
    elif roll < 0.5:
        body += rng.choice(HOSTILE) + frame(rng, b"".join(
            event(rng, head, tail) for _ in range(rng.randint(0, 3))))
    elif roll < 0.6:
        cut = rng.randint(0, len(body))
        body = body[:cut] + rng.choice(HOSTILE) + body[cut:]
    return body


def sizes(rng: random.Random, total: int) -> list[int]:
    """Read sizes: a byte each, small, or large, covering ``total`` bytes."""
    style = rng.random() if total < 10_000 else 1.0
    out: list[int] = []
    covered = 0
    while covered < total:
        if style < 0.15:
            out.append(1)
        elif style < 0.6:
            out.append(rng.randint(1, 40))
        else:
            out.append(rng.choice([1, rng.randint(1, 600), rng.randint(1, 5000)]))
        covered += out[-1]
    return out


def mutate(rng: random.Random, data: bytes) -> bytes:
    for _ in range(rng.randint(0, 4)):
        at = rng.randint(0, len(data))
        roll = rng.random()
        if roll < 0.3 and data:
            at = min(at, len(data) - 1)
            data = data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
        elif roll < 0.5:
            data = data[:at] + rng.choice([b"\r", b"\n", b"\r\n", b"0", b";"]) + data[at:]
        elif roll < 0.7:
            data = data[:at] + data[at + rng.randint(1, 4):]
        elif roll < 0.85:
            data = data[:at] + rng.randbytes(rng.randint(1, 20)) + data[at:]
        else:
            data = data[:at]
    return data


# ---- the scanner ----

def scanner_case(rng: random.Random) -> None:
    from prefixpin.core._relay import plain_json_text, scan

    if rng.random() < 0.7:
        head, tail = rng.choice(SHAPES)
    else:
        head, tail = rng.randbytes(rng.randint(1, 4)), rng.randbytes(rng.randint(0, 3)) + b"\n\n"
    roll = rng.random()
    if roll < 0.6:
        data = mutate(rng, wire(rng, head, tail))
    elif roll < 0.8:
        data = rng.randbytes(rng.randint(0, 300))
    else:
        data = b"".join(rng.choice([chunk(rng.randbytes(rng.randint(1, 40))),
                                    chunk(event(rng, head, tail)), rng.choice(HOSTILE)])
                        for _ in range(rng.randint(1, 12)))
    carry = b""
    if rng.random() < 0.2:
        carry = rng.choice([head[:rng.randint(0, len(head))], rng.randbytes(rng.randint(1, 30))])
    whole = scan(data, head, tail, carry)
    ref = reference_scan(data, head, tail, carry)
    assert whole == (ref.consumed, ref.events, ref.carry, ref.stop), (data, whole, ref)
    pieces = scan_in_pieces(scan, data, head, tail, sizes(rng, len(data)), carry)
    assert pieces == whole, (data, pieces, whole)
    for mangled in (bytearray(data), memoryview(data)):  # any bytes-like object
        assert scan(mangled, head, tail, carry) == whole  # type: ignore[arg-type]
    for body in (rng.randbytes(rng.randint(0, 12)), mutate(rng, text(rng))):
        assert plain_json_text(body) == plain_text(body), body


# ---- the socket loop ----

def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        one = socket.create_connection(server.getsockname())
        two, _ = server.accept()
    return one, two


def reset(sock: socket.socket) -> None:
    """Closes ``sock``; a TCP one with a reset rather than a FIN."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def read_to_end(sock: socket.socket) -> bytes:
    """What ``sock`` reads until its peer's end of file (a TCP peer's bytes may still be on
    their way: the relay's write was taken by the kernel, not yet by the reader)."""
    sock.settimeout(10)
    out = bytearray()
    while piece := sock.recv(1 << 16):
        out += piece
    return bytes(out)


def drain(sock: socket.socket) -> bytes:
    """What ``sock`` has to read now (never blocking; an end or a reset ends it)."""
    out = bytearray()
    while True:
        try:
            piece = sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return bytes(out)
        except OSError:
            return bytes(out)
        if not piece:
            return bytes(out)
        out += piece


ACTIONS = ["none", "none", "none", "reclaim", "drop", "engine-eof", "engine-reset",
           "client-close", "client-reset"]
# What gives a stream back besides the scanner (an AF_UNIX pair closes where TCP resets).
ENDS = ("engine-eof", "engine-close", "engine-reset", "client-close", "client-reset")


@dataclass(eq=False)
class Fuzzed:
    """One stream under test: its wire, its sockets, what it sent and read, its fate."""

    head: bytes
    tail: bytes
    wire: bytes
    ref: Scanned
    tcp: bool
    cuts: list[int]
    action: str
    action_at: int
    read_chance: float
    burst: bool
    engine: socket.socket = field(init=False)
    engine_peer: socket.socket = field(init=False)
    client: socket.socket = field(init=False)
    client_peer: socket.socket = field(init=False)
    sent: int = 0
    read: bytearray = field(default_factory=bytearray)
    live: bool = True
    engine_reset: bool = False
    client_reset: bool = False
    client_closed: bool = False
    stopped_sending: bool = False
    acted: bool = False
    delivered: bytes = b""  # the relayed events of its deliveries so far, in order
    delivered_count: int = 0

    def __post_init__(self) -> None:
        pair = tcp_pair if self.tcp else socket.socketpair
        self.engine, self.engine_peer = pair()
        self.client, self.client_peer = pair()
        for sock in (self.engine_peer, self.client, self.client_peer):
            sock.setblocking(False)
        if self.tcp:  # every write on the wire at once (no Nagle wait for an ACK)
            for sock in (self.engine_peer, self.client):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.read_chance < 1:  # a slow client: its socket fills, the stream is held back
            self.client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            self.client_peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        if self.burst:  # the whole wire in the engine's socket at once
            for sock in (self.engine, self.engine_peer, self.client, self.client_peer):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)

    def feed(self) -> None:
        if self.stopped_sending or self.sent >= len(self.wire) or not self.cuts:
            return
        size = self.cuts[0]
        try:
            n = self.engine_peer.send(self.wire[self.sent:self.sent + size])
        except (BlockingIOError, InterruptedError):
            return  # the engine's socket is full: the relay holds the stream back
        self.sent += n
        if n == size:
            self.cuts.pop(0)
        else:
            self.cuts[0] = size - n

    def read_client(self) -> None:
        if not self.client_closed:
            self.read += drain(self.client_peer)

    def close(self) -> None:
        for sock in (self.engine, self.engine_peer, self.client, self.client_peer):
            sock.close()

    def texts_of(self, relayed: bytes) -> bytes:
        """The texts of relayed events (each between the shape's head and tail), joined."""
        events = [e + b"\n\n" for e in relayed.split(b"\n\n")[:-1]]
        return b"".join(e[len(self.head):len(e) - len(self.tail)] for e in events)

    def deliver(self, back: Back) -> None:
        """Relayed events delivered while the relay keeps the stream: the next in order."""
        token, relayed, count, engine, unsent, last_read, last_write, texts = back
        assert (token, engine, unsent) == (self, None, b"")
        assert texts == self.texts_of(relayed)
        assert self.live
        assert relayed
        assert count > 0
        assert last_read > 0
        assert last_write > 0
        self.delivered += relayed
        self.delivered_count += count
        assert self.delivered == b"".join(self.ref.events[:self.delivered_count])

    def check(self, back: Back, *, held: bool = False) -> None:
        """Every byte of a stream given back accounted for (``held``: reclaimed, which
        the relay still held)."""
        token, relayed, count, engine, unsent, last_read, last_write, texts = back
        assert token is self
        assert engine is not None
        assert texts == self.texts_of(relayed)
        assert last_read > 0
        assert last_write > 0
        self.live = False
        relayed, count = self.delivered + relayed, self.delivered_count + count
        # The relay let go of its duplicates: what they wrote reaches the other end, then
        # the end of file the originals send now.
        if not self.client_closed:
            self.client.shutdown(socket.SHUT_WR)
            self.read += read_to_end(self.client_peer)
        rest = b""
        if not self.engine_reset:
            if not self.stopped_sending:
                self.engine_peer.shutdown(socket.SHUT_WR)
            rest = read_to_end(self.engine) + self.wire[self.sent:]
        ref = self.ref
        assert count <= len(ref.events), (count, len(ref.events))
        assert relayed == b"".join(ref.events[:count])
        framed = b"".join(chunk(e) for e in ref.events[:count])
        if self.client_reset:  # what the reset lost is neither read nor unsent
            assert framed.startswith(bytes(self.read))
            assert framed.endswith(unsent)
            assert len(self.read) + len(unsent) <= len(framed)
        else:
            assert bytes(self.read) + unsent == framed, (bytes(self.read), unsent, framed)
        ends = [ref.given_back(consumed, carry, self.wire)
                for consumed, taken, carry in ref.checkpoints if taken == count]
        if self.engine_reset:
            assert any(end.startswith(engine) for end in ends), (engine, ends)
        else:
            assert engine + rest in ends, (engine, rest, ends)
        if self.engine_reset or rest:
            return
        # The relay read the whole wire: it stands where the reference ends, and it held
        # the stream only if the reference needs more (at the turn it reads a stop, the
        # relay gives the stream back), and let it go itself only at a stop, or an end.
        assert count == len(ref.events)
        assert engine == ref.given_back(ref.consumed, ref.carry, self.wire)
        if held:
            assert ref.stop == "more", ref.stop
        elif not (self.acted and self.action in ENDS):
            assert ref.stop != "more"


def relay_case(rng: random.Random, stats: dict[str, int]) -> None:
    from prefixpin.core._relay import MAX_RELAYED_HELD, Relay

    # The default hold, or one small enough that most streams deliver, or every run.
    relay = Relay(hold_bytes=rng.choice([MAX_RELAYED_HELD, MAX_RELAYED_HELD, 4096, 1]))
    streams: list[Fuzzed] = []
    tcp = rng.random() < 0.35
    for _ in range(rng.randint(1, 4)):
        head, tail = rng.choice(SHAPES)
        kind = rng.choice(["plain", "plain", "slow", "slow", "burst"] if rng.random() < 0.1
                          else ["plain", "plain", "slow"])
        if kind == "burst":  # more than a turn reads (MAX_READ_PER_TURN), ready at once
            head, tail = SHAPES[0]
            data = frame(rng, b"".join(head + text(rng) + tail for _ in range(3000)))
            data += rng.choice([b"", b"0\r\n\r\n"])
            cuts = [len(data)]
        else:  # a slow client's, longer: its socket fills, the relay holds the stream back
            data = wire(rng, head, tail, 30 if kind == "plain" else 300)
            cuts = sizes(rng, len(data))
        action = rng.choice(ACTIONS)
        if action.endswith("reset") and not tcp:
            action = action.replace("reset", "close")
        stream = Fuzzed(head, tail, data, reference_scan(data, head, tail), tcp, cuts, action,
                  rng.randint(0, 60), rng.choice([0.3, 0.05]) if kind == "slow" else 1.0,
                  kind == "burst")
        relay.adopt(stream.engine.fileno(), stream.client.fileno(), head, tail, stream)
        streams.append(stream)
    stats["streams"] += len(streams)
    for stream in streams:
        stop = f"wires stopping at {stream.ref.stop}"
        stats[stop] = stats.get(stop, 0) + 1
    try:
        run_streams(rng, relay, streams, stats)
    finally:
        relay.close()
        for stream in streams:
            stream.close()


def act(relay: Any, stream: Fuzzed) -> bool:
    """Whether the stream is still the relay's after its action."""
    stream.acted = True
    if stream.action == "reclaim":
        back = relay.reclaim(stream)
        assert back is not None
        stream.check(back, held=True)
    elif stream.action == "drop":
        held = relay.held()
        assert relay.drop(stream) is True
        assert relay.held() == held - 1
        assert relay.reclaim(stream) is None
        stream.live = False
    elif stream.action == "engine-eof":
        stream.engine_peer.shutdown(socket.SHUT_WR)
        stream.stopped_sending = True
    elif stream.action == "engine-close":
        stream.engine_peer.close()
        stream.stopped_sending = True
    elif stream.action == "engine-reset":
        reset(stream.engine_peer)
        stream.engine_reset = stream.stopped_sending = True
    elif stream.action in ("client-close", "client-reset"):
        stream.read_client()
        if stream.action == "client-reset":
            reset(stream.client_peer)
        else:
            stream.client_peer.close()
        # An AF_UNIX close fails the relay's next write; over TCP, a write can still be
        # taken before the peer's reset comes back, and be lost.
        stream.client_reset = stream.tcp
        stream.client_closed = True
        stream.read_chance = 0
    return stream.live


def run_streams(rng: random.Random, relay: Any, streams: list[Fuzzed],
                stats: dict[str, int]) -> None:
    by_hold = {id(stream): stream for stream in streams}
    quiet = 0
    for step in range(40_000):
        for stream in streams:
            if not stream.live:
                continue
            if step == stream.action_at and stream.action != "none" and not act(relay, stream):
                continue
            stream.feed()
            if stream.read_chance and rng.random() < stream.read_chance:
                stream.read_client()
        backs = relay.run()
        for back in backs:
            stats["events"] += back[2]
            if back[3] is None:
                by_hold[id(back[0])].deliver(back)
                stats["delivered"] += 1
                continue
            by_hold[id(back[0])].check(back)
            stats["given back"] += 1
            stats["given back unsent"] += bool(back[4])
        live = [stream for stream in streams if stream.live]
        if not live:
            return
        sent = all(stream.stopped_sending or stream.sent == len(stream.wire) for stream in live)
        quiet = quiet + 1 if sent and not backs else 0
        if quiet >= 3:
            for stream in live:  # a last turn with each client drained
                if stream.read_chance:
                    stream.read_client()
            if quiet >= 8 and not any(unread(stream) for stream in live):
                break
    # Held with every byte sent and read: the reference needs more too, and a reclaim
    # gives back exactly the rest. A close (the relay's own) ends some cases instead.
    if rng.random() < 0.15:
        return
    for stream in streams:
        if stream.live:
            back = relay.reclaim(stream)
            assert back is not None
            stream.check(back, held=True)
            stats["reclaimed at the end"] += 1
            stats["events"] += back[2]


def unread(stream: Fuzzed) -> bool:
    """Whether the engine's socket still holds bytes the relay has not read."""
    if stream.engine_reset:
        return False
    try:
        return bool(stream.engine.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return False


def refused(error: type[Exception], call: Callable[..., object], *args: object) -> None:
    try:
        call(*args)
    except error:
        return
    raise AssertionError(f"{call.__name__}{args!r} must raise {error.__name__}")


def misuse_case(rng: random.Random) -> None:
    """The API's refusals: they raise, and leave nothing behind."""
    from prefixpin.core._relay import Relay, plain_json_text, scan

    refused(TypeError, Relay, 1)
    relay = Relay()
    one, two = socket.socketpair()
    try:
        assert relay.fileno() >= 0
        for head, tail in ((b"", b"\n\n"), (b"x", b"")):
            refused(ValueError, relay.adopt, one.fileno(), two.fileno(), head, tail, None)
            refused(ValueError, scan, b"1\r\nx\r\n", head, tail)
        refused(TypeError, scan, "1\r\nx\r\n", b"x", b"\n\n")
        refused(TypeError, plain_json_text, "text")
        closed = socket.socket()
        number = closed.fileno()
        closed.close()
        refused(OSError, relay.adopt, number, two.fileno(), b"x", b"\n\n", None)
        assert relay.held() == 0
        assert relay.drop(relay) is False
        assert relay.reclaim(relay) is None
        relay.adopt(one.fileno(), two.fileno(), b"x", b"\n\n", object())
        if rng.random() < 0.5:
            del relay  # dealloc with a stream held
        else:
            relay.close()
            assert relay.run() == []
            assert relay.held() == 0
            refused(ValueError, relay.fileno)
            refused(ValueError, relay.adopt, one.fileno(), two.fileno(), b"x", b"\n\n", None)
    finally:
        one.close()
        two.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", type=int, default=None, help="run this case number alone")
    parser.add_argument("--relay", default=None, help="the extension build to load")
    args = parser.parse_args(argv)
    path = load_relay(args.relay)
    with open("/proc/self/maps") as maps:
        sanitized = "libasan" in maps.read()
    print(f"relay: {path} (AddressSanitizer {'loaded' if sanitized else 'not loaded'})")
    started = time.monotonic()
    stats = {"relay cases": 0, "scanner cases": 0, "streams": 0, "given back": 0,
             "reclaimed at the end": 0, "events": 0, "given back unsent": 0, "delivered": 0}
    numbers = [args.only] if args.only is not None else range(args.cases)
    for number in numbers:
        rng = random.Random(f"{args.seed}:{number}")
        try:
            if number % 50 == 0:
                misuse_case(rng)
            if number % 2:
                scanner_case(rng)
                stats["scanner cases"] += 1
            else:
                relay_case(rng, stats)
                stats["relay cases"] += 1
        except Exception:
            traceback.print_exc()
            print(f"case {number} failed: rerun it with --seed {args.seed} --only {number}",
                  file=sys.stderr)
            return 1
    summary = ", ".join(f"{v} {k}" for k, v in stats.items())
    print(f"ok: {summary} in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``Codec`` protocol: everything one client wire format decides, in one object.

The request path itself (plan, slot lease, generation, relay pacing, figures, commit) is the
same for every API; what differs is only how a request is read and how its answer is
written. That difference is a codec. ``proxy.pipeline.relay.respond`` and the request path look a
codec up (``proxy.codecs.codec_of``) and never test which API a client speaks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from starlette.responses import Response

from prefixpin.core.errors import ProxyError
from prefixpin.core.frames import Frame
from prefixpin.proxy.pipeline.body_memo import BodyMemo
from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.pipeline.validation import Api, ClientRequest, Endpoint


class StreamEncoder(Protocol):
    """One streaming client's view of one generation: the bytes its frames become.

    Made per client by ``Codec.stream`` (so it may hold state: a frame held back, a
    translation's position); a stateless codec returns one shared instance. ``encode`` is
    the hot path: called once per batch of frames (up to ``relay.BATCH_FRAMES``, all that
    arrived while the client was busy in one write), it should do no more than pick or
    rewrite each frame and join the bytes.
    """

    # True when every output chunk (``FrameKind.CHUNK``) encodes as its own bytes
    # (``frame.raw``) and changes nothing the encoder holds: the relay then writes a lone
    # new chunk as it is, without ``encode`` (``proxy.pipeline.relay.LiveStream``).
    raw_chunks: bool

    def encode(self, frames: Sequence[Frame]) -> bytes:
        """The bytes for these frames, in order; ``b""`` when none is for this client."""
        ...

    def flush(self) -> bytes | None:
        """What is still held back when the generation ends (before any late error)."""
        ...

    def heartbeat(self, text: str) -> bytes:
        """The keep-alive this client gets after ``--heartbeat`` seconds of silence, where
        its stream is now: the codec's (``Codec.heartbeat``), unless the format allows that
        one only past some event (Anthropic's ``ping`` only after ``message_start``: an SSE
        comment before it). ``text`` says what the proxy is waiting for."""
        ...


class Codec(Protocol):
    """One client wire format: its parser, its streamed and whole answers, its error shape,
    its usage and the assistant reply of a finished generation.

    Registered once (``proxy.codecs.register``) under a unique ``name``, its ``(api,
    endpoint)`` and the client paths (``routes``) it serves.
    """

    name: str  # unique; also the in-flight namespace: another wire format is another answer
    api: Api
    # The API the engine is asked in: ``api`` itself for a format the engine speaks, "openai"
    # for a format the codec converts to chat completions (Anthropic Messages, Responses).
    # A lane serves the codec when its engine kind serves this API (proxy.engine.engines).
    engine_api: Api
    endpoint: Endpoint
    routes: tuple[str, ...]  # the client paths answered in this format
    media_type: str  # of the streamed answer
    headers: Mapping[str, str]  # of the streamed answer
    opening: bytes  # written with the headers, before the engine said anything

    def parse(self, raw: bytes, path: str, *, max_messages: int,
              memo: BodyMemo | None = None) -> ClientRequest:
        """The client's body as a ``ClientRequest``; ``BadRequestError`` (a ``ClientError``)
        naming the field when it is refused (nothing is forwarded then)."""
        ...

    def stream(self, client: ClientRequest, generation: Generation, *,
               fill_cached: bool) -> StreamEncoder:
        """The encoder of one streaming client's frames. ``fill_cached``: the engine
        measures cached tokens, so a usage that left them out may be completed from the
        engine's other figures (never from an estimate)."""
        ...

    def heartbeat(self, text: str) -> bytes:
        """A keep-alive after ``--heartbeat`` seconds of silence, that every client of this
        format skips once its stream has begun (what a client is sent is its encoder's:
        ``StreamEncoder.heartbeat``); ``text`` says what the proxy is waiting for (a codec
        may drop it)."""
        ...

    def late_error(self, exc: ProxyError) -> bytes:
        """The error written after the headers went out (the stream then ends cleanly)."""
        ...

    def whole(self, client: ClientRequest, generation: Generation, *,
              fill_cached: bool) -> Response:
        """The one body of a ``stream: false`` client, from a generation that completed:
        the frames folded as this format's own non-streamed answer, usage filled in."""
        ...

    def error_response(self, exc: ProxyError) -> Response:
        """The whole response for an error found before any byte went to the client (a
        refused body, an engine error status within the first-byte budget)."""
        ...

    def reply(self, frames: Sequence[Frame]) -> Mapping[str, Any] | None:
        """The assistant message of a finished generation, as the client will send it back
        in its next turn (what the planner commits); None when the format has none."""
        ...

"""The bounds' defaults that ``proxy.settings`` offers and the modules enforcing them fall
back to: constants alone. A leaf (it imports nothing), so reading the settings loads no
engine client or pipeline."""

from __future__ import annotations

# The engine connection (adapters.h1). An engine that writes faster than the proxy relays
# must not keep the loop (every other stream) in its reads: the connections flooding at
# once split ``TURN_READ_BUDGET`` per turn of the loop, each reading at least ``MIN_READ``.
TURN_READ_BUDGET = 16 * 1024
MIN_READ = 2 * 1024
# Its response head, bounded: its bytes (an endless header line or header count would grow
# the parser's buffers), the interim 1xx responses before it, and the time from its first
# byte (the read timeout measures silence, and a trickle is never silent).
MAX_HEAD_BYTES = 1 << 20
MAX_INTERIM_RESPONSES = 8
HEAD_WITHIN_S = 30.0

# The event bytes of one engine reply (proxy.pipeline.generation): 512 bytes for each of
# ``--max-reply-events``' default events, more than any token event of an engine we serve.
MAX_REPLY_BYTES = 64 * 1024 * 1024

# Chunks of one chunked request body (proxy.listen.http_limits): each costs the parser's callbacks
# whatever its size.
MAX_BODY_CHUNKS = 4096

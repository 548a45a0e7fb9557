"""What every layer speaks: the layer below both ``proxy/`` (policy) and ``adapters/``
(engines).

- ``core.errors``: the one exception tree, translated to a wire error at the boundary;
- ``core.frames``: the normalized events of an engine's output stream;
- ``core.sse``, ``core.ndjson``: sans-IO codecs of the two streamed wire formats;
- ``core.figures``: the cache figures a stream carries (prompt, cached, timings);
- ``core.streaming``: the streamed ASGI response and the wait for a client's disconnect.

Nothing here imports from ``proxy`` or ``adapters``.
"""

"""Speed: the pieces that make the listener cheaper per event, none of which changes what a
client receives (the same bytes, in the same order, with or without each of them).

It sits behind the listener's frame sink: the listener (``proxy.listen.server``,
``proxy.listen.http_limits``) plugs these pieces in, and nothing on the request path
(``proxy.pipeline``, ``proxy.session``, ``proxy.engine``, ``proxy.parking``,
``proxy.codecs``, ``proxy.cluster``, ``proxy.ops``, nor ``adapters``, ``core``,
``fingerprint``) imports any of it (``tests/test_layers.py``). What the relay needs of it
is a name of its own, ``proxy.pipeline.relay.BODY_WRITER``, read from the request's scope.

- ``client_writes``: a turn's writes to a client sent together, one syscall per connection
  per turn, and a body chunk written without an ASGI ``send``: the relay's kernel time and
  Python per event.
- ``accepting``: every connection waiting on a listener accepted in one turn of the loop:
  a burst of new connections does not wait a turn each.
- ``collector``: the garbage collector's thresholds and a young-generation timer: the
  relay's p99 pauses.
- ``allocator``: glibc's malloc thresholds fixed (``--keep-large-buffers``): large uploads
  reuse heap memory instead of faulting in fresh pages.
- ``interpreter``: the interpreter's build, logged at start: a deployment can see that its
  Python costs more per event, and pick another.
- ``uvicorn_seam``: the one place reaching into uvicorn's private protocol (what
  ``client_writes`` and ``accepting`` read), with the check that it is all there.
"""

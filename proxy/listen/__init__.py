"""Listening and limits: the sockets, HTTP/1.1, the bounds on what comes in, the ASGI app and
its routes, and which tenant a request belongs to."""

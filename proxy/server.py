"""Run the app under uvicorn with the settings' host and port."""

from __future__ import annotations

import uvicorn

from proxy.app import create_app
from proxy.logs import configure
from proxy.settings import Settings


def serve(settings: Settings) -> int:
    configure(settings.log_level)
    app = create_app(settings)
    # uvicorn speaks ASGI HTTP spec 2.3, so Starlette's StreamingResponse listens for
    # http.disconnect while it streams: a client that leaves cancels the relay at once.
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()
    return 0

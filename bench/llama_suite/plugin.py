"""pytest plugin loaded into llama.cpp's own server test suite (``-p bench.llama_suite.plugin``).

It changes the harness (``utils.ServerProcess``) in six ways, and nothing in the tests:

- every server it starts runs the project's llama-server (``LLAMA_SERVER_BIN_PATH``) on the
  project's local GGUF (``LLAMA_SUITE_MODEL``) with ``--offline``: no preset's Hugging Face
  repo, URL or mmproj reaches the command line, ``ServerPreset.load_all`` (which starts
  every preset once to download it) does nothing, ``wget`` is a stub that refuses, and
  ``requests`` refuses any host but loopback (the Anthropic vision test's image comes from
  a local PNG instead of huggingface.co);
- with ``LLAMA_SUITE_MODE=prefixpin``, once the harness has seen llama-server healthy,
  prefixpin is started in process (uvicorn in threads) in front of it, and
  ``server.server_port`` becomes prefixpin's tenant port: the OpenAI clients the tests
  build from ``server_host``/``server_port`` talk to prefixpin, and so do
  ``make_request``/``make_stream_request``, which send a path the tenant port does not
  serve (``/slots``, ``POST /props``, ...) to prefixpin's operator listener
  instead, except a bare path whose ``/v1`` form is a tenant route (``/responses``: one
  llama-server handler for both), which goes to the tenant port as that form
  (``LLAMA_SUITE_ROUTING=tenant`` sends everything to the tenant port as it is);
- prefixpin is configured as an operator configures it in front of that engine: its
  ``--engine-api-key`` is the server's ``--api-key`` (prefixpin's own probes need it), and
  its ``--cors-origins`` is the one llama-server resolves from the same server's
  settings (``engine_cors_origins``: its ``--cors-origins``, else ``localhost`` with built-in
  tools or MCP servers, else ``*``, this build's default; prefixpin's own default is
  ``localhost``). Every ``OPTIONS`` goes to the tenant port, which answers preflights
  itself;
- in both runs, the headers of a ``make_request`` answer are read case-insensitively, as
  HTTP defines them (RFC 9110 §5.1): the harness keeps them in a plain ``dict``, so a test
  that looks up ``Access-Control-Allow-Origin`` would miss the same header written
  ``access-control-allow-origin``, as uvicorn writes every header name (llama-server keeps
  the case it was given);
- every request the harness makes is logged with its test id and the listener it went to
  (``LLAMA_SUITE_ROUTES``, JSON lines);
- every test's outcome, its failure message and its duration go to ``LLAMA_SUITE_RESULTS``
  (JSON), which ``bench/llama_suite/run.py`` compares between the two runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from requests.structures import CaseInsensitiveDict

MODE = os.environ.get("LLAMA_SUITE_MODE", "direct")
ROUTING = os.environ.get("LLAMA_SUITE_ROUTING", "auto")
MODEL = os.environ.get("LLAMA_SUITE_MODEL", "")
RESULTS = os.environ.get("LLAMA_SUITE_RESULTS")
ROUTES = os.environ.get("LLAMA_SUITE_ROUTES")

# 1x1 PNG (the same one test_completion.py sends): stands in for the image the Anthropic
# vision test would fetch from huggingface.co.
LOCAL_PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNk+A8AAQUBAScY42Y"
             "AAAAASUVORK5CYII=")

_local = threading.local()
_current_test = {"nodeid": ""}
_outcomes: dict[str, dict[str, Any]] = {}
_routes_lock = threading.Lock()


def _stub_wget() -> None:
    def download(url: str, *args: Any, **kwargs: Any) -> str:
        raise RuntimeError(f"llama_suite: downloads are disabled ({url})")

    module = types.ModuleType("wget")
    module.download = download  # type: ignore[attr-defined]
    sys.modules["wget"] = module


def _guard_requests() -> None:
    import requests.sessions

    original = requests.sessions.Session.request

    def request(self: Any, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        host = urlsplit(str(url)).hostname or ""
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise RuntimeError(f"llama_suite: only loopback may be reached ({url})")
        return original(self, method, url, *args, **kwargs)

    requests.sessions.Session.request = request  # type: ignore[method-assign,assignment]


def _tenant_serves(method: str, path: str) -> bool:
    """Whether prefixpin's tenant port answers ``method path`` itself (its pipeline routes,
    ``/healthz`` and the read-only allow-list), read from the project's own tables."""
    from prefixpin.proxy.codecs import routes as codec_routes
    from prefixpin.proxy.listen.passthrough import TENANT_PATHS

    path = path.partition("?")[0]
    if method == "OPTIONS":  # every preflight: answered before routing (proxy.listen.cors)
        return True
    if method == "POST" and path in codec_routes():
        return True
    if path == "/healthz" and method == "GET":
        return True
    return TENANT_PATHS.get(path) == method


def engine_cors_origins(server: Any) -> str:
    """The ``--cors-origins`` llama-server resolves for ``server`` (common/arg.cpp): the one
    given, else ``localhost`` when built-in tools or MCP servers are on, else ``*``."""
    if server.cors_origins:
        return str(server.cors_origins)
    if server.server_tools or server.mcp_servers_config or server.mcp_servers_json:
        return "localhost"
    return "*"


class _Proxy:
    """prefixpin in front of one llama-server, in this process."""

    def __init__(self, upstream: str, cors_origins: str, engine_api_key: str | None) -> None:
        from prefixpin.proxy.listen.app import create_apps
        from prefixpin.proxy.settings import Settings
        from tests.fakes.servers import serve_proxy

        self.stack = contextlib.ExitStack()
        settings = Settings(upstream=upstream, cors_origins=cors_origins,
                            engine_api_key=engine_api_key)
        self.url = self.stack.enter_context(serve_proxy(create_apps(settings)))
        self.admin: str = self.url.admin
        self.port = int(urlsplit(self.url).port or 0)
        self._wait_healthy()

    def _wait_healthy(self, timeout: float = 30.0) -> None:
        import requests

        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                if requests.get(f"{self.url}/healthz", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("llama_suite: prefixpin never reported the engine healthy")
            time.sleep(0.05)

    def close(self) -> None:
        self.stack.close()


def _log_route(method: str, path: str, listener: str) -> None:
    if not ROUTES:
        return
    line = json.dumps({"test": _current_test["nodeid"], "method": method, "path": path,
                       "listener": listener})
    with _routes_lock, open(ROUTES, "a") as out:
        out.write(line + "\n")


def _patch_harness() -> None:
    tests_dir = os.environ.get("LLAMA_SUITE_TESTS_DIR")
    if tests_dir and tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    import utils  # type: ignore[import-not-found]  # the harness (tools/server/tests/utils.py)

    server_cls = utils.ServerProcess
    original_start = server_cls.start
    original_stop = server_cls.stop
    original_make_url = server_cls.make_url
    original_make_request = server_cls.make_request
    original_make_stream_request = server_cls.make_stream_request

    def localise(server: Any) -> None:
        if server.models_dir is None and MODEL:
            server.model_file = MODEL
        server.model_hf_repo = None
        server.model_hf_file = None
        server.model_url = None
        server.mmproj_url = None
        server.offline = True

    def start(self: Any, timeout_seconds: int = utils.DEFAULT_HTTP_TIMEOUT) -> None:
        localise(self)
        self._suite_proxy = None
        _local.starting = True  # the harness's /health polls are not logged
        try:
            original_start(self, timeout_seconds)
        finally:
            _local.starting = False
        if MODE == "prefixpin" and not self.external_server:
            self._suite_llama_port = self.server_port
            host = self.server_host.split(",")[0].strip()
            try:
                self._suite_proxy = _Proxy(f"http://{host}:{self.server_port}",
                                           engine_cors_origins(self), self.api_key)
            except BaseException:
                original_stop(self)
                raise
            self.server_port = self._suite_proxy.port

    def stop(self: Any) -> None:
        proxy = getattr(self, "_suite_proxy", None)
        if proxy is not None:
            self._suite_proxy = None
            self.server_port = self._suite_llama_port
            proxy.close()
        original_stop(self)

    def make_url(self: Any, path: str, host: str | None = None) -> str:
        proxy = getattr(self, "_suite_proxy", None)
        method = getattr(_local, "method", "?")
        if proxy is None or host is not None:
            if getattr(_local, "method", None) and not getattr(_local, "starting", False):
                _log_route(method, path, "llama-server")
            return str(original_make_url(self, path, host))
        if ROUTING == "tenant" or _tenant_serves(method, path):
            _log_route(method, path, "tenant")
            return f"{proxy.url}{path}"
        if _tenant_serves(method, "/v1" + path):
            # llama-server serves /responses and /v1/responses with one handler; the
            # tenant port only the /v1 form: that one, so the pipeline is what answers
            _log_route(method, path, "tenant as /v1" + path)
            return f"{proxy.url}/v1{path}"
        _log_route(method, path, "operator")
        return f"{proxy.admin}{path}"

    def with_method(function: Any) -> Any:
        def wrapped(self: Any, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            _local.method = method
            try:
                answer = function(self, method, path, *args, **kwargs)
            finally:
                _local.method = None
            answer.headers = CaseInsensitiveDict(answer.headers)
            return answer

        wrapped.__name__ = function.__name__
        return wrapped

    def streamed(self: Any, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        # a generator: the URL is made when it is first iterated, so the method is set then
        _local.method = method
        try:
            yield from original_make_stream_request(self, method, path, *args, **kwargs)
        finally:
            _local.method = None

    server_cls.start = start
    server_cls.stop = stop
    server_cls.make_url = make_url
    server_cls.make_request = with_method(original_make_request)
    server_cls.make_stream_request = streamed
    utils.ServerPreset.load_all = staticmethod(lambda: None)


# At import (``-p`` loads this before the suite's conftest imports ``utils``, which
# imports ``wget``).
_stub_wget()
_guard_requests()
_patch_harness()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "get_test_image_base64"):
            module.get_test_image_base64 = lambda: LOCAL_PNG


def pytest_runtest_setup(item: pytest.Item) -> None:
    _current_test["nodeid"] = item.nodeid


def _message(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    return str(longrepr)[-2000:]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "message": "",
                                                 "duration": 0.0, "traceback": ""})
    entry["duration"] += report.duration
    if report.passed:
        return
    if report.skipped:
        if entry["outcome"] == "passed":
            entry.update(outcome="skipped", message=_message(report))
        return
    # failed: in the call it is a failure, in setup or teardown an error
    outcome = "failed" if report.when == "call" else f"error ({report.when})"
    if entry["outcome"] in ("passed", "skipped"):
        entry.update(outcome=outcome, message=_message(report),
                     traceback=report.longreprtext[-6000:])
    else:
        entry["outcome"] += f" + {outcome}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if RESULTS:
        Path(RESULTS).write_text(json.dumps({"mode": MODE, "routing": ROUTING,
                                             "exitstatus": int(exitstatus),
                                             "tests": _outcomes}, indent=1))

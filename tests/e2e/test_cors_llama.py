"""A browser page on another origin streams a chat completion through prefixpin from the real
llama-server (issue 46): headless Chromium loads the page from a small static server on
another local port and calls the tenant port with ``fetch`` and an ``Authorization``
header, so the browser sends a preflight first. From an allowed origin (``localhost``, the
default) the page reads the streamed text; from a refused one (``127.0.0.2``) the browser
blocks the call, and the engine never sees it. And, without a browser: what a refused origin
gets carries no allow header and no body it could read."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import queue
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ProxyRunner
from tests.rig.browser import find_chromium, headless_args

pytestmark = [pytest.mark.llama, pytest.mark.usefixtures("chromium_binary")]

BODY = {"messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 8, "temperature": 0, "stream": True}
KEY = "sk-from-the-page"

# The page streams the answer and sends what it read (or why it could not) back to its own
# site (same origin, so nothing CORS decides), where the test waits for it.
PAGE = """<!doctype html><html><body><pre id="out">pending</pre><script>
(async () => {
  const out = document.getElementById("out");
  try {
    const response = await fetch(%(url)s, {method: "POST", body: %(body)s,
      headers: {"Authorization": "Bearer %(key)s", "Content-Type": "application/json"}});
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let raw = "";
    for (;;) {
      const {done, value} = await reader.read();
      if (done) break;
      raw += decoder.decode(value, {stream: true});
    }
    let text = "";
    for (const line of raw.split("\\n")) {
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const delta = JSON.parse(line.slice(6)).choices[0]?.delta?.content;
      if (delta) text += delta;
    }
    out.textContent = "read:" + JSON.stringify({status: response.status, text: text});
  } catch (error) {
    out.textContent = "blocked:" + error.name;
  }
  await fetch("/result", {method: "POST", body: out.textContent});
})();
</script></body></html>"""


@dataclass
class Site:
    """The page's own origin: a static server that also takes the page's result."""

    url: str
    results: queue.Queue[str]


class SiteHandler(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *args: Any, results: queue.Queue[str], **kwargs: Any) -> None:
        self.results = results
        super().__init__(*args, **kwargs)

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.results.put(self.rfile.read(length).decode())
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def static_site(root: Path, host: str, name: str) -> Iterator[Site]:
    """``root`` served on ``host`` at a free port; ``name``: the host as the page's URL
    says it."""
    results: queue.Queue[str] = queue.Queue()
    handler = functools.partial(SiteHandler, directory=str(root), results=results)
    server = http.server.ThreadingHTTPServer((host, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Site(f"http://{name}:{server.server_address[1]}", results)
    finally:
        server.shutdown()
        server.server_close()


def page_result(site: Site, profile: Path, timeout_s: float = 120.0) -> str:
    """What the page at ``site`` reports once it has run in headless Chromium."""
    binary = find_chromium()
    assert binary is not None  # the chromium_binary fixture found it
    log = profile.with_suffix(".log")
    with open(log, "wb") as errors:
        browser = subprocess.Popen(
            [str(binary), *headless_args(profile), f"{site.url}/chat.html"],
            stdout=subprocess.DEVNULL, stderr=errors)
        try:
            return site.results.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"the page reported nothing: {log.read_text()[-2000:]}"
                                 ) from None
        finally:
            browser.terminate()
            browser.wait(timeout=30)


def streamed_text(url: str) -> str:
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=BODY, timeout=120,
                      headers={"authorization": f"Bearer {KEY}"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += (choice.get("delta") or {}).get("content") or ""
    return text


def requests_served(admin: str) -> float:
    metrics = httpx.get(f"{admin}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("prefixpin_requests_total{"))


def test_a_page_on_an_allowed_origin_reads_the_stream_and_a_refused_one_is_blocked(
        run_proxy: ProxyRunner, erase_slots: Callable[[], None], tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    with run_proxy() as url:
        (site / "chat.html").write_text(PAGE % {
            "url": json.dumps(f"{url}/v1/chat/completions"), "body": json.dumps(
                json.dumps(BODY)), "key": KEY})
        expected = streamed_text(url)
        with static_site(site, "127.0.0.1", "localhost") as page:
            allowed = page_result(page, tmp_path / "a")
        before = requests_served(url.admin)
        with static_site(site, "127.0.0.2", "127.0.0.2") as page:
            refused = page_result(page, tmp_path / "b")
        after = requests_served(url.admin)
    assert expected  # the engine answers this prompt with some text
    assert allowed.startswith("read:"), allowed
    assert json.loads(allowed.removeprefix("read:")) == {"status": 200, "text": expected}
    assert refused == "blocked:TypeError"  # fetch's network error: the browser said no
    assert after == before  # the refused page's request never reached the pipeline


def test_a_refused_origin_gets_no_allow_header_and_no_body_it_could_read(
        run_proxy: ProxyRunner, erase_slots: Callable[[], None]) -> None:
    origin = "http://127.0.0.2:3000"
    with run_proxy() as url:
        preflight = httpx.options(f"{url}/v1/chat/completions", timeout=30, headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization,content-type"})
        before = requests_served(url.admin)
        chat = httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=120,
                          headers={"origin": origin, "authorization": f"Bearer {KEY}"})
        models = httpx.get(f"{url}/v1/models", headers={"origin": origin}, timeout=30)
        after = requests_served(url.admin)
        allowed = httpx.get(f"{url}/v1/models", headers={"origin": "http://localhost:3000"},
                            timeout=30)
    assert preflight.status_code == 200
    assert preflight.content == b""
    assert "access-control-allow-origin" not in preflight.headers
    for refused in (chat, models):
        assert refused.status_code == 403
        assert not any(name.startswith("access-control-") for name in refused.headers)
    assert after == before
    # llama-server's own header (it reflects every origin by default) is not passed on:
    # the one there is prefixpin's
    assert allowed.headers.get_list("access-control-allow-origin") == ["http://localhost:3000"]

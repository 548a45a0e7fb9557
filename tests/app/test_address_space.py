"""The real ``prefixpin serve`` under an address-space limit (``ulimit -v``, systemd's
``LimitAS=``) survives bodies built to make a JSON parser allocate per value.

Before ``--max-json-values`` a 30 MiB ``[0,0,...]`` body (inside ``--max-body``) made the
parser ask for gigabytes, and under such a limit that crashed the proxy. Now the body is
refused before it is parsed (413 in the client's API shape), the proxy stays up and the
next request is answered. The engine is the test fake (its answers are not the point).
"""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer
from tests.fakes.servers import serve_in_thread

# Far under what the parser asked for (4.25 GB), far over what the proxy needs to run.
ADDRESS_SPACE = 3 * 1024**3
BODY_BYTES = 30 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def limit_address_space() -> None:  # in the child, before exec
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@contextmanager
def limited_proxy(upstream: str, log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefixpin.proxy.cli", "serve", "--upstream", upstream,
             "--port", str(port), "--admin-listen", f"127.0.0.1:{free_port()}"],
            stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit_address_space)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log.read_text()
                try:
                    if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            yield url, proc
        finally:
            proc.terminate()
            proc.wait(10)


def chat() -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def test_a_body_of_millions_of_tiny_values_is_refused_and_the_limited_proxy_stays_up(
        tmp_path: Path) -> None:
    engine = FakeLlamaServer(FakeLlamaConfig(reply="hello there"))
    with serve_in_thread(engine.app()) as engine_url, \
            limited_proxy(engine_url, tmp_path / "serve.log") as (url, proc):
        values = b"[" + b"0," * (BODY_BYTES // 2 - 1) + b"0]"
        body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "pad": ' \
            + values + b"}"
        refused = httpx.post(f"{url}/v1/chat/completions", content=body,
                             headers={"content-type": "application/json"}, timeout=120)
        assert refused.status_code == 413, refused.text
        assert "JSON values" in refused.json()["error"]["message"]
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        answered = httpx.post(f"{url}/v1/chat/completions", json=chat(), timeout=60)
        assert answered.status_code == 200, answered.text
        assert json.loads(answered.text)["choices"][0]["message"]["content"]

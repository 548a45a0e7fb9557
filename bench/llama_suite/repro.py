#!/usr/bin/env python3
"""The exact requests behind ``run.py``'s differing tests, sent directly and through
prefixpin, with both answers (``bench/results/llama-suite/repro.json``).

Each case starts llama-server as the suite's harness does for that test (the preset's
flags, the local SmolLM2 GGUF), prefixpin in process in front of it, and sends the
test's request to both.

    .venv/bin/python bench/llama_suite/repro.py            # every case
    .venv/bin/python bench/llama_suite/repro.py chat_n2    # one
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import requests  # noqa: E402

from prefixpin.proxy.listen.app import create_apps  # noqa: E402
from prefixpin.proxy.settings import Settings  # noqa: E402
from tests.fakes.servers import serve_proxy  # noqa: E402
from tests.rig.llama_build import ensure_llama_server  # noqa: E402
from tests.rig.models import fetch_model  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "llama-suite" / "repro.json"

# ServerPreset.tinyllama2() as utils.py turns it into flags (temp 0.8, seed 42, --no-slots,
# --no-jinja), and the Anthropic file's fixture on top of it.
TINYLLAMA2 = ["--temp", "0.8", "--seed", "42", "--ctx-size", "512", "--batch-size", "32",
              "--parallel", "2", "--n-predict", "64", "--alias", "tinyllama-2",
              "--no-slots", "--no-jinja"]
ANTHROPIC = ["--temp", "0.8", "--seed", "42", "--ctx-size", "8192", "--batch-size", "2048",
             "--parallel", "1", "--n-predict", "64", "--alias", "tinyllama-2-anthropic",
             "--no-slots", "--no-jinja"]
BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]

CASES: dict[str, dict[str, Any]] = {
    "chat_n2": {
        "test": "test_chat_completion.py::test_chat_completions_multiple_choices",
        "flags": TINYLLAMA2, "path": "/chat/completions",
        "body": {"max_tokens": 8, "n": 2, "messages": BOOK, "id_slot": 0},
    },
    "anthropic_empty_messages": {
        "test": "test_compat_anthropic.py::test_anthropic_empty_messages",
        "flags": ANTHROPIC, "path": "/v1/messages",
        "body": {"model": "test", "max_tokens": 50, "messages": []},
    },
    "chat_empty_messages": {  # no test sends it: how each answers an empty chat, beside it
        "test": None, "flags": TINYLLAMA2, "path": "/chat/completions",
        "body": {"max_tokens": 8, "messages": []},
    },
    "anthropic_image_error": {
        "test": "test_compat_anthropic.py::test_anthropic_vision_format_accepted",
        "flags": ANTHROPIC, "path": "/v1/messages",
        "body": {"model": "test", "max_tokens": 10, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": (
                "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNk+A8AAQUBAScY42Y"
                "AAAAASUVORK5CYII=")}},
            {"type": "text", "text": "What is in this image?"}]}]},
    },
    "responses_stream_telemetry": {
        # the test sends /responses; llama-server serves it and /v1/responses with one
        # handler, prefixpin's tenant port the /v1 form only
        "test": "test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry",
        "flags": ["--temp", "0.8", "--seed", "42", "--ctx-size", "256", "--batch-size", "32",
                  "--parallel", "1", "--n-predict", "64", "--alias", "tinyllama-2",
                  "--no-slots", "--no-jinja"],
        "path": "/v1/responses",
        "body": {"input": "This is a test" * 10, "max_output_tokens": 8, "temperature": 0.8,
                 "stream": True, "timings_per_token": True, "return_progress": True},
    },
    "responses": {
        "test": "test_compat_oai_responses.py::test_responses_with_openai_library",
        "flags": TINYLLAMA2, "path": "/v1/responses",
        "body": {"model": "gpt-4.1", "input": BOOK, "max_output_tokens": 8, "temperature": 0.8},
    },
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_llama(flags: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [str(ensure_llama_server()), "--host", "127.0.0.1", "--port", str(port),
               "--model", str(fetch_model("smollm2")), "--offline", *flags]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except requests.RequestException:
            pass
        time.sleep(0.05)
    process.kill()
    raise RuntimeError("llama-server did not start")


def answer(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    if body.get("stream"):
        return streamed(url, path, body)
    response = requests.post(f"{url}{path}", json=body, timeout=600)
    try:
        content: Any = response.json()
    except ValueError:
        content = response.text
    return {"status": response.status_code, "body": content}


def streamed(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed answer: its events (``data:`` lines as JSON, with the ``event:`` name),
    and per event type the top-level keys its events carry."""
    response = requests.post(f"{url}{path}", json=body, timeout=600, stream=True)
    events: list[Any] = []
    name = None
    for raw in response.iter_lines():
        line = raw.decode("utf-8")
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            try:
                events.append({"event": name, "data": json.loads(data)})
            except ValueError:
                events.append({"event": name, "data": data})
            name = None
    shapes: dict[str, list[str]] = {}
    for event in events:
        data = event["data"]
        if isinstance(data, dict):
            kind = str(data.get("type", event["event"]))
            shapes[kind] = sorted(set(shapes.get(kind, [])) | set(data))
    return {"status": response.status_code, "keys_by_type": shapes, "body": events}


def keys(value: Any, prefix: str = "") -> set[str]:
    """Every key path of a JSON value (list items as ``[]``)."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            found.add(prefix + key)
            found |= keys(item, prefix + key + ".")
    elif isinstance(value, list):
        for item in value:
            found |= keys(item, prefix + "[].")
    return found


def run_case(name: str, case: dict[str, Any]) -> dict[str, Any]:
    process, llama = start_llama(case["flags"])
    try:
        direct = answer(llama, case["path"], case["body"])
        with serve_proxy(create_apps(Settings(upstream=llama))) as proxy:
            proxied = answer(proxy, case["path"], case["body"])
    finally:
        process.terminate()
        process.wait(10)
    a, b = keys(direct["body"]), keys(proxied["body"])
    return {"case": name, "test": case["test"], "request": {"path": case["path"],
                                                             "body": case["body"]},
            "direct": direct, "prefixpin": proxied,
            "keys_only_direct": sorted(a - b), "keys_only_prefixpin": sorted(b - a)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", metavar="CASE", help=", ".join(CASES))
    args = parser.parse_args()
    args.cases = args.cases or list(CASES)
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}; known: {', '.join(CASES)}")
    results = [run_case(name, CASES[name]) for name in args.cases]
    for result in results:
        print(f"== {result['case']} ({result['test']})\n"
              f"POST {result['request']['path']} {json.dumps(result['request']['body'])[:600]}")
        for mode in ("direct", "prefixpin"):
            answer_ = result[mode]
            shown = answer_.get("keys_by_type") or answer_["body"]
            print(f"  {mode}: {answer_['status']} {json.dumps(shown)[:1500]}")
        print(f"  keys only direct: {result['keys_only_direct']}\n"
              f"  keys only prefixpin: {result['keys_only_prefixpin']}\n")
    if set(args.cases) == set(CASES):
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``prefixpin doctor`` against real llama-servers started with good and with bad flags.

Every server is small (SmolLM2-135M or Gemma 3 270M, a few thousand tokens of context)
and each test reads its verdict through the real command line (``prefixpin doctor
--json``). Most checks run twice: from HTTP and probes alone (``--no-local``, as when
llama-server runs in a container or on another host) and with the server's command line
read from /proc.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from prefixpin.proxy.cli import main
from tests.fakes.servers import free_port
from tests.rig.llama_build import ensure_llama_server
from tests.rig.llama_process import (
    LlamaServerProcess,
    engine_threads,
    launch_llama_server,
    stop,
)
from tests.rig.models import ensure_model

pytestmark = pytest.mark.llama

GOOD_FLAGS = ["-np", "2", "-c", "1024", "--metrics", "--slot-save-path", "{tmp}"]
SMALL = ("--min-ctx", "512")  # the test servers keep 512 tokens per slot


@contextmanager
def llama_server(model: str, flags: list[str]) -> Iterator[LlamaServerProcess]:
    """llama-server with exactly ``flags`` (``{tmp}`` becomes a fresh directory): the
    rig's ``run_llama_server`` always adds --metrics, which one test must leave out."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="prefixpin-doctor-") as tmp:
        args = ["-m", str(ensure_model(model)), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(engine_threads()), "--no-webui",
                *(f.replace("{tmp}", tmp) for f in flags)]
        handle = launch_llama_server(ensure_llama_server(), args,
                                     Path(tmp) / "llama-server.log", port=port)
        try:
            yield handle
        finally:
            stop(handle)


def doctor(capsys: pytest.CaptureFixture[str], url: str, *flags: str) -> tuple[int, dict[str, Any]]:
    code = main(["doctor", "--upstream", url, "--json", *flags])
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == code
    return code, report


def by_key(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["key"]: f for f in report["findings"]}


def problems(report: dict[str, Any]) -> dict[str, str]:
    """flag -> finding key of every problem."""
    return {f["flag"]: f["key"] for f in report["findings"] if f["status"] == "problem"}


def test_good_flags_pass(capsys: pytest.CaptureFixture[str]) -> None:
    with llama_server("smollm2", GOOD_FLAGS) as llama:
        code, local = doctor(capsys, llama.url, *SMALL)
        remote_code, remote = doctor(capsys, llama.url, *SMALL, "--no-local",
                                     "--probe-context-shift")
        text_code = main(["doctor", "--upstream", llama.url, *SMALL, "--no-probe"])
        text = capsys.readouterr().out
    assert code == 0, problems(local)
    assert remote_code == 0, problems(remote)
    assert text_code == 0
    assert "Nothing found that defeats prompt caching" in text
    findings = by_key(local)
    for key in ("metrics", "slots-endpoint", "slot-save-path", "cache-prompt", "np-unified-idle",
                "swa-full", "context-shift", "return-progress", "slot-context"):
        assert findings[key]["status"] == "ok", findings[key]
    assert "command line of process" in findings["context-shift"]["evidence"]
    # Over HTTP, only a request that fills a slot shows context shift (opt-in).
    assert "stopped there" in by_key(remote)["context-shift"]["evidence"]
    assert by_key(remote)["np-unified-idle"]["status"] == "ok"  # seen by the probe
    command = local["recommended_command"]
    assert {"--metrics", "--slot-save-path", "-np"} <= set(command)
    assert "--swa-full" not in command  # SmolLM2 is full attention (read from its GGUF)


def test_bad_flags_are_each_named(capsys: pytest.CaptureFixture[str]) -> None:
    """-np auto (4 unified slots) with idle-slot caching and a 1 MiB --cache-ram, no
    --metrics, no --slot-save-path, 2048 tokens per slot."""
    with llama_server("smollm2", ["-np", "-1", "-c", "2048", "--cache-ram", "1"]) as llama:
        remote_code, remote = doctor(capsys, llama.url, "--no-local")
        code, local = doctor(capsys, llama.url, "--no-probe")
        text_code = main(["doctor", "--upstream", llama.url, "--no-probe"])
        text = capsys.readouterr().out
    for report in (remote, local):
        named = problems(report)
        assert {"--metrics", "--slot-save-path", "-np auto", "-c"} <= set(named), named
        idle = by_key(report)["np-unified-idle"]
        assert "here idle sessions are lost" in idle["summary"]
        assert "came back" not in idle["evidence"]
    assert remote_code == code == 1
    assert "emptied idle slot" in by_key(remote)["np-unified-idle"]["evidence"]
    assert "--cache-ram 1 on the command line" in by_key(local)["np-unified-idle"]["evidence"]
    assert text_code == 1
    for flag in ("--metrics", "--slot-save-path", "-np auto", "-c "):
        assert f"PROBLEM  {flag}" in text
    command = local["recommended_command"]
    assert command[command.index("-np") + 1] == "4"
    assert "--metrics" in command


def test_cache_prompt_off_and_context_shift_on_are_named(
        capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["-np", "2", "-c", "512", "--metrics", "--slot-save-path", "{tmp}",
             "--no-cache-prompt", "--context-shift"]
    with llama_server("smollm2", flags) as llama:
        remote_code, remote = doctor(capsys, llama.url, "--no-local", "--min-ctx", "256",
                                     "--probe-context-shift")
        code, local = doctor(capsys, llama.url, "--min-ctx", "256", "--no-probe")
    assert remote_code == code == 1
    for report in (remote, local):
        assert problems(report) == {"--no-cache-prompt": "cache-prompt",
                                    "--context-shift": "context-shift"}
    assert "kept generating" in by_key(remote)["context-shift"]["evidence"]
    assert "--context-shift on the command line" in by_key(local)["context-shift"][
        "evidence"]
    assert "recomputed" in by_key(remote)["cache-prompt"]["evidence"]
    # With caching off no rollback probe runs; the GGUF still says full attention.
    assert by_key(remote)["swa-full"]["status"] == "ok"


def test_gemma3_needs_swa_full(capsys: pytest.CaptureFixture[str]) -> None:
    """Gemma 3 is a sliding-window model: without --swa-full a prompt sharing only a
    prefix with the slot's is re-read in full; with it the prefix is reused."""
    with llama_server("gemma3", GOOD_FLAGS) as llama:
        remote_code, remote = doctor(capsys, llama.url, "--no-local", *SMALL)
        code, local = doctor(capsys, llama.url, *SMALL, "--no-probe")
    assert remote_code == code == 1
    for report in (remote, local):
        assert problems(report) == {"--swa-full": "swa-full"}, problems(report)
        assert "gemma3 uses sliding-window attention (512 tokens)" in by_key(report)[
            "swa-full"]["summary"]
        assert "--swa-full" in report["recommended_command"]
    assert "reused none of them" in by_key(remote)["swa-full"]["evidence"]
    assert "command line" in by_key(local)["swa-full"]["evidence"]
    # what --swa-full costs, for the model loaded (its GGUF read here)
    assert re.search(r"grows to at most \d+ MiB", by_key(local)["swa-full"]["fix"]), \
        by_key(local)["swa-full"]

    with llama_server("gemma3", [*GOOD_FLAGS, "--swa-full"]) as llama:
        code, report = doctor(capsys, llama.url, "--no-local", *SMALL)
    assert code == 0, problems(report)
    assert "reused them" in by_key(report)["swa-full"]["evidence"]


def test_unreachable_upstream_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, report = doctor(capsys, url)
    assert code == 2
    assert not report["reachable"]
    assert report["error"]
    assert main(["doctor", "--upstream", url]) == 2
    assert "--no-repack" in capsys.readouterr().out  # what to try if it crashed


@pytest.mark.parametrize("cache_ram", [None, "0"])
def test_shared_cache_probe(capsys: pytest.CaptureFixture[str], cache_ram: str | None) -> None:
    """llama-server's default --cache-ram (8192 MiB) is one host cache for all slots: a
    prefix cached on slot 0 and pushed out of it is served from cache on slot 1. With
    --cache-ram 0 it is not; the flag read from /proc says the same."""
    flags = GOOD_FLAGS + (["--cache-ram", cache_ram] if cache_ram is not None else [])
    with llama_server("smollm2", flags) as llama:
        _, probed = doctor(capsys, llama.url, *SMALL, "--no-local", "--probe-shared-cache")
        _, local = doctor(capsys, llama.url, *SMALL, "--no-probe")
        _, unknown = doctor(capsys, llama.url, *SMALL, "--no-probe", "--no-local")
    seen, from_flags = by_key(probed)["shared-cache"], by_key(local)["shared-cache"]
    cache_n = int(seen["evidence"].rsplit("cache_n ", 1)[1])
    if cache_ram is None:
        assert seen["status"] == from_flags["status"] == "warning", (seen, from_flags)
        assert cache_n > 100, seen  # most of the 200-token prefix, on the other slot
        assert "--cache-ram 0" in seen["fix"]
        assert "--allow-shared-cache" in seen["fix"]
        assert "default is 8192" in from_flags["evidence"]
    else:
        assert seen["status"] == from_flags["status"] == "ok", (seen, from_flags)
        assert cache_n < 20, seen
        assert "--cache-ram 0 on the command line" in from_flags["evidence"]
    assert by_key(unknown)["shared-cache"]["status"] == "unknown"
    assert "assumes it is" in by_key(unknown)["shared-cache"]["summary"]

"""The built-in status page in headless Chromium, with data from a real run against the
real llama-server: it loads, and each session's chart has one bar per turn and its cached
and prompt token lines. A screenshot goes to test-artifacts/status-page.png."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ProxyRunner
from tests.e2e.helpers import filler
from tests.rig.browser import find_chromium, headless_args

pytestmark = [pytest.mark.llama, pytest.mark.usefixtures("chromium_binary")]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def chromium(args: list[str], profile: Path) -> str:
    binary = find_chromium()
    assert binary is not None  # the chromium_binary fixture found it
    result = subprocess.run([str(binary), *headless_args(profile), *args], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_status_page_renders_sessions_and_their_charts(
        run_proxy: ProxyRunner, erase_slots: Callable[[], None], tmp_path: Path) -> None:
    """Three turns of one session: the page lists it with a three-bar TTFT chart."""
    messages = [{"role": "system", "content": "You are brief. " + filler(100, seed=3)}]
    with run_proxy() as url:
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn}: " + filler(15)})
            reply = httpx.post(f"{url}/v1/chat/completions", headers={"x-session-id": "page"},
                               json={"messages": messages, "max_tokens": 4}, timeout=120)
            messages.append(reply.json()["choices"][0]["message"])
        page = f"{url.admin}/"
        dom = chromium(["--virtual-time-budget=5000", "--dump-dom", page], tmp_path / "a")
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "status-page.png"
        chromium(["--virtual-time-budget=5000", "--window-size=1000,800",
                  f"--screenshot={shot}", page], tmp_path / "b")
    assert 'data-loaded="true"' in dom
    cards = re.findall(r'<div class="session" data-session="[^"]+">.*?</svg>', dom, re.S)
    assert len(cards) == 1
    assert "page" in cards[0]
    assert len(re.findall(r'<rect class="ttft"', cards[0])) == 3
    assert '<polyline class="cached"' in cards[0]
    assert '<polyline class="prompt"' in cards[0]
    assert shot.stat().st_size > 10_000

"""``prefixpin doctor --probe-eviction`` against real llama-servers: what a session keeps on
a warm slot, after another prompt pushed it out, and after a save, erase and restore.

Full attention (SmolLM2), sliding-window attention with and without --swa-full (Gemma 3
270M; the tiny gpt-oss), and hybrid recurrent memory (the tiny Qwen3.5). The tiny models'
weights are random (``tests.rig.tiny_models``): only the engine's cache mechanics are real,
and only they are asserted. Each figure is read from the report that the real command line
prints (``prefixpin doctor --json``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from prefixpin.proxy.cli import main
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.tiny_models import ensure_tiny_model

pytestmark = pytest.mark.llama

Step = dict[str, int]


@contextmanager
def server(model: str, *extra: str, slot_files: bool = True) -> Iterator[LlamaServerProcess]:
    """Two slots of 1024 tokens. One compute thread for the tiny models: the test client
    needs the CPU more than a second thread would help them."""
    tiny = model.endswith("-tiny")
    with run_llama_server(ensure_tiny_model(model) if tiny else model, slots=2,
                          ctx_per_slot=1024, slot_save_path=slot_files or None,
                          threads=1 if tiny else None, extra=extra) as handle:
        yield handle


def probe(capsys: pytest.CaptureFixture[str], url: str,
          *flags: str) -> tuple[dict[str, Step], dict[str, Any]]:
    """The eviction figures by step, and the eviction finding."""
    code = main(["doctor", "--upstream", url, "--json", "--min-ctx", "512", "--probe-eviction",
                 *flags])
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == code
    assert not [s for s in report["sources"] if s.startswith("probe error")], report["sources"]
    [finding] = [f for f in report["findings"] if f["key"] == "eviction"]
    steps: dict[str, Step] = report["eviction"]
    return steps, finding


def all_kept(step: Step, slack: int = 0) -> bool:
    """Everything the slot had evaluated came back (a ~200-token chat at least)."""
    return step["reusable"] > 150 and step["cached"] >= step["reusable"] - slack


def assert_steps(steps: dict[str, Step], names: Sequence[str]) -> None:
    assert list(steps) == list(names), steps
    for step in steps.values():
        assert step["prompt"] > step["reusable"] > 0, steps


ALL = ("warm", "warm-next-turn", "evicted", "restored", "restored-next-turn")


def test_full_attention_keeps_everything(capsys: pytest.CaptureFixture[str]) -> None:
    with server("smollm2") as llama:
        steps, finding = probe(capsys, llama.url)
        text_code = main(["doctor", "--upstream", llama.url, "--min-ctx", "512",
                          "--probe-eviction"])
        text = capsys.readouterr().out
    assert_steps(steps, ALL)
    assert all(all_kept(step) for step in steps.values()), steps
    assert finding["status"] == "ok", finding
    assert "llama (full attention)" in finding["summary"]
    assert "after a restore" in finding["summary"]
    assert "saved, erased and restored, exact extension: cached" in finding["evidence"]
    assert text_code == 0
    assert "What survives on one slot (--probe-eviction)" in text
    assert "saved, erased and restored, next chat turn:" in text


def test_without_host_cache_or_slot_files_an_evicted_session_is_lost(
        capsys: pytest.CaptureFixture[str]) -> None:
    with server("smollm2", "--cache-ram", "0", slot_files=False) as llama:
        steps, finding = probe(capsys, llama.url)
    assert_steps(steps, ("warm", "warm-next-turn", "evicted"))  # no restore to measure
    assert all_kept(steps["warm"]), steps
    assert all_kept(steps["warm-next-turn"]), steps
    assert steps["evicted"]["cached"] == 0, steps
    assert (finding["status"], finding["flag"]) == ("warning", "--cache-ram"), finding
    assert "slot files (--slot-save-path) were not measured" in finding["summary"]


def test_hybrid_recurrent_restore_keeps_only_an_exact_extension(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Random weights. Qwen3.5's template drops the reply's think block when it renders the
    next turn, so that turn parts from the slot just before its end: a warm slot resumes
    from a context checkpoint there; a restored slot has none, and its recurrent state
    cannot roll back."""
    with server("qwen35-tiny") as llama:
        steps, finding = probe(capsys, llama.url)
    assert_steps(steps, ALL)
    for name in ("warm", "evicted", "restored"):
        assert all_kept(steps[name]), (name, steps)
    assert all_kept(steps["warm-next-turn"], slack=8), steps
    assert steps["restored-next-turn"]["cached"] == 0, steps
    assert (finding["status"], finding["flag"]) == ("warning", "--slot-save-path"), finding
    assert finding["summary"].startswith("qwen35 (hybrid/recurrent memory): a restored slot "
                                         "is re-processed from token 0 unless the request "
                                         "extends it exactly")


@pytest.mark.parametrize("model", ["gemma3", "gptoss-tiny"])
def test_sliding_window_restore_keeps_nothing_without_swa_full(
        capsys: pytest.CaptureFixture[str], model: str) -> None:
    """A slot file keeps only the sliding layers' last cells, and a restored slot has no
    checkpoints: even an exact extension is re-read from the start. A warm slot, and the
    host prompt cache (which keeps checkpoints), give the prompt back."""
    with server(model, "-b", "64", "-ub", "64") as llama:
        steps, finding = probe(capsys, llama.url)
    assert_steps(steps, ALL)
    for name in ("warm", "evicted"):
        assert all_kept(steps[name], slack=10), (name, steps)
    assert steps["restored"]["cached"] == steps["restored-next-turn"]["cached"] == 0, steps
    assert (finding["status"], finding["flag"]) == ("problem", "--swa-full"), finding
    window = {"gemma3": 512, "gptoss-tiny": 128}[model]
    assert (f"(sliding-window attention, {window} tokens, without --swa-full): a restored "
            "slot keeps nothing, even for an exact extension") in finding["summary"]


def test_sliding_window_restore_keeps_everything_with_swa_full(
        capsys: pytest.CaptureFixture[str]) -> None:
    with server("gemma3", "-b", "64", "-ub", "64", "--swa-full") as llama:
        steps, finding = probe(capsys, llama.url)
    assert_steps(steps, ALL)
    assert all(all_kept(step) for step in steps.values()), steps
    assert finding["status"] == "ok", finding
    assert "gemma3 (sliding-window attention, 512 tokens, with --swa-full)" in finding[
        "summary"]

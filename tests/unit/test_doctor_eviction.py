"""How doctor judges what ``--probe-eviction`` measured: a pure function of the figures and
the model's memory (the figures themselves are measured on real engines in
``tests/e2e/test_doctor_eviction.py``)."""

from __future__ import annotations

import pytest

from prefixpin.proxy.engine.engine_facts import ModelFacts
from prefixpin.proxy.ops.doctor import (
    EVICTED,
    RESTORED,
    RESTORED_NEXT,
    WARM,
    WARM_NEXT,
    Finding,
    Observations,
    ProbeResults,
    Report,
    Survival,
    build_report,
    diagnose,
    render_text,
)

KEPT, LOST = Survival(218, 235, 218), Survival(0, 235, 218)
FULL = ModelFacts("llama", 0, False, 8192, None)
SLIDING = ModelFacts("gemma3", 512, False, 32768, None)
HYBRID = ModelFacts("qwen35", 0, True, 262144, None)


def observations(model: ModelFacts | None, steps: dict[str, Survival]) -> Observations:
    probes = ProbeResults(eviction=steps, eviction_slot=0 if steps else None)
    return Observations("http://127.0.0.1:8080", {"total_slots": 2}, 200, [], 200, 200, 400,
                        "Invalid action", None, None, model, "", probes)


def steps(**named: Survival) -> dict[str, Survival]:
    """warm_next_turn= stands for the step "warm-next-turn"."""
    return {k.replace("_", "-"): v for k, v in named.items()}


def eviction(model: ModelFacts | None, **named: Survival) -> Finding:
    found = diagnose(observations(model, steps(**named)))
    [finding] = [f for f in found if f.key == "eviction"]
    return finding


def everything(**changed: Survival) -> dict[str, Survival]:
    """Every step kept everything, but those given."""
    kept = {WARM: KEPT, WARM_NEXT: KEPT, EVICTED: KEPT, RESTORED: KEPT, RESTORED_NEXT: KEPT}
    return {**kept, **steps(**changed)}


def test_no_finding_unless_probed() -> None:
    assert not [f for f in diagnose(observations(FULL, {})) if f.key == "eviction"]
    assert build_report(observations(FULL, {})).to_json()["eviction"] == {}


def test_everything_kept_is_ok() -> None:
    finding = eviction(FULL, **everything())
    assert finding.status == "ok"
    assert finding.summary.startswith("llama (full attention): a session's cached prompt "
                                      "survives on a warm slot, after eviction and after a "
                                      "restore")
    assert "saved, erased and restored, next chat turn: cached 218 of 235 prompt tokens " \
           "(218 reusable)" in finding.evidence


@pytest.mark.parametrize(("model", "flag", "status", "words"), [
    (SLIDING, "--swa-full", "problem", "gemma3 (sliding-window attention, 512 tokens): a "
     "restored slot keeps nothing, even for an exact extension"),
    (None, "--swa-full", "problem", "the model: a restored slot keeps nothing"),
    (FULL, "--slot-save-path", "problem", "llama (full attention): a restored slot keeps "
     "nothing"),
])
def test_a_restore_that_keeps_nothing(model: ModelFacts | None, flag: str, status: str,
                                      words: str) -> None:
    finding = eviction(model, **everything(restored=LOST, restored_next_turn=LOST))
    assert (finding.flag, finding.status) == (flag, status)
    assert finding.summary.startswith(words), finding.summary


def test_a_restore_that_keeps_only_an_exact_extension() -> None:
    finding = eviction(HYBRID, **everything(restored_next_turn=LOST))
    assert (finding.flag, finding.status) == ("--slot-save-path", "warning")
    assert finding.summary.startswith("qwen35 (hybrid/recurrent memory): a restored slot is "
                                      "re-processed from token 0 unless the request extends "
                                      "it exactly")


def test_no_host_cache_and_no_slot_files() -> None:
    finding = eviction(FULL, warm=KEPT, warm_next_turn=KEPT, evicted=LOST)
    assert (finding.flag, finding.status) == ("--cache-ram", "warning")
    assert "slot files (--slot-save-path) were not measured" in finding.summary
    assert eviction(FULL, warm=KEPT, warm_next_turn=KEPT, evicted=KEPT).summary.endswith(
        "survives on a warm slot, after eviction (restores not measured: no --slot-save-path)")


def test_the_worst_loss_is_named_first() -> None:
    assert eviction(FULL, **everything(warm=LOST, restored=LOST)).flag == "--cache-prompt"
    assert eviction(HYBRID, **everything(warm_next_turn=LOST)).flag == "-cms"
    assert eviction(SLIDING, **everything(evicted=LOST, restored=LOST)).flag == "--swa-full"
    assert eviction(SLIDING, **everything(warm_next_turn=LOST, restored_next_turn=LOST)
                    ).flag == "--slot-save-path"


def test_the_figures_are_in_the_json_and_the_text() -> None:
    report: Report = build_report(observations(HYBRID, everything(restored_next_turn=LOST)))
    assert report.to_json()["eviction"][RESTORED_NEXT] == {"cached": 0, "prompt": 235,
                                                           "reusable": 218}
    text = render_text(report)
    assert "What survives on one slot (--probe-eviction), in prompt tokens:" in text
    rows = [" ".join(line.split()) for line in text.splitlines()]
    assert "saved, erased and restored, next chat turn: cached 0 of 235 (218 reusable)" in rows
    assert "eviction probe on slot 0" in text


def test_no_host_cache_but_slot_files_is_ok() -> None:
    """--cache-ram 0 is what proxy.listen.isolation recommends: slot files bring sessions back."""
    finding = eviction(FULL, **everything(evicted=LOST))
    assert finding.status == "ok"
    assert finding.summary.endswith("survives on a warm slot and after a restore from a slot "
                                    "file, not after eviction (no host prompt cache: "
                                    "--cache-ram 0, or too small)")

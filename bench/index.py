"""``python -m bench.index``: bench/results/README.md, one line per scenario and arm.

Built from each result directory's ``rows.jsonl`` with the same medians as its table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.report import ArmSummary, summarize

RESULTS = Path(__file__).resolve().parent / "results"

_HEADER = """# Bench results

One line per scenario and arm: the sum of per-turn median TTFTs, its ratio to the
scenario's baseline arm, the share of prompt tokens served from cache, the tokens the
engine really prefilled (per rep), the worst turn's reuse of its session's previous
prompt ("prior prompt kept": what a cache layer controls; 100% means nothing the engine
had seen was lost), and the turns on which the client rewrote history.
Each directory has the per-turn table (`table.md`), the plot (`ttft.png`), the rows and
`RUN.md` with the exact command, machine and versions. Re-create this file with
`python -m bench.index`.

"""
_HEADER += ("| scenario | arm | summed TTFT (s) | ratio | cached | engine prefilled tokens "
            "| prior prompt kept | rewrite turns |\n|---|---|---|---|---|---|---|---|\n")


def scenario_lines(directory: Path) -> list[str]:
    rows = [json.loads(line) for line in
            (directory / "rows.jsonl").read_text(encoding="utf-8").splitlines() if line]
    if not rows or "rewrote" not in rows[0]:
        return []  # not a replay result: other benches (parking) write their own tables
    summaries = summarize(rows)
    baseline = summaries[rows[0].get("baseline", rows[0]["arm"])]
    return [_line(directory.name, summary, baseline) for summary in summaries.values()]


def _line(scenario: str, s: ArmSummary, baseline: ArmSummary) -> str:
    rewrites = sum(1 for turn in s.turns if turn.rewrote)
    engine = "n/a" if s.engine_prompt_tokens is None else f"{s.engine_prompt_tokens:.0f}"
    kept = "n/a" if s.kept_min is None else f"{100 * s.kept_min:.0f}%"
    return (f"| [{scenario}]({scenario}/table.md) | {s.arm} | {s.summed_ttft_ms / 1000:.1f} | "
            f"{s.summed_ttft_ms / baseline.summed_ttft_ms:.2f} | {100 * s.reuse:.0f}% | "
            f"{engine} | {kept} | {rewrites} of {len(s.turns)} |")


def build(results: Path) -> str:
    lines = []
    for directory in sorted(p for p in results.iterdir() if (p / "rows.jsonl").exists()):
        lines += scenario_lines(directory)
    return _HEADER + "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    results = Path(argv[0]) if argv else RESULTS
    (results / "README.md").write_text(build(results), encoding="utf-8")
    print(f"wrote {results / 'README.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

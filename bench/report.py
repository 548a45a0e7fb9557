"""Rows in, figures out: per-turn medians per arm, their sums, ratios, table and plot.

Never a mean over turns: turn 0 is cold in every arm and later turns differ by design.
Each turn's figure is the median over reps of that turn; an arm's total is the sum of its
per-turn medians; the end-to-end figure is the median over reps of a rep's wall clock.

Two sums separate the engine from the path in front of it: the engine's own prefill time
(``timings.prompt_ms``) and the rest of the TTFT (proxy, queueing, resends, first decode).
On a shared machine the engine's speed drifts between reps; equal cached and prefilled
tokens with a small "rest" is what shows a pass-through arm adds nothing.

    python -m bench.report bench/results/<scenario>   # re-render from rows.jsonl
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Row = dict[str, Any]


@dataclass(frozen=True, slots=True)
class TurnMedian:
    seq: int
    session: str
    step: int
    rewrote: bool
    ttft_ms: float
    prompt_tokens: float
    cached_tokens: float
    prefill_ms: float
    attempts: float

    @property
    def rest_ms(self) -> float:
        """TTFT not spent in the engine's prefill of the answered attempt."""
        return self.ttft_ms - self.prefill_ms


@dataclass(frozen=True, slots=True)
class ArmSummary:
    arm: str
    reps: int
    turns: list[TurnMedian]
    summed_ttft_ms: float
    summed_prefill_ms: float
    wall_ms: float  # median over reps of the rep's end-to-end wall clock
    prompt_tokens: float
    cached_tokens: float
    engine_prompt_tokens: float | None  # median over reps of tokens the engine prefilled
    arm_cpu_s: float | None  # median over reps of the CPU time of a proxy the run started

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def kept_min(self) -> float | None:
        """Worst turn's cached tokens over its session's previous prompt (capped at 1).

        The share of the prompt served from cache depends on how much a turn adds (a 1k-token
        tool result on a 3k-token history caps it near 75% in any arm); this asks what a
        cache layer controls: was everything the engine had already seen reused?
        """
        previous: dict[str, float] = {}
        kept = []
        for turn in self.turns:
            before = previous.get(turn.session)
            if before and not math.isnan(turn.cached_tokens):
                kept.append(min(1.0, turn.cached_tokens / before))
            previous[turn.session] = turn.prompt_tokens
        return min(kept) if kept else None

    @property
    def flatness(self) -> float | None:
        """Last turn's TTFT over the second turn's (issue 6's flat line is <= 1.5).

        Only for one session: with several interleaved sessions the turns are not a line.
        """
        if len(self.turns) < 3 or self.turns[1].ttft_ms <= 0:
            return None
        if len({turn.session for turn in self.turns}) > 1:
            return None
        return self.turns[-1].ttft_ms / self.turns[1].ttft_ms


def _median(values: Iterable[float | None]) -> float:
    """Median of the values present; NaN when a turn failed in every rep."""
    present = [value for value in values if value is not None]
    return float(statistics.median(present)) if present else math.nan


def summarize(rows: list[Row]) -> dict[str, ArmSummary]:
    by_arm: dict[str, dict[int, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        by_arm[row["arm"]][row["seq"]].append(row)
    summaries = {}
    for arm, by_seq in by_arm.items():
        turns = [_turn_median(seq, by_seq[seq]) for seq in sorted(by_seq)]
        arm_rows = [r for seq_rows in by_seq.values() for r in seq_rows]
        walls = {r["rep"]: r["rep_wall_ms"] for r in arm_rows}
        summaries[arm] = ArmSummary(
            arm=arm, reps=len(walls), turns=turns,
            summed_ttft_ms=sum(t.ttft_ms for t in turns),
            summed_prefill_ms=sum(t.prefill_ms for t in turns),
            wall_ms=_median(walls.values()),
            prompt_tokens=sum(t.prompt_tokens for t in turns),
            cached_tokens=sum(t.cached_tokens for t in turns),
            engine_prompt_tokens=_per_rep_sum(arm_rows, "engine_prompt_tokens"),
            arm_cpu_s=_ms_to_s(_per_rep_sum(arm_rows, "arm_cpu_ms")))
    return summaries


def _turn_median(seq: int, rows: list[Row]) -> TurnMedian:
    first = rows[0]
    return TurnMedian(
        seq=seq, session=first["session"], step=first["step"], rewrote=first["rewrote"],
        ttft_ms=_median(r["ttft_ms"] for r in rows),
        prompt_tokens=_median(r["prompt_tokens"] for r in rows),
        cached_tokens=_median(r["cached_tokens"] for r in rows),
        prefill_ms=_median(r["prefill_ms"] for r in rows),
        attempts=_median(r["attempts"] for r in rows))


def _per_rep_sum(rows: list[Row], key: str) -> float | None:
    """Median over reps of a rep's total of ``key`` (None when some row lacks it)."""
    per_rep: dict[int, float] = defaultdict(float)
    for row in rows:
        if row.get(key) is None:
            return None
        per_rep[row["rep"]] += row[key]
    return _median(per_rep.values()) if per_rep else None


def _ms_to_s(value: float | None) -> float | None:
    return None if value is None else value / 1000


def markdown(scenario: str, summaries: dict[str, ArmSummary], baseline: str) -> str:
    base = summaries[baseline]
    lines = [f"# {scenario}: TTFT by turn", "",
             f"Per-turn figures are medians over reps; ratios are arm / {baseline} "
             "(below 1 is faster).", "",
             "| arm | reps | summed TTFT (s) | ratio | end-to-end (s) | ratio | "
             "cached / prompt tokens | engine prefilled tokens | engine prefill (s) | "
             "TTFT - prefill (s) | proxy CPU (s) | last / 2nd turn TTFT | "
             "previous prompt reused (worst turn) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, s in summaries.items():
        engine = "n/a" if s.engine_prompt_tokens is None else f"{s.engine_prompt_tokens:.0f}"
        flat = "n/a" if s.flatness is None else f"{s.flatness:.2f}"
        cpu = "n/a" if s.arm_cpu_s is None else f"{s.arm_cpu_s:.2f}"
        kept = "n/a" if s.kept_min is None else f"{100 * s.kept_min:.0f}%"
        lines.append(
            f"| {arm} | {s.reps} | {s.summed_ttft_ms / 1000:.2f} | "
            f"{s.summed_ttft_ms / base.summed_ttft_ms:.2f} | {s.wall_ms / 1000:.2f} | "
            f"{s.wall_ms / base.wall_ms:.2f} | {s.cached_tokens:.0f} / {s.prompt_tokens:.0f} "
            f"({100 * s.reuse:.0f}%) | {engine} | {s.summed_prefill_ms / 1000:.2f} | "
            f"{(s.summed_ttft_ms - s.summed_prefill_ms) / 1000:.2f} | {cpu} | {flat} | "
            f"{kept} |")
    lines += ["", "## Per turn", "", _turn_header(summaries), _turn_rule(summaries)]
    for index, turn in enumerate(base.turns):
        cells = [str(turn.seq), turn.session, str(turn.step), "yes" if turn.rewrote else ""]
        for s in summaries.values():
            t = s.turns[index]
            retry = f" ({t.attempts:.0f} tries)" if t.attempts > 1 else ""
            cells += [f"{t.ttft_ms:.0f}{retry}", f"{t.cached_tokens:.0f}/{t.prompt_tokens:.0f}",
                      f"{t.prefill_ms:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _turn_header(summaries: dict[str, ArmSummary]) -> str:
    cells = ["turn", "session", "step", "rewrite"]
    for arm in summaries:
        cells += [f"{arm} TTFT ms", f"{arm} cached/prompt", f"{arm} prefill ms"]
    return "| " + " | ".join(cells) + " |"


def _turn_rule(summaries: dict[str, ArmSummary]) -> str:
    return "|" + "---|" * (4 + 3 * len(summaries))


def plot(path: Path, scenario: str, rows: list[Row], summaries: dict[str, ArmSummary]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 1.3]})
    for index, (arm, summary) in enumerate(summaries.items()):
        color = f"C{index}"
        seqs = [t.seq for t in summary.turns]
        top.plot(seqs, [t.ttft_ms / 1000 for t in summary.turns], marker="o", color=color,
                 label=f"{arm} (median of {summary.reps})", linewidth=2)
        mine = [r for r in rows if r["arm"] == arm]
        top.scatter([r["seq"] for r in mine], [r["ttft_ms"] / 1000 for r in mine],
                    color=color, alpha=0.3, s=14)
        bottom.plot(seqs, [100 * t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0
                           for t in summary.turns], marker=".", color=color, label=arm)
    for turn in next(iter(summaries.values())).turns:
        if turn.rewrote:
            top.axvline(turn.seq, color="grey", alpha=0.15, linewidth=6)
    top.set_ylabel("time to first token (s)")
    top.set_title(f"{scenario}: TTFT by turn (shaded: the client rewrote history)")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    top.legend()
    bottom.set_ylabel("prompt cached (%)")
    bottom.set_xlabel("turn (request number in the run)")
    bottom.set_ylim(0, 105)
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_rows(path: Path, rows: list[Row]) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, sort_keys=True) + "\n")


def render(directory: Path, scenario: str, baseline: str | None = None) -> str:
    """Write table.md and ttft.png from ``directory/rows.jsonl``; return the table."""
    rows = [json.loads(line) for line in
            (directory / "rows.jsonl").read_text(encoding="utf-8").splitlines() if line]
    summaries = summarize(rows)
    table = markdown(scenario, summaries, baseline or rows[0]["baseline"])
    (directory / "table.md").write_text(table, encoding="utf-8")
    plot(directory / "ttft.png", scenario, rows, summaries)
    return table


def summary_block(table: str) -> str:
    """The summary table of ``table``, between markers so RUN.md can be re-rendered."""
    summary = table.split("\n## Per turn")[0].split("\n", 2)[2].strip()
    return f"{SUMMARY_START}\n{summary}\n{SUMMARY_END}"


SUMMARY_START, SUMMARY_END = "<!-- summary -->", "<!-- /summary -->"


def main(argv: list[str]) -> int:
    for name in argv:
        directory = Path(name)
        run_md = directory / "RUN.md"
        table = render(directory, directory.name)
        text = run_md.read_text(encoding="utf-8")
        if SUMMARY_START in text:
            head, rest = text.split(SUMMARY_START, 1)
            text = head + summary_block(table) + rest.split(SUMMARY_END, 1)[1]
            run_md.write_text(text, encoding="utf-8")
        print(f"re-rendered {directory}")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))

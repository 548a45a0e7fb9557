"""The agent bench's figures from its rows: summaries, ratios, Markdown tables, plots.

    python -m bench.agents.report bench/results/agents   # re-render table.md and the plots

A row is one turn of one session (``run.py`` writes them to ``rows.jsonl``); an arm run is
one CLI x condition x arm against its own fresh llama-server (``arms.jsonl``).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]

SLACK = 32  # tokens a follow-up may re-read and still count as reusing its previous prompt
CLI_NAMES = {"opencode": "OpenCode", "claude": "Claude Code", "codex": "Codex"}


def reuses(cached: int | None, previous: int | None) -> bool | None:
    """Whether a follow-up kept its session's whole previous prompt (None: a first turn,
    or no figure)."""
    if previous is None or cached is None:
        return None
    return cached >= previous - SLACK


def kept_whole(cached: int | None, previous: int | None) -> bool | None:
    """The strict reading: every token of the previous prompt came from cache (a warm slot
    holds the previous prompt and its answer, so a follow-up's cached tokens exceed it)."""
    if previous is None or cached is None:
        return None
    return cached >= previous


def reread(row: Row) -> int | None:
    """Tokens of the session's previous prompt the engine computed again for this turn."""
    if row["prev_prompt_tokens"] is None or row["cached_tokens"] is None:
        return None
    return max(0, int(row["prev_prompt_tokens"]) - int(row["cached_tokens"]))


def _median(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return float(statistics.median(got)) if got else None


def _ordered(values: Iterable[str], order: Sequence[str]) -> list[str]:
    seen = list(dict.fromkeys(values))
    return sorted(seen, key=lambda v: order.index(v) if v in order else len(order))


def groups(rows: list[Row]) -> list[tuple[str, str, str]]:
    """(cli, condition, arm) in the bench's order."""
    clis = _ordered((r["cli"] for r in rows), ("opencode", "claude", "codex"))
    conditions = _ordered((r["condition"] for r in rows), ("default", "cache-ram-0", "restart"))
    arms = _ordered((r["arm"] for r in rows), ("direct", "prefixpin"))
    present = {(r["cli"], r["condition"], r["arm"]) for r in rows}
    return [(c, k, a) for c in clis for k in conditions for a in arms if (c, k, a) in present]


def summarize(rows: list[Row], arm_runs: list[Row]) -> list[Row]:
    out = []
    runs = {(r["cli"], r["condition"], r["arm"]): r for r in arm_runs}
    for cli, condition, arm in groups(rows):
        mine = [r for r in rows if (r["cli"], r["condition"], r["arm"]) == (cli, condition, arm)]
        follow = [r for r in mine if r["turn"] > 1]
        first = [r for r in mine if r["turn"] == 1]
        run = runs.get((cli, condition, arm), {})
        out.append({
            "cli": cli, "condition": condition, "arm": arm, "turns": len(mine),
            "follow_ups": len(follow),
            "reused": sum(1 for r in follow if r["reused"]),
            "kept_whole": sum(1 for r in follow
                              if kept_whole(r["cached_tokens"], r["prev_prompt_tokens"])),
            "reread_follow_ups": sum(reread(r) or 0 for r in follow),
            "engine_prefilled": sum(r["engine_prefilled"] or 0 for r in mine),
            "engine_prefilled_follow_ups": sum(r["engine_prefilled"] or 0 for r in follow),
            "ttft_s_median_follow_ups": _median(r["ttft_s"] for r in follow),
            "ttft_s_max_follow_ups": max((r["ttft_s"] for r in follow
                                          if r["ttft_s"] is not None), default=None),
            "ttft_s_median_first": _median(r["ttft_s"] for r in first),
            "failed": sum(1 for r in mine if not r["ok"]),
            "parks": run.get("parks"), "restores": run.get("restores"),
            "wall_s": run.get("wall_s"),
        })
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(summary: list[Row]) -> list[Row]:
    """prefixpin / direct, per CLI x condition, measured side by side in one run."""
    by = {(s["cli"], s["condition"], s["arm"]): s for s in summary}
    out = []
    for cli, condition in dict.fromkeys((s["cli"], s["condition"]) for s in summary):
        direct, mine = by.get((cli, condition, "direct")), by.get((cli, condition, "prefixpin"))
        if direct is None or mine is None:
            continue
        out.append({
            "cli": cli, "condition": condition,
            "engine_prefilled": _ratio(mine["engine_prefilled"], direct["engine_prefilled"]),
            "engine_prefilled_follow_ups": _ratio(mine["engine_prefilled_follow_ups"],
                                                  direct["engine_prefilled_follow_ups"]),
            "ttft_follow_ups": _ratio(mine["ttft_s_median_follow_ups"],
                                      direct["ttft_s_median_follow_ups"]),
        })
    return out


def side_by_side(rows: list[Row]) -> list[Row]:
    """Turns where prefixpin kept less of the previous prompt than direct did, or
    prefilled more (beyond the slack): the cases where it was worse."""
    key = ("cli", "condition", "session", "turn")
    direct = {tuple(r[k] for k in key): r for r in rows if r["arm"] == "direct"}
    worse = []
    for r in rows:
        if r["arm"] != "prefixpin":
            continue
        d = direct.get(tuple(r[k] for k in key))
        if d is None:
            continue
        fewer_cached = (r["cached_tokens"] or 0) < (d["cached_tokens"] or 0) - SLACK
        more_prefill = (r["engine_prefilled"] or 0) > (d["engine_prefilled"] or 0) + SLACK
        if fewer_cached or more_prefill:
            worse.append({"prefixpin": r, "direct": d})
    return worse


def _n(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}"


def summary_markdown(summary: list[Row], ratio_rows: list[Row]) -> str:
    lines = [
        f"| CLI | condition | arm | follow-ups reusing their previous prompt (±{SLACK}) | "
        "follow-ups keeping all of it | previous prompts re-read, follow-ups (tokens) | "
        "engine prefill, all turns | engine prefill, follow-ups | median TTFT turn 1 (s) | "
        "median TTFT follow-ups (s) | worst follow-up TTFT (s) | parks / restores | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        parks = ("" if s["parks"] is None
                 else f"{s['parks']:.0f} / {(s['restores'] or 0):.0f}")
        lines.append(
            f"| {CLI_NAMES.get(s['cli'], s['cli'])} | {s['condition']} | {s['arm']} | "
            f"{s['reused']} of {s['follow_ups']} | {s['kept_whole']} of {s['follow_ups']} | "
            f"{s['reread_follow_ups']} | {s['engine_prefilled']:.0f} | "
            f"{s['engine_prefilled_follow_ups']:.0f} | {_n(s['ttft_s_median_first'], 2)} | "
            f"{_n(s['ttft_s_median_follow_ups'], 2)} | {_n(s['ttft_s_max_follow_ups'], 2)} | "
            f"{parks or 'n/a'} | {s['failed']} of {s['turns']} |")
    lines += ["", "prefixpin / direct, side by side in one run (below 1: prefixpin better):", "",
              "| CLI | condition | engine prefill, all turns | engine prefill, follow-ups | "
              "median follow-up TTFT |", "|---|---|---|---|---|"]
    for r in ratio_rows:
        lines.append(f"| {CLI_NAMES.get(r['cli'], r['cli'])} | {r['condition']} | "
                     f"{_n(r['engine_prefilled'], 2)} | "
                     f"{_n(r['engine_prefilled_follow_ups'], 2)} | "
                     f"{_n(r['ttft_follow_ups'], 2)} |")
    return "\n".join(lines) + "\n"


def turns_markdown(rows: list[Row]) -> str:
    lines = [
        "| CLI | condition | arm | # | session | turn | prompt tokens | cached | "
        "previous prompt | re-read of it | engine prefilled | TTFT (s) | reuses previous | "
        "requests | prefixpin decision |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cli, condition, arm in groups(rows):
        mine = sorted((r for r in rows if (r["cli"], r["condition"], r["arm"])
                       == (cli, condition, arm)), key=lambda r: r["seq"])
        for r in mine:
            reused = {True: "yes", False: "**no**", None: ""}[r["reused"]]
            proxy = r.get("proxy") or {}
            decision = proxy.get("decision") or ""
            if proxy.get("restored"):
                decision += " (restored)"
            restart = " ↻" if r.get("after_restart") else ""
            lines.append(
                f"| {CLI_NAMES.get(cli, cli)} | {condition} | {arm} | {r['seq'] + 1}{restart} | "
                f"s{r['session']} | {r['turn']} | {_n(r['prompt_tokens'])} | "
                f"{_n(r['cached_tokens'])} | {_n(r['prev_prompt_tokens'])} | "
                f"{_n(reread(r))} | {_n(r['engine_prefilled'])} | {_n(r['ttft_s'], 2)} | "
                f"{reused} | "
                f"{r['requests']} | {decision} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, rows: list[Row], field: str, ylabel: str, title: str) -> None:
    """One panel per CLI x condition: ``field`` per turn, in the order sent, one line per
    arm, on a log scale (a cold turn and a warm one differ 10-100x); a dotted line where
    the engine restarted."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    clis = _ordered((r["cli"] for r in rows), ("opencode", "claude", "codex"))
    conditions = _ordered((r["condition"] for r in rows), ("default", "cache-ram-0", "restart"))
    fig, axes = plt.subplots(len(clis), len(conditions),
                             figsize=(4.6 * len(conditions), 3.4 * len(clis)), squeeze=False)
    styles = {"direct": ("tab:red", "o"), "prefixpin": ("tab:blue", "s")}
    for i, cli in enumerate(clis):
        for j, condition in enumerate(conditions):
            axis = axes[i][j]
            panel = [r for r in rows if r["cli"] == cli and r["condition"] == condition]
            labels: list[str] = []
            for arm in _ordered((r["arm"] for r in panel), ("direct", "prefixpin")):
                mine = sorted((r for r in panel if r["arm"] == arm), key=lambda r: r["seq"])
                labels = labels or [f"s{r['session']}t{r['turn']}" for r in mine]
                color, marker = styles.get(arm, ("tab:gray", "^"))
                axis.plot(range(len(mine)), [r[field] if r[field] else float("nan")
                                             for r in mine],
                          marker=marker, color=color, label=arm, markersize=4)
                restarts = [k for k, r in enumerate(mine) if r.get("after_restart")]
                if restarts and arm == "direct":
                    axis.axvline(restarts[0] - 0.5, color="gray", linestyle=":",
                                 label="engine restart")
            axis.set_xticks(range(len(labels)))
            axis.set_xticklabels(labels, rotation=60, fontsize=7)
            axis.set_yscale("log")
            axis.set_title(f"{CLI_NAMES.get(cli, cli)}, {condition}", fontsize=10)
            axis.grid(alpha=0.3)
            if j == 0:
                axis.set_ylabel(ylabel)
            if i == 0 and j == 0:
                axis.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def read_jsonl(path: Path) -> list[Row]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def render(out: Path, rows: list[Row], arm_runs: list[Row]) -> str:
    """Write table.md and the plots; the summary's Markdown."""
    summary = summarize(rows, arm_runs)
    table = summary_markdown(summary, ratios(summary))
    (out / "table.md").write_text("## Summary\n\n" + table + "\n## Every turn\n\n"
                                  "`#`: the order sent within the arm run (↻: after the "
                                  "engine restart).\n\n" + turns_markdown(rows))
    plot(out / "ttft.png", rows, "ttft_s", "TTFT (s, log)",
         "Time to first token per turn (main request), direct vs prefixpin")
    plot(out / "prefill.png", rows, "engine_prefilled", "tokens prefilled (log)",
         "Tokens llama-server prefilled per turn (all of the turn's requests)")
    return table


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "results" / "agents"
    print(render(out, read_jsonl(out / "rows.jsonl"), read_jsonl(out / "arms.jsonl")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

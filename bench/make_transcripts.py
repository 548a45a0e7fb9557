"""Generate the bench transcripts deterministically from one seed.

    python bench/make_transcripts.py                 # write bench/transcripts/*.json
    python bench/make_transcripts.py --check         # exit 1 if the files would change
    python bench/make_transcripts.py --measure URL   # token counts via llama-server

The same seed always yields byte-identical files (``random.Random`` seeded with a string
is stable across runs and platforms; nothing depends on ``hash()`` or the clock).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.synth.story import render
from bench.transcript import ReasoningStyle, Transcript, transcripts_dir

DEFAULT_SEED = 4242


@dataclass(frozen=True, slots=True)
class SessionSpec:
    name: str
    offset: int
    style: ReasoningStyle


# Six sessions (three per slot of a 2-slot server, for the interleaving scenario) plus the
# inline-<think> rendering of two of them.
SESSIONS = (
    *(SessionSpec(f"session-{i:02d}", i, "field") for i in range(6)),
    *(SessionSpec(f"session-{i:02d}-think", i, "inline") for i in range(2)),
)


def generate(seed: int = DEFAULT_SEED) -> dict[str, Transcript]:
    return {spec.name: render(spec.name, seed + spec.offset, spec.style) for spec in SESSIONS}


def write(transcripts: dict[str, Transcript], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, transcript in transcripts.items():
        (directory / f"{name}.json").write_text(transcript.dumps(), encoding="utf-8")


def stale_files(transcripts: dict[str, Transcript], directory: Path) -> list[str]:
    """Names whose committed file differs from what the seed generates."""
    stale = []
    for name, transcript in transcripts.items():
        path = directory / f"{name}.json"
        if not path.exists() or path.read_text(encoding="utf-8") != transcript.dumps():
            stale.append(name)
    return stale


def measure(transcripts: dict[str, Transcript], url: str) -> None:
    """Print the rendered prompt size of each session's first and last request."""
    import httpx  # only this optional mode talks to a server

    with httpx.Client(base_url=url, timeout=60) as client:
        for name, transcript in transcripts.items():
            sizes = []
            for step in (0, len(transcript.steps) - 1):
                body = {"messages": transcript.history_before(step),
                        "tools": list(transcript.tools)}
                prompt = client.post("/apply-template", json=body).json()["prompt"]
                tokens = client.post("/tokenize", json={"content": prompt,
                                                        "add_special": True}).json()["tokens"]
                sizes.append((len(prompt), len(tokens)))
            chars = sum(len(json.dumps(m)) for m in transcript.messages)
            print(f"{name}: {len(transcript.steps)} steps, first request {sizes[0][1]} tokens, "
                  f"last request {sizes[1][1]} tokens ({sizes[1][0] / sizes[1][1]:.2f} "
                  f"chars/token rendered; {chars} JSON chars in all)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--out", type=Path, default=transcripts_dir())
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    parser.add_argument("--measure", metavar="URL", help="llama-server to count tokens with")
    args = parser.parse_args(argv)
    transcripts = generate(args.seed)
    if args.measure:
        measure(transcripts, args.measure)
        return 0
    if args.check:
        stale = stale_files(transcripts, args.out)
        for name in stale:
            print(f"{args.out / name}.json differs from seed {args.seed}", file=sys.stderr)
        return 1 if stale else 0
    write(transcripts, args.out)
    print(f"wrote {len(transcripts)} transcripts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What llama.cpp's weight repacking is worth on this CPU: the embedded engine's library
with its extra buffer types (``--repack on``) and without (``off``), side by side.

    python bench/cpu_paths.py [--models smollm2 gemma3] [--rounds 6] [--prompt 512]
                              [--generate 64] [--threads 2] [--out FILE]

Each round loads the model once per arm, in alternating order (machine noise hits both
arms alike), prefills ``--prompt`` tokens in one batch and generates ``--generate`` tokens
one at a time (greedy) on one slot context, as the engine does. Printed: tokens per second
per arm (median of rounds) and the ratio off / on, with llama.cpp's compiled-in CPU
features and which buffer types the weights went to. On a CPU with AMX, ``on`` takes
llama.cpp's AMX kernels, which prefixpin avoids (``core/cpu.py``): run it there only with
that in mind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefixpin.adapters.embedded.cpu_paths import compiled_features
from prefixpin.adapters.embedded.model.context import Sampler, SamplingParams, SlotContext
from prefixpin.adapters.embedded.model.llama import LlamaModel, llama_log, load_bindings
from tests.rig.models import ensure_model


def one_round(lib: Any, path: Path, *, repack: bool, prompt: int, generate: int,
              threads: int) -> dict[str, float]:
    model = LlamaModel(lib, path, lambda _fraction: None, use_extra_bufts=repack)
    context = SlotContext(model, n_ctx=prompt + generate + 8, n_batch=prompt,
                          n_threads=threads)
    sampler = Sampler(lib, SamplingParams(temperature=0.0))
    try:
        vocab = model.info.n_vocab
        tokens = [(7 + 31 * i) % vocab for i in range(prompt)]
        context.warm_up(model.warm_up_tokens())
        started = time.perf_counter()
        context.decode(tokens, 0, logits_last=True)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        for index in range(generate):
            token = sampler.sample(context)
            context.decode([token], prompt + index, logits_last=True)
        generate_s = time.perf_counter() - started
    finally:
        sampler.close()
        context.close()
        model.close()
    return {"prefill_tok_s": prompt / prefill_s, "generate_tok_s": generate / generate_s}


def measure(name: str, *, rounds: int, prompt: int, generate: int,
            threads: int) -> dict[str, Any]:
    lib = load_bindings()
    path = ensure_model(name)
    arms: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for index in range(rounds):
        order = ("on", "off") if index % 2 == 0 else ("off", "on")
        for arm in order:
            arms[arm].append(one_round(lib, path, repack=arm == "on", prompt=prompt,
                                       generate=generate, threads=threads))
    result: dict[str, Any] = {"model": path.name}
    for figure in ("prefill_tok_s", "generate_tok_s"):
        on = statistics.median(r[figure] for r in arms["on"])
        off = statistics.median(r[figure] for r in arms["off"])
        result[figure] = {"on": round(on, 1), "off": round(off, 1),
                          "off_over_on": round(off / on, 3)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--generate", type=int, default=64)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lib = load_bindings()
    log = llama_log(lib)
    log.echo = False
    info = bytes(lib.llama_print_system_info()).decode()
    report: dict[str, Any] = {"cpu_features": list(compiled_features(info)),
                              "threads": args.threads, "prompt": args.prompt,
                              "generate": args.generate, "rounds": args.rounds, "models": []}
    for name in args.models:
        report["models"].append(measure(name, rounds=args.rounds, prompt=args.prompt,
                                        generate=args.generate, threads=args.threads))
        print(json.dumps(report["models"][-1]), flush=True)
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""llama.cpp's own server tests, run directly against llama-server and through prefixpin.

The claim under test: llama.cpp's chat, completion, Anthropic, Responses and security files
pass through prefixpin exactly as they pass directly (header-name case aside). Each test
must have the SAME outcome in both runs; many fail in both, since they assert what their
stories260K model writes and here SmolLM2-135M answers (no weights come from a model hub).

    .venv/bin/python bench/llama_suite/run.py                 # both runs, then the table
    .venv/bin/python bench/llama_suite/run.py -k anthropic    # a subset (pytest -k)
    .venv/bin/python bench/llama_suite/run.py --proxy-env PREFIXPIN_RETRY_GRACE_S=0

Where the tests come from: the llama.cpp tree vendored in the pinned llama-cpp-python
sdist (``tests.rig.llama_build``): ``/tmp/lcpp/llama_cpp_python-<v>`` when it is there,
else the sdist fetched with ``pip download`` into ``<prefixpin cache>/llama-suite``. The
test directory (and ``models/templates``, which the tests name by relative path) is copied
to a temporary directory, and pytest runs there twice with ``bench/llama_suite/plugin.py``
(see its docstring: local model, the project's llama-server, prefixpin in front in the
second run). Outcomes are compared per test id; ``bench/results/llama-suite/RUN.md``
gets the command, the counts, the table and every differing test with its analysis
(``KNOWN`` below: a test not in it is marked UNANALYSED); ``runs.json`` keeps the
whole record (``--report-only`` rewrites RUN.md from it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from prefixpin.proxy.settings import cache_root  # noqa: E402
from tests.rig.llama_build import LLAMA_CPP_PYTHON_VERSION, ensure_llama_server  # noqa: E402
from tests.rig.models import fetch_model  # noqa: E402

DEFAULT_FILES = (
    "unit/test_chat_completion.py",
    "unit/test_completion.py",
    "unit/test_compat_anthropic.py",
    "unit/test_compat_oai_responses.py",
    "unit/test_security.py",
)
SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
TESTS_IN_TREE = "vendor/llama.cpp/tools/server/tests"
TEMPLATES_IN_TREE = "vendor/llama.cpp/models/templates"
RESULTS_DIR = ROOT / "bench" / "results" / "llama-suite"
MODES = ("direct", "prefixpin")

# Every test known to differ, by test id (a prefix of the node id): its class and why.
# Classes: "fidelity bug" (prefixpin answers differently from the engine, and should not),
# "by design" (prefixpin changes it on purpose, documented), "proxy-inherent" (timing,
# slots or headers a proxy necessarily changes), "harness artefact".
# ``bench/llama_suite/repro.py`` sends the requests named here directly and through
# prefixpin (both answers in bench/results/llama-suite/repro.json).
KNOWN: dict[str, tuple[str, str]] = {
    "test_chat_completions_multiple_choices": (
        "by design",
        "the test asks `n: 2` (and `id_slot: 0`) on `POST /chat/completions`; llama-server "
        "answers 200 with two choices, prefixpin 400 `invalid_request_error` (param `n`): "
        "\"'n' must be 1 through prefixpin: each further choice would run on another engine "
        "slot, over the session it holds; send n requests instead\" "
        "(`proxy/pipeline/validation.py` `_check_one_choice`; README, Isolation: "
        "\"on the OpenAI routes "
        "an `n` above 1 is a 400\"; `id_slot` is dropped as a prefixpin-owned control). "
        "repro.py case `chat_n2`."),
    "test_anthropic_empty_messages": (
        "fidelity bug",
        "`POST /v1/messages` `{\"model\": \"test\", \"max_tokens\": 50, \"messages\": []}`: "
        "llama-server answers 200 (a `message` generated from the template's empty prompt, "
        "4 input tokens: its permissive design, which this test pins), prefixpin 400 "
        "`{\"type\": \"error\", \"error\": {\"type\": \"invalid_request_error\", \"message\": "
        "\"'messages' must contain at least one message\"}}` "
        "(`proxy/codecs/anthropic_convert.py`, `_refuse(\"messages\", ...)`). The same holds "
        "for `POST /v1/chat/completions` with `messages: []` (llama-server 200, prefixpin 400 "
        "from `proxy/pipeline/validation.py`), which no test here sends. A deliberate check, "
        "but one "
        "the README does not list among the refusals, and the Anthropic codec otherwise "
        "converts as llama-server does: either forward it or document it. repro.py cases "
        "`anthropic_empty_messages`, `chat_empty_messages`."),
    "test_cancel_request": (
        "by design (retry grace), and flaky directly",
        "the test sends `POST /completion` (n_predict -1) with a 0.1 s client timeout, waits "
        "2 s and wants `GET /slots` to show slot 0 idle. Through prefixpin the generation "
        "whose client left keeps running for `--retry-grace` (default 30 s) so a resend can "
        "join it (README, Options), so the slot is still processing: with "
        "`--proxy-env PREFIXPIN_RETRY_GRACE_S=0` it passes through prefixpin too (3 of 3). "
        "Directly it is timing-bound on this loaded 2-core machine (llama-server notices the "
        "closed connection late): it failed directly in 2 of 14 runs while this bench was "
        "written."),
    "test_responses_stream_with_llama_telemetry": (
        "fidelity bug",
        "`POST /v1/responses` streamed with llama-server's `timings_per_token: true` and "
        "`return_progress: true` (body: `input` \"This is a test\" x10, `max_output_tokens` 8, "
        "`temperature` 0.8; the test sends it to `/responses`, which llama-server serves with "
        "the same handler and prefixpin's tenant port only as `/v1/responses`). llama-server "
        "puts a `timings` object on every `response.output_text.delta` event (and on "
        "`response.in_progress`, beside `prompt_progress`); prefixpin's Responses stream "
        "drops it from both (it keeps `prompt_progress` on `response.in_progress` and "
        "`timings` on `response.completed`), so `saw_delta_timings` stays False. The "
        "Responses codec (`proxy/codecs/responses.py`) should carry an event's `timings` "
        "through as it does on `response.completed`. repro.py case "
        "`responses_stream_telemetry` (`keys_by_type` of both streams)."),
    "test_anthropic_vision_base64_with_multimodal_model": (
        "wire-format difference (no outcome changes)",
        "the error body of `/v1/messages`: llama-server answers in its OpenAI shape "
        "`{\"error\": {\"code\": 500, \"message\": ..., \"type\": \"server_error\"}}`, "
        "prefixpin in Anthropic's `{\"type\": \"error\", \"error\": {\"type\": \"api_error\", "
        "\"message\": ...}}` (same status, same message). The tests read `error.message` only. "
        "Here the test runs SmolLM2 (no mmproj) on a local 1x1 PNG, not tinygemma3 on "
        "huggingface.co's image, so it fails in both. repro.py case `anthropic_image_error`."),
    "test_responses_with_openai_library": (
        "harness artefact (ids) + body difference (no outcome changes)",
        "the message differs only in the Response object's repr: its random id, and the body "
        "prefixpin writes, which has the ~25 fields of OpenAI's Response object that "
        "llama-server omits, and `model` echoing the request's (`gpt-4.1`) where llama-server "
        "reports its alias. Same text, same usage. repro.py case `responses`."),
    "test_responses_stream_with_openai_library": (
        "harness artefact (ids) + body difference (no outcome changes)",
        "as test_responses_with_openai_library (the completed response's repr)."),
    "test_completion_prompt_cache": (
        "harness artefact",
        "the test draws its prompts with an unseeded `random.randint`, so each run sends "
        "other prompts (and fails on SmolLM2's token counts in both)."),
}

# Appended to RUN.md: what the comparison does not show by itself.
NOTES = """\
## Notes

- **What the plugin changes in the harness** (`bench/llama_suite/plugin.py`): every server
  runs the project's llama-server on the local SmolLM2-135M GGUF with `--offline` (no
  preset's Hugging Face repo reaches the command line; `ServerPreset.load_all`, which
  would start every preset to download it, does nothing; `wget` is a refusing stub;
  `requests` may reach loopback only). The Anthropic vision test gets a local 1x1 PNG
  instead of huggingface.co's image (its tinygemma3 preset runs SmolLM2 like the rest, so
  it fails in both runs). The tests marked `slow` are deselected as the suite's `tests.sh`
  does (they need Phi-3.5 and DeepSeek-R1-7B). No extra package was installed: `wget` (the
  only one of tests/requirements.txt missing from the venv) is stubbed, and
  `pytest-xdist`/`aiohttp` are not needed by these files.
- **Many tests fail in both runs**: they assert what stories260K writes (regexes, token
  counts, templates): that is expected, and the claim is about the outcome being the same.
  "Same outcome, another failure message" above lists those that fail differently.
- **Paths the tenant port does not serve** (see "Requests sent to the operator listener"):
  `GET /slots` (`test_cancel_request`, `test_completion_parallel_slots`) and
  `POST /chat/completions/input_tokens` (`test_chat_completions_token_count`) go to the
  operator listener. `--routing tenant` (everything to the tenant port) turns
  `test_chat_completions_token_count` into a 403 `operator_only`: llama-server's chat token
  counter is not on the tenant allow-list, while its Anthropic twin
  `/v1/messages/count_tokens` is. `test_completion_parallel_slots` passes either way: its
  `/slots` check runs inside `parallel_function_calls`, which swallows its exceptions.
  `POST /responses` (bare, as `test_responses_stream_with_llama_telemetry` sends it) is not
  a tenant route either, although `/chat/completions` and `/completions` are; llama-server
  serves `/responses` and `/v1/responses` with one handler, so the plugin sends it to the
  tenant port as `/v1/responses`, where the pipeline answers it (through the operator
  listener it passed, unchanged).
- **For `test_security.py`** prefixpin is configured as an operator would configure it in
  front of each server: the server's `--api-key` as `--engine-api-key`, and as
  `--cors-origins` the value llama-server resolves (its `--cors-origins`, else `localhost`
  with built-in tools or MCP servers, else `*`, this build's default; prefixpin's own
  default is `localhost`). Every `OPTIONS` goes to the tenant port. Both runs read answer
  headers case-insensitively (the harness keeps them in a plain `dict`, and uvicorn writes
  every name in lower case). `GET /` of `test_access_static_assets_without_api_key` reaches
  the operator listener's status page (200) where llama-server, built without its UI,
  answers 404: the test fails at `/sw.js` instead, in both runs. `/cors-proxy`
  (llama-server's MCP proxy, which fetches any URL it is given) is an operator path.
- **Timings are not comparable**: the machine has 2 cores shared with other jobs (see the
  load averages above); the per-test seconds in the table measure mostly that.
"""


def log(message: str) -> None:
    print(f"[llama-suite] {message}", file=sys.stderr, flush=True)


# --- the test tree --------------------------------------------------------------------

def sdist_root() -> Path:
    """The unpacked sdist: /tmp/lcpp's, or our cache's (fetched with pip download)."""
    for candidate in (os.environ.get("LLAMA_SUITE_SDIST"), f"/tmp/lcpp/{SDIST}",
                      str(cache_root() / "llama-suite" / SDIST)):
        if candidate and (Path(candidate) / TESTS_IN_TREE / "utils.py").exists():
            return Path(candidate)
    cache = cache_root() / "llama-suite"
    cache.mkdir(parents=True, exist_ok=True)
    log(f"fetching llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist with pip download")
    with tempfile.TemporaryDirectory(prefix="llama-suite-sdist-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "-q", "-d", tmp, f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
            check=True,
        )
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            wanted = [member for member in archive.getmembers()
                      if member.name.startswith((f"{SDIST}/{TESTS_IN_TREE}/",
                                                 f"{SDIST}/{TEMPLATES_IN_TREE}/"))]
            archive.extractall(cache, members=wanted, filter="data")
    return cache / SDIST


def copy_tree(source: Path, workdir: Path) -> Path:
    """``llama.cpp/tools/server/tests`` and ``llama.cpp/models/templates`` under
    ``workdir`` (the tests name templates as ``../../../models/templates/...``)."""
    tests = workdir / "llama.cpp" / "tools" / "server" / "tests"
    shutil.copytree(source / TESTS_IN_TREE, tests,
                    ignore=shutil.ignore_patterns("__pycache__", "tmp"))
    shutil.copytree(source / TEMPLATES_IN_TREE, workdir / "llama.cpp" / "models" / "templates")
    (tests / "tmp").mkdir(exist_ok=True)
    return tests


# --- one run --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pytest_command(tests: Path, files: list[str], junit: Path,
                   args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
               "-p", "bench.llama_suite.plugin", "-c", str(tests / "pytest.ini"),
               "--rootdir", str(tests), "--confcutdir", str(tests),
               "-q", "--tb=short", "--show-capture=no", f"--junitxml={junit}"]
    if not args.include_slow:
        command += ["-m", "not slow"]  # as the suite's tests.sh: they need other models
    if args.k:
        command += ["-k", args.k]
    return command + files


def run_mode(mode: str, tests: Path, workdir: Path, binary: Path, model: Path,
             args: argparse.Namespace, files: list[str] | None = None,
             tag: str = "") -> dict[str, Any]:
    """One pytest run of ``files`` (default: the selected files); ``tag`` names a recheck
    (its junit and log stay in the temporary directory)."""
    name = f"{tag}{mode}"
    results = workdir / f"results-{name}.json"
    routes = workdir / f"routes-{name}.jsonl"
    logs = workdir if tag else args.out
    junit = logs / f"junit-{name}.xml"
    command = pytest_command(tests, files or args.files, junit, args)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("PREFIXPIN_")  # prefixpin's settings are its defaults
           and key not in ("DEBUG", "DEBUG_EXTERNAL", "N_GPU_LAYERS", "SLOW_TESTS", "PORT")}
    env.update({
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # the venv's plugins are not the suite's
        "LLAMA_SERVER_BIN_PATH": str(binary),
        "LLAMA_CACHE": str(workdir / "llama-cache"),
        "PORT": str(free_port()),
        "LLAMA_SUITE_MODE": mode,
        "LLAMA_SUITE_ROUTING": args.routing,
        "LLAMA_SUITE_MODEL": str(model),
        "LLAMA_SUITE_TESTS_DIR": str(tests),
        "LLAMA_SUITE_RESULTS": str(results),
        "LLAMA_SUITE_ROUTES": str(routes),
    })
    if mode == "prefixpin":
        for setting in args.proxy_env:
            key, _, value = setting.partition("=")
            env[key] = value
    log(f"{name}: {shlex.join(command)}")
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with open(logs / f"pytest-{name}.log", "w") as output:
        subprocess.run(command, cwd=tests, env=env, stdout=output, stderr=subprocess.STDOUT,
                       check=False)
    elapsed = time.monotonic() - started
    log(f"{name}: {elapsed:.0f} s")
    if not results.exists():
        raise SystemExit(f"pytest wrote no results in the {name} run: see "
                         f"{logs / f'pytest-{name}.log'}")
    lines = routes.read_text().splitlines() if routes.exists() else []
    return {"results": json.loads(results.read_text()),
            "routes": [json.loads(line) for line in lines], "command": command,
            "elapsed": elapsed, "load": (load_before, os.getloadavg()[0])}


# --- the comparison -------------------------------------------------------------------

def file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def known(nodeid: str) -> tuple[str, str] | None:
    name = nodeid.split("::", 1)[-1]
    for prefix, entry in KNOWN.items():
        if name == prefix or name.startswith(prefix + "["):
            return entry
    return None


_VOLATILE = re.compile(r"(chatcmpl|cmpl|resp|msg|toolu|call|fc)[-_][A-Za-z0-9]{6,}|"
                       r"0x[0-9a-f]+|\d+\.\d+ ?(s|ms)\b|port=\d+|:\d{4,5}\b")


def normalise(message: str) -> str:
    """A failure message without what changes run to run (ids, addresses, times, ports)."""
    return _VOLATILE.sub("<v>", message).strip()


def compare(direct: dict[str, Any], proxied: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for nodeid in sorted(set(direct["tests"]) | set(proxied["tests"]),
                         key=lambda n: (file_of(n), n)):
        a = direct["tests"].get(nodeid, {"outcome": "absent", "message": ""})
        b = proxied["tests"].get(nodeid, {"outcome": "absent", "message": ""})
        same = a["outcome"] == b["outcome"]
        rows.append({
            "test": nodeid, "direct": a["outcome"], "prefixpin": b["outcome"], "same": same,
            # the same outcome for another reason (a failure with another message)
            "same_message": normalise(a["message"]) == normalise(b["message"]),
            "direct_message": a["message"], "prefixpin_message": b["message"],
            "prefixpin_traceback": b.get("traceback", ""),
            "direct_s": round(a.get("duration", 0.0), 2),
            "prefixpin_s": round(b.get("duration", 0.0), 2),
        })
    return rows


def recheck(rows: list[dict[str, Any]], tests: Path, workdir: Path, binary: Path, model: Path,
            args: argparse.Namespace) -> None:
    """Run every differing test ``args.recheck`` more times in both modes: a difference
    that every recheck reproduces is stable, else flaky."""
    differing = [row for row in rows if not row["same"]]
    for row in differing:
        row["rechecks"] = []
    if not differing:
        return
    for attempt in range(args.recheck):
        outcomes = {}
        for mode in MODES:
            run = run_mode(mode, tests, workdir, binary, model, args,
                           files=[row["test"] for row in differing], tag=f"recheck{attempt}-")
            outcomes[mode] = run["results"]["tests"]
        for row in differing:
            row["rechecks"].append({mode: outcomes[mode].get(row["test"], {}).get(
                "outcome", "absent") for mode in MODES})
    for row in differing:
        row["stable"] = all(check["direct"] == row["direct"]
                            and check["prefixpin"] == row["prefixpin"]
                            for check in row["rechecks"])


def cell(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[:limit] + " ..."
    return text.replace("|", "\\|")


def print_table(rows: list[dict[str, Any]]) -> None:
    width = max(len(row["test"]) for row in rows)
    print(f"{'test':<{width}}  {'direct':<10}  {'prefixpin':<10}  same?")
    for row in rows:
        print(f"{row['test']:<{width}}  {row['direct']:<10}  {row['prefixpin']:<10}  "
              f"{'yes' if row['same'] else 'NO'}")
    for row in rows:
        if not row["same"]:
            print(f"\nDIFFERS {row['test']}\n  direct:    {row['direct']} "
                  f"{cell(row['direct_message'], 400)}\n  prefixpin: {row['prefixpin']} "
                  f"{cell(row['prefixpin_message'], 400)}")


def write_report(record: dict[str, Any], out: Path) -> None:
    """RUN.md from a run's record (``runs.json``: ``--report-only`` rewrites it from there,
    with the current ``KNOWN`` and ``NOTES``)."""
    rows, runs, argv = record["rows"], record["runs"], record["argv"]
    per_file: dict[str, Counter[str]] = {}
    for row in rows:
        counts = per_file.setdefault(file_of(row["test"]), Counter())
        counts["same" if row["same"] else "differ"] += 1
        counts[f"direct {row['direct']}"] += 1
        counts[f"prefixpin {row['prefixpin']}"] += 1
    differing = [row for row in rows if not row["same"]]
    reasons = [row for row in rows if row["same"] and not row["same_message"]
               and row["direct"] != "passed"]
    operator_paths: dict[str, Counter[str]] = {}
    rewritten: dict[str, Counter[str]] = {}
    for route in runs["prefixpin"]["routes"]:
        request = f"{route['method']} {route['path'].partition('?')[0]}"
        if route["listener"] == "operator":
            operator_paths.setdefault(route["test"], Counter())[request] += 1
        elif route["listener"].startswith("tenant as "):
            rewritten.setdefault(route["test"], Counter())[
                f"{request} -> {route['listener'].removeprefix('tenant as ')}"] += 1

    lines = [
        "# llama.cpp's server tests, directly and through prefixpin",
        "",
        "Generated by `bench/llama_suite/run.py` (its docstring says how; "
        "`bench/llama_suite/plugin.py` what it changes in the harness).",
        "",
        "## Command",
        "",
        "```sh",
        shlex.join([".venv/bin/python", "bench/llama_suite/run.py", *argv]),
        "```",
        "",
        f"Tests from `{record['source']}/{TESTS_IN_TREE}` (llama-cpp-python "
        f"{LLAMA_CPP_PYTHON_VERSION}), model `{Path(record['model']).name}`, llama-server "
        f"`{record['binary']}`, routing `{record['routing']}`"
        + (f", prefixpin env {' '.join(record['proxy_env'])}" if record["proxy_env"] else "")
        + f". Total {record['elapsed']:.0f} s with the rechecks.",
        "",
    ]
    for mode in MODES:
        lines += [f"- {mode}: {runs[mode]['elapsed']:.0f} s (load average "
                  f"{runs[mode]['load'][0]:.1f} before, {runs[mode]['load'][1]:.1f} after), "
                  "exit status "
                  f"{runs[mode]['results']['exitstatus']}: `{shlex.join(runs[mode]['command'])}`"]
    lines += [
        "",
        "## Counts",
        "",
        "| file | tests | same | differ | direct passed | prefixpin passed |",
        "|---|---|---|---|---|---|",
    ]
    for name, counts in per_file.items():
        total = counts["same"] + counts["differ"]
        lines.append(f"| {name} | {total} | {counts['same']} | {counts['differ']} | "
                     f"{counts['direct passed']} | {counts['prefixpin passed']} |")
    total_same = sum(c["same"] for c in per_file.values())
    total_differ = sum(c["differ"] for c in per_file.values())
    lines += [f"| **all** | {total_same + total_differ} | {total_same} | {total_differ} | "
              f"{sum(c['direct passed'] for c in per_file.values())} | "
              f"{sum(c['prefixpin passed'] for c in per_file.values())} |", ""]

    lines += ["## Differing tests", ""]
    if not differing:
        lines += ["None.", ""]
    for row in differing:
        entry = known(row["test"])
        kind, analysis = entry if entry else ("UNANALYSED", "not in run.py's KNOWN table")
        lines += [
            f"### `{row['test']}`",
            "",
            f"- direct: {row['direct']} {cell(row['direct_message'], 600)}",
            f"- prefixpin: {row['prefixpin']} {cell(row['prefixpin_message'], 600)}",
            "- rechecks (direct/prefixpin): "
            + (", ".join(f"{c['direct']}/{c['prefixpin']}" for c in row["rechecks"])
               or "none")
            + (f": **{'stable' if row['stable'] else 'flaky'}**" if row["rechecks"] else ""),
            f"- **{kind}**: {analysis}",
            "",
        ]

    lines += [
        "## Same outcome, another failure message",
        "",
        "Both runs fail, but not alike (ids, times and ports masked): a difference the "
        "outcome alone hides.",
        "",
    ]
    if not reasons:
        lines += ["None.", ""]
    for row in reasons:
        entry = known(row["test"])
        lines += [f"- `{row['test']}`"
                  + (f" (**{entry[0]}**: {entry[1]})" if entry else ""),
                  f"  - direct: {cell(row['direct_message'])}",
                  f"  - prefixpin: {cell(row['prefixpin_message'])}"]
    lines += [""]

    lines += [
        "## Requests sent to the operator listener",
        "",
        "The harness's requests to a path the tenant port does not serve went to prefixpin's "
        "operator listener, which passes every engine path through unchanged (so these "
        "requests are not a check of the pipeline). The OpenAI clients the tests build "
        "always reach the tenant port.",
        "",
    ]
    if not operator_paths:
        lines += ["None.", ""]
    for test, paths in sorted(operator_paths.items()):
        lines.append(f"- `{test}`: " + ", ".join(f"`{p}` x{n}" for p, n in sorted(paths.items())))
    lines += [
        "",
        "Sent to the tenant port in their `/v1` form (one llama-server handler for both "
        "forms; the tenant port serves the `/v1` one only):",
        "",
    ]
    if not rewritten:
        lines += ["None."]
    for test, paths in sorted(rewritten.items()):
        lines.append(f"- `{test}`: " + ", ".join(f"`{p}` x{n}" for p, n in sorted(paths.items())))
    lines += [
        "",
        NOTES,
        "## Table",
        "",
        "| test | direct | prefixpin | same? | direct s | prefixpin s |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| `{cell(row['test'], 200)}` | {row['direct']} | {row['prefixpin']} | "
                     f"{'yes' if row['same'] else '**NO**'} | {row['direct_s']} | "
                     f"{row['prefixpin_s']} |")
    (out / "RUN.md").write_text("\n".join(lines) + "\n")
    log(f"wrote {out / 'RUN.md'}")


# --- main -----------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES),
                        help="test files, relative to tools/server/tests")
    parser.add_argument("-k", help="pytest -k expression (a subset)")
    parser.add_argument("--include-slow", action="store_true",
                        help="also the tests marked slow (upstream skips them by default)")
    parser.add_argument("--routing", choices=("auto", "tenant"), default="auto",
                        help="auto: a path the tenant port does not serve goes to the "
                        "operator listener; tenant: every request to the tenant port")
    parser.add_argument("--proxy-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment of the prefixpin run (PREFIXPIN_* settings)")
    parser.add_argument("--recheck", type=int, default=2, metavar="N",
                        help="run each differing test N more times in both modes")
    parser.add_argument("--only", choices=MODES, help="one run (no comparison)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite RUN.md from OUT/runs.json (no run)")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        write_report(json.loads((args.out / "runs.json").read_text()), args.out)
        return 0
    started = time.monotonic()
    source = sdist_root()
    binary = ensure_llama_server()
    model = fetch_model("smollm2")
    workdir = Path(tempfile.mkdtemp(prefix="llama-suite-"))
    try:
        tests = copy_tree(source, workdir)
        runs: dict[str, Any] = {}
        for mode in ([args.only] if args.only else MODES):
            runs[mode] = run_mode(mode, tests, workdir, binary, model, args)
        if args.only:
            counts = Counter(t["outcome"] for t in runs[args.only]["results"]["tests"].values())
            print(dict(counts))
            return 0
        rows = compare(runs["direct"]["results"], runs["prefixpin"]["results"])
        recheck(rows, tests, workdir, binary, model, args)
        print_table(rows)
        record = {"argv": argv, "source": str(source), "model": str(model),
                  "binary": str(binary), "routing": args.routing, "proxy_env": args.proxy_env,
                  "elapsed": time.monotonic() - started, "runs": runs, "rows": rows}
        (args.out / "runs.json").write_text(json.dumps(record, indent=1) + "\n")
        write_report(record, args.out)
        differ = sum(not row["same"] for row in rows)
        print(f"\n{len(rows) - differ} same, {differ} differ "
              f"(direct {runs['direct']['elapsed']:.0f} s, "
              f"prefixpin {runs['prefixpin']['elapsed']:.0f} s)")
        return 1 if differ else 0
    finally:
        if args.keep:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

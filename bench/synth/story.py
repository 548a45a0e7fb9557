"""One coding-agent session drawn from a seed: user turns, tool loops, answers.

The session is drawn once as abstract turns and then rendered in a reasoning style, so
the ``field`` (``reasoning_content``) and ``inline`` (``<think>`` in content) variants of
a seed carry exactly the same text.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bench.synth.outputs import DRAWERS
from bench.synth.project import Module, Project, draw_project
from bench.synth.prompt import system_prompt, tool_definitions
from bench.transcript import Message, ReasoningStyle, Transcript

# Measured once with SmolLM2's tokenizer through llama-server /tokenize over the committed
# transcripts (see bench/transcripts/README.md); used only to size tool results.
CHARS_PER_TOKEN = 3.4
# Most tool results are small (a grep, a short read, a test run); one per session is a
# big file read. With 12-14 steps that lands the last request at ~4.5-6k tokens.
SMALL_TOOL_TOKENS = (170, 260)
BIG_TOOL_TOKENS = (600, 1100)
_KIND_WEIGHTS = {"read": 35, "grep": 20, "pytest": 20, "edit": 10, "git": 8, "glob": 7}

_TASKS = (
    "`pytest tests/test_{module}.py` fails with KeyError: 'amount' since this morning's "
    "merge. Find out why and fix it without changing the public API.",
    "`{function}` gets slow on big inputs and I think it rescans the list. Can you check "
    "and make it linear?",
    "We need `{function}` to accept an empty input and return an empty result instead of "
    "raising. Please implement that and add a test.",
    "The nightly export job logged `ValueError: empty {noun}` twice last night. Track down "
    "where it comes from in {module} and make it fail with a clearer message.",
)
_FOLLOW_UPS = (
    "Thanks. Can you also add a regression test for an empty {noun} list?",
    "Run the whole test file once more and tell me if anything else broke.",
    "Please update the docstring of `{function}` to mention the new behaviour.",
    "Why did you guard inside `{function}` rather than in its caller?",
    "Show me the pending diff before I commit.",
    "Does anything else in the package call `{function}` with a None argument?",
)
_THOUGHTS = {
    "read": "I should read {target} before changing anything, to see how {function} handles "
            "missing keys and what the callers expect it to return.",
    "grep": "I need every caller of {function} first; a grep over the package is the "
            "quickest way to see whether the None case can actually reach it.",
    "pytest": "Let me run the tests for {module} to see the current failure and its "
              "traceback; the assertion message should tell me which key is missing.",
    "edit": "The guard belongs right after the lookup in {function}; a one-line edit keeps "
            "the change small and does not touch the signature.",
    "git": "Before I summarize I want to look at the pending diff for {module} to make sure "
           "only the intended lines changed.",
    "glob": "I do not know the layout of the package yet; listing the Python files will "
            "show where {module} and its tests live.",
}
_SAYINGS = ("", "", "Let me check {target}.", "Looking at {target} next.",
            "I'll start with {target}.")
_CONCLUSIONS = (
    "The checks are done, so I can answer: summarize what changed in {module} and how I "
    "verified it, in two or three lines.",
    "That settles it. The user wants a short answer: where the change is, why it is safe, "
    "and which tests I ran for {module}.",
    "Nothing else calls {function} in a way that breaks; I can report back now without "
    "another tool call.",
)
_ANSWERS = (
    "Fixed: `{function}` in `{path}` now checks for the missing key before using it, and "
    "the tests for {module} pass. The public signature is unchanged.",
    "Done. The change is confined to `{path}`; `{function}` now returns early on empty "
    "input. I ran the {module} tests and they pass.",
    "`{function}` is only called from `{path}` and from its tests, and none of those "
    "callers pass None, so the guard is defensive rather than required.",
    "Here is the summary: one edit in `{path}`, no new dependencies, and the {module} "
    "test file passes. Nothing else in the package depended on the old behaviour.",
)


@dataclass(frozen=True, slots=True)
class Call:
    id: str
    tool: str
    arguments: dict[str, Any]
    result: str


@dataclass(frozen=True, slots=True)
class Step:
    thought: str
    saying: str
    calls: tuple[Call, ...]  # empty: the step is the answer that ends a user turn
    module: Module  # what the step is about, so the next answer can refer to it


@dataclass(frozen=True, slots=True)
class UserTurn:
    request: str
    steps: tuple[Step, ...]


def draw_session(seed: int) -> tuple[Project, tuple[UserTurn, ...]]:
    rng = random.Random(f"prefixpin-bench:{seed}")
    project = draw_project(rng)
    n_steps = rng.randint(12, 14)
    sizes = _partition(rng, n_steps)
    kinds = [[_draw_calls(rng) for _ in range(size - 1)] for size in sizes]
    n_calls = sum(len(calls) for turn in kinds for calls in turn)
    tool_tokens = [rng.randint(*SMALL_TOOL_TOKENS) for _ in range(n_calls)]
    tool_tokens[rng.randrange(n_calls)] = rng.randint(*BIG_TOOL_TOKENS)
    sizes_tokens = iter(tool_tokens)
    turns = []
    for index, turn_kinds in enumerate(kinds):
        focus = project.module(rng)
        steps = []
        for calls in turn_kinds:
            step = _tool_step(rng, project, calls, sizes_tokens)
            focus = step.module
            steps.append(step)
        steps.append(_answer_step(rng, focus))
        template = _TASKS if index == 0 else _FOLLOW_UPS
        turns.append(UserTurn(_mention(rng, project.module(rng), rng.choice(template)),
                              tuple(steps)))
    return project, tuple(turns)


def _partition(rng: random.Random, n_steps: int) -> list[int]:
    """User turns of 2-4 steps each (the last step of a turn answers the user).

    The first turn is the task itself and always gets a full tool loop of four steps.
    """
    sizes = [4]
    while sum(sizes) < n_steps:
        sizes.append(min(rng.randint(2, 4), n_steps - sum(sizes)))
    if sizes[-1] == 1:  # a turn needs at least one tool step before its answer
        sizes[-2] -= 1
        sizes[-1] += 1
    return sizes


def _draw_calls(rng: random.Random) -> list[str]:
    kinds, weights = zip(*_KIND_WEIGHTS.items(), strict=True)
    count = 2 if rng.random() < 0.15 else 1  # independent calls go out together
    return rng.choices(kinds, weights=weights, k=count)


def _tool_step(rng: random.Random, project: Project, kinds: list[str],
               sizes_tokens: Iterator[int]) -> Step:
    calls = []
    modules = []
    for kind in kinds:
        tool, drawer = DRAWERS[kind]
        arguments, result, module = drawer(rng, project, int(next(sizes_tokens) * CHARS_PER_TOKEN))
        calls.append(Call(f"call_{rng.getrandbits(96):024x}", tool, arguments, result))
        modules.append(module)
    target = _target_of(calls[0])
    thought = _mention(rng, modules[0], _THOUGHTS[kinds[0]]).replace("{target}", target)
    saying = rng.choice(_SAYINGS).replace("{target}", f"`{target}`")
    return Step(thought=thought, saying=saying, calls=tuple(calls), module=modules[-1])


def _answer_step(rng: random.Random, module: Module) -> Step:
    thought = _mention(rng, module, rng.choice(_CONCLUSIONS))
    return Step(thought=thought, saying=_mention(rng, module, rng.choice(_ANSWERS)), calls=(),
                module=module)


def _target_of(call: Call) -> str:
    for key in ("path", "pattern", "command"):
        if key in call.arguments:
            return str(call.arguments[key])
    return call.tool


def _mention(rng: random.Random, module: Module, template: str) -> str:
    function = rng.choice(module.functions)
    noun = function.name.split("_", 1)[1]
    return (template.replace("{module}", module.name).replace("{function}", function.name)
            .replace("{noun}", noun).replace("{path}", module.path))


def render(name: str, seed: int, style: ReasoningStyle) -> Transcript:
    """The session of ``seed`` as OpenAI chat messages, reasoning rendered in ``style``."""
    project, turns = draw_session(seed)
    messages: list[Message] = [
        {"role": "system", "content": system_prompt(project.name, project.branch)}]
    for turn in turns:
        messages.append({"role": "user", "content": turn.request})
        for step in turn.steps:
            messages.append(_assistant(step, style))
            messages.extend({"role": "tool", "tool_call_id": call.id, "content": call.result}
                            for call in step.calls)
    return Transcript(name=name, seed=seed, reasoning_style=style,
                      tools=tuple(tool_definitions()), messages=tuple(messages))


def _assistant(step: Step, style: ReasoningStyle) -> Message:
    if style == "inline":
        message: Message = {"role": "assistant",
                            "content": f"<think>\n{step.thought}\n</think>\n\n{step.saying}"}
    else:
        message = {"role": "assistant", "content": step.saying or None,
                   "reasoning_content": step.thought}
    if step.calls:
        # The model's own serialization: json.dumps defaults, keys in the order produced.
        message["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.tool, "arguments": json.dumps(call.arguments)}}
            for call in step.calls]
    return message

"""A small fictional Python project, drawn from a seed, that a session's tools look at.

The text only has to be plausible to a tokenizer and to a reader of the transcripts:
typed Python modules, test files and their paths, with identifiers that repeat across
reads, greps and test logs the way they do in a real repository.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_PROJECTS = ("ledgerkit", "tidewatch", "quillmark", "ferrybook", "saltcellar", "orbitlog",
             "pinecount", "mapleroute")
_MODULES = ("config", "parser", "storage", "cli", "report", "retry", "cache", "schema",
            "ingest", "export", "auth", "scheduler")
_NOUNS = ("account", "entry", "record", "batch", "ledger", "window", "token", "route",
          "payload", "snapshot", "budget", "invoice", "checkpoint", "segment", "quota")
_VERBS = ("load", "parse", "validate", "merge", "render", "flush", "resolve", "normalize",
          "collect", "apply", "compute", "export", "restore", "split", "index")
_TYPES = ("str", "int", "float", "Path", "bytes", "list[str]", "dict[str, int]", "bool")
_PHRASES = (
    "Return the {noun} for {arg}, or raise if it is missing.",
    "Normalize {arg} so that equal {noun}s compare equal.",
    "Split {arg} into {noun}s no longer than the limit.",
    "Merge the {noun} into the running totals and return them.",
    "Validate {arg} against the schema before it is stored.",
    "Load every {noun} below {arg}, newest first.",
)
_STATEMENTS = (
    "    {var} = {other}.strip().lower()",
    "    if not {var}:\n        raise ValueError(f\"empty {noun}: {{{other}!r}}\")",
    "    {var} = [item for item in {other} if item]",
    "    log.debug(\"{verb} %s (%d items)\", {other}, len({var}))",
    "    {var} = {other}.get(\"{noun}\", DEFAULT_{const})",
    "    for index, item in enumerate({other}):\n        {var}[index] = item",
    "    {var} = sorted({other}, key=lambda item: item.{noun}_id)",
    "    if len({var}) > MAX_{const}:\n        {var} = {var}[:MAX_{const}]",
    "    with {other}.open(encoding=\"utf-8\") as handle:\n        {var} = handle.read()",
    "    {var} = {{key: value for key, value in {other}.items() if value is not None}}",
    "    total += {var}.amount if {var} else 0",
    "    {var} = _{verb}_{noun}({other}, strict=strict)",
)


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    params: tuple[tuple[str, str], ...]
    returns: str
    doc: str
    body: tuple[str, ...]

    def lines(self) -> list[str]:
        args = ", ".join(f"{name}: {kind}" for name, kind in self.params)
        head = [f"def {self.name}({args}, *, strict: bool = False) -> {self.returns}:",
                f'    """{self.doc}"""']
        body = [line for statement in self.body for line in statement.split("\n")]
        return [*head, *body, f"    return {self.params[0][0]}", ""]


@dataclass(frozen=True, slots=True)
class Module:
    name: str
    path: str
    klass: str
    functions: tuple[Function, ...]

    def lines(self) -> list[str]:
        const = self.name.upper()
        lines = [
            f'"""{self.name.capitalize()} helpers: {self.functions[0].doc[:-1].lower()}."""',
            "", "from __future__ import annotations", "", "import logging",
            "from dataclasses import dataclass, field", "from pathlib import Path", "",
            "log = logging.getLogger(__name__)", "", f"DEFAULT_{const} = 30",
            f"MAX_{const} = 512", "", "", "@dataclass(frozen=True)",
            f"class {self.klass}:", "    name: str", "    amount: int = 0",
            "    tags: list[str] = field(default_factory=list)", "", "",
        ]
        for function in self.functions:
            lines.extend(function.lines())
            lines.append("")
        return lines


@dataclass(frozen=True, slots=True)
class Project:
    name: str
    branch: str
    modules: tuple[Module, ...]

    def module(self, rng: random.Random) -> Module:
        return rng.choice(self.modules)

    def test_path(self, module: Module) -> str:
        return f"tests/test_{module.name}.py"


def plural(noun: str) -> str:
    if noun.endswith("y"):
        return noun[:-1] + "ies"
    return noun + ("es" if noun.endswith(("ch", "sh", "s", "x")) else "s")


def draw_project(rng: random.Random) -> Project:
    name = rng.choice(_PROJECTS)
    branch = rng.choice(("main", "develop", f"fix/{rng.choice(_NOUNS)}-{rng.randrange(10, 99)}"))
    chosen = rng.sample(_MODULES, 6)
    modules = tuple(_draw_module(rng, name, module) for module in chosen)
    return Project(name=name, branch=branch, modules=modules)


def _draw_module(rng: random.Random, project: str, name: str) -> Module:
    klass = "".join(part.capitalize() for part in (name, rng.choice(_NOUNS)))
    functions = tuple(_draw_function(rng, name) for _ in range(rng.randrange(4, 7)))
    return Module(name=name, path=f"src/{project}/{name}.py", klass=klass, functions=functions)


def _draw_function(rng: random.Random, module: str) -> Function:
    noun, verb = rng.choice(_NOUNS), rng.choice(_VERBS)
    params = tuple((f"{rng.choice(_NOUNS)}_{suffix}", rng.choice(_TYPES))
                   for suffix in rng.sample(("path", "items", "raw", "name", "limit"), 2))
    body = []
    for _ in range(rng.randrange(3, 7)):
        template = rng.choice(_STATEMENTS)
        body.append(template.format(
            var=plural(rng.choice(_NOUNS)), other=params[rng.randrange(2)][0], noun=noun,
            verb=verb, const=module.upper(),
        ))
    doc = rng.choice(_PHRASES).format(noun=noun, arg=params[0][0])
    return Function(name=f"{verb}_{noun}", params=params, returns=params[0][1], doc=doc,
                    body=tuple(body))

"""``prefixpin``: a thin shell over ``Settings`` (flags override ``PREFIXPIN_*`` variables)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from types import NoneType, UnionType
from typing import Any, NamedTuple, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from prefixpin.proxy.settings import ENV_PREFIX, Flag, Settings


class ServeFlag(NamedTuple):
    """A ``prefixpin serve`` flag, made from the ``Settings`` field marked ``Flag``."""

    field: str  # the setting it sets
    kind: type  # its value's type before Settings validates it; bool: --X and --no-X
    help: str  # the field's description and its default
    repeat: bool = False  # given once for each value, all of them collected


def value_type(annotation: Any) -> type:
    """int, float or bool where the field is one (or None), else str: paths, secrets and
    choices are checked by ``Settings``, as they always were."""
    union = get_origin(annotation) in (Union, UnionType)
    members = set(get_args(annotation)) - {NoneType} if union else {annotation}
    return next((kind for kind in (bool, int, float) if members == {kind}), str)


def binary_units(value: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size and value % size == 0:
            return f"{value // size} {unit}"
    return f"{value} bytes"


def shown_default(info: FieldInfo, unit: str = "") -> str | None:
    """A setting's default as ``--help`` and docs/flags.md show it (``on``, ``32 MiB``,
    ``256 tokens``, ``2,000,000``, ``2``); None where there is none to show (the field's
    description says what its absence means)."""
    value = None if info.is_required() else info.get_default(call_default_factory=True)
    if value is None:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and unit == "bytes":
        return binary_units(value)
    if isinstance(value, int):
        number = f"{value:,}" if value >= 10_000 else str(value)
        return f"{number} {unit}" if unit else number
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def help_text(name: str, info: FieldInfo, flag: Flag) -> str:
    text, shown = info.description or "", shown_default(info, flag.unit)
    if isinstance(info.default, bool):
        text += f" (default {shown}; env {ENV_PREFIX}{name.upper()}={int(not info.default)})"
    elif shown is not None:
        text += f" (default {shown})"
    return text.replace("%", "%%")  # argparse formats help with %


def serve_flags() -> dict[str, ServeFlag]:
    """Every ``Settings`` field marked ``Flag``, as its flag, in the fields' order."""
    flags = {}
    for name, info in Settings.model_fields.items():
        flag = next((m for m in info.metadata if isinstance(m, Flag)), None)
        if flag is not None:
            option = flag.name or "--" + name.replace("_", "-")
            flags[option] = ServeFlag(name, value_type(info.annotation),
                                      help_text(name, info, flag), flag.repeat)
    return flags


SERVE_FLAGS = serve_flags()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixpin", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    # Every flag defaults to "not given", so the environment and the Settings defaults
    # apply unless the flag is on the command line.
    serve = commands.add_parser("serve", help="run the proxy",
                                argument_default=argparse.SUPPRESS)
    for option, flag in SERVE_FLAGS.items():
        if flag.kind is bool:
            serve.add_argument(option, dest=flag.field, action=argparse.BooleanOptionalAction,
                               help=flag.help)
        else:
            serve.add_argument(option, dest=flag.field, type=flag.kind, help=flag.help,
                               action="append" if flag.repeat else "store")
    # Not a setting: its lines become upstream(s), upstream_namespaces, upstream_api_keys.
    serve.add_argument("--upstreams-file", dest="upstreams_file", help="file with one engine "
                       "base URL a line (# comments): backends besides --upstream; a URL "
                       "followed by namespace=NS[,NS...] serves only those namespaces (as "
                       "/sessions shows them)")
    from prefixpin.proxy.ops.doctor import add_arguments as add_doctor_arguments

    add_doctor_arguments(commands.add_parser(
        "doctor", help="check a llama-server for settings that defeat prompt caching"))
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {k: v for k, v in vars(args).items() if k not in ("command", "upstreams_file")}
    urls: list[str] = list(given.pop("upstream", None) or [])
    if (path := vars(args).get("upstreams_file")) is not None:
        entries = read_upstreams_file(path)
        urls += [entry.url for entry in entries]
        dedicated = {entry.url: list(entry.namespaces) for entry in entries if entry.namespaces}
        if dedicated:
            given["upstream_namespaces"] = dedicated
        keys = {entry.url: entry.api_key for entry in entries if entry.api_key}
        if keys:
            given["upstream_api_keys"] = keys
    if urls:
        given["upstream"] = urls[0]
    if len(urls) > 1:  # else PREFIXPIN_UPSTREAMS, if set, still applies
        given["upstreams"] = urls[1:]
    return Settings(**given)


@dataclass(frozen=True, slots=True)
class UpstreamEntry:
    url: str
    namespaces: tuple[str, ...] = ()  # empty: any namespace
    # The engine's API key (else --engine-api-key); a key holds no "#" (a comment starts).
    api_key: str | None = dataclass_field(default=None, repr=False)


class UpstreamsFileError(ValueError):
    pass


_NAMESPACE = re.compile(r"^(anon|t-[0-9a-f]{16})$")


def read_upstreams_file(path: str) -> list[UpstreamEntry]:
    """One base URL a line, optionally followed by ``namespace=NS[,NS...]`` (the backend
    then serves only those namespaces) and ``api_key=KEY`` (the engine's API key for
    prefixpin's own requests, instead of ``--engine-api-key``); blank lines and ``#``
    comments are skipped."""
    with open(path, encoding="utf-8") as handle:
        lines = [line.split("#", 1)[0].strip() for line in handle]
    return [parse_upstream_line(line, f"{path}:{number}")
            for number, line in enumerate(lines, 1) if line]


def parse_upstream_line(line: str, where: str = "") -> UpstreamEntry:
    url, *options = line.split()
    namespaces: list[str] = []
    api_key: str | None = None
    for option in options:
        name, sep, value = option.partition("=")
        if name == "api_key" and sep:
            if not value:
                raise UpstreamsFileError(f"{where}: api_key= without a key")
            api_key = value
            continue
        if name != "namespace" or not sep:
            # The option's value is left out: it may be a mistyped key.
            raise UpstreamsFileError(f"{where}: unknown option {name!r} (only "
                                     "namespace=NS[,NS...] and api_key=KEY follow a URL)")
        for namespace in value.split(","):
            if not _NAMESPACE.match(namespace):
                raise UpstreamsFileError(
                    f"{where}: {namespace!r} is not a namespace id (t- and 16 hex digits, "
                    "as /sessions shows it, or anon)")
            namespaces.append(namespace)
    return UpstreamEntry(url, tuple(dict.fromkeys(namespaces)), api_key)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from prefixpin.proxy.ops.doctor import main_from_args

        return main_from_args(args)
    try:
        settings = settings_from_args(args)
    except OSError as exc:
        print(f"prefixpin: cannot read --upstreams-file: {exc}", file=sys.stderr)
        return 2
    except UpstreamsFileError as exc:
        print(f"prefixpin: invalid --upstreams-file: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"prefixpin: invalid settings: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from prefixpin.proxy.listen.server import serve

        return serve(settings)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

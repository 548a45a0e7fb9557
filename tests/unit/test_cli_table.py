"""``prefixpin``'s command line, as users know it: every flag each subcommand accepts, what
each sets, and the ``Settings`` a command line gives (flags over ``PREFIXPIN_*`` variables
over the defaults). Recorded from the hand-written flag table before the flags came from
``Settings``; it holds them to what they were."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path
from typing import Any, Literal, Optional

import pytest
from pydantic import SecretStr
from pydantic.fields import FieldInfo

from prefixpin.proxy.cli import (
    SERVE_FLAGS,
    build_parser,
    settings_from_args,
    shown_default,
    value_type,
)
from prefixpin.proxy.settings import Flag, Settings

# flag -> (the argument it sets, what it sets given "7", or given alone if it takes none)
SERVE: dict[str, tuple[str, Any]] = {
    "--upstream": ("upstream", ["7"]),
    "--engine": ("engine", "7"),
    "--host": ("host", "7"),
    "--port": ("port", 7),
    "--admin-listen": ("admin_listen", "7"),
    "--admin-token": ("admin_token", "7"),
    "--engine-api-key": ("engine_api_key", "7"),
    "--tenants": ("tenants_file", "7"),
    "--cors-origins": ("cors_origins", "7"),
    "--first-byte": ("first_byte_ms", 7),
    "--heartbeat": ("heartbeat_s", 7.0),
    "--max-body": ("max_body_bytes", 7),
    "--max-bodies": ("max_bodies_bytes", 7),
    "--max-json-values": ("max_json_values", 7),
    "--max-reply-events": ("max_reply_events", 7),
    "--max-reply-bytes": ("max_reply_bytes", 7),
    "--keep-reply-events": ("keep_reply_events", 7),
    "--max-connections": ("max_connections", 7),
    "--head-timeout": ("head_timeout_s", 7.0),
    "--body-timeout": ("body_timeout_s", 7.0),
    "--engine-head-bytes": ("engine_head_bytes", 7),
    "--engine-interim-responses": ("engine_interim_responses", 7),
    "--engine-head-timeout": ("engine_head_timeout_s", 7.0),
    "--engine-read-share": ("engine_read_share", 7),
    "--compiled-read-share": ("compiled_read_share", 7),
    "--compiled-hold": ("compiled_hold_bytes", 7),
    "--max-body-chunks": ("max_body_chunks", 7),
    "--retry-grace": ("retry_grace_s", 7.0),
    "--queue-timeout": ("queue_timeout_s", 7.0),
    "--read-timeout": ("read_timeout_s", 7.0),
    "--max-sessions": ("max_sessions", 7),
    "--max-sessions-per-namespace": ("max_sessions_per_namespace", 7),
    "--max-committed-bytes-per-namespace": ("max_committed_bytes_per_namespace", 7),
    "--max-queued-per-namespace": ("max_queued_per_namespace", 7),
    "--max-queued-per-lane": ("max_queued_per_lane", 7),
    "--max-shared-sessions-per-namespace": ("max_shared_sessions_per_namespace", 7),
    "--model": ("model", "7"),
    "--slots": ("slots", 7),
    "--ctx-size": ("ctx_size", 7),
    "--threads": ("threads", 7),
    "--repack": ("repack", "7"),
    "--park-dir": ("park_dir", "7"),
    "--park-max-bytes": ("park_max_bytes", 7),
    "--park-min-tokens": ("park_min_tokens", 7),
    "--opening-min-tokens": ("opening_min_tokens", 7),
    "--park-verify": ("park_verify", "7"),
    "--park-index-dir": ("park_index_dir", "7"),
    "--redis": ("redis", "7"),
    "--redis-prefix": ("redis_prefix", "7"),
    "--replica-id": ("replica_id", "7"),
    "--placement": ("placement", "7"),
    "--overload-queue": ("overload_queue", 7),
    "--overload-occupancy": ("overload_occupancy", 7.0),
    "--tokenizer": ("tokenizer", "7"),
    "--log-level": ("log_level", "7"),
    "--upstreams-file": ("upstreams_file", "7"),
    "--affinity": ("affinity", True),
    "--no-affinity": ("affinity", False),
    "--repair": ("repair", True),
    "--no-repair": ("repair", False),
    "--parking": ("parking", True),
    "--no-parking": ("parking", False),
    "--park-ahead": ("park_ahead", True),
    "--no-park-ahead": ("park_ahead", False),
    "--anchor": ("anchor", True),
    "--no-anchor": ("anchor", False),
    "--openings": ("openings", True),
    "--no-openings": ("openings", False),
    "--allow-shared-cache": ("allow_shared_cache", True),
    "--no-allow-shared-cache": ("allow_shared_cache", False),
    "--compiled-relay": ("compiled_relay", True),
    "--no-compiled-relay": ("compiled_relay", False),
    "--keep-large-buffers": ("keep_large_buffers", True),
    "--no-keep-large-buffers": ("keep_large_buffers", False),
    "--park-shared": ("park_shared", True),
    "--no-park-shared": ("park_shared", False),
}
DOCTOR: dict[str, tuple[str, Any]] = {
    "--upstream": ("upstream", "7"),
    "--engine-api-key": ("engine_api_key", "7"),
    "--json": ("json", True),
    "--no-probe": ("probe", False),
    "--probe-context-shift": ("probe_context_shift", True),
    "--probe-shared-cache": ("probe_shared_cache", True),
    "--probe-eviction": ("probe_eviction", True),
    "--no-local": ("local", False),
    "--min-ctx": ("min_ctx", 7),
    "--timeout": ("timeout", 7.0),
}


def help_of(*command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    return out.getvalue()


def flags_in(text: str) -> list[str]:
    """The option strings of a ``--help`` text's ``options:`` section, in order."""
    found = []
    for line in text.split("\noptions:\n", 1)[1].splitlines():
        if line.startswith("  -"):
            found += [piece.split(" ")[0] for piece in line.strip().split("  ")[0].split(", ")]
    return found


def parsed(argv: list[str]) -> dict[str, Any] | None:
    """The arguments ``argv`` gives, or None where the parser refuses it."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return vars(build_parser().parse_args(argv))
    except SystemExit:
        return None


@pytest.fixture(autouse=True)
def _no_prefixpin_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("PREFIXPIN_")]:
        monkeypatch.delenv(name)


def test_the_top_level_takes_help_and_the_subcommands() -> None:
    text = help_of()
    assert flags_in(text) == ["-h", "--help"]
    assert "{serve,doctor}" in text
    assert parsed([]) is None
    assert parsed(["bogus"]) is None


@pytest.mark.parametrize(("command", "table"), [("serve", SERVE), ("doctor", DOCTOR)])
def test_each_subcommand_accepts_the_same_flags(command: str, table: dict[str, Any]) -> None:
    assert sorted(flags_in(help_of(command))) == sorted(["-h", "--help", *table])


@pytest.mark.parametrize(("command", "table"), [("serve", SERVE), ("doctor", DOCTOR)])
def test_each_flag_sets_the_same_argument_the_same_way(command: str,
                                                       table: dict[str, Any]) -> None:
    """A flag that takes a value converts "7" as it did (int, float, str, a list for a
    repeated one); a switch takes none and sets True or False."""
    base = parsed([command])
    assert base is not None
    for flag, (dest, value) in table.items():
        takes_value = not isinstance(value, bool)
        argv = [command, flag, "7"] if takes_value else [command, flag]
        got = parsed(argv)
        assert got is not None, argv
        assert {k: v for k, v in got.items() if base.get(k, KeyError) != v} == {dest: value}, \
            flag
        if not takes_value:
            assert parsed([command, flag, "7"]) is None, flag


def test_serve_sets_nothing_not_given() -> None:
    """Every serve flag defaults to "not given": the environment and the Settings defaults
    apply unless the flag is on the command line."""
    assert parsed(["serve"]) == {"command": "serve"}


def test_repeated_flags() -> None:
    """--upstream collects; any other flag's last value wins."""
    got = parsed(["serve", "--upstream", "a", "--upstream", "b", "--port", "1", "--port", "2",
                  "--affinity", "--no-affinity"])
    assert got == {"command": "serve", "upstream": ["a", "b"], "port": 2, "affinity": False}


SAMPLE = [
    "serve", "--upstream", "http://a:1", "--upstream", "http://b:2", "--engine", "ollama",
    "--host", "0.0.0.0", "--port", "9000", "--admin-listen", "[::1]:9100",
    "--admin-token", "secret", "--engine-api-key", "key", "--tenants", "t.toml",
    "--first-byte", "50", "--heartbeat", "0.5", "--max-body", "2048",
    "--max-reply-bytes", "1048576", "--compiled-hold", "8192", "--head-timeout", "3",
    "--max-sessions", "17", "--model", "m.gguf", "--threads", "3", "--repack", "off",
    "--park-dir", "/tmp/park", "--park-verify", "tokens", "--redis", "redis://r:6379/0",
    "--placement", "least-loaded", "--overload-occupancy", "1.5", "--log-level", "debug",
    "--no-affinity", "--no-park-ahead", "--allow-shared-cache", "--no-compiled-relay",
    "--park-shared",
]


def test_a_command_line_gives_the_same_settings() -> None:
    settings = settings_from_args(build_parser().parse_args(SAMPLE))
    assert settings == Settings(
        upstream="http://a:1", upstreams=["http://b:2"], engine="ollama", host="0.0.0.0",
        port=9000, admin_listen="[::1]:9100", admin_token="secret", engine_api_key="key",
        tenants_file="t.toml", first_byte_ms=50, heartbeat_s=0.5, max_body_bytes=2048,
        max_reply_bytes=1 << 20, compiled_hold_bytes=8192, head_timeout_s=3.0,
        max_sessions=17, model="m.gguf", threads=3, repack="off", park_dir="/tmp/park",
        park_verify="tokens", redis="redis://r:6379/0", placement="least-loaded",
        overload_occupancy=1.5, log_level="debug", affinity=False, park_ahead=False,
        allow_shared_cache=True, compiled_relay=False, park_shared=True)
    assert settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == "secret"


def test_no_flags_give_the_settings_defaults() -> None:
    assert settings_from_args(build_parser().parse_args(["serve"])) == Settings()


def test_flags_override_the_environment_and_the_environment_the_defaults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXPIN_FIRST_BYTE_MS", "70")
    monkeypatch.setenv("PREFIXPIN_AFFINITY", "0")
    monkeypatch.setenv("PREFIXPIN_ALLOW_SHARED_CACHE", "1")
    monkeypatch.setenv("PREFIXPIN_UPSTREAMS", '["http://c:3"]')
    monkeypatch.setenv("PREFIXPIN_HEARTBEAT_S", "4")
    env_only = settings_from_args(build_parser().parse_args(["serve", "--upstream", "http://a:1"]))
    assert (env_only.first_byte_ms, env_only.affinity, env_only.allow_shared_cache,
            env_only.upstreams, env_only.heartbeat_s) == (70, False, True, ["http://c:3"], 4.0)
    assert env_only.port == 8088
    flagged = settings_from_args(build_parser().parse_args(
        ["serve", "--upstream", "http://a:1", "--upstream", "http://b:2", "--first-byte", "90",
         "--affinity", "--no-allow-shared-cache"]))
    assert (flagged.first_byte_ms, flagged.affinity, flagged.allow_shared_cache,
            flagged.upstreams, flagged.heartbeat_s) == (90, True, False, ["http://b:2"], 4.0)


# ---------------------------------------------------------------- one table: Settings

def field_flag(name: str) -> Flag:
    return next(m for m in Settings.model_fields[name].metadata if isinstance(m, Flag))


def test_the_serve_flags_are_the_settings_marked_flag() -> None:
    """Each flag is a Settings field marked ``Flag`` (and --upstreams-file, which is read
    into several), so a new setting becomes a flag by its field alone."""
    marked = [name for name, info in Settings.model_fields.items()
              if any(isinstance(m, Flag) for m in info.metadata)]
    assert [flag.field for flag in SERVE_FLAGS.values()] == marked
    switches = [f"--no-{option[2:]}" for option, flag in SERVE_FLAGS.items()
                if flag.kind is bool]
    assert sorted([*SERVE_FLAGS, *switches, "--upstreams-file"]) == sorted(SERVE)


def test_each_help_is_the_fields_description_and_its_default() -> None:
    for option, flag in SERVE_FLAGS.items():
        description = Settings.model_fields[flag.field].description
        assert description
        assert flag.help.startswith(description), option
    helps = {option: flag.help for option, flag in SERVE_FLAGS.items()}
    assert helps["--max-body"].endswith(" in bytes (default 32 MiB)")
    assert helps["--park-max-bytes"].endswith("(default 8 GiB)")
    assert helps["--compiled-hold"].endswith("(default 64 KiB)")
    assert helps["--max-json-values"].endswith("(default 2,000,000)")
    assert helps["--keep-reply-events"].endswith("(default 8192)")
    assert helps["--park-min-tokens"].endswith("(default 256 tokens)")
    assert helps["--heartbeat"].endswith("(default 2)")
    assert helps["--overload-occupancy"].endswith("(default 1)")
    assert helps["--host"].endswith("(default 127.0.0.1)")
    assert helps["--park-ahead"].endswith("(default on; env PREFIXPIN_PARK_AHEAD=0)")
    assert helps["--park-shared"].endswith("(default off; env PREFIXPIN_PARK_SHARED=1)")
    assert "(default" not in helps["--threads"]  # None: nothing to show


def test_the_help_names_only_real_variables() -> None:
    """A ``PREFIXPIN_*`` variable the help names is a setting's (a renamed field would
    leave it stale)."""
    names = set(re.findall(r"PREFIXPIN_([A-Z_]+)", " ".join(f.help for f in SERVE_FLAGS.values())))
    assert names
    assert {name.lower() for name in names} <= set(Settings.model_fields)


def test_a_default_shows_in_its_unit() -> None:
    def info(default: object) -> FieldInfo:
        return FieldInfo(default=default)

    assert shown_default(info(3 << 20), "bytes") == "3 MiB"
    assert shown_default(info(1000), "bytes") == "1000 bytes"
    assert shown_default(info(4096), "bytes") == "4 KiB"
    assert shown_default(info(12_345)) == "12,345"
    assert shown_default(info(0.85)) == "0.85"
    assert shown_default(info(False)) == "off"
    assert shown_default(info(None)) is None
    assert shown_default(FieldInfo(default_factory=list)) == "[]"
    assert shown_default(FieldInfo()) is None  # required


def test_values_convert_as_their_fields_are_typed() -> None:
    assert value_type(int) is int
    assert value_type(int | None) is int
    assert value_type(Optional[float]) is float  # noqa: UP045 - the other spelling
    assert value_type(bool) is bool
    assert value_type(Literal["a", "b"]) is str
    assert value_type(SecretStr | None) is str
    assert value_type(int | str) is str


# ---------------------------------------------------------------- docs/flags.md

FLAGS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


def page_rows() -> list[tuple[list[str], str]]:
    """Each row of docs/flags.md's table naming flags: its flags (``--[no-]x`` as both) and
    its default cell."""
    rows = []
    for line in FLAGS_PAGE.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        flags = []
        for match in re.finditer(r"`--(\[no-\])?([a-z][a-z-]*)", cells[0]):
            flags += [f"--{match[2]}", *([f"--no-{match[2]}"] if match[1] else [])]
        if flags:
            rows.append((flags, cells[1]))
    return rows


def test_the_flags_page_lists_every_flag() -> None:
    listed = [flag for flags, _ in page_rows() for flag in flags]
    assert sorted(listed) == sorted(SERVE)


def test_the_flags_page_shows_the_settings_defaults() -> None:
    """Where each of a row's flags has a default to show, the row shows those (``on`` once
    for three switches); a setting without one (None) is described in words there."""
    checked = 0
    for flags, cell in page_rows():
        infos = [(Settings.model_fields[SERVE_FLAGS[flag].field], field_flag(
            SERVE_FLAGS[flag].field)) for flag in flags if flag in SERVE_FLAGS]
        shown = [shown_default(info, flag.unit) for info, flag in infos]
        if shown and all(text is not None for text in shown):
            assert cell == ", ".join(dict.fromkeys(str(text) for text in shown)), flags
            checked += 1
    assert checked >= 40

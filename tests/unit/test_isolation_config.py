"""``--upstreams-file`` with dedicated backends (``namespace=``), ``--allow-shared-cache``,
and which engines' prompt caches cross slots (``proxy.engine.engines.shared_cache_reason``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixpin.proxy.cli import (
    UpstreamEntry,
    UpstreamsFileError,
    build_parser,
    main,
    parse_upstream_line,
    read_upstreams_file,
    settings_from_args,
)
from prefixpin.proxy.engine.engine_facts import parse_llama_args
from prefixpin.proxy.engine.engines import FLAGS_UNREADABLE, OLLAMA_SHARED, shared_cache_reason

NS_A, NS_B = "t-0123456789abcdef", "t-fedcba9876543210"


def test_the_plain_format_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "backends.txt"
    path.write_text("# engines\nhttp://a:8080\n\n  http://b:8080  # the second\n")
    assert read_upstreams_file(str(path)) == [UpstreamEntry("http://a:8080"),
                                              UpstreamEntry("http://b:8080")]


def test_namespaces_follow_a_url(tmp_path: Path) -> None:
    path = tmp_path / "backends.txt"
    path.write_text(f"http://a:8080 namespace={NS_A},{NS_B}\nhttp://b:8080\n"
                    f"http://c:8080 namespace={NS_B} namespace=anon # team b\n")
    entries = read_upstreams_file(str(path))
    assert entries == [UpstreamEntry("http://a:8080", (NS_A, NS_B)),
                       UpstreamEntry("http://b:8080"),
                       UpstreamEntry("http://c:8080", (NS_B, "anon"))]
    args = build_parser().parse_args(["serve", "--upstream", "http://z:1",
                                      "--upstreams-file", str(path), "--allow-shared-cache"])
    settings = settings_from_args(args)
    assert settings.backend_urls() == ["http://z:1", "http://a:8080", "http://b:8080",
                                       "http://c:8080"]
    assert settings.upstream_namespaces == {"http://a:8080": [NS_A, NS_B],
                                            "http://c:8080": [NS_B, "anon"]}
    assert settings.allow_shared_cache is True
    plain = settings_from_args(build_parser().parse_args(["serve", "--upstream", "http://z:1"]))
    assert plain.allow_shared_cache is False
    assert plain.upstream_namespaces == {}


@pytest.mark.parametrize("line", ["http://a:8080 namespace=", "http://a:8080 ns=t-0123",
                                  "http://a:8080 namespace=sk-secret-token",
                                  "http://a:8080 weight=2"])
def test_bad_options_are_refused(line: str) -> None:
    with pytest.raises(UpstreamsFileError):
        parse_upstream_line(line, "f:1")


def test_a_bad_file_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "backends.txt"
    path.write_text("http://a:8080 namespace=team-a\n")
    assert main(["serve", "--upstreams-file", str(path)]) == 2
    assert "not a namespace id" in capsys.readouterr().err


def test_which_caches_cross_slots() -> None:
    default = parse_llama_args(["llama-server", "-np", "2"], {}, "command line of process 1")
    default.defaults = {"cache_ram": "8192"}
    off = parse_llama_args(["llama-server", "--cache-ram", "0"], {}, "command line of process 1")
    env_off = parse_llama_args(["llama-server"], {"LLAMA_ARG_CACHE_RAM": "0"}, "cmd")
    unlimited = parse_llama_args(["llama-server", "-cram", "-1"], {}, "command line of process 1")
    assert shared_cache_reason("embedded", None, {}) is None
    assert shared_cache_reason("ollama", None, {}) == OLLAMA_SHARED
    assert shared_cache_reason("llama-server", None, {}) == FLAGS_UNREADABLE
    assert shared_cache_reason("llama-server", None, {"cache_ram": 0}) is None
    assert "default 8192 MiB" in (shared_cache_reason("llama-server", default, {}) or "")
    assert shared_cache_reason("llama-server", off, {}) is None
    assert shared_cache_reason("llama-server", env_off, {}) is None
    assert "--cache-ram -1" in (shared_cache_reason("llama-server", unlimited, {}) or "")
    # flags read from the command line win over what /props says
    assert shared_cache_reason("llama-server", default, {"cache_ram": 0}) is not None

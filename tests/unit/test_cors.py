"""Which origins each engine's rules allow (proxy.listen.cors): llama-server's localhost
check as ``origin_is_localhost`` parses an origin, Ollama's patterns as gin-contrib/cors
matches them."""

from __future__ import annotations

import pytest

from prefixpin.proxy.listen.cors import (
    is_localhost_origin,
    llama_server_rules,
    ollama_rules,
    rules_for,
)


@pytest.mark.parametrize(("origin", "local"), [
    ("http://localhost", True), ("https://localhost:8443", True), ("http://127.0.0.1", True),
    ("http://127.0.0.1:3000", True), ("http://[::1]", True), ("http://[::1]:3000", True),
    ("http://localhost/path", True), ("http://user@localhost:1", True),
    ("http://localhost@evil.com", False), ("http://localhost.evil.com", False),
    ("http://notlocalhost", False), ("http://127.0.0.2", False), ("http://[::2]", False),
    ("http://[::1", False), ("http://[::1]x", False), ("http://localhost:x", False),
    ("ftp://localhost", False), ("localhost", False), ("null", False), ("", False),
    ("http://LOCALHOST", False),  # compared as written, as llama-server compares it
])
def test_localhost_is_llama_servers_localhost(origin: str, local: bool) -> None:
    assert is_localhost_origin(origin) is local
    assert (llama_server_rules(None).allowed(origin) is not None) is local


def test_llama_servers_list_is_of_exact_origins() -> None:
    rules = llama_server_rules(" https://a.example ,http://b.example:1")
    assert rules.allowed("https://a.example") is not None
    assert rules.allowed("http://b.example:1") is not None
    assert rules.allowed("http://b.example") is None
    assert rules.allowed("http://localhost") is None


@pytest.mark.parametrize(("given", "origin", "allowed"), [
    (None, "http://localhost:11434", True), (None, "https://0.0.0.0", True),
    (None, "http://localhost.evil.com", False), (None, "tauri://localhost", True),
    (None, "chrome-extension://abc", False), ("chrome-extension://*", "chrome-extension://a", True),
    ("https://*.example.com", "https://a.b.example.com", True),
    ("https://*.example.com", "https://example.com", False),
    ("HTTPS://Chat.Example", "https://chat.example", True),
    ("http://192.168.1.1:*", "http://192.168.1.1:80", True),
])
def test_ollama_origins_match_as_gin_cors_matches_them(given: str | None, origin: str,
                                                      allowed: bool) -> None:
    assert (ollama_rules(given).allowed(origin) is not None) is allowed


def test_ollamas_rules_only_where_every_engine_is_ollama() -> None:
    llama, ollama = llama_server_rules(None), ollama_rules(None)
    assert rules_for(["ollama", "ollama"], llama, ollama) is ollama
    assert rules_for(["ollama", "llama-server"], llama, ollama) is llama
    assert rules_for(["embedded"], llama, ollama) is llama
    assert rules_for([], llama, ollama) is llama

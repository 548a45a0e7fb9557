"""Tenants: none configured is one namespace for every key; a tenants file authenticates
keys (401 otherwise), names namespaces by tenant, and is read again when it changes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from prefixpin.proxy.listen.tenants import (
    ANONYMOUS,
    Tenants,
    TenantsFileError,
    UnauthorizedError,
    client_key,
    parse_tenants,
)

LOG = logging.getLogger("prefixpin.test")
FILE = '[tenants]\nalice = "sk-alice"\nbot = ["sk-bot-1", "sk-bot-2"]\n'


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-one"},
                                     {"x-api-key": "sk-two"}, {"authorization": "Basic x"}])
def test_without_tenants_every_key_is_one_namespace(headers: dict[str, str]) -> None:
    assert Tenants(None, LOG).namespace_of(headers) == ANONYMOUS
    assert Tenants(None, LOG).count == 1


def test_a_key_names_its_tenant_in_either_header(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(FILE)
    tenants = Tenants(path, LOG)
    assert tenants.count == 2
    assert tenants.namespace_of({"authorization": "Bearer sk-alice"}) == "alice"
    assert tenants.namespace_of({"x-api-key": "sk-bot-2"}) == "bot"
    # a bearer token wins over x-api-key
    assert tenants.namespace_of({"authorization": "Bearer sk-bot-1",
                                 "x-api-key": "sk-alice"}) == "bot"


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-nobody"},
                                     {"authorization": "Basic sk-alice"},
                                     {"x-api-key": "sk-alic"}])
def test_a_missing_or_unknown_key_is_unauthorized(tmp_path: Path,
                                                  headers: dict[str, str]) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(FILE)
    with pytest.raises(UnauthorizedError) as caught:
        Tenants(path, LOG).namespace_of(headers)
    assert caught.value.status_code == 401
    assert "sk-" not in caught.value.message


def test_the_file_is_read_again_when_it_changes_and_a_broken_one_keeps_the_last(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "prefixpin")
    path = tmp_path / "tenants.toml"
    path.write_text(FILE)
    clock = Clock()
    tenants = Tenants(path, LOG, clock=clock)
    assert tenants.namespace_of({"x-api-key": "sk-alice"}) == "alice"
    path.write_text('[tenants]\ncarol = "sk-carol"\n')
    clock.now = 2.0
    assert tenants.namespace_of({"x-api-key": "sk-carol"}) == "carol"
    with pytest.raises(UnauthorizedError):
        tenants.namespace_of({"x-api-key": "sk-alice"})
    path.write_text("[tenants\n")  # broken: carol stays
    clock.now = 4.0
    assert tenants.namespace_of({"x-api-key": "sk-carol"}) == "carol"
    assert any(r.getMessage() == "tenants file not reloaded" for r in caplog.records)


@pytest.mark.parametrize("text", ["", "[tenants]\n", 'tenants = "x"\n',
                                  '[tenants]\na = ""\n', '[tenants]\na = 5\n',
                                  '[tenants]\na = "k"\nb = "k"\n', '[tenants]\nanon = "k"\n',
                                  '[tenants]\na = " k"\n', "not toml ["])
def test_a_bad_file_says_why(text: str) -> None:
    with pytest.raises(TenantsFileError):
        parse_tenants(text)


def test_a_bad_file_at_start_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants]\na = 5\n')
    with pytest.raises(TenantsFileError):
        Tenants(path, LOG)
    with pytest.raises(TenantsFileError):
        Tenants(tmp_path / "missing.toml", LOG)


def test_the_client_key_is_the_bearer_token_else_x_api_key() -> None:
    assert client_key({"authorization": "bearer  sk-1 "}) == "sk-1"
    assert client_key({"authorization": "Basic sk-1", "x-api-key": "sk-2"}) == "sk-2"
    assert client_key({}) == ""

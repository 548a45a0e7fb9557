"""Tenants: who may use the tenant port, and the namespace each request belongs to.

With no tenants configured (one person's agents in front of their own engine), every
request is the one namespace ``ANONYMOUS``, whatever key it carries: the agent CLIs each
need some key, a dummy one is fine, and nothing is isolated because there is no one to
isolate from. The keys reach the engine as they came, for an engine started with
``--api-key``.

With ``--tenants FILE``, a TOML file of tenant names and their keys::

    [tenants]
    alice = "sk-alice-..."
    build-bot = ["sk-bot-1", "sk-bot-2"]   # several keys, one tenant

a request is its tenant's namespace (the tenant's name), and one with a missing or unknown
key is a 401 in its API's shape before any other work. The key is the bearer token, else
the ``x-api-key`` header (Anthropic clients). The file is read again when it changes (its
size or modification time, looked at once a second at most); a file that no longer parses
keeps the tenants read before, with an error in the log. Tenant keys never reach the
engine: a configured proxy sends the engine its own key (``--engine-api-key``) instead.
Only digests of the keys are kept, and nothing but the tenant's name is ever shown.
"""

from __future__ import annotations

import logging
import os
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import blake3

from prefixpin.core.errors import ClientError
from prefixpin.proxy.ops.logs import log_event

ANONYMOUS = "anon"
CREDENTIAL_HEADERS = ("authorization", "x-api-key")
RELOAD_EVERY_S = 1.0
MAX_NAME_CHARS = 64


class UnauthorizedError(ClientError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class TenantsFileError(ValueError):
    """The tenants file does not parse, or says something impossible."""


@dataclass(frozen=True, slots=True)
class TenantTable:
    by_digest: Mapping[bytes, str]  # blake3 of a key -> its tenant's name
    names: frozenset[str]


def parse_tenants(text: str) -> TenantTable:
    """The tenants of a tenants file's text (sans-IO)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(f"not TOML: {exc}") from None
    section = data.get("tenants")
    if not isinstance(section, dict) or not section:
        raise TenantsFileError("no [tenants] table with at least one tenant")
    by_digest: dict[bytes, str] = {}
    for name, keys in section.items():
        if not name or len(name) > MAX_NAME_CHARS or name == ANONYMOUS:
            raise TenantsFileError(f"tenant name {name[:MAX_NAME_CHARS]!r}: 1 to "
                                   f"{MAX_NAME_CHARS} characters, and not {ANONYMOUS!r}")
        listed = [keys] if isinstance(keys, str) else keys
        if not isinstance(listed, list) or not listed or not all(
                isinstance(k, str) and k.strip() == k and k for k in listed):
            raise TenantsFileError(f"tenant {name}: a key, or a list of keys (non-empty "
                                   "strings without surrounding spaces)")
        for key in listed:
            digest = _digest(key)
            if by_digest.setdefault(digest, name) != name:
                raise TenantsFileError(f"one key is given to both {by_digest[digest]} and "
                                       f"{name}")
    return TenantTable(by_digest, frozenset(section))


def client_key(headers: Mapping[str, str]) -> str:
    """The key a request carries: its bearer token, else its ``x-api-key``; "" for none."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    bearer = token.strip() if scheme.lower() == "bearer" else ""
    return bearer or headers.get("x-api-key", "").strip()


def _digest(key: str) -> bytes:
    return blake3.blake3(key.encode()).digest()


class Tenants:
    """The configured tenants (none: one namespace for all), read again as the file
    changes."""

    def __init__(self, path: Path | None, logger: logging.Logger, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.log = logger
        self.clock = clock
        self._table: TenantTable | None = None
        self._stamp: tuple[int, int] | None = None
        self._checked = float("-inf")
        if path is not None:
            self._table = self._read(path)  # a bad file at start is an error (raises)

    @property
    def configured(self) -> bool:
        return self.path is not None

    @property
    def count(self) -> int:
        """How many tenants there are (1 without a tenants file: everyone is one)."""
        return len(self._current().names) if self._table is not None else 1

    def namespace_of(self, headers: Mapping[str, str]) -> str:
        """The request's namespace: its tenant's name, ``ANONYMOUS`` with no tenants
        configured. Raises ``UnauthorizedError`` for a missing or unknown key."""
        if self._table is None:
            return ANONYMOUS
        key = client_key(headers)
        if not key:
            raise UnauthorizedError("this prefixpin serves configured tenants only: send "
                                    "your key as a bearer token or in x-api-key")
        name = self._current().by_digest.get(_digest(key))
        if name is None:
            raise UnauthorizedError("unknown API key")
        return name

    def _current(self) -> TenantTable:
        assert self._table is not None
        assert self.path is not None
        now = self.clock()
        if now - self._checked >= RELOAD_EVERY_S:
            self._checked = now
            if _stamp_of(self.path) != self._stamp:
                try:
                    self._table = self._read(self.path)
                    log_event(self.log, logging.INFO, "tenants reloaded",
                              tenants=sorted(self._table.names))
                except (OSError, TenantsFileError) as exc:
                    self._stamp = _stamp_of(self.path)  # said once per change
                    log_event(self.log, logging.ERROR, "tenants file not reloaded",
                              path=str(self.path), error=str(exc),
                              reason="the tenants read before still apply")
        return self._table

    def _read(self, path: Path) -> TenantTable:
        self._stamp = _stamp_of(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise TenantsFileError(f"{path}: {exc.strerror}") from None
        return parse_tenants(text)


def _stamp_of(path: Path) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns

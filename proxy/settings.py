"""One typed settings object, read from flags and ``PREFIXPIN_*`` environment variables.

Nothing outside this module reads the environment. The CLI builds a ``Settings`` and hands
it to ``create_app``; tests build one directly.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Literal

import httpx
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prefixpin.adapters import h1
from prefixpin.core import compiled_relay
from prefixpin.proxy.listen import http_limits
from prefixpin.proxy.pipeline import generation

EngineName = Literal["auto", "llama-server", "ollama", "embedded"]


EMBEDDED = "embedded"  # an upstream value: the in-process engine as one lane among others


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PREFIXPIN_", extra="forbid", frozen=True)

    # Where requests go. No upstream: the embedded llama.cpp engine runs in process.
    upstream: str | None = Field(None, description="Base URL of llama-server or Ollama")
    engine: EngineName = Field("auto", description="Force the engine type instead of probing")
    host: str = "127.0.0.1"
    port: int = Field(8088, ge=1, le=65535)
    # The operator listener (status page, /sessions, /metrics, every engine path): off the
    # tenants' port. Default: loopback, the next port.
    admin_listen: str | None = Field(None, description="HOST:PORT of the operator listener "
                                     "(default 127.0.0.1:<port + 1>)")
    admin_token: SecretStr | None = Field(None, description="Bearer token every operator "
                                          "request must carry; required beyond loopback")
    # The engine's own API key (llama-server --api-key): sent as `Authorization: Bearer` on
    # the proxy's own requests (probes, tokenizer, template, slot files), never on a
    # client's, which carry the client's credentials. One for every upstream, unless the
    # upstreams file gives a URL its own (`api_key=`: upstream_api_keys).
    # Tenants (proxy.listen.tenants): none configured, one namespace for every client and key.
    tenants_file: Path | None = Field(None, description="TOML file of tenant names and their "
                                      "keys: only then are requests authenticated (401) and "
                                      "tenants isolated")
    engine_api_key: SecretStr | None = Field(None, description="API key of the engine(s) "
                                             "for the proxy's own requests")
    upstream_api_keys: dict[str, SecretStr] = Field(
        default_factory=dict, description="Engine base URL -> its API key, instead of "
        "engine_api_key (--upstreams-file api_key=)")

    # Relay behaviour.
    first_byte_ms: int = Field(100, ge=1, description="Headers and a first SSE comment by then")
    heartbeat_s: float = Field(2.0, gt=0, description="SSE comment interval while silent")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    max_bodies_bytes: int = Field(256 * 1024 * 1024, ge=1024, description="request-body "
                                  "bytes held at once across all connections of the tenant "
                                  "listener (each body reserves its Content-Length, or its "
                                  "bytes as they arrive, until it is parsed); a body that "
                                  "would pass it gets a 503 with Retry-After")
    # The event loop (uvloop where installed, or asyncio's own) and the engine connection's
    # HTTP/1.1 (httptools' C parser, adapters/h1.py, or httpx's pure-Python one).
    loop: Literal["auto", "asyncio"] = "auto"
    engine_http: Literal["httptools", "httpx"] = "httptools"
    max_json_values: int = Field(2_000_000, ge=1000, description="JSON values (separators) "
                                 "a request body may hold; past it a 413 before parsing")
    # An engine that sends more events than this in one reply (one that ignores max_tokens,
    # or floods) is cut off with an error event.
    max_reply_events: int = Field(131_072, ge=1024, description="events of one engine "
                                  "reply; past them the stream ends with an error")
    max_reply_bytes: int = Field(generation.MAX_REPLY_BYTES, ge=64 * 1024,
                                 description="event bytes of one engine reply; past them "
                                 "the stream ends with an error")
    # A reply's log is kept whole (a retry joins it from the start) for this many events;
    # past them, what every client read is folded into the reply's text (proxy.pipeline.generation).
    keep_reply_events: int = Field(8192, ge=256, description="events of a reply kept as "
                                   "they came, for a retry to join; past them the read "
                                   "ones are folded")
    # What an engine connection may make the proxy hold or wait for (adapters.h1: past
    # them the request fails with a 502, or a 504 for the head's time); the engine bytes
    # read per turn of the loop by the connections that flood at once, in the Python relay
    # and in the compiled one (per run); the relayed bytes the compiled relay holds for a
    # stream before Python takes them into its log.
    engine_head_bytes: int = Field(h1.MAX_HEAD_BYTES, ge=1024)
    engine_interim_responses: int = Field(h1.MAX_INTERIM_RESPONSES, ge=0)
    engine_head_timeout_s: float = Field(h1.HEAD_WITHIN_S, gt=0)
    engine_read_share: int = Field(h1.TURN_READ_BUDGET, ge=h1.MIN_READ)
    compiled_read_share: int = Field(compiled_relay.MAX_READ_PER_RUN,
                                     ge=compiled_relay.MIN_READ_PER_RUN)
    compiled_hold_bytes: int = Field(compiled_relay.MAX_RELAYED_HELD, ge=4096)
    # Each listener's connections, and the time a request's head and body may take
    # (proxy.listen.http_limits: past them a 503 or a 408, and the connection closed).
    max_connections: int = Field(2048, ge=1)
    head_timeout_s: float = Field(30.0, gt=0)
    body_timeout_s: float = Field(300.0, gt=0)
    max_body_chunks: int = Field(http_limits.MAX_BODY_CHUNKS, ge=1,
                                 description="chunks of one chunked request body; past "
                                 "them a 413 and close")
    max_messages: int = Field(100_000, ge=1)
    compiled_relay: bool = Field(True, description="Relay token events in compiled code "
                             "(core._relay) where it is built")
    keep_large_buffers: bool = Field(True, description="Fixed glibc malloc thresholds "
                                     "(proxy.listen.allocator): large buffers reused, not mapped "
                                     "and faulted in again")
    retry_grace_s: float = Field(30.0, ge=0, description="Keep a generation whose clients left")
    queue_timeout_s: float = Field(300.0, gt=0, description="Longest wait for a free slot")

    # Per-tenant bounds (issue 16): one namespace never crowds out the others.
    max_sessions: int = Field(4096, ge=1, description="Sessions kept in all")
    max_sessions_per_namespace: int = Field(1024, ge=1, description="Sessions kept per "
                                            "namespace (its least recently used go first)")
    max_committed_bytes_per_namespace: int = Field(
        256 * 1024**2, ge=1024, description="Committed history bytes kept per namespace")
    max_queued_per_namespace: int = Field(32, ge=1, description="Requests of one namespace "
                                          "waiting for a slot on one lane (then 429)")
    max_queued_per_lane: int = Field(256, ge=1, description="Requests waiting for a slot "
                                     "on one lane, all namespaces (then 429)")
    max_shared_sessions_per_namespace: int = Field(
        4096, ge=1, description="Session records per namespace in Redis (--redis)")

    # Upstream timeouts: connect is short; read bounds every silence of the engine (a
    # queued request gets no bytes until a slot frees, so it must allow a long wait).
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(900.0, gt=0)
    probe_timeout_s: float = Field(5.0, gt=0)
    health_interval_s: float = Field(5.0, gt=0, description="Engine probe interval (restarts)")

    # Rollback switches: each feature is an A/B arm of the same binary.
    affinity: bool = True
    repair: bool = True
    parking: bool = True

    # History repair policies (each also off with PREFIXPIN_REPAIR=0).
    repair_reasoning: bool = True
    repair_tool_calls: bool = True
    repair_tool_results: bool = True
    repair_window: bool = True
    repair_volatile: bool = True
    repair_tools: bool = True
    repair_reminders: bool = True
    repair_volatile_rules: list[str] = Field(default_factory=list,
                                             description="Extra volatile regexes (JSON list)")
    repair_budget: float = Field(0.85, gt=0, le=1, description="Share of per-slot context")

    # Embedded engine.
    model: Path | None = Field(None, description="GGUF file for the embedded engine")
    slots: int = Field(2, ge=1, le=64)
    ctx_size: int = Field(8192, ge=256, description="Context per slot (embedded engine)")
    threads: int | None = Field(None, ge=1)
    repack: Literal["auto", "on", "off"] = Field(
        "auto", description="llama.cpp's weight repacking (extra buffer types) in the embedded "
        "engine: auto turns it off where the library has its AMX kernels (core.cpu)")

    # Parking: park_dir must be the engine's --slot-save-path as this proxy sees it.
    park_dir: Path | None = None
    park_max_bytes: int = Field(8 * 1024**3, ge=0, description="Disk budget for parked files")
    park_min_tokens: int = Field(256, ge=1, description="Smaller histories are not parked")
    park_verify: Literal["full", "tokens"] = Field(
        "full", description="Check a park file's whole content (blake3) or its token list")
    park_ahead: bool = Field(True, description="On an engine short of slots, save a slot "
                             "after its turn while the engine is idle, so the next "
                             "request's eviction of it costs nothing")
    anchor: bool = Field(True, description="On recurrent/hybrid memory, before parking a slot "
                         "ahead, evaluate its session's next request's opening into it, so "
                         "that a restore is an extension (proxy.parking.anchor)")
    openings: bool = Field(True, description="Save what a namespace's new sessions share "
                           "(system prompt and tools) once and restore it into the slot a "
                           "new session or sub-agent gets (proxy.parking.openings)")
    opening_min_tokens: int = Field(1024, ge=1, description="Shorter openings are not saved")
    park_shared: bool = Field(False, description="Every engine's --slot-save-path is "
                              "park_dir (one directory for all engines and replicas): a "
                              "file one engine saved may be restored into another")
    park_index_dir: Path | None = Field(None, description="prefixpin's own directory for the "
                                        "sqlite park index (without --redis)")

    # Several backends and replicas (docs/backends.md).
    upstreams: list[str] = Field(default_factory=list,
                                 description="Further engine base URLs (several backends)")
    placement: Literal["affinity", "round-robin", "least-loaded"] = Field(
        "affinity", description="How a session picks its backend (the others: bench arms)")
    overload_queue: int = Field(4, ge=1, description="Requests queued for a slot on a "
                                "backend at which its sessions move elsewhere")
    overload_occupancy: float = Field(1.0, gt=0, description="Live sessions per slot at which "
                                      "a backend takes no new session while another has room")
    live_session_s: float = Field(600.0, gt=0, description="A session idle this long no "
                                  "longer counts towards its backend's occupancy")
    upstream_namespaces: dict[str, list[str]] = Field(
        default_factory=dict, description="Dedicated backends: engine base URL -> the only "
        "namespaces (as /sessions shows them) placed there (--upstreams-file namespace=)")
    allow_shared_cache: bool = Field(False, description="Let several namespaces share an "
                                     "engine whose prompt cache crosses slots (llama-server "
                                     "with --cache-ram > 0, Ollama): tenants may then learn "
                                     "each other's cached prefixes")
    redis: str | None = Field(None, description="Redis URL: state shared by several replicas")
    redis_prefix: str = Field("prefixpin", min_length=1, description="Redis key prefix")
    replica_id: str | None = Field(None, description="This replica's name (default: random)")

    # Identity.
    tokenizer: Path | None = Field(None, description="tokenizer.json or GGUF overriding /props")

    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("admin_listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            split_address(value)
        return value

    @field_validator("admin_token", "engine_api_key", mode="before")
    @classmethod
    def _no_empty_token(cls, value: object) -> object:
        """An empty token (``PREFIXPIN_ADMIN_TOKEN=``) is no token: it protects nothing."""
        return None if value == "" else value

    def engine_key_for(self, url: str) -> str | None:
        """The API key the proxy's own requests to the engine at ``url`` carry."""
        key = self.upstream_api_keys.get(url) or self.engine_api_key
        return key.get_secret_value() if key is not None else None

    def admin_address(self) -> tuple[str, int]:
        """Where the operator listener binds: ``admin_listen``, else loopback, ``port + 1``."""
        if self.admin_listen is None:
            return "127.0.0.1", self.port + 1 if self.port < 65535 else self.port - 1
        return split_address(self.admin_listen)

    def admin_display(self) -> str:
        """The operator listener as an operator would type it (IPv6 in brackets)."""
        host, port = self.admin_address()
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def admin_problem(self) -> str | None:
        """Why the operator listener must not start: bound beyond loopback without a token."""
        host, _ = self.admin_address()
        if self.admin_token is None and not is_loopback(host):
            return (f"--admin-listen {self.admin_display()} is reachable beyond loopback: "
                    "set --admin-token (env PREFIXPIN_ADMIN_TOKEN) to protect it")
        return None

    def repair_switches(self) -> dict[str, bool]:
        return {"reasoning": self.repair_reasoning, "tool_calls": self.repair_tool_calls,
                "tool_results": self.repair_tool_results, "window": self.repair_window,
                "volatile": self.repair_volatile, "tools": self.repair_tools,
                "reminders": self.repair_reminders}

    def backend_urls(self) -> list[str]:
        """Every engine base URL, ``upstream`` first, each once."""
        urls = [self.upstream] if self.upstream is not None else []
        return list(dict.fromkeys([*urls, *self.upstreams]))

    def embedded(self) -> bool:
        """The in-process engine is one of the lanes: no upstream at all, or ``embedded``
        given among them."""
        urls = self.backend_urls()
        return not urls or EMBEDDED in urls

    def several(self) -> bool:
        """Several backends, or state shared with other replicas: the routed path."""
        return len(self.backend_urls()) > 1 or self.redis is not None

    def slot_dir(self) -> Path:
        """Where the embedded engine saves slot files (parking uses it)."""
        base = self.park_dir or Path.home() / ".cache" / "prefixpin" / "park"
        path = base / "slots"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def upstream_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(
            connect=self.connect_timeout_s, read=self.read_timeout_s,
            write=self.read_timeout_s, pool=self.connect_timeout_s,
        )


def split_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as a host and a port."""
    host, sep, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def environment(name: str) -> str | None:
    """A variable read outside ``Settings`` (the doctor's defaults, the cache folder the
    default model and the test rig share), empty as unset: this module is the only one
    that reads the environment."""
    return os.environ.get(name) or None


def cache_root() -> Path:
    """Where downloaded models and built parts are kept: ``$PREFIXPIN_CACHE``, else
    ``~/.cache/prefixpin``."""
    configured = environment("PREFIXPIN_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "prefixpin"

"""One typed settings object, read from flags and ``PREFIXPIN_*`` environment variables.

Nothing outside this module reads the environment. The CLI builds a ``Settings`` and hands
it to ``create_app``; tests build one directly.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prefixpin.core.defaults import (
    HEAD_WITHIN_S,
    MAX_BODY_CHUNKS,
    MAX_HEAD_BYTES,
    MAX_INTERIM_RESPONSES,
    MAX_REPLY_BYTES,
    MIN_READ,
    TURN_READ_BUDGET,
)

if TYPE_CHECKING:
    import httpx

EngineName = Literal["auto", "llama-server", "ollama", "embedded"]


# The removed compiled relay's switch and bounds (``--compiled-relay``, ``--compiled-read-share``,
# ``--compiled-hold``): still accepted, with the defaults and bounds they had; they do nothing.
REMOVED = "; does nothing: the compiled relay was removed, the Python relay does it all"

EMBEDDED = "embedded"  # an upstream value: the in-process engine as one lane among others
ENV_PREFIX = "PREFIXPIN_"


@dataclass(frozen=True, slots=True)
class Flag:
    """Marks a setting as a ``prefixpin serve`` flag (``Annotated[int, Flag()]``): the CLI
    builds the flag from the field, its help from the field's description and default.

    ``name``: the flag, where it is not ``--`` and the field's name with dashes. ``unit``:
    how the default reads in the help (``32 MiB``, ``256 tokens``). ``repeat``: given once
    for each value, all of them collected (``--upstream``). A ``bool`` field is a switch,
    ``--X`` and ``--no-X``."""

    name: str = ""
    unit: Literal["", "bytes", "tokens"] = ""
    repeat: bool = False


BYTES = Flag(unit="bytes")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    # Where requests go. No upstream: the embedded llama.cpp engine runs in process.
    upstream: Annotated[str | None, Flag(repeat=True)] = Field(
        None, description="engine base URL (llama-server or Ollama); omit to run the "
        "embedded engine; repeat for several backends")
    engine: Annotated[EngineName, Flag()] = Field(
        "auto", description="the engine's type: auto (asked of each URL) | llama-server | "
        "ollama | embedded")
    host: Annotated[str, Flag()] = Field("127.0.0.1", description="listen address")
    port: Annotated[int, Flag()] = Field(8088, ge=1, le=65535, description="listen port")
    # The operator listener (status page, /sessions, /metrics, every engine path): off the
    # tenants' port. Default: loopback, the next port.
    admin_listen: Annotated[str | None, Flag()] = Field(
        None, description="HOST:PORT of the operator listener: status page, /sessions, "
        "/metrics and every engine path (default 127.0.0.1:<port+1>)")
    admin_token: Annotated[SecretStr | None, Flag()] = Field(
        None, description="bearer token every operator request must carry; required when "
        "--admin-listen is beyond loopback (env PREFIXPIN_ADMIN_TOKEN)")
    # Tenants (proxy.listen.tenants): none configured, one namespace for every client and key.
    tenants_file: Annotated[Path | None, Flag("--tenants")] = Field(
        None, description="TOML file of tenants and their keys ([tenants] name = \"key\" or "
        "[\"key\", ...]), read again when it changes: only then are requests authenticated "
        "(401) and tenants isolated; without it, every client and key is one namespace")
    # Browser pages on other origins (proxy.listen.cors): read as the engine reads its own.
    cors_origins: Annotated[str | None, Flag()] = Field(
        None, description="origins a browser page may call the tenant port from, read as "
        "the engine behind it reads its own: in front of llama-server its --cors-origins "
        "(localhost: http(s)://localhost, 127.0.0.1 and [::1] on any port; *: every origin; "
        "else a comma-separated list), in front of Ollama its OLLAMA_ORIGINS (added to "
        "Ollama's own list; * a wildcard). Default: localhost in front of llama-server, "
        "Ollama's own list in front of Ollama. The operator listener serves no other origin")
    # The engine's own API key: one for every upstream, unless the upstreams file gives a
    # URL its own (`api_key=`: upstream_api_keys).
    engine_api_key: Annotated[SecretStr | None, Flag()] = Field(
        None, description="the engine's API key (llama-server --api-key), sent as "
        "Authorization: Bearer on prefixpin's own requests (probes, tokenizer, slot files), "
        "and on clients' requests with --tenants (without, clients' requests carry their own "
        "credentials). One for every upstream; an upstreams-file line's api_key=KEY "
        "overrides it (env PREFIXPIN_ENGINE_API_KEY)")
    upstream_api_keys: dict[str, SecretStr] = Field(
        default_factory=dict, description="Engine base URL -> its API key, instead of "
        "engine_api_key (--upstreams-file api_key=)")

    # Relay behaviour.
    first_byte_ms: Annotated[int, Flag("--first-byte")] = Field(
        100, ge=1, description="ms until headers + first SSE comment")
    heartbeat_s: Annotated[float, Flag("--heartbeat")] = Field(
        2.0, gt=0, description="seconds between SSE heartbeats")
    max_body_bytes: Annotated[int, Flag("--max-body", unit="bytes")] = Field(
        32 * 1024 * 1024, ge=1024, description="largest request body in bytes")
    # Each body reserves its Content-Length, or its bytes as they arrive, until it is parsed.
    max_bodies_bytes: Annotated[int, Flag("--max-bodies", unit="bytes")] = Field(
        256 * 1024 * 1024, ge=1024, description="request-body bytes held at once across all "
        "tenant connections while bodies are read and parsed; a body that would pass it "
        "gets a 503 with Retry-After")
    # The event loop (uvloop where installed, or asyncio's own) and the engine connection's
    # HTTP/1.1 (httptools' C parser, adapters/h1.py, or httpx's pure-Python one).
    loop: Literal["auto", "asyncio"] = "auto"
    engine_http: Literal["httptools", "httpx"] = "httptools"
    max_json_values: Annotated[int, Flag()] = Field(
        2_000_000, ge=1000, description="JSON values a request body may hold, counted "
        "before it is parsed; past it a 413")
    # An engine that sends more events than this in one reply (one that ignores max_tokens,
    # or floods) is cut off with an error event.
    max_reply_events: Annotated[int, Flag()] = Field(
        131_072, ge=1024, description="events of one engine reply; past them the stream "
        "ends with an error event")
    max_reply_bytes: Annotated[int, BYTES] = Field(
        MAX_REPLY_BYTES, ge=64 * 1024, description="event bytes of one engine reply; past "
        "them the stream ends with an error event")
    # A reply's log is kept whole (a retry joins it from the start) for this many events;
    # past them, what every client read is folded into the reply's text
    # (proxy.pipeline.generation).
    keep_reply_events: Annotated[int, Flag()] = Field(
        8192, ge=256, description="events of a reply kept as they came, for a retry to join "
        "it from the start; past them what every client read is folded into the reply's text")
    # What an engine connection may make the proxy hold or wait for (adapters.h1: past
    # them the request fails with a 502, or a 504 for the head's time); the engine bytes
    # read per turn of the loop by the connections that flood at once.
    engine_head_bytes: Annotated[int, BYTES] = Field(
        MAX_HEAD_BYTES, ge=1024, description="bytes of an engine's response head (status "
        "line and headers); past them the request fails")
    engine_interim_responses: Annotated[int, Flag()] = Field(
        MAX_INTERIM_RESPONSES, ge=0, description="interim (1xx) responses an engine may "
        "send before its answer")
    engine_head_timeout_s: Annotated[float, Flag("--engine-head-timeout")] = Field(
        HEAD_WITHIN_S, gt=0, description="seconds an engine's response head may take from "
        "its first byte")
    engine_read_share: Annotated[int, BYTES] = Field(
        TURN_READ_BUDGET, ge=MIN_READ, description="engine bytes read per turn of the loop "
        "by the connections that flood at once, split between them, at least "
        f"{MIN_READ >> 10} KiB each")
    compiled_read_share: Annotated[int, BYTES] = Field(
        16 * 1024, ge=4096, description="engine bytes per run of the compiled relay" + REMOVED)
    compiled_hold_bytes: Annotated[int, Flag("--compiled-hold", unit="bytes")] = Field(
        64 * 1024, ge=4096, description="relayed bytes the compiled relay kept for a stream"
        + REMOVED)
    # Each listener's connections, and the time a request's head and body may take
    # (proxy.listen.http_limits: past them a 503 or a 408, and the connection closed).
    max_connections: Annotated[int, Flag()] = Field(
        2048, ge=1, description="open connections per listener; past it a 503 and close")
    head_timeout_s: Annotated[float, Flag("--head-timeout")] = Field(
        30.0, gt=0, description="seconds a request's line and headers may take from their "
        "first byte; then a 408 and close")
    body_timeout_s: Annotated[float, Flag("--body-timeout")] = Field(
        300.0, gt=0, description="seconds a request's body may take after its head; then a "
        "408 and close")
    max_body_chunks: Annotated[int, Flag()] = Field(
        MAX_BODY_CHUNKS, ge=1, description="chunks of one chunked request body "
        "(Transfer-Encoding: chunked); past them a 413 and close")
    max_messages: int = Field(100_000, ge=1)
    compiled_relay: Annotated[bool, Flag()] = Field(
        True, description="relay streamed token events in compiled code" + REMOVED)
    # Fixed glibc malloc thresholds (proxy.speed.allocator).
    keep_large_buffers: Annotated[bool, Flag()] = Field(
        True, description="keep the memory of large buffers (socket reads, request bodies) "
        "in glibc's heap for reuse, with up to 64 MiB of it free, instead of mapping each "
        "anew: every fresh page is a fault the loop waits for")
    retry_grace_s: Annotated[float, Flag("--retry-grace")] = Field(
        30.0, ge=0, description="seconds a generation outlives its clients so a resend can "
        "join it")
    queue_timeout_s: Annotated[float, Flag("--queue-timeout")] = Field(
        300.0, gt=0, description="longest wait for a slot")

    # Per-tenant bounds (issue 16): one namespace never crowds out the others.
    max_sessions: Annotated[int, Flag()] = Field(
        4096, ge=1, description="sessions kept in all; when full, the least recently used "
        "of the namespace holding the most goes")
    max_sessions_per_namespace: Annotated[int, Flag()] = Field(
        1024, ge=1, description="sessions kept per namespace (bearer token); its own least "
        "recently used go first")
    max_committed_bytes_per_namespace: Annotated[int, BYTES] = Field(
        256 * 1024**2, ge=1024, description="committed history bytes kept per namespace; "
        "its least recently used go first")
    max_queued_per_namespace: Annotated[int, Flag()] = Field(
        32, ge=1, description="requests of one namespace waiting for a slot on one engine; "
        "the next gets a 429 queue_full_namespace")
    max_queued_per_lane: Annotated[int, Flag()] = Field(
        256, ge=1, description="requests of all namespaces waiting for a slot on one engine; "
        "the next gets a 429 queue_full_lane")
    max_shared_sessions_per_namespace: Annotated[int, Flag()] = Field(
        4096, ge=1, description="with --redis: session records one namespace keeps in "
        "Redis; past it its least recently used are deleted")

    # Upstream timeouts: connect is short; read bounds every silence of the engine (a
    # queued request gets no bytes until a slot frees, so it must allow a long wait).
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: Annotated[float, Flag("--read-timeout")] = Field(
        900.0, gt=0, description="longest engine silence")
    probe_timeout_s: float = Field(5.0, gt=0)
    health_interval_s: float = Field(5.0, gt=0, description="Engine probe interval (restarts)")

    # Rollback switches: each feature is an A/B arm of the same binary.
    affinity: Annotated[bool, Flag()] = Field(True, description="session affinity on/off")
    repair: Annotated[bool, Flag()] = Field(True, description="history repair on/off")
    parking: Annotated[bool, Flag()] = Field(True, description="parking on/off")

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
    model: Annotated[Path | None, Flag()] = Field(
        None, description="GGUF for the embedded engine (default SmolLM2-135M)")
    slots: Annotated[int, Flag()] = Field(2, ge=1, le=64, description="embedded engine slots")
    ctx_size: Annotated[int, Flag()] = Field(
        8192, ge=256, description="embedded engine context per slot")
    threads: Annotated[int | None, Flag()] = Field(
        None, ge=1, description="embedded engine threads")
    # llama.cpp's weight repacking (extra buffer types); core.cpu knows the AMX kernels.
    repack: Annotated[Literal["auto", "on", "off"], Flag()] = Field(
        "auto", description="embedded engine weight repacking: auto (off where llama.cpp "
        "has its AMX kernels, which crash), on, off")

    # Parking: park_dir must be the engine's --slot-save-path as this proxy sees it.
    park_dir: Annotated[Path | None, Flag()] = Field(
        None, description="directory for parked sessions: the engine's --slot-save-path as "
        "this proxy sees it")
    park_max_bytes: Annotated[int, BYTES] = Field(
        8 * 1024**3, ge=0, description="disk budget for parked sessions, LRU")
    park_min_tokens: Annotated[int, Flag(unit="tokens")] = Field(
        256, ge=1, description="smallest history worth parking")
    park_verify: Annotated[Literal["full", "tokens"], Flag()] = Field(
        "full", description="full (blake3 of the whole file) | tokens (size and token list "
        "only)")
    park_ahead: Annotated[bool, Flag()] = Field(
        True, description="on an engine short of slots, save a session's slot after its "
        "turn while the engine is otherwise idle, so the next session's request finds it "
        "parked already instead of saving it first")
    # proxy.parking.anchor
    anchor: Annotated[bool, Flag()] = Field(
        True, description="on recurrent/hybrid memory (Qwen3.5, Qwen3-Next, ...), before "
        "parking a slot ahead, evaluate its session's next request's opening into it, so a "
        "restore is an extension")
    # proxy.parking.openings
    openings: Annotated[bool, Flag()] = Field(
        True, description="save what a namespace's new sessions share (system prompt and "
        "tools) once, and restore it into the slot a new session or sub-agent gets, so it "
        "prefills only what differs")
    opening_min_tokens: Annotated[int, Flag(unit="tokens")] = Field(
        1024, ge=1, description="shortest opening (system prompt and tools) worth saving for "
        "a namespace's new sessions")
    park_shared: Annotated[bool, Flag()] = Field(
        False, description="every engine's --slot-save-path is --park-dir, one directory "
        "for all engines and replicas: a session parked by one engine may be restored into "
        "another running the same model; off, each engine saves into its own")
    park_index_dir: Annotated[Path | None, Flag()] = Field(
        None, description="prefixpin's own directory for the park index without --redis "
        "(default: one per park directory under ~/.cache/prefixpin/park-index)")

    # Several backends and replicas (docs/backends.md).
    upstreams: list[str] = Field(default_factory=list,
                                 description="Further engine base URLs (several backends)")
    placement: Annotated[Literal["affinity", "round-robin", "least-loaded"], Flag()] = Field(
        "affinity", description="affinity | round-robin | least-loaded: how a request picks "
        "its backend among several")
    overload_queue: Annotated[int, Flag()] = Field(
        4, ge=1, description="requests queued for a slot at which a backend's sessions move "
        "elsewhere")
    overload_occupancy: Annotated[float, Flag()] = Field(
        1.0, gt=0, description="live sessions per slot at which a backend takes no new "
        "session while another has room")
    live_session_s: float = Field(600.0, gt=0, description="A session idle this long no "
                                  "longer counts towards its backend's occupancy")
    upstream_namespaces: dict[str, list[str]] = Field(
        default_factory=dict, description="Dedicated backends: engine base URL -> the only "
        "namespaces (as /sessions shows them) placed there (--upstreams-file namespace=)")
    allow_shared_cache: Annotated[bool, Flag()] = Field(
        False, description="let several namespaces (bearer tokens) share an engine whose "
        "prompt cache crosses slots (llama-server with --cache-ram above 0, its default; "
        "every Ollama). This gives up tenant isolation: a tenant may then learn another's "
        "cached prefixes (system prompts, documents) from cached_tokens; off, a second "
        "namespace on such an engine is refused")
    redis: Annotated[str | None, Flag()] = Field(
        None, description="Redis URL (redis://host:port/db): sessions, slot leases, homes "
        "and in-flight generations shared by several replicas (env PREFIXPIN_REDIS; needs "
        "the `replicas` extra)")
    redis_prefix: Annotated[str, Flag()] = Field(
        "prefixpin", min_length=1, description="prefix of every Redis key")
    replica_id: Annotated[str | None, Flag()] = Field(
        None, description="this replica's name in Redis (default: random)")

    # Identity.
    tokenizer: Annotated[Path | None, Flag()] = Field(
        None, description="tokenizer.json or GGUF for fingerprints")

    log_level: Annotated[Literal["debug", "info", "warning", "error"], Flag()] = Field(
        "info", description="debug | info | warning | error")

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
        import httpx  # here: reading the settings loads no HTTP client

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

"""``prefixpin``: a thin shell over ``Settings`` (flags override ``PREFIXPIN_*`` variables)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from pydantic import ValidationError

from prefixpin.core import compiled_relay
from prefixpin.proxy.listen import http_limits
from prefixpin.proxy.pipeline import generation
from prefixpin.proxy.settings import Settings

# flag -> (settings field, type, help). Every flag defaults to "not given", so the
# environment and the Settings defaults apply unless the flag is on the command line.
SERVE_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--upstream": ("upstream", str, "engine base URL (llama-server or Ollama); "
                   "omit to run the embedded engine"),
    "--engine": ("engine", str, "auto | llama-server | ollama | embedded"),
    "--host": ("host", str, "listen address (default 127.0.0.1)"),
    "--port": ("port", int, "listen port (default 8088)"),
    "--admin-listen": ("admin_listen", str, "HOST:PORT of the operator listener: status page, "
                       "/sessions, /metrics and every engine path (default 127.0.0.1:<port+1>)"),
    "--admin-token": ("admin_token", str, "bearer token every operator request must carry; "
                      "required when --admin-listen is beyond loopback (env "
                      "PREFIXPIN_ADMIN_TOKEN)"),
    "--engine-api-key": ("engine_api_key", str, "the engine's API key (llama-server "
                         "--api-key), sent as Authorization: Bearer on prefixpin's own "
                         "requests (probes, tokenizer, slot files), and on clients' requests "
                         "with --tenants (without, clients' requests carry their own "
                         "credentials). One for every upstream; an upstreams-file line's "
                         "api_key=KEY overrides it (env PREFIXPIN_ENGINE_API_KEY)"),
    "--tenants": ("tenants_file", str, "TOML file of tenants and their keys ([tenants] "
                  "name = \"key\" or [\"key\", ...]), read again when it changes: only "
                  "then are requests authenticated (401) and tenants isolated; without it, "
                  "every client and key is one namespace"),
    "--first-byte": ("first_byte_ms", int, "ms until headers + first SSE comment (default 100)"),
    "--heartbeat": ("heartbeat_s", float, "seconds between SSE heartbeats (default 2)"),
    "--max-body": ("max_body_bytes", int, "largest request body in bytes (default 32 MiB)"),
    "--max-bodies": ("max_bodies_bytes", int, "request-body bytes held at once across all "
                     "tenant connections while bodies are read and parsed; a body that would "
                     "pass it gets a 503 with Retry-After (default 256 MiB)"),
    "--max-json-values": ("max_json_values", int, "JSON values a request body may hold, "
                          "counted before it is parsed; past it a 413 (default 2,000,000)"),
    "--max-reply-events": ("max_reply_events", int, "events of one engine reply; past "
                           "them the stream ends with an error event (default 131,072)"),
    "--max-reply-bytes": ("max_reply_bytes", int, "event bytes of one engine reply; past "
                          "them the stream ends with an error event "
                          f"(default {generation.MAX_REPLY_BYTES >> 20} MiB)"),
    "--keep-reply-events": ("keep_reply_events", int, "events of a reply kept as they came, "
                            "for a retry to join it from the start; past them what every "
                            "client read is folded into the reply's text (default 8192)"),
    "--max-connections": ("max_connections", int, "open connections per listener; past it "
                          "a 503 and close (default 2048)"),
    "--head-timeout": ("head_timeout_s", float, "seconds a request's line and headers may "
                       "take from their first byte; then a 408 and close (default 30)"),
    "--body-timeout": ("body_timeout_s", float, "seconds a request's body may take after "
                       "its head; then a 408 and close (default 300)"),
    "--engine-head-bytes": ("engine_head_bytes", int, "bytes of an engine's response head "
                            "(status line and headers); past them the request fails "
                            "(default 1 MiB)"),
    "--engine-interim-responses": ("engine_interim_responses", int, "interim (1xx) "
                                   "responses an engine may send before its answer "
                                   "(default 8)"),
    "--engine-head-timeout": ("engine_head_timeout_s", float, "seconds an engine's response "
                              "head may take from its first byte (default 30)"),
    "--engine-read-share": ("engine_read_share", int, "engine bytes read per turn of the "
                            "loop by the connections that flood at once, split between "
                            "them, at least 2 KiB each (default 16 KiB)"),
    "--compiled-read-share": ("compiled_read_share", int, "the same, per run of the "
                              "compiled relay, each flood in turn; a stream that is not "
                              f"flooding reads {compiled_relay.MIN_READ_PER_RUN >> 10} KiB "
                              f"besides (default {compiled_relay.MAX_READ_PER_RUN >> 10} KiB)"),
    "--compiled-hold": ("compiled_hold_bytes", int, "relayed bytes the compiled relay keeps "
                        "for a stream before delivering them to its log; the relay keeps the "
                        f"stream (default {compiled_relay.MAX_RELAYED_HELD >> 10} KiB)"),
    "--max-body-chunks": ("max_body_chunks", int, "chunks of one chunked request body "
                          "(Transfer-Encoding: chunked); past them a 413 and close "
                          f"(default {http_limits.MAX_BODY_CHUNKS})"),
    "--retry-grace": ("retry_grace_s", float, "seconds a generation outlives its clients "
                      "so a resend can join it (default 30)"),
    "--queue-timeout": ("queue_timeout_s", float, "longest wait for a slot (default 300)"),
    "--read-timeout": ("read_timeout_s", float, "longest engine silence (default 900)"),
    "--max-sessions": ("max_sessions", int, "sessions kept in all; when full, the least "
                       "recently used of the namespace holding the most goes (default 4096)"),
    "--max-sessions-per-namespace": ("max_sessions_per_namespace", int, "sessions kept per "
                                     "namespace (bearer token); its own least recently used "
                                     "go first (default 1024)"),
    "--max-committed-bytes-per-namespace": ("max_committed_bytes_per_namespace", int,
                                            "committed history bytes kept per namespace; its "
                                            "least recently used go first (default 256 MiB)"),
    "--max-queued-per-namespace": ("max_queued_per_namespace", int, "requests of one "
                                   "namespace waiting for a slot on one engine; the next gets "
                                   "a 429 queue_full_namespace (default 32)"),
    "--max-queued-per-lane": ("max_queued_per_lane", int, "requests of all namespaces "
                              "waiting for a slot on one engine; the next gets a 429 "
                              "queue_full_lane (default 256)"),
    "--max-shared-sessions-per-namespace": (
        "max_shared_sessions_per_namespace", int, "with --redis: session records one "
        "namespace keeps in Redis; past it its least recently used are deleted (default 4096)"),
    "--model": ("model", str, "GGUF for the embedded engine (default SmolLM2-135M)"),
    "--slots": ("slots", int, "embedded engine slots (default 2)"),
    "--ctx-size": ("ctx_size", int, "embedded engine context per slot (default 8192)"),
    "--threads": ("threads", int, "embedded engine threads"),
    "--repack": ("repack", str, "embedded engine weight repacking: auto (off where llama.cpp "
                 "has its AMX kernels, which crash), on, off (default auto)"),
    "--park-dir": ("park_dir", str, "directory for parked sessions: the engine's "
                   "--slot-save-path as this proxy sees it"),
    "--park-max-bytes": ("park_max_bytes", int, "disk budget for parked sessions, LRU "
                         "(default 8 GiB)"),
    "--park-min-tokens": ("park_min_tokens", int, "smallest history worth parking "
                          "(default 256 tokens)"),
    "--opening-min-tokens": ("opening_min_tokens", int, "shortest opening (system prompt "
                             "and tools) worth saving for a namespace's new sessions "
                             "(default 1024 tokens)"),
    "--park-verify": ("park_verify", str, "full (blake3 of the whole file, default) | tokens "
                      "(size and token list only)"),
    "--park-index-dir": ("park_index_dir", str, "prefixpin's own directory for the park "
                         "index without --redis (default: one per park directory under "
                         "~/.cache/prefixpin/park-index)"),
    "--redis": ("redis", str, "Redis URL (redis://host:port/db): sessions, slot leases, homes and "
                "in-flight generations shared by several replicas (env PREFIXPIN_REDIS; "
                "needs the `replicas` extra)"),
    "--redis-prefix": ("redis_prefix", str, "prefix of every Redis key (default prefixpin)"),
    "--replica-id": ("replica_id", str, "this replica's name in Redis (default: random)"),
    "--placement": ("placement", str, "affinity (default) | round-robin | least-loaded: how "
                    "a request picks its backend among several"),
    "--overload-queue": ("overload_queue", int, "requests queued for a slot at which a "
                         "backend's sessions move elsewhere (default 4)"),
    "--overload-occupancy": ("overload_occupancy", float, "live sessions per slot at which a "
                             "backend takes no new session while another has room (default 1)"),
    "--tokenizer": ("tokenizer", str, "tokenizer.json or GGUF for fingerprints"),
    "--log-level": ("log_level", str, "debug | info | warning | error"),
}
SWITCHES = {"affinity": "session affinity", "repair": "history repair", "parking": "parking"}
# Off unless given (--no-X turns them off again), but park-ahead (on unless --no-park-ahead).
OPTIONS = {"park-ahead": ("park_ahead", "on an engine short of slots, save a session's slot "
                          "after its turn while the engine is otherwise idle, so the next "
                          "session's request finds it parked already instead of saving it "
                          "first (default on; env PREFIXPIN_PARK_AHEAD=0)"),
           "anchor": ("anchor", "on recurrent/hybrid memory (Qwen3.5, Qwen3-Next, ...), "
                      "before parking a slot ahead, evaluate its session's next request's "
                      "opening into it, so a restore is an extension (default on; env "
                      "PREFIXPIN_ANCHOR=0)"),
           "openings": ("openings", "save what a namespace's new sessions share (system "
                        "prompt and tools) once, and restore it into the slot a new session "
                        "or sub-agent gets, so it prefills only what differs (default on; env "
                        "PREFIXPIN_OPENINGS=0)"),
           "allow-shared-cache": ("allow_shared_cache", "let several namespaces (bearer "
                                  "tokens) share an engine whose prompt cache crosses slots "
                                  "(llama-server with --cache-ram above 0, its default; every "
                                  "Ollama). This gives up tenant isolation: a tenant may then "
                                  "learn another's cached prefixes (system prompts, documents) "
                                  "from cached_tokens (default off: a second namespace on such "
                                  "an engine is refused; env PREFIXPIN_ALLOW_SHARED_CACHE=1)"),
           "compiled-relay": ("compiled_relay", "relay streamed token events between the engine's "
                          "socket and the client's in compiled code (core/_relay.c, built on "
                          "Linux by the install; without it, or with --no-compiled-relay, the "
                          "Python relay does it all) (default on; env "
                          "PREFIXPIN_COMPILED_RELAY=0)"),
           "keep-large-buffers": ("keep_large_buffers", "keep the memory of large buffers "
                                  "(socket reads, request bodies) in glibc's heap for reuse, "
                                  "with up to 64 MiB of it free, instead of mapping each anew: "
                                  "every fresh page is a fault the loop waits for (default on; "
                                  "env PREFIXPIN_KEEP_LARGE_BUFFERS=0)"),
           "park-shared": ("park_shared", "every engine's --slot-save-path is --park-dir, one "
                           "directory for all engines and replicas: a session parked by one "
                           "engine may be restored into another running the same model "
                           "(default off: per-engine save directories; env "
                           "PREFIXPIN_PARK_SHARED=1)")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixpin", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the proxy",
                                argument_default=argparse.SUPPRESS)
    for flag, (field, kind, text) in SERVE_FLAGS.items():
        if flag == "--upstream":  # repeated: several backends
            serve.add_argument(flag, dest=field, action="append", help=text + "; repeat for "
                               "several backends")
            continue
        serve.add_argument(flag, dest=field, type=kind, help=text)
    serve.add_argument("--upstreams-file", dest="upstreams_file", help="file with one engine "
                       "base URL a line (# comments): backends besides --upstream; a URL "
                       "followed by namespace=NS[,NS...] serves only those namespaces (as "
                       "/sessions shows them)")
    for name, text in SWITCHES.items():
        serve.add_argument(f"--{name}", dest=name, action=argparse.BooleanOptionalAction,
                           help=f"{text} on/off (env PREFIXPIN_{name.upper()}=0 turns it off)")
    for name, (field, text) in OPTIONS.items():
        serve.add_argument(f"--{name}", dest=field, action=argparse.BooleanOptionalAction,
                           help=text)
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

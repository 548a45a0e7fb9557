"""What can be known about a running llama-server besides its HTTP answers: its flags and
its model file. ``prefixpin doctor`` judges them; parking reads them to know what a
restored slot is worth (``proxy.parking.limits``).

1. The server's own command line and ``LLAMA_ARG_*`` environment, when the upstream is a
   loopback address and ``/proc`` shows which process listens on its port (same host, and
   permission to read it); the binary's ``--help`` then gives this build's defaults.
2. The GGUF metadata, when ``/props.model_path`` (or the server's ``-m``) is a readable file
   here: sliding window, recurrent layers, and the KV bytes a full slot takes.

Everything here is blocking I/O (``/proc``, a subprocess, the model file): the proxy runs it
in a thread.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

# ---------------------------------------------------------------- the llama-server flags

@dataclass(frozen=True, slots=True)
class FlagSpec:
    names: tuple[str, ...]
    kind: Literal["int", "float", "str", "bool", "switch"]
    env: str | None = None
    negs: tuple[str, ...] = ()


FLAG_SPECS: dict[str, FlagSpec] = {
    "n_parallel": FlagSpec(("-np", "--parallel"), "int", "LLAMA_ARG_N_PARALLEL"),
    "kv_unified": FlagSpec(("-kvu", "--kv-unified"), "bool", "LLAMA_ARG_KV_UNIFIED",
                           ("-no-kvu", "--no-kv-unified")),
    "cache_ram": FlagSpec(("-cram", "--cache-ram"), "int", "LLAMA_ARG_CACHE_RAM"),
    "cache_idle_slots": FlagSpec(("--cache-idle-slots",), "bool", "LLAMA_ARG_CACHE_IDLE_SLOTS",
                                 ("--no-cache-idle-slots",)),
    "swa_full": FlagSpec(("--swa-full",), "switch", "LLAMA_ARG_SWA_FULL"),
    "repack": FlagSpec(("--repack",), "bool", "LLAMA_ARG_REPACK", ("-nr", "--no-repack")),
    "ctx_shift": FlagSpec(("--context-shift",), "bool", "LLAMA_ARG_CONTEXT_SHIFT",
                          ("--no-context-shift",)),
    "metrics": FlagSpec(("--metrics",), "switch", "LLAMA_ARG_ENDPOINT_METRICS"),
    "slot_save_path": FlagSpec(("--slot-save-path",), "str"),
    "cache_prompt": FlagSpec(("--cache-prompt",), "bool", "LLAMA_ARG_CACHE_PROMPT",
                             ("--no-cache-prompt",)),
    "slot_similarity": FlagSpec(("-sps", "--slot-prompt-similarity"), "float"),
    "endpoint_slots": FlagSpec(("--slots",), "bool", "LLAMA_ARG_ENDPOINT_SLOTS", ("--no-slots",)),
    "ctx_size": FlagSpec(("-c", "--ctx-size"), "int", "LLAMA_ARG_CTX_SIZE"),
    "cache_type_k": FlagSpec(("-ctk", "--cache-type-k"), "str", "LLAMA_ARG_CACHE_TYPE_K"),
    "cache_type_v": FlagSpec(("-ctv", "--cache-type-v"), "str", "LLAMA_ARG_CACHE_TYPE_V"),
    "ctx_checkpoints": FlagSpec(("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"), "int",
                                "LLAMA_ARG_CTX_CHECKPOINTS"),
    "checkpoint_min_step": FlagSpec(("-cms", "--checkpoint-min-step"), "int",
                                    "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT"),
    "model": FlagSpec(("-m", "--model"), "str", "LLAMA_ARG_MODEL"),
    "host": FlagSpec(("--host",), "str", "LLAMA_ARG_HOST"),
    "port": FlagSpec(("--port",), "int", "LLAMA_ARG_PORT"),
}
TRUTHY, FALSEY = {"on", "enabled", "true", "1"}, {"off", "disabled", "false", "0"}


@dataclass(slots=True)
class ServerFlags:
    """Flags of a running llama-server: what was set, and this build's defaults."""

    source: str
    explicit: dict[str, str | bool] = field(default_factory=dict)
    defaults: dict[str, str] = field(default_factory=dict)
    known: set[str] = field(default_factory=set)  # flags this build's --help lists
    cwd: Path | None = None  # the engine's working directory (relative paths are its own)

    def value(self, key: str) -> str | bool | None:
        if key in self.explicit:
            return self.explicit[key]
        return self.defaults.get(key)

    def is_set(self, key: str) -> bool:
        return key in self.explicit

    def boolean(self, key: str) -> bool | None:
        raw = self.value(key)
        if isinstance(raw, bool) or raw is None:
            return raw
        text = raw.strip().lower()
        return True if text in TRUTHY else False if text in FALSEY else None

    def number(self, key: str) -> float | None:
        raw = self.value(key)
        if raw is None or isinstance(raw, bool):
            return None
        try:
            return float(raw.split(",")[0])
        except ValueError:
            return None

    def np_auto(self) -> bool:
        """``-np auto`` (-1): llama-server picks the slot count and unifies the KV cache."""
        n_parallel = self.number("n_parallel")
        return n_parallel is not None and n_parallel < 0

    def unified_kv(self) -> bool:
        """One KV pool for all slots: ``-np auto``, or ``--kv-unified`` given (without it,
        unified KV follows -np: on for auto, off when explicit)."""
        return self.np_auto() or bool(self.is_set("kv_unified") and self.boolean("kv_unified"))

    def idle_slot_caching(self) -> bool | None:
        """``--cache-idle-slots`` (None: not known); builds from before the flag never
        clear idle slots."""
        if self.known and "cache_idle_slots" not in self.known:
            return False
        return self.boolean("cache_idle_slots")

    def clears_idle_slots(self) -> bool | None:
        """Whether starting a request saves the other idle slots to host RAM and empties
        them (unified KV with idle-slot caching and a RAM cache); None: not known."""
        if not self.unified_kv():
            return False
        caching = self.idle_slot_caching()
        if caching is None:
            return None
        return caching and self.number("cache_ram") != 0

    def slot_save_path(self) -> Path | None:
        value = self.value("slot_save_path")
        if not isinstance(value, str) or not value:
            return None
        path = Path(value)
        return self.cwd / path if self.cwd is not None and not path.is_absolute() else path


def parse_llama_args(argv: Sequence[str], env: Mapping[str, str], source: str) -> ServerFlags:
    """The flags of ``argv`` (binary first) over the ``LLAMA_ARG_*`` variables, as
    llama-server applies them: the environment first, the command line overrides."""
    flags = ServerFlags(source)
    for key, spec in FLAG_SPECS.items():
        if spec.env is None:
            continue
        if spec.negs and spec.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_") in env:
            flags.explicit[key] = False
        elif spec.env in env:
            raw = env[spec.env]
            flags.explicit[key] = (raw.lower() in TRUTHY) if spec.kind == "switch" else raw
    by_name = {name: (key, True) for key, spec in FLAG_SPECS.items() for name in spec.names}
    by_name |= {name: (key, False) for key, spec in FLAG_SPECS.items() for name in spec.negs}
    args = list(argv[1:])
    i = 0
    while i < len(args):
        name, _, inline = args[i].partition("=")
        i += 1
        if name not in by_name:
            continue
        key, positive = by_name[name]
        kind = FLAG_SPECS[key].kind
        if kind in ("bool", "switch"):
            flags.explicit[key] = positive
        elif inline:
            flags.explicit[key] = inline
        elif i < len(args):
            flags.explicit[key] = args[i]
            i += 1
    return flags


_DEFAULT = re.compile(r"\(default:\s*([^)\s,]+)")


def parse_help_defaults(help_text: str) -> tuple[dict[str, str], set[str]]:
    """This build's default for each flag we care about, from ``llama-server --help``,
    and which of those flags the build knows at all."""
    blocks: list[str] = []
    for line in help_text.splitlines():
        if line.startswith("-"):
            blocks.append(line)
        elif blocks and line.startswith(" "):
            blocks[-1] += " " + line.strip()
    defaults: dict[str, str] = {}
    known: set[str] = set()
    for block in blocks:
        head = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", block.split("  ")[0]))
        for key, spec in FLAG_SPECS.items():
            if head & set(spec.names):
                known.add(key)
                match = _DEFAULT.search(block)
                if match:
                    defaults[key] = match.group(1)
    return defaults, known


# ---------------------------------------------------------------- the process on this host

def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
    return inodes


def _pid_owning(inodes: set[str]) -> int | None:
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        return int(proc.name)
    return None


def _help_of(executable: str) -> str:
    try:
        done = subprocess.run([executable, "--help"], capture_output=True, timeout=15,
                              stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (done.stdout + done.stderr).decode(errors="replace")


def local_server_flags(url: str) -> ServerFlags | None:
    """The flags of the llama-server process serving ``url``, if it runs on this host and
    we may read its ``/proc`` entries; None otherwise (remote, container, other user)."""
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    pid = _pid_owning(_listening_inodes(port))
    if pid is None:
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    argv = [a for a in argv if a]
    if not argv or "llama" not in Path(argv[0]).name:
        return None  # e.g. docker-proxy in front of a container: its flags are not ours
    env: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for item in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0"):
            name, sep, value = item.partition("=")
            if sep and name.startswith("LLAMA_ARG_"):
                env[name] = value
    flags = parse_llama_args(argv, env, f"command line of process {pid}")
    with contextlib.suppress(OSError):
        flags.cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    with contextlib.suppress(OSError):
        flags.defaults, flags.known = parse_help_defaults(_help_of(os.readlink(f"/proc/{pid}/exe")))
    return flags


# ---------------------------------------------------------------- the model file

# Bytes per element of the KV cache types (block size 32 for the quantized ones).
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32,
                 "q5_0": 22 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}


@dataclass(frozen=True, slots=True)
class ModelFacts:
    architecture: str
    sliding_window: int  # 0: full attention
    recurrent: bool  # SSM / RWKV state: cannot roll back without checkpoints
    n_ctx_train: int | None
    kv_elements_per_token: int | None  # K+V elements across layers (full-size, upper bound)


def model_facts(metadata: Mapping[str, Any]) -> ModelFacts:
    arch = str(metadata.get("general.architecture", "unknown"))

    def get(name: str) -> Any:
        return metadata.get(f"{arch}.{name}")

    layers, heads, embd = get("block_count"), get("attention.head_count"), get("embedding_length")
    kv_heads = get("attention.head_count_kv") or heads
    elements: int | None = None
    if isinstance(layers, int) and isinstance(heads, int) and isinstance(embd, int) and heads:
        key_len = int(get("attention.key_length") or embd // heads)
        value_len = int(get("attention.value_length") or key_len)
        per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
        elements = sum(int(h) for h in per_layer) * (key_len + value_len)
    recurrent = any(k.startswith((f"{arch}.ssm.", f"{arch}.wkv.", f"{arch}.rwkv."))
                    for k in metadata)
    window = get("attention.sliding_window")
    ctx = get("context_length")
    return ModelFacts(arch, int(window) if isinstance(window, int) else 0, recurrent,
                      int(ctx) if isinstance(ctx, int) else None, elements)


def read_model(props: Mapping[str, Any],
               flags: ServerFlags | None) -> tuple[ModelFacts | None, str]:
    """The GGUF facts of the model the server loaded (``/props.model_path``, else its
    ``-m``), and a note saying where they came from or why they are missing."""
    path = props.get("model_path") or (flags.value("model") if flags else None)
    if not isinstance(path, str) or not path:
        return None, "the server does not say which model file it loaded"
    if not Path(path).is_file():
        return None, f"{path} is not readable here (another host or container?)"
    # Imported here: gguf pulls in numpy, which `prefixpin serve` does not need at start.
    from prefixpin.fingerprint.gguf_metadata import GgufFormatError, read_metadata

    try:
        return model_facts(read_metadata(path)), f"GGUF metadata of {path}"
    except (OSError, GgufFormatError, ValueError) as exc:
        return None, f"{path}: {exc}"


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What this host can read about one engine: its flags (None: not readable here) and
    its model's GGUF facts (None: see ``model_note``)."""

    flags: ServerFlags | None
    model: ModelFacts | None
    model_note: str


def read_engine_facts(url: str | None, props: Mapping[str, Any]) -> EngineFacts:
    """The flags of the server at ``url`` (None: do not look) and its model's facts."""
    return engine_facts_of(local_server_flags(url) if url else None, props)


def engine_facts_of(flags: ServerFlags | None, props: Mapping[str, Any]) -> EngineFacts:
    """The facts of an engine whose flags were read already (None: not readable here)."""
    model, note = read_model(props, flags)
    return EngineFacts(flags, model, note)

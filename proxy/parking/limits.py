"""What the engine allows: when a restored slot is reused at all.

A file is restored only into a request whose messages repeat the parked history exactly
and add to it (or resend it); a rewound or diverged request never restores. A restore
clears the slot's context checkpoints (research note §3). Measured with Gemma 3 (sliding
window, no ``--swa-full``): llama-server reuses such a slot only through a checkpoint, so
it re-processes a restored slot from the first token even for an exact extension; parking
is off for such a model when the engine's flags are readable, and pauses itself after two
restores the engine did not reuse when they are not. For recurrent/hybrid memory a restore
only helps when the request's tokens extend all the file's tokens, which is checked (the
engine's template and tokenizer) before restoring. The embedded engine keeps context
checkpoints in its slot files (``adapters.embedded.model.checkpoints``), so a restored
slot rolls back there as a live one does: its limits are those of full attention.

llama-server's own host-RAM cache (``--cache-ram``) keeps working beside this: it copies a
slot's state when a pinned request displaces it and can load it back by itself; parking
writes to disk only what the proxy evicts and restores only into the slot it hands to a
returning session, so the two never act on the same slot at once.

The engine's flags and its model's GGUF facts are read by ``proxy.engine.engine_facts`` (which
``prefixpin doctor`` reads too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefixpin.adapters.base import EngineInfo
from prefixpin.proxy.engine.engine_facts import ServerFlags, engine_facts_of, local_server_flags
from prefixpin.proxy.settings import Settings


@dataclass(frozen=True, slots=True)
class EngineLimits:
    sliding_window: int = 0  # 0: full attention, or --swa-full
    recurrent: bool = False  # hybrid / recurrent memory: no rollback without checkpoints
    cache_ram_mib: float | None = None  # llama-server's host-RAM cache; None: unknown / none
    clears_idle_slots: bool = False  # unified KV + --cache-idle-slots empties idle slots
    slot_save_path: Path | None = None  # from the engine's command line, when readable
    flags_known: bool = False  # the engine's command line was read (--swa-full is known)
    source: str = "engine probe"

    @property
    def restores_reprocessed(self) -> bool:
        """Sliding window without --swa-full: llama-server re-processes every prompt on a
        restored slot, even an exact extension (measured with Gemma 3: every reuse of a
        sliding-window slot goes through a context checkpoint, and a restore clears them)."""
        return self.sliding_window > 0

    @property
    def exact_extension_only(self) -> bool:
        """Recurrent/hybrid memory: a restored slot serves a prompt only if the prompt's
        tokens extend *all* the tokens it holds (any rewind needs a checkpoint)."""
        return self.recurrent and not self.sliding_window

    @property
    def memory(self) -> str:
        if self.sliding_window:
            return f"sliding-window attention ({self.sliding_window} tokens)"
        return "recurrent/hybrid memory" if self.recurrent else "full attention"

    def notes(self) -> list[str]:
        out = []
        if self.restores_reprocessed:
            swa = ("without --swa-full" if self.flags_known
                   else "and llama-server may run without --swa-full (its flags are not "
                        "readable here): if restores are not reused, parking stops itself")
            out.append(f"the model uses {self.memory} {swa}: a restored slot has no context "
                       "checkpoints and llama-server re-processes it from the first token")
        if self.exact_extension_only:
            out.append(f"the model uses {self.memory}: a restored slot has no context "
                       "checkpoints, so a file is restored only when the request's tokens "
                       "extend all the tokens it holds")
        if self.cache_ram_mib:
            ram = "no limit" if self.cache_ram_mib < 0 else f"{self.cache_ram_mib:.0f} MiB"
            out.append(f"llama-server keeps its own host-RAM prompt cache (--cache-ram {ram}); "
                       "parking keeps what outlives it (restarts, more than fits in RAM)")
        if self.clears_idle_slots:
            out.append("llama-server empties idle slots (unified KV with --cache-idle-slots): "
                       "a slot may be empty by the time it is parked; such parks are skipped")
        return out


def engine_limits(settings: Settings, info: EngineInfo, url: str | None = None) -> EngineLimits:
    """Sliding window, recurrent memory and the RAM cache of the engine at ``url`` (default
    ``settings.upstream``): from its command line and GGUF when this host can read them
    (blocking: run it in a thread)."""
    target = url or settings.upstream
    flags = local_server_flags(target) if target and info.engine != "embedded" else None
    return limits_from(info, flags)


def limits_from(info: EngineInfo, flags: ServerFlags | None) -> EngineLimits:
    """The same, from flags read already (None: not readable here); the GGUF is read here
    (blocking: run it in a thread)."""
    if info.engine == "embedded":
        return EngineLimits(source="embedded engine (full-size SWA cache, context "
                                   "checkpoints in its slot files, no RAM cache)")
    facts = engine_facts_of(flags, info.props)
    window, recurrent, source = info.n_swa, False, "engine probe"
    if facts.model is not None:
        window, recurrent = facts.model.sliding_window, facts.model.recurrent
        source = "GGUF metadata"
    flags = facts.flags
    if flags is None:
        return EngineLimits(window, recurrent, source=source)
    if flags.boolean("swa_full"):
        window = 0
    cache_ram = flags.number("cache_ram")
    return EngineLimits(
        window, recurrent, cache_ram if cache_ram != 0 else None,
        clears_idle_slots=bool(flags.clears_idle_slots()),
        slot_save_path=flags.slot_save_path(), flags_known=True,
        source=f"{source} and {flags.source}")

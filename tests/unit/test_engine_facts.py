"""Facts read from a running engine's command line (shared by parking and doctor)."""

from __future__ import annotations

from pathlib import Path

from prefixpin.proxy.engine.engine_facts import parse_llama_args


def test_a_relative_slot_save_path_is_the_engines_own() -> None:
    """llama-server resolves ``--slot-save-path slots`` against its own working directory,
    not the proxy's."""
    flags = parse_llama_args(["llama-server", "--slot-save-path", "slots"], {}, "test")
    flags.cwd = Path("/srv/engine")
    assert flags.slot_save_path() == Path("/srv/engine/slots")
    absolute = parse_llama_args(["llama-server", "--slot-save-path", "/data/slots"], {}, "test")
    absolute.cwd = Path("/srv/engine")
    assert absolute.slot_save_path() == Path("/data/slots")

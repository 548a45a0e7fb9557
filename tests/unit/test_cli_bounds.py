"""The per-namespace bounds and the engine connections' bounds are flags too, and each
reaches its setting and what enforces it."""

from __future__ import annotations

import pytest

from prefixpin.proxy.cli import SERVE_FLAGS, build_parser, settings_from_args
from prefixpin.proxy.settings import Settings

BOUNDS = {
    "--max-sessions": ("max_sessions", 17),
    "--max-sessions-per-namespace": ("max_sessions_per_namespace", 5),
    "--max-committed-bytes-per-namespace": ("max_committed_bytes_per_namespace", 4096),
    "--max-queued-per-namespace": ("max_queued_per_namespace", 3),
    "--max-queued-per-lane": ("max_queued_per_lane", 9),
    "--max-shared-sessions-per-namespace": ("max_shared_sessions_per_namespace", 11),
    "--max-body-chunks": ("max_body_chunks", 64),
    "--engine-head-bytes": ("engine_head_bytes", 4096),
    "--engine-interim-responses": ("engine_interim_responses", 2),
    "--engine-head-timeout": ("engine_head_timeout_s", 1.5),
    "--engine-read-share": ("engine_read_share", 8192),
    "--compiled-read-share": ("compiled_read_share", 32768),
    "--compiled-hold": ("compiled_hold_bytes", 32768),
    "--max-reply-bytes": ("max_reply_bytes", 1 << 20),
}


@pytest.mark.parametrize("flag", sorted(BOUNDS))
def test_each_bound_flag_reaches_its_setting(flag: str) -> None:
    field, value = BOUNDS[flag]
    assert SERVE_FLAGS[flag][0] == field
    args = build_parser().parse_args(["serve", "--upstream", "http://z:1", flag, str(value)])
    settings = settings_from_args(args)
    assert getattr(settings, field) == value
    default = Settings.model_fields[field].default
    assert default != value
    # The other bounds keep their defaults: one flag sets one field.
    for other, _ in BOUNDS.values():
        if other != field:
            assert getattr(settings, other) == Settings.model_fields[other].default


def test_all_bounds_at_once_reach_the_session_store_and_queue_gate() -> None:
    from prefixpin.proxy.session.placement import QueueGate
    from prefixpin.proxy.session.sessions import SessionStore

    argv = ["serve", "--upstream", "http://z:1"]
    for flag, (_, value) in BOUNDS.items():
        argv += [flag, str(value)]
    settings = settings_from_args(build_parser().parse_args(argv))
    store = SessionStore.from_settings(settings)
    assert (store._max, store._max_ns, store._max_bytes) == (17, 5, 4096)
    gate = QueueGate(max_queued=settings.max_queued_per_lane,
                     max_queued_per_namespace=settings.max_queued_per_namespace)
    assert (gate.max_queued, gate.max_queued_per_namespace) == (9, 3)


def test_a_bound_below_its_minimum_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from prefixpin.proxy.cli import main

    assert main(["serve", "--upstream", "http://z:1", "--max-queued-per-lane", "0"]) == 2
    assert "max_queued_per_lane" in capsys.readouterr().err


def test_the_engine_bounds_reach_the_engine_connections() -> None:
    from prefixpin.adapters.h1 import EngineBounds
    from prefixpin.proxy.engine.engines import engine_bounds

    argv = ["serve", "--upstream", "http://z:1"]
    for flag, (_, value) in BOUNDS.items():
        argv += [flag, str(value)]
    settings = settings_from_args(build_parser().parse_args(argv))
    assert engine_bounds(settings) == EngineBounds(
        head_bytes=4096, interim_responses=2, head_within_s=1.5, read_share=8192)

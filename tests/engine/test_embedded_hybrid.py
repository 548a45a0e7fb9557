"""The embedded engine on hybrid recurrent memory: context checkpoints, live and parked.

The model is the rig's tiny random-weight ``qwen35`` (``tests.rig.tiny_models``): its text
is noise; its cache mechanics are real (Qwen3.5's gated delta-net layers beside full
attention, run by llama.cpp through llama-cpp-python, with Qwen3.5's chat template, which
opens a reply with ``<think>`` and renders a past reply without it).

Recurrent memory cannot drop its last tokens: without a checkpoint, a next prompt that
leaves the slot's tokens before their end (a reply sent back changed, a regenerate) is
prefilled from its first token. The engine checkpoints each prompt 4 tokens before its
end (as llama-server does) and writes the newest checkpoint into the slot file, so the
same holds after a save and a restore, and through the proxy's parking.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakes.servers import serve_in_thread
from tests.rig.parts import require_llama_cpp
from tests.rig.tiny_models import ensure_tiny_model

require_llama_cpp()  # the embedded extra: skips, or fails under CI

from prefixpin.adapters.embedded import EngineConfig, create_engine_app  # noqa: E402
from prefixpin.adapters.embedded.model.checkpoints import CHECKPOINT_BEFORE_END  # noqa: E402

pytestmark = pytest.mark.embedded

Json = dict[str, Any]
N_CTX = 2048
N_BATCH = 64


@pytest.fixture(scope="module")
def model_path() -> Path:
    return ensure_tiny_model("qwen35-tiny")


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def engine_url(model_path: Path, slot_dir: Path) -> Iterator[str]:
    config = EngineConfig(model_path, n_slots=2, n_ctx=N_CTX, n_batch=N_BATCH,
                          slot_save_path=slot_dir, n_threads=2, show_progress=False)
    with serve_in_thread(create_engine_app(config)) as url:
        yield url


@pytest.fixture
def client(engine_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine_url, timeout=120) as http:
        yield http


def opening(topic: str) -> list[Json]:
    """A unique system prompt long enough to checkpoint, then a user turn."""
    return [{"role": "system", "content": f"Session {uuid.uuid4().hex[:8]}: "
                                          + f"notes on {topic}, " * 40},
            {"role": "user", "content": f"Tell me about {topic}."}]


def chat(client: httpx.Client, messages: list[Json], slot: int) -> Json:
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "id_slot": slot}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    result: Json = response.json()
    return result


def reply_of(result: Json) -> str:
    content = result["choices"][0]["message"].get("content") or ""
    return str(content)


def changed_follow_up(messages: list[Json], reply: str) -> list[Json]:
    """The reply kept as received when the user interrupted it (its first half), then the
    next user turn."""
    return [*messages, {"role": "assistant", "content": reply[: len(reply) // 2]},
            {"role": "user", "content": "Go on, but shorter."}]


def slot_action(client: httpx.Client, slot: int, action: str, filename: str = "") -> Json:
    body = {"filename": filename} if filename else {}
    response = client.post(f"/slots/{slot}", params={"action": action}, json=body)
    assert response.status_code == 200, response.text
    result: Json = response.json()
    return result


def prompt_tokens(result: Json) -> int:
    return int(result["timings"]["cache_n"] + result["timings"]["prompt_n"])


# -- live slots ---------------------------------------------------------------------------


def test_a_changed_last_reply_rolls_back_to_the_prompts_checkpoint(
        client: httpx.Client) -> None:
    """The follow-up leaves the slot's tokens inside the last reply (and Qwen3.5's
    template drops the reply's ``<think>`` opening): the slot rolls back to its checkpoint
    4 tokens before the first prompt's end and prefills only what follows."""
    first_messages = opening("rivers")
    first = chat(client, first_messages, slot=0)
    follow_up = chat(client, changed_follow_up(first_messages, reply_of(first)), slot=0)
    assert follow_up["timings"]["cache_n"] == prompt_tokens(first) - CHECKPOINT_BEFORE_END


def test_a_regenerate_rolls_back_and_answers_as_the_first_time(client: httpx.Client) -> None:
    """An identical resend of a finished turn: the slot holds the old reply after the
    prompt; it rolls back to the checkpoint, and greedy decoding gives the same reply."""
    messages = opening("maples")
    first = chat(client, messages, slot=1)
    again = chat(client, messages, slot=1)
    assert again["timings"]["cache_n"] == prompt_tokens(first) - CHECKPOINT_BEFORE_END
    assert reply_of(again) == reply_of(first)


# -- slot files ---------------------------------------------------------------------------


def test_a_restored_slot_keeps_its_checkpoint(client: httpx.Client, slot_dir: Path) -> None:
    """Save, erase, restore: the file carries the checkpoint after llama.cpp's state, and
    the changed follow-up rolls back to it as on the live slot, answering as a cold slot
    does on the same prompt."""
    first_messages = opening("copper")
    first = chat(client, first_messages, slot=0)
    saved = slot_action(client, 0, "save", "hybrid.bin")
    slot_action(client, 0, "erase")
    chat(client, opening("lanterns"), slot=0)  # the slot serves someone else meanwhile
    restored = slot_action(client, 0, "restore", "hybrid.bin")
    messages = changed_follow_up(first_messages, reply_of(first))
    warm = chat(client, messages, slot=0)
    slot_action(client, 1, "erase")
    cold = chat(client, messages, slot=1)

    assert restored["n_read"] == saved["n_written"] == (slot_dir / "hybrid.bin").stat().st_size
    assert warm["timings"]["cache_n"] == prompt_tokens(first) - CHECKPOINT_BEFORE_END
    assert cold["timings"]["cache_n"] == 0
    assert reply_of(warm) == reply_of(cold)


def test_a_damaged_checkpoint_trailer_is_refused(client: httpx.Client, slot_dir: Path) -> None:
    """A file cut inside its checkpoint is refused as llama-server refuses a damaged state
    file (the proxy then re-prefills), never rolled back to."""
    chat(client, opening("orbits"), slot=1)
    slot_action(client, 1, "save", "cut.bin")
    path = slot_dir / "cut.bin"
    path.write_bytes(path.read_bytes()[:-100])
    response = client.post("/slots/1", params={"action": "restore"},
                           json={"filename": "cut.bin"})
    assert response.status_code == 400, response.text
    assert "checkpoint" in response.json()["error"]["message"]
    assert client.get("/slots").json()[1]["n_prompt_tokens"] == 0


# -- through the proxy: parked and restored -----------------------------------------------


class Session:
    """One conversation through the proxy, under its own session key."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.messages = opening(f"{name}'s garden")
        self.results: list[Json] = []

    async def turn(self, client: httpx.AsyncClient) -> Json:
        response = await client.post(
            "/v1/chat/completions", headers={"x-session-id": self.name},
            json={"messages": self.messages, "max_tokens": 12, "temperature": 0})
        assert response.status_code == 200, response.text
        result: Json = response.json()
        self.results.append(result)
        return result

    def send_back(self, reply: str) -> None:
        self.messages += [{"role": "assistant", "content": reply},
                          {"role": "user", "content": f"And then, {len(self.results)}?"}]


def interrupted(session: Session, reply: str) -> None:
    session.send_back(reply[: len(reply) // 2])  # the part the client received


def edited(session: Session, reply: str) -> None:
    session.send_back(f"(edited) {reply[::-1]}")


def echoed(session: Session, reply: str) -> None:
    session.send_back(reply)


def regenerated(session: Session, reply: str) -> None:
    """The same request again: the slot it was parked from held the old reply."""


def usage(result: Json) -> tuple[int, int]:
    """(prompt tokens, cached tokens) as the proxy reports them."""
    figures = result["usage"]
    return int(figures["prompt_tokens"]), int(figures["prompt_tokens_details"]["cached_tokens"])


async def returning_after_two_others(model_path: Path, park: Path,
                                     comes_back: Callable[[Session, str], None]
                                     ) -> tuple[Session, float]:
    """One slot: A's first turn, then B's and C's (each takes the slot: A is parked), then
    A's next request, made by ``comes_back`` from A's reply. Returns A, its results kept,
    and the restores the proxy counted."""
    from prefixpin.proxy.listen.app import create_apps
    from prefixpin.proxy.settings import Settings
    from tests.app.conftest import clients_of
    from tests.app.test_parking import metric

    config = Settings(model=model_path, slots=1, ctx_size=N_CTX, threads=2, park_dir=park,
                      park_min_tokens=64, park_ahead=False)
    apps = create_apps(config)
    a, others = Session("A"), [Session("B"), Session("C")]
    async with apps.tenant.router.lifespan_context(apps.tenant), clients_of(
            apps, timeout=300) as client:
        reply = reply_of(await a.turn(client))
        for other in others:
            await other.turn(client)
        comes_back(a, reply)
        await a.turn(client)
        restores = await metric(client, "prefixpin_restores_total", outcome="restored")
    return a, restores


@pytest.mark.anyio
@pytest.mark.parametrize("comes_back", [interrupted, edited, regenerated, echoed],
                         ids=["interrupted", "edited", "regenerated", "echoed"])
async def test_a_parked_session_whose_reply_comes_back_changed_prefills_only_the_change(
        model_path: Path, tmp_path: Path, comes_back: Callable[[Session, str], None]) -> None:
    """A's reply comes back changed after two other sessions took its slot: its file is
    restored with its checkpoint, and A's turn prefills from 4 tokens before its first
    prompt's end (the reply as the client has it, the new user turn), not the
    conversation. An echoed reply too: Qwen3.5's template renders it without the
    ``<think>`` the prompt ended with, so it also rolls back to the checkpoint."""
    a, restores = await returning_after_two_others(model_path, tmp_path, comes_back)
    first_prompt, _ = usage(a.results[0])
    prompt, cached = usage(a.results[1])
    assert restores == 1
    assert cached == first_prompt - CHECKPOINT_BEFORE_END
    assert prompt - cached < 0.25 * prompt, (prompt, cached)

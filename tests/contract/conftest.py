"""One contract suite, every engine adapter: the same calls, the same cache figures.

The llama-server arm is the real llama-server built by the rig; the embedded arm is the
in-process llama.cpp engine. Both run SmolLM2 with small prefill batches, so a prompt of a
few hundred tokens is prefilled in several batches and a disconnect can land mid-prefill.

The Ollama arms (its OpenAI-compatible API, and the same calls on its native ``/api/chat``)
run against the recorded-format fake Ollama (``tests.fakes.fake_ollama``): Ollama cannot
be installed on these machines. The fake prefills in batches of the same size, slowly
enough for a disconnect to land mid-prefill, and counts cached tokens as llama-server under
Ollama 0.33.3 and later reports them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import httpx
import pytest

from prefixpin.adapters.base import Adapter, UpstreamCall
from prefixpin.adapters.llama_server import LlamaServerAdapter
from prefixpin.adapters.ollama import OllamaAdapter
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_ollama import FakeModel, FakeOllamaConfig, create_fake_ollama
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.models import ensure_model

BATCH = 64
TIMEOUT = httpx.Timeout(connect=5, read=300, write=60, pool=5)
OLLAMA_MODEL = "smollm2:135m"


class NativeOllamaAdapter(OllamaAdapter):
    """The contract's OpenAI-style calls sent to Ollama's native ``/api/chat`` instead, as
    an Ollama-native client sends them (``max_tokens`` as ``options.num_predict``)."""

    def prepare(self, path: str, body: Mapping[str, Any], *, slot: int | None) -> UpstreamCall:
        native = {k: v for k, v in body.items() if k not in ("max_tokens", "temperature")}
        native["options"] = {"num_predict": body.get("max_tokens"),
                             "temperature": body.get("temperature")}
        return super().prepare("/api/chat" if path.endswith("chat/completions") else path,
                               native, slot=slot)


@pytest.fixture(scope="session")
def contract_llama() -> Iterator[LlamaServerProcess]:
    with run_llama_server("smollm2", slots=2, ctx_per_slot=4096,
                          extra=["-b", str(BATCH), "-ub", str(BATCH), "--cache-ram", "0"]
                          ) as handle:
        yield handle


@pytest.fixture(params=[pytest.param("llama-server", marks=pytest.mark.llama),
                        pytest.param("embedded", marks=pytest.mark.embedded),
                        "ollama", "ollama-native"])
async def adapter(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                  ) -> AsyncIterator[Adapter]:
    if request.param.startswith("ollama"):
        fake = create_fake_ollama(FakeOllamaConfig(
            models=(FakeModel(OLLAMA_MODEL),), num_parallel=2, batch_tokens=BATCH,
            prefill_seconds_per_token=0.002, decode_seconds_per_token=0.001,
            load_seconds=0.05))
        http = httpx.AsyncClient(base_url="http://fake-ollama", timeout=TIMEOUT,
                                 transport=StreamingASGITransport(fake))
        kind = NativeOllamaAdapter if request.param == "ollama-native" else OllamaAdapter
        ollama = kind(http)
        await ollama.probe()
        yield ollama
        await ollama.aclose()
        return
    if request.param == "llama-server":
        server: LlamaServerProcess = request.getfixturevalue("contract_llama")
        http = httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT)
        llama = LlamaServerAdapter(http)
        for slot in range(2):
            await llama.erase_slot(slot)
        yield llama
        await llama.aclose()
        return
    from prefixpin.adapters.embedded import EmbeddedAdapter, EngineConfig

    config = EngineConfig(model_path=ensure_model("smollm2"), n_slots=2, n_ctx=4096,
                          n_batch=BATCH, slot_save_path=tmp_path_factory.mktemp("slots"),
                          show_progress=False)
    embedded = await EmbeddedAdapter.open(config, TIMEOUT)
    yield embedded
    await embedded.aclose()

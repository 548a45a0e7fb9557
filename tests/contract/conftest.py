"""One contract suite, every engine adapter: the same calls, the same cache figures.

The llama-server arm is the real llama-server built by the rig; the embedded arm is the
in-process llama.cpp engine. Both run SmolLM2 with small prefill batches, so a prompt of a
few hundred tokens is prefilled in several batches and a disconnect can land mid-prefill.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from adapters.base import Adapter
from adapters.llama_server import LlamaServerAdapter
from proxy.rig.llama_process import LlamaServerProcess, run_llama_server
from proxy.rig.models import ensure_model

BATCH = 64
TIMEOUT = httpx.Timeout(connect=5, read=300, write=60, pool=5)


@pytest.fixture(scope="session")
def contract_llama() -> Iterator[LlamaServerProcess]:
    with run_llama_server("smollm2", slots=2, ctx_per_slot=4096,
                          extra=["-b", str(BATCH), "-ub", str(BATCH), "--cache-ram", "0"]
                          ) as handle:
        yield handle


@pytest.fixture(params=[pytest.param("llama-server", marks=pytest.mark.llama),
                        pytest.param("embedded", marks=pytest.mark.embedded)])
async def adapter(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                  ) -> AsyncIterator[Adapter]:
    if request.param == "llama-server":
        server: LlamaServerProcess = request.getfixturevalue("contract_llama")
        http = httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT)
        llama = LlamaServerAdapter(http)
        for slot in range(2):
            await llama.erase_slot(slot)
        yield llama
        await llama.aclose()
        return
    from adapters.embedded import EmbeddedAdapter, EngineConfig

    config = EngineConfig(model_path=ensure_model("smollm2"), n_slots=2, n_ctx=4096,
                          n_batch=BATCH, slot_save_path=tmp_path_factory.mktemp("slots"),
                          show_progress=False)
    embedded = await EmbeddedAdapter.open(config, TIMEOUT)
    yield embedded
    await embedded.aclose()

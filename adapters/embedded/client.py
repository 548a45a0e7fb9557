"""The proxy's side of the embedded engine: the llama-server adapter over the worker's
Unix socket, with the supervisor that keeps the worker running."""

from __future__ import annotations

import httpx

from prefixpin.adapters.embedded.adapter import EngineConfig
from prefixpin.adapters.embedded.supervisor import EngineSupervisor
from prefixpin.adapters.llama_server import LlamaServerAdapter


class EmbeddedAdapter(LlamaServerAdapter):
    """The embedded engine, driven exactly as a real llama-server is driven."""

    name = "embedded"

    def __init__(self, supervisor: EngineSupervisor, http: httpx.AsyncClient) -> None:
        super().__init__(http)
        self.supervisor = supervisor

    @classmethod
    async def open(cls, config: EngineConfig, http_timeout: httpx.Timeout) -> EmbeddedAdapter:
        """Start the worker (the model loaded, the socket bound) and connect to it."""
        supervisor = EngineSupervisor(config)
        try:
            await supervisor.start()
        except BaseException:
            await supervisor.aclose()
            raise
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        transport = httpx.AsyncHTTPTransport(uds=str(supervisor.socket_path), limits=limits)
        http = httpx.AsyncClient(base_url="http://embedded", timeout=http_timeout,
                                 transport=transport)
        return cls(supervisor, http)

    def fault(self) -> str | None:
        return self.supervisor.fault()

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.supervisor.aclose()

"""The embedded engine: llama.cpp in process (llama-cpp-python), speaking llama-server's HTTP.

``EmbeddedAdapter`` is the proxy's way in: it drives the engine with the llama-server
adapter over a Unix socket to the engine's worker process, so that a crash in llama.cpp
ends the worker, never the proxy. The modules, in the order a completion meets them
(the last two serve all of them):

- ``client``: ``EmbeddedAdapter``, the proxy's side;
- ``supervisor``: the worker process started, watched and restarted after a crash;
- ``worker``: the worker's entry point (``python -m adapters.embedded.worker``);
- ``cpu_paths``: which of llama.cpp's CPU paths the engine takes (chosen once at start);
- ``adapter``: ``EngineConfig``, ``EmbeddedEngine`` (one model, ``n_slots`` slots, their
  jobs) and ``create_engine_app``; the differences from llama-server;
- ``http``: llama-server's routes, status codes, error bodies and SSE responses;
- ``request``: the request fields read with llama-server's leniency (``CompletionOptions``);
- ``chat``: the GGUF's Jinja chat template rendered as llama-server renders it (jinja2);
- ``llama``: the typed layer over llama-cpp-python's ctypes bindings: library, model,
  llama.cpp's log, tokenizer;
- ``slots``: slots and their worker threads, llama-server's slot choice, slot state files;
- ``job``: one running completion, bridging its slot's thread and the event loop;
- ``generate``: the completion itself: prefix reuse, batched prefill, sampling, stop words;
- ``context``: a slot's ``llama_context`` (decode, KV cache, state files) and sampler chain;
- ``checkpoints``: context checkpoints of recurrent/hybrid memory, kept per slot and
  written into its state file;
- ``wire``: the events rendered as llama-server's result objects and stream chunks;
- ``facts``: what the engine says about itself (``/props``, ``/v1/models``, ``/metrics``)
  and llama.cpp's rule for slot file names;
- ``errors``: the exception tree and llama-server's error types.

Importing this package loads neither llama-cpp-python nor jinja2: the bindings are
imported when a model is loaded (``llama.load_bindings``), the template module when the
engine starts, so the proxy's light install (no ``embedded`` extra) can import it.
"""

from prefixpin.adapters.embedded.adapter import EmbeddedEngine, EngineConfig, create_engine_app
from prefixpin.adapters.embedded.client import EmbeddedAdapter
from prefixpin.adapters.embedded.errors import (
    ApiError,
    ContextSizeError,
    EmbeddedEngineError,
    EngineBackendError,
    ModelLoadError,
)
from prefixpin.adapters.embedded.model.llama import check_gguf_file

__all__ = [
    "ApiError",
    "ContextSizeError",
    "EmbeddedAdapter",
    "EmbeddedEngine",
    "EmbeddedEngineError",
    "EngineBackendError",
    "EngineConfig",
    "ModelLoadError",
    "check_gguf_file",
    "create_engine_app",
]

"""What the embedded engine reports about itself, in llama-server's shapes: ``/props``,
``/v1/models``, ``/metrics``; and llama.cpp's rule for slot file names."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prefixpin.adapters.embedded.api.request import sampling_params_json
from prefixpin.adapters.embedded.model.context import SamplingParams

if TYPE_CHECKING:
    from prefixpin.adapters.embedded.api.seam import EngineSurface

# The llama-server counters /metrics reports (server-task.cpp, to_metrics), with its help.
METRIC_HELP = {
    "prompt_tokens_total": "Number of prompt tokens processed, excluding cached tokens",
    "prompt_tokens_cached_total": "Number of prompt tokens reused from the cache",
    "prompt_seconds_total": "Total time spent processing prompts",
    "tokens_predicted_total": "Number of generation tokens processed",
    "tokens_predicted_seconds_total": "Total time spent generating tokens",
}


def fs_validate_filename(filename: str) -> bool:
    """llama.cpp's fs_validate_filename (common/common.cpp), without subdirectories."""
    if not filename or len(filename.encode("utf-8", "surrogatepass")) > 255:
        return False
    for char in filename:
        code = ord(char)
        if (code <= 0x1F or code == 0x7F or 0x80 <= code <= 0x9F
                or code in (0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF)
                or 0xD800 <= code <= 0xDFFF or char in ':*?"<>|/\\'):
            return False
    if filename[0] == " " or filename[-1] in " .":
        return False
    return ".." not in filename and filename != "."


def template_caps(source: str) -> dict[str, bool]:
    """Rough ``chat_template_caps``: llama-server probes the template by rendering test
    conversations; here the template's text is searched for the variables it would use."""
    return {
        "supports_object_arguments": "arguments|items" in source or "arguments.items" in source,
        "supports_parallel_tool_calls": "tool_calls" in source,
        "supports_preserve_reasoning": "preserve_reasoning" in source,
        "supports_reasoning_effort": "reasoning_effort" in source,
        "supports_string_content": True,
        "supports_system_role": True,
        "supports_tool_calls": "tool_calls" in source,
        "supports_tools": "tools" in source,
        "supports_typed_content": False,
    }


def server_props(engine: EngineSurface) -> dict[str, Any]:
    """GET /props (server-context.cpp, get_res_props)."""
    info = engine.info
    return {
        "default_generation_settings": {
            "params": sampling_params_json(SamplingParams()),
            "n_ctx": engine.n_ctx_slot,
        },
        "total_slots": len(engine.pool.slots),
        "model_alias": engine.model_name,
        "model_ftype": info.ftype,
        "model_path": str(engine.config.model_path),
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": engine.media_marker,
        "endpoint_slots": True,
        "endpoint_props": False,
        "endpoint_metrics": True,
        "ui": False,
        "ui_settings": {},
        "chat_template": engine.template.source,
        "chat_template_caps": template_caps(engine.template.source),
        "bos_token": info.bos_token,
        "eos_token": info.eos_token,
        "build_info": engine.build_info,
        "is_sleeping": False,
        "cors_proxy_enabled": False,
    }


def server_models(engine: EngineSurface) -> dict[str, Any]:
    """GET /v1/models (get_res_models): the Ollama-style list and the OpenAI list."""
    info, name = engine.info, engine.model_name
    return {
        "models": [{
            "name": name, "model": name, "modified_at": "", "size": "", "digest": "",
            "type": "model", "description": "", "tags": [""], "capabilities": ["completion"],
            "parameters": "",
            "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                        "parameter_size": "", "quantization_level": ""},
        }],
        "object": "list",
        "data": [{
            "id": name, "aliases": [name], "tags": [], "object": "model",
            "created": int(time.time()), "owned_by": "llamacpp",
            "architecture": info.architecture,
            "meta": {"vocab_type": info.vocab_type, "n_vocab": info.n_vocab,
                     "n_ctx": engine.n_ctx_slot, "n_ctx_train": info.n_ctx_train,
                     "n_embd": info.n_embd, "n_params": info.n_params, "size": info.size,
                     "ftype": info.ftype},
        }],
    }


def metrics_text(engine: EngineSurface) -> str:
    """Prometheus text with llama-server's metric names (all prefixed ``llamacpp:``)."""
    samples = [(name, "counter", METRIC_HELP[name], value)
               for name, value in engine.counters.items()]
    busy = sum(slot.busy for slot in engine.pool.slots)
    samples += [
        ("requests_processing", "gauge", "Number of requests processing", busy),
        ("requests_deferred", "gauge", "Number of requests deferred", engine.pool.n_waiting),
    ]
    lines = []
    for name, kind, text, value in samples:
        lines += [f"# HELP llamacpp:{name} {text}", f"# TYPE llamacpp:{name} {kind}",
                  f"llamacpp:{name} {value:g}"]
    return "\n".join(lines) + "\n"

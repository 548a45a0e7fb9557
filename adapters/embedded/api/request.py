"""Reading llama-server's request fields, with its leniency.

llama-server reads each field with ``json_value(body, key, default)``, which falls back to
the default when the value has the wrong type; the same rule applies here. Defaults are
llama-server's (common/common.h): temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, a
random seed, ``n_predict`` -1 (until end of generation or the context is full).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from prefixpin.adapters.embedded.errors import ApiError
from prefixpin.adapters.embedded.model.context import SamplingParams

T = TypeVar("T")

_DEFAULT_SAMPLING = SamplingParams()  # llama-server's defaults, the fallback for every field


def field(body: Mapping[str, Any], key: str, default: T) -> T:
    """``json_value``: the value if present, non-null and of the default's type."""
    value = body.get(key)
    if isinstance(default, float) and type(value) is int:
        value = float(value)  # JSON does not tell 1 from 1.0
    # exact type: a bool is not an int here, as nlohmann's is_number_integer() says
    return value if type(value) is type(default) else default


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as an object.

    Malformed JSON is a 400 ``invalid_request_error`` here; llama-server answers it with a
    500 ``server_error`` carrying nlohmann's parse message (a client error reported as a
    server fault). A body that is valid JSON but not an object reads as ``{}``, so the
    handler reports the missing field, as llama-server does.
    """
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"Invalid JSON in request body: {exc}") from None
    return body if isinstance(body, dict) else {}


@dataclass(frozen=True, slots=True)
class CompletionOptions:
    """The request fields the embedded engine honours."""

    stream: bool
    include_usage: bool
    return_progress: bool
    cache_prompt: bool
    id_slot: int
    n_predict: int
    stop: tuple[str, ...]
    sampling: SamplingParams

    def params_json(self) -> dict[str, Any]:
        """The slot's ``params`` as GET /slots shows them (task_params::to_json)."""
        return sampling_params_json(self.sampling, n_predict=self.n_predict, stream=self.stream)


# Fixed values for the llama-server sampling settings this engine does not implement.
_FIXED_PARAMS: dict[str, Any] = {
    "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_n_sigma": -1.0,
    "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0, "repeat_last_n": 64,
    "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
    "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0,
    "adaptive_decay": 0.9,
}


def sampling_params_json(sampling: SamplingParams, *, n_predict: int = -1,
                         stream: bool = False) -> dict[str, Any]:
    """llama-server's ``params`` object, key for key; unsupported settings at their defaults."""
    return {
        "seed": sampling.seed & 0xFFFFFFFF,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p,
        **_FIXED_PARAMS,
        "max_tokens": n_predict, "n_predict": n_predict, "n_keep": 0, "n_discard": 0,
        "ignore_eos": False, "stream": stream, "n_probs": 0, "min_keep": 0,
        "chat_format": "Content-only",  # generated text is returned as content, unparsed
        "reasoning_format": "none", "reasoning_in_content": False, "generation_prompt": "",
        "samplers": ["top_k", "top_p", "min_p", "temperature"],
        "speculative.types": "none", "timings_per_token": False,
        "post_sampling_probs": False, "backend_sampling": False, "lora": [],
    }


def _stop_words(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list):
        return tuple(word for word in stop if isinstance(word, str) and word)
    return ()


def _n_predict(body: Mapping[str, Any]) -> int:
    # llama-server: n_predict, else max_tokens (OpenAI's max_completion_tokens maps onto it)
    fallback = field(body, "max_completion_tokens", -1)
    return field(body, "n_predict", field(body, "max_tokens", fallback))


def parse_options(body: Mapping[str, Any]) -> CompletionOptions:
    stream_options = body.get("stream_options")
    stream = field(body, "stream", False)
    return CompletionOptions(
        stream=stream,
        include_usage=stream and isinstance(stream_options, dict)
        and field(stream_options, "include_usage", False),
        return_progress=field(body, "return_progress", False),
        cache_prompt=field(body, "cache_prompt", True),
        id_slot=field(body, "id_slot", -1),
        n_predict=_n_predict(body),
        stop=_stop_words(body),
        sampling=SamplingParams(
            temperature=field(body, "temperature", _DEFAULT_SAMPLING.temperature),
            top_k=field(body, "top_k", _DEFAULT_SAMPLING.top_k),
            top_p=field(body, "top_p", _DEFAULT_SAMPLING.top_p),
            min_p=field(body, "min_p", _DEFAULT_SAMPLING.min_p),
            seed=field(body, "seed", _DEFAULT_SAMPLING.seed),
        ),
    )

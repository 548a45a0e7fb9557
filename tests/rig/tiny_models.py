"""Tiny GGUF models of architectures no PyPI wheel ships, generated for the tests.

The weights are RANDOM: what these models say is noise. Only the engine's cache mechanics
are real: llama-server runs the real architecture (its recurrent state, its sliding-window
and full-attention KV cells, its checkpoints, its slot files) on the real chat template,
through a real tokenizer. That is what the tests measure, never the text.

- ``qwen35-tiny``: Qwen3.5's hybrid layout, gated delta-net (recurrent) layers with full
  attention every 4th layer (gated query, q/k norms, interleaved M-RoPE), and Qwen3.5's
  chat template.
- ``qwen35-agent``: the same, and its reply ends after its first line (``QWEN35_ENDING``),
  so that the real agent CLIs, which ask for 32k tokens, get an answer.
- ``qwen35-long``: ``qwen35-tiny`` declaring a training context of 262,144 tokens
  (llama-server caps a slot at the model's training context): for sessions past 32k tokens
  (``bench/long.py``).
- ``gptoss-tiny``: gpt-oss, sliding-window attention (window 128) alternating with full
  attention, attention sinks, a mixture of experts, and gpt-oss's harmony chat template.
  Its reply's opening is scripted (``GPTOSS_OPENING``) so that llama-server's harmony
  parser accepts it; the rest of the reply is the random weights' noise.

The tokenizer is SmolLM2's gpt2-style BPE vocabulary (a model the rig already fetches),
with spare control tokens renamed to the template's special tokens. The chat templates come
from the llama.cpp tree the rig's llama-server is built from: the pinned sdist, or the
unpacked tree ``$PREFIXPIN_LLAMA_TREE`` points at.

Each file is generated deterministically (seeded weights, fixed key order) into
``cache_root() / "tiny-models"``, named by a short hash of everything that shapes it, and
reused while that hash holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from prefixpin.proxy.settings import cache_root
from tests.rig.llama_build import LLAMA_CPP_PYTHON_VERSION, unpacked_tree
from tests.rig.models import ensure_model
from tests.rig.parts import prepared

# Bump when the generator changes what it writes for the same parameters.
GENERATOR_VERSION = 2
TOKENIZER_MODEL = "smollm2"
WEIGHT_STD = 0.02

# llama.cpp's token types (gguf.TokenType): the templates' markers are either control
# tokens (never printed, matched only as special text) or user-defined (printed as text).
CONTROL = int(gguf.TokenType.CONTROL)
USER_DEFINED = int(gguf.TokenType.USER_DEFINED)


class Init(Enum):
    """How a tensor's values are drawn."""

    RANDOM = "random"  # normal(0, WEIGHT_STD), stored F16: the projections
    ONES = "ones"  # norm scales: 1 leaves the activations as they are
    ZEROS = "zeros"  # biases, attention sinks, delta-net time-step bias
    DECAY = "decay"  # the delta-net's A (negative): its state decays instead of growing
    RANDOM_F32 = "random_f32"  # the conv kernel: llama.cpp's ssm_conv takes F32 only


@dataclass(frozen=True, slots=True)
class TensorPlan:
    name: str
    ne: tuple[int, ...]  # ggml order: the fastest-varying dimension first
    init: Init = Init.RANDOM


@dataclass(frozen=True, slots=True)
class Qwen35Shape:
    n_layer: int = 8
    full_attention_interval: int = 4  # layers 3 and 7 attend; the others are delta-nets
    n_embd: int = 128
    n_ff: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    rope_dims: int = 8  # Qwen3.5's partial rotary factor, 0.25 of the head
    rope_sections: tuple[int, int, int, int] = (2, 1, 1, 0)  # the M-RoPE split of rope_dims/2
    ssm_k_heads: int = 2
    ssm_v_heads: int = 4
    ssm_head_dim: int = 32
    ssm_conv_kernel: int = 4
    context_length: int = 32768
    rope_freq_base: float = 10_000_000.0
    rms_eps: float = 1e-6


@dataclass(frozen=True, slots=True)
class GptOssShape:
    n_layer: int = 4  # even layers slide over the window, odd layers attend to everything
    n_embd: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_expert: int = 64
    sliding_window: int = 128
    context_length: int = 32768
    rope_freq_base: float = 150_000.0
    rms_eps: float = 1e-5


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """Renamed spare tokens (id → text, type) and the ids llama.cpp stops and starts on."""

    renamed: tuple[tuple[int, str, int], ...]
    bos: int
    eos: int
    eot: int | None
    padding: int


@dataclass(frozen=True, slots=True)
class TinyModel:
    name: str
    arch: str
    template: str  # under the llama.cpp tree's models/templates/
    shape: Qwen35Shape | GptOssShape
    tokens: SpecialTokens
    seed: int
    # Forced next tokens (after piece, next piece) over the random weights; see script_reply.
    script: tuple[tuple[str, str], ...] = ()


# SmolLM2's vocabulary: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|> (Qwen3.5's ChatML
# markers as they are), 3..16 spare control tokens (<repo_name>, <file_sep>, ...) that
# neither template uses.
QWEN35_TOKENS = SpecialTokens(
    # Qwen's think and tool-call markers are ordinary added tokens: printed as text, which
    # is how llama-server's parser finds them in a reply.
    renamed=((3, "<think>", USER_DEFINED), (4, "</think>", USER_DEFINED),
             (5, "<tool_call>", USER_DEFINED), (6, "</tool_call>", USER_DEFINED)),
    bos=0, eos=2, eot=2, padding=0)

GPTOSS_TOKENS = SpecialTokens(
    # The harmony format's markers, control tokens as in o200k_harmony. llama.cpp makes
    # <|return|> and <|call|> end of generation by their text, and re-marks <|start|>,
    # <|message|>, <|channel|>, <|constrain|> user-defined at load, as for the real model
    # (src/llama-vocab.cpp).
    renamed=((3, "<|start|>", CONTROL), (4, "<|end|>", CONTROL), (5, "<|message|>", CONTROL),
             (6, "<|channel|>", CONTROL), (7, "<|return|>", CONTROL), (8, "<|call|>", CONTROL),
             (9, "<|constrain|>", CONTROL)),
    bos=0, eos=7, eot=None, padding=0)

# llama-server parses a gpt-oss reply as harmony and answers 500 to one that is not. Random
# weights would never open with a channel header, so the reply's opening is scripted: the
# generation prompt ends "<|start|>assistant" ("ass" "istant" in SmolLM2's BPE), then come
# "<|channel|>final<|message|>" and, from there, the random weights' text up to the cap.
GPTOSS_OPENING = (("istant", "<|channel|>"), ("<|channel|>", "final"), ("final", "<|message|>"))

# The agent CLIs ask for 32k tokens, and with tools in the request llama-server's own tool
# grammar replaces a default --grammar cap: random weights would ramble to the end. The
# agent variant's reply is "Done": the generation prompt ends with a newline, after which
# comes the end of its reasoning (thinking on: "<think>\n") or "Done" (thinking off:
# "</think>\n\n"), then end of turn. A newline among the reply's noise ends it there.
QWEN35_ENDING = (("Ċ", "</think>"), ("</think>", "Done"), ("ĊĊ", "Done"),
                 ("Done", "<|im_end|>"))

TINY_MODELS: dict[str, TinyModel] = {
    "qwen35-tiny": TinyModel("qwen35-tiny", "qwen35", "Qwen3.5-4B.jinja", Qwen35Shape(),
                             QWEN35_TOKENS, seed=35),
    "qwen35-agent": TinyModel("qwen35-agent", "qwen35", "Qwen3.5-4B.jinja", Qwen35Shape(),
                              QWEN35_TOKENS, seed=35, script=QWEN35_ENDING),
    # Only the declared context differs (its name and the shape are in the file's hash).
    "qwen35-long": TinyModel("qwen35-long", "qwen35", "Qwen3.5-4B.jinja",
                             replace(Qwen35Shape(), context_length=262_144), QWEN35_TOKENS,
                             seed=35),
    "gptoss-tiny": TinyModel("gptoss-tiny", "gpt-oss", "openai-gpt-oss-120b.jinja",
                             GptOssShape(), GPTOSS_TOKENS, seed=120, script=GPTOSS_OPENING),
}


# Greedy, the tiny random-weight models answer newlines only; a client sending back a
# changed reply needs text to change. These are SmolLM2's whitespace tokens ("\n", "\n\n",
# "\n\n\n", "\n\n\n\n", " \n"), banned by a request's OpenAI ``logit_bias``: the answer is noise
# words (all ``reasoning_content`` with Qwen3.5's template).
NO_NEWLINES: dict[str, float] = {str(token): -100.0 for token in (198, 1116, 16506, 22342,
                                                                   3717)}


def tiny_model_path(name: str) -> Path:
    """Where ``name``'s GGUF lives: the name carries a hash of all that shapes the file."""
    return cache_root() / "tiny-models" / f"{name}-{parameters_digest(TINY_MODELS[name])}.gguf"


def ensure_tiny_model(name: str, *, preparing: bool = False) -> Path:
    """``name``'s GGUF, generated first if it is not there (a few seconds, plus fetching
    the sdist for its chat template unless ``$PREFIXPIN_LLAMA_TREE`` is set). Under CI only
    the prepare step (``preparing``) generates it: a test that finds it missing fails."""
    target = tiny_model_path(name)
    if target.exists():
        return target
    if not preparing:
        prepared(target, f"tiny model {name}")
    model = TINY_MODELS[name]
    with llama_tree() as tree:
        template = (tree / "models" / "templates" / model.template).read_text(encoding="utf-8")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(".partial")
    write_gguf(model, template, read_vocabulary(ensure_model(TOKENIZER_MODEL)), staging)
    staging.replace(target)  # atomic: an interrupted run never leaves half a model
    return target


def parameters_digest(model: TinyModel) -> str:
    # The template and the tokenizer are pinned by the sdist version and the model name.
    key = repr((GENERATOR_VERSION, LLAMA_CPP_PYTHON_VERSION, TOKENIZER_MODEL, WEIGHT_STD,
                asdict(model)))
    return hashlib.blake2b(key.encode(), digest_size=4).hexdigest()


@contextlib.contextmanager
def llama_tree() -> Iterator[Path]:
    """The llama.cpp tree: ``$PREFIXPIN_LLAMA_TREE`` if set, else the sdist, unpacked."""
    configured = os.environ.get("PREFIXPIN_LLAMA_TREE")
    if configured:
        yield Path(configured)
        return
    with tempfile.TemporaryDirectory(prefix="prefixpin-llama-tree-") as tmp:
        yield unpacked_tree(Path(tmp), quiet=True)


# ---------------------------------------------------------------- writing the file

def write_gguf(model: TinyModel, template: str, vocab: Vocabulary, path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), model.arch)
    writer.add_string("general.name", f"prefixpin {model.name} (random weights)")
    # Declared, else llama.cpp guesses from the tensor count, which the F32 norms dominate.
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    add_hparams(writer, model)
    add_tokenizer(writer, vocab, model.tokens)
    writer.add_string("tokenizer.chat_template", template)
    arrays = tensor_arrays(tensor_plan(model), len(vocab.tokens), model.seed)
    if model.script:
        script_reply(arrays, renamed(vocab, model.tokens), model.script)
    for name, values in arrays.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_hparams(writer: gguf.GGUFWriter, model: TinyModel) -> None:
    for key, value in hparams(model).items():
        full_key = f"{model.arch}.{key}"
        if isinstance(value, float):
            writer.add_float32(full_key, value)
        elif isinstance(value, tuple):
            writer.add_array(full_key, list(value))
        else:
            writer.add_uint32(full_key, value)


def hparams(model: TinyModel) -> dict[str, Any]:
    """The metadata keys llama.cpp's loader reads (src/llama-model.cpp, src/models/*.cpp)."""
    shape = model.shape
    common = {
        "context_length": shape.context_length, "embedding_length": shape.n_embd,
        "block_count": shape.n_layer, "attention.head_count": shape.n_head,
        "attention.head_count_kv": shape.n_head_kv, "attention.key_length": shape.head_dim,
        "attention.value_length": shape.head_dim, "rope.freq_base": shape.rope_freq_base,
        "attention.layer_norm_rms_epsilon": shape.rms_eps,
    }
    if isinstance(shape, Qwen35Shape):
        return {**common, **qwen35_hparams(shape)}
    return {**common, **gptoss_hparams(shape)}


def qwen35_hparams(shape: Qwen35Shape) -> dict[str, Any]:
    return {
        "feed_forward_length": shape.n_ff,
        "rope.dimension_count": shape.rope_dims,
        "rope.dimension_sections": shape.rope_sections,
        "full_attention_interval": shape.full_attention_interval,
        "ssm.conv_kernel": shape.ssm_conv_kernel,
        "ssm.state_size": shape.ssm_head_dim,  # the key head size
        "ssm.group_count": shape.ssm_k_heads,
        "ssm.time_step_rank": shape.ssm_v_heads,
        "ssm.inner_size": shape.ssm_head_dim * shape.ssm_v_heads,  # all value heads
    }


def gptoss_hparams(shape: GptOssShape) -> dict[str, Any]:
    return {
        "rope.dimension_count": shape.head_dim,
        "expert_count": shape.n_expert,
        "expert_used_count": shape.n_expert_used,
        "expert_feed_forward_length": shape.n_ff_expert,
        "attention.sliding_window": shape.sliding_window,
    }


# ---------------------------------------------------------------- tokenizer

@dataclass(frozen=True, slots=True)
class Vocabulary:
    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]


def read_vocabulary(source: Path) -> Vocabulary:
    fields = gguf.GGUFReader(str(source)).fields
    return Vocabulary(pre=str(fields["tokenizer.ggml.pre"].contents()),
                      tokens=[str(t) for t in fields["tokenizer.ggml.tokens"].contents()],
                      types=[int(t) for t in fields["tokenizer.ggml.token_type"].contents()],
                      merges=[str(m) for m in fields["tokenizer.ggml.merges"].contents()])


def renamed(vocab: Vocabulary, special: SpecialTokens) -> Vocabulary:
    tokens, types = list(vocab.tokens), list(vocab.types)
    for token_id, text, token_type in special.renamed:
        tokens[token_id], types[token_id] = text, token_type
    return Vocabulary(vocab.pre, tokens, types, vocab.merges)


def add_tokenizer(writer: gguf.GGUFWriter, source: Vocabulary, special: SpecialTokens) -> None:
    vocab = renamed(source, special)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    # The pre-tokenizer goes with the vocabulary (SmolLM2's), not with the architecture.
    writer.add_string("tokenizer.ggml.pre", vocab.pre)
    writer.add_array("tokenizer.ggml.tokens", vocab.tokens)
    writer.add_array("tokenizer.ggml.token_type", vocab.types)
    writer.add_array("tokenizer.ggml.merges", vocab.merges)
    writer.add_uint32("tokenizer.ggml.bos_token_id", special.bos)
    writer.add_uint32("tokenizer.ggml.eos_token_id", special.eos)
    if special.eot is not None:
        writer.add_uint32("tokenizer.ggml.eot_token_id", special.eot)
    writer.add_uint32("tokenizer.ggml.padding_token_id", special.padding)
    # Both templates write every marker themselves; a BOS in front would be extra.
    writer.add_bool("tokenizer.ggml.add_bos_token", False)


# ---------------------------------------------------------------- tensors

def tensor_plan(model: TinyModel) -> list[TensorPlan]:
    if isinstance(model.shape, Qwen35Shape):
        plan = qwen35_tensors(model.shape)
        if model.script:  # a script writes the output head: its own, untied
            plan.insert(2, TensorPlan("output.weight", (model.shape.n_embd, VOCAB)))
        return plan
    return gptoss_tensors(model.shape)


def qwen35_tensors(shape: Qwen35Shape) -> list[TensorPlan]:
    """src/models/qwen35.cpp's load_arch_tensors; the output head is tied to the embedding
    (no output.weight), as in the small Qwen3.5 models."""
    plan = [TensorPlan("token_embd.weight", (shape.n_embd, VOCAB)),
            TensorPlan("output_norm.weight", (shape.n_embd,), Init.ONES)]
    for layer in range(shape.n_layer):
        blk = f"blk.{layer}"
        plan += [TensorPlan(f"{blk}.attn_norm.weight", (shape.n_embd,), Init.ONES),
                 TensorPlan(f"{blk}.post_attention_norm.weight", (shape.n_embd,), Init.ONES)]
        attends = (layer + 1) % shape.full_attention_interval == 0
        plan += qwen35_attention(shape, blk) if attends else qwen35_delta_net(shape, blk)
        plan += [TensorPlan(f"{blk}.ffn_gate.weight", (shape.n_embd, shape.n_ff)),
                 TensorPlan(f"{blk}.ffn_up.weight", (shape.n_embd, shape.n_ff)),
                 TensorPlan(f"{blk}.ffn_down.weight", (shape.n_ff, shape.n_embd))]
    return plan


def qwen35_attention(shape: Qwen35Shape, blk: str) -> list[TensorPlan]:
    q_width = shape.head_dim * shape.n_head
    kv_width = shape.head_dim * shape.n_head_kv
    return [
        # The query projection carries the output gate too: twice the query width.
        TensorPlan(f"{blk}.attn_q.weight", (shape.n_embd, 2 * q_width)),
        TensorPlan(f"{blk}.attn_k.weight", (shape.n_embd, kv_width)),
        TensorPlan(f"{blk}.attn_v.weight", (shape.n_embd, kv_width)),
        TensorPlan(f"{blk}.attn_output.weight", (q_width, shape.n_embd)),
        TensorPlan(f"{blk}.attn_q_norm.weight", (shape.head_dim,), Init.ONES),
        TensorPlan(f"{blk}.attn_k_norm.weight", (shape.head_dim,), Init.ONES),
    ]


def qwen35_delta_net(shape: Qwen35Shape, blk: str) -> list[TensorPlan]:
    key_width = shape.ssm_head_dim * shape.ssm_k_heads
    value_width = shape.ssm_head_dim * shape.ssm_v_heads
    conv_width = 2 * key_width + value_width  # q, k and v go through the conv together
    return [
        TensorPlan(f"{blk}.attn_qkv.weight", (shape.n_embd, conv_width)),
        TensorPlan(f"{blk}.attn_gate.weight", (shape.n_embd, value_width)),
        TensorPlan(f"{blk}.ssm_conv1d.weight", (shape.ssm_conv_kernel, conv_width),
                   Init.RANDOM_F32),
        TensorPlan(f"{blk}.ssm_dt.bias", (shape.ssm_v_heads,), Init.ZEROS),
        TensorPlan(f"{blk}.ssm_a", (shape.ssm_v_heads,), Init.DECAY),
        TensorPlan(f"{blk}.ssm_beta.weight", (shape.n_embd, shape.ssm_v_heads)),
        TensorPlan(f"{blk}.ssm_alpha.weight", (shape.n_embd, shape.ssm_v_heads)),
        TensorPlan(f"{blk}.ssm_norm.weight", (shape.ssm_head_dim,), Init.ONES),
        TensorPlan(f"{blk}.ssm_out.weight", (value_width, shape.n_embd)),
    ]


def gptoss_tensors(shape: GptOssShape) -> list[TensorPlan]:
    """src/models/openai-moe.cpp's load_arch_tensors. The experts are F16 where the real
    model ships MXFP4: the loader takes any type, the expert matmul any ggml supports."""
    plan = [TensorPlan("token_embd.weight", (shape.n_embd, VOCAB)),
            TensorPlan("output_norm.weight", (shape.n_embd,), Init.ONES),
            TensorPlan("output.weight", (shape.n_embd, VOCAB))]
    for layer in range(shape.n_layer):
        blk = f"blk.{layer}"
        plan += [TensorPlan(f"{blk}.attn_norm.weight", (shape.n_embd,), Init.ONES),
                 TensorPlan(f"{blk}.post_attention_norm.weight", (shape.n_embd,), Init.ONES)]
        plan += gptoss_attention(shape, blk) + gptoss_experts(shape, blk)
    return plan


def gptoss_attention(shape: GptOssShape, blk: str) -> list[TensorPlan]:
    q_width = shape.head_dim * shape.n_head
    kv_width = shape.head_dim * shape.n_head_kv
    return [
        TensorPlan(f"{blk}.attn_q.weight", (shape.n_embd, q_width)),
        TensorPlan(f"{blk}.attn_q.bias", (q_width,), Init.ZEROS),
        TensorPlan(f"{blk}.attn_k.weight", (shape.n_embd, kv_width)),
        TensorPlan(f"{blk}.attn_k.bias", (kv_width,), Init.ZEROS),
        TensorPlan(f"{blk}.attn_v.weight", (shape.n_embd, kv_width)),
        TensorPlan(f"{blk}.attn_v.bias", (kv_width,), Init.ZEROS),
        TensorPlan(f"{blk}.attn_output.weight", (q_width, shape.n_embd)),
        TensorPlan(f"{blk}.attn_output.bias", (shape.n_embd,), Init.ZEROS),
        TensorPlan(f"{blk}.attn_sinks.weight", (shape.n_head,), Init.ZEROS),
    ]


def gptoss_experts(shape: GptOssShape, blk: str) -> list[TensorPlan]:
    n_embd, n_ff, n_expert = shape.n_embd, shape.n_ff_expert, shape.n_expert
    return [
        TensorPlan(f"{blk}.ffn_gate_inp.weight", (n_embd, n_expert), Init.RANDOM_F32),
        TensorPlan(f"{blk}.ffn_gate_inp.bias", (n_expert,), Init.ZEROS),
        TensorPlan(f"{blk}.ffn_gate_exps.weight", (n_embd, n_ff, n_expert)),
        TensorPlan(f"{blk}.ffn_gate_exps.bias", (n_ff, n_expert), Init.ZEROS),
        TensorPlan(f"{blk}.ffn_up_exps.weight", (n_embd, n_ff, n_expert)),
        TensorPlan(f"{blk}.ffn_up_exps.bias", (n_ff, n_expert), Init.ZEROS),
        TensorPlan(f"{blk}.ffn_down_exps.weight", (n_ff, n_embd, n_expert)),
        TensorPlan(f"{blk}.ffn_down_exps.bias", (n_embd, n_expert), Init.ZEROS),
    ]


# A placeholder dimension in a plan: the vocabulary's size, known once the tokenizer is read.
VOCAB = -1


def tensor_arrays(plan: list[TensorPlan], n_vocab: int,
                  seed: int) -> dict[str, np.ndarray[Any, Any]]:
    # One generator drawn in plan order: the same plan and seed give the same bytes.
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for tensor in plan:
        ne = tuple(n_vocab if n == VOCAB else n for n in tensor.ne)
        arrays[tensor.name] = tensor_values(rng, ne[::-1], tensor.init)
    return arrays


def tensor_values(rng: np.random.Generator, shape: tuple[int, ...],
                  init: Init) -> np.ndarray[Any, Any]:
    """Values in numpy's order (ggml's ne reversed)."""
    if init is Init.ONES:
        return np.ones(shape, dtype=np.float32)
    if init is Init.ZEROS:
        return np.zeros(shape, dtype=np.float32)
    if init is Init.DECAY:
        return np.full(shape, -1.0, dtype=np.float32)
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(WEIGHT_STD)
    return values if init is Init.RANDOM_F32 else values.astype(np.float16)


# ---------------------------------------------------------------- the scripted opening

# Tensors that write into the residual stream, numpy shape (..., n_embd, width).
RESIDUAL_WRITERS = ("attn_output.weight", "ffn_down_exps.weight", "ffn_down.weight",
                    "ssm_out.weight")
MARK = 1.0  # against embeddings of std WEIGHT_STD: the marker dominates the final norm


def script_reply(arrays: dict[str, np.ndarray[Any, Any]], vocab: Vocabulary,
                 script: tuple[tuple[str, str], ...]) -> None:
    """Make each ``(after, next)`` pair a certainty: greedy decoding emits ``next`` right
    after ``after``, whatever the context; every other prediction stays random.

    One embedding dimension per pair (the last ones) is a private marker: only ``after``'s
    embedding sets it, no layer writes to it, and only ``next``'s output row reads it. The
    reply never holds a control token the script does not place (their rows are zero, below
    the random rows' maximum): no stray end of turn cuts a harmony message short."""
    ids = {text: token_id for token_id, text in enumerate(vocab.tokens)}
    embed, output = arrays["token_embd.weight"], arrays["output.weight"]
    n_embd = embed.shape[1]
    markers = list(range(n_embd - len(script), n_embd))
    embed[:, markers] = 0
    output[:, markers] = 0
    for name, values in arrays.items():
        if name.endswith(RESIDUAL_WRITERS):
            values[..., markers, :] = 0
    controls = [i for i, kind in enumerate(vocab.types) if kind == CONTROL]
    output[controls + [ids[after_next[1]] for after_next in script]] = 0
    for marker, (after, then) in zip(markers, script, strict=True):
        embed[ids[after], marker] = MARK
        output[ids[then], marker] = MARK

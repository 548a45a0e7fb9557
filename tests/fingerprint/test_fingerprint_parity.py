"""Our GGUF-built tokenizers against the real llama-server's ``/tokenize`` (rig models).

The curated corpus (``parity_corpus.json``) names what each text probes: code, unicode,
whitespace runs, digits, chat-template text with control tokens. A seeded generator adds
random mixtures of the same ingredients, including fragments of control-token text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest

from prefixpin.fingerprint.tokenizer import ModelTokenizer

pytestmark = [pytest.mark.llama, pytest.mark.slow]

CURATED: dict[str, str] = json.loads(
    (Path(__file__).parent / "parity_corpus.json").read_text(encoding="utf-8"))

INGREDIENTS = (
    "a", "b", "Z", "é", "ß", "日", "😀", "\u0301", "0", "7", "42", " ", "  ", "\t", "\n",
    "\n\n", "\r\n", ".", ",", "'s", "'LL", "-", "_", "(", ")", "{", "}", "<", ">", "/", "\\",
    '"', "#", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<|im_",
    "_turn>", "<b>", "</s>", "user", "model", "assistant", "the", " the", "ing", "def",
    "\u00a0", "\u3000", "\u200b", "\U0001f9ec",
)


def generated(count: int = 300, seed: int = 20250101) -> dict[str, str]:
    """Random mixtures of the ingredients, the same on every run."""
    rng = random.Random(seed)
    return {f"generated[{i}]": "".join(rng.choices(INGREDIENTS, k=rng.randint(1, 40)))
            for i in range(count)}


def engine_tokens(client: httpx.Client, text: str) -> list[int]:
    # The chat path's tokenization minus BOS: control-token text is parsed as such.
    reply = client.post("/tokenize", json={"content": text, "add_special": False,
                                           "parse_special": True})
    reply.raise_for_status()
    tokens: list[int] = reply.json()["tokens"]
    return tokens


def mismatches(tokenizer: ModelTokenizer, url: str, texts: dict[str, str]) -> list[str]:
    found = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for label, text in texts.items():
            expected, got = engine_tokens(client, text), tokenizer.encode(text)
            if got != expected:
                at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False))
                           if a != b), min(len(got), len(expected)))
                found.append(f"{label}: {text!r} differs at token {at}: "
                             f"ours {got[at:at + 6]} engine {expected[at:at + 6]}")
    return found


def test_curated_corpus_matches_llama_server(tokenizer: ModelTokenizer, llama_server: str) -> None:
    """Code, unicode, whitespace runs, digits and chat text tokenize as the engine does."""
    assert mismatches(tokenizer, llama_server, CURATED) == []


def test_generated_corpus_matches_llama_server(tokenizer: ModelTokenizer,
                                               llama_server: str) -> None:
    """300 seeded random mixtures with control-token fragments tokenize as the engine does."""
    assert mismatches(tokenizer, llama_server, generated()) == []


def test_rendered_conversation_matches_llama_server(tokenizer: ModelTokenizer,
                                                    llama_server: str) -> None:
    """The chat template's own rendering of a conversation tokenizes as the engine does."""
    messages = [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": "List the files, then read   main.py\n\n"},
        {"role": "assistant", "content": "Running `ls -la`.\n\t(one moment)"},
        {"role": "user", "content": "Thanks! 日本語 😀 12345"},
    ]
    with httpx.Client(base_url=llama_server, timeout=30) as client:
        reply = client.post("/apply-template", json={"messages": messages})
        reply.raise_for_status()
        prompt: str = reply.json()["prompt"]
        assert tokenizer.encode(prompt) == engine_tokens(client, prompt)

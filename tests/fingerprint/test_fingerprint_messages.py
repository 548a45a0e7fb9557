"""Message views, the per-message token cache, and chains of real conversations."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from prefixpin.fingerprint.chain import Chain, chain, nominates, shared_leading
from prefixpin.fingerprint.messages import (
    CHECKPOINT_EVERY,
    EDGE_CHARS,
    TOOL_RESULT_CHARS,
    ChainMemo,
    Encoder,
    Markers,
    MessageTokenCache,
    chain_for_messages,
    edge_texts,
    fingerprint_view,
    prefix_keys,
)
from prefixpin.fingerprint.tokenizer import ModelTokenizer, markers_for
from prefixpin.proxy.session.history import digest

Message = dict[str, Any]

LISTING = "".join(f"-rw-r--r-- 1 dev dev {1000 + i * 37:6d} Jan {i % 28 + 1:2d} src/module_{i}.py\n"
                  for i in range(80))


def agent_conversation() -> list[Message]:
    """An agent session as a client sends it on turn 4, reasoning and full tool output kept."""
    return [
        {"role": "system", "content": "You are a coding agent. Work in /repo. Be brief."},
        {"role": "user", "content": "Which modules are in src/?"},
        {"role": "assistant", "content": "",
         "reasoning_content": "I should list the directory first.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "bash", "arguments": '{"command": "ls -l src", "timeout": 30}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": LISTING},
        {"role": "assistant",
         "content": "<think>\nThe listing has 80 modules.\n</think>\n\nThere are 80 modules."},
        {"role": "user", "content": "Open module_3.py."},
    ]


def rewritten_by_client(messages: list[Message]) -> list[Message]:
    """What the client sends on turn 5: reasoning dropped, old tool output cut to 400 chars."""
    rewritten = copy.deepcopy(messages)
    for message in rewritten:
        message.pop("reasoning_content", None)
        if message["role"] == "assistant":
            message["content"] = message["content"].split("</think>")[-1].strip()
        if message["role"] == "tool":
            message["content"] = message["content"][:400]
        for call in message.get("tool_calls", []):
            arguments = json.loads(call["function"]["arguments"])
            call["function"]["arguments"] = json.dumps(dict(reversed(arguments.items())),
                                                       indent=2)
    return rewritten


def wrapped(message: Message, markers: Markers) -> str:
    return markers.wrap(fingerprint_view(message))


@pytest.fixture(scope="session")
def markers(tokenizer: ModelTokenizer) -> Markers:
    found = markers_for(tokenizer)
    assert found is not None
    return found


def fingerprint(messages: list[Message], tokenizer: ModelTokenizer, markers: Markers) -> Chain:
    return chain_for_messages(messages, tokenizer, MessageTokenCache(), markers)


# -- views ---------------------------------------------------------------------------------


def test_view_is_role_then_visible_content() -> None:
    """A plain message's view is its role and its content, outer whitespace dropped."""
    assert fingerprint_view({"role": "user", "content": "  hi there \n"}) == "user\nhi there"


def test_view_drops_reasoning_content_and_think_blocks() -> None:
    """reasoning_content and every <think> block are excluded from the view."""
    plain = fingerprint_view({"role": "assistant", "content": "Answer."})
    assert fingerprint_view({"role": "assistant", "content": "Answer.",
                             "reasoning_content": "hmm"}) == plain
    assert fingerprint_view({"role": "assistant",
                             "content": "<think>a</think>\nAns<think>b</think>wer."}) == plain


def test_view_drops_reasoning_before_a_lone_closing_tag() -> None:
    """A template that opened the think block itself leaves only </think>: before it goes."""
    assert fingerprint_view({"role": "assistant", "content": "reasoning...</think>\n\nAnswer."}
                            ) == "assistant\nAnswer."


def test_view_drops_an_unterminated_think_block() -> None:
    """A reply cut off while thinking keeps only what came before <think>."""
    assert fingerprint_view({"role": "assistant", "content": "Answer. <think>and then"}
                            ) == "assistant\nAnswer."


def test_view_of_content_parts() -> None:
    """Text parts are joined by newlines; other parts keep only their kind."""
    message = {"role": "user", "content": [
        {"type": "text", "text": "look:"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        "plain string part",
    ]}
    assert fingerprint_view(message) == "user\nlook:\n[image_url]\nplain string part"


def test_view_of_missing_and_structured_content() -> None:
    """No content is empty; a non-text content is canonical JSON."""
    assert fingerprint_view({"role": "assistant", "content": None}) == "assistant\n"
    assert fingerprint_view({"content": {"b": 1, "a": [2]}}) == '\n{"a":[2],"b":1}'


def test_view_canonicalizes_tool_call_arguments() -> None:
    """Key order and spacing of tool-call JSON do not matter; ids do not either."""
    def call(arguments: object, call_id: str) -> Message:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "grep",
                                                             "arguments": arguments}}]}

    compact = fingerprint_view(call('{"pattern":"TODO","path":"src"}', "a"))
    assert compact == 'assistant\n\ngrep({"path":"src","pattern":"TODO"})'
    assert fingerprint_view(call('{\n  "path": "src",\n  "pattern": "TODO"\n}', "b")) == compact
    assert fingerprint_view(call({"pattern": "TODO", "path": "src"}, "c")) == compact


def test_view_keeps_unparseable_arguments_and_odd_calls() -> None:
    """Arguments that are not JSON are kept as sent; a call without a function as JSON."""
    message = {"role": "assistant", "tool_calls": [
        {"function": {"name": "run", "arguments": " not json "}}, {"id": "x"}, "junk"]}
    assert fingerprint_view(message) == 'assistant\n\nrun(not json)\n?({"id":"x"})\n?("junk")'
    assert fingerprint_view({"role": "assistant", "tool_calls": "junk"}) == "assistant\n"


def test_tool_view_keeps_only_the_first_256_characters() -> None:
    """A tool result and any trim of it that keeps 256 characters have the same view."""
    full = {"role": "tool", "content": "\n  " + LISTING}
    view = fingerprint_view(full)
    assert view == "tool\n" + LISTING[:TOOL_RESULT_CHARS].rstrip()
    for kept in (400, 300, TOOL_RESULT_CHARS + 3):
        assert fingerprint_view({"role": "tool", "content": full["content"][:kept]}) == view
    assert fingerprint_view({"role": "tool", "content": LISTING[:200]}) != view


# -- the token cache -----------------------------------------------------------------------


def test_cache_counts_hits_and_misses(smollm: ModelTokenizer) -> None:
    """The first request for a text tokenizes it; later ones are hits with equal ids."""
    cache = MessageTokenCache()
    first = cache.tokens("<|im_start|>user\nhello<|im_end|>\n", smollm)
    again = cache.tokens("<|im_start|>user\nhello<|im_end|>\n", smollm)
    assert list(first) == smollm.encode("<|im_start|>user\nhello<|im_end|>\n")
    assert again is first
    assert (cache.stats.hits, cache.stats.misses, len(cache)) == (1, 1, 1)


def test_cache_evicts_the_least_recently_used_entry(smollm: ModelTokenizer) -> None:
    """Past max_entries the entry used longest ago goes first."""
    cache = MessageTokenCache(max_entries=2)
    cache.tokens("one", smollm)
    cache.tokens("two", smollm)
    cache.tokens("one", smollm)  # now "two" is the oldest
    cache.tokens("three", smollm)
    misses = cache.stats.misses
    cache.tokens("one", smollm)
    assert cache.stats.misses == misses
    cache.tokens("two", smollm)
    assert cache.stats.misses == misses + 1
    assert cache.stats.evictions == 2


def test_cache_is_bounded_in_tokens(smollm: ModelTokenizer) -> None:
    """Cached tokens never exceed max_tokens; a text larger than all of it is not cached."""
    cache = MessageTokenCache(max_tokens=50)
    for word in ("alpha beta gamma " * 5, "delta epsilon " * 6, "zeta eta theta " * 5):
        cache.tokens(word, smollm)
        assert cache.cached_tokens <= 50
    before = (len(cache), cache.cached_tokens)
    huge = cache.tokens("word " * 100, smollm)
    assert len(huge) > 50
    assert (len(cache), cache.cached_tokens) == before


def test_cache_stores_a_concurrently_tokenized_text_once(smollm: ModelTokenizer) -> None:
    """If the same text is tokenized twice at once, one run is kept and the count is right."""
    cache = MessageTokenCache()

    class ReentrantEncoder:
        # Looks the same text up again while the first lookup is still tokenizing, the
        # interleaving two threads produce.
        def encode(self, text: str) -> list[int]:
            cache.tokens(text, smollm)
            return smollm.encode(text)

    encoder: Encoder = ReentrantEncoder()
    run = cache.tokens("same text", encoder)
    assert list(run) == smollm.encode("same text")
    assert (len(cache), cache.cached_tokens) == (1, len(run))


def test_cache_replaces_lone_surrogates(smollm: ModelTokenizer) -> None:
    """JSON may carry a lone surrogate; it is tokenized as '?' instead of failing."""
    cache = MessageTokenCache()
    assert list(cache.tokens("a\ud800b", smollm)) == smollm.encode("a?b")


def test_cache_bounds_are_validated() -> None:
    """A cache that could hold nothing is refused."""
    with pytest.raises(ValueError, match="at least 1"):
        MessageTokenCache(max_entries=0)


# -- chains of conversations (both rig tokenizers) -----------------------------------------


def test_markers_open_with_one_control_token(tokenizer: ModelTokenizer, markers: Markers) -> None:
    """The opener is the control token the template starts each message with."""
    assert len(markers.openers) == 1
    assert markers.openers <= tokenizer.control_ids
    assert tokenizer.encode(markers.open) == list(markers.openers)


def test_message_chain_equals_the_chain_of_the_whole_text(tokenizer: ModelTokenizer,
                                                          markers: Markers) -> None:
    """Tokenizing per message and chaining equals tokenizing all messages in one piece."""
    messages = agent_conversation()
    whole = "".join(wrapped(message, markers) for message in messages)
    expected = chain(tokenizer.encode(whole), markers.openers)
    assert fingerprint(messages, tokenizer, markers) == expected
    assert len(expected) == len(messages)


def test_reasoning_stripping_and_tool_trimming_keep_every_segment(
        tokenizer: ModelTokenizer, markers: Markers) -> None:
    """Dropping reasoning, removing <think>, cutting a tool result to 400 chars and
    re-serializing tool-call JSON change no digest of the conversation."""
    original = agent_conversation()
    rewritten = rewritten_by_client(original)
    assert rewritten != original
    assert (fingerprint(rewritten, tokenizer, markers).digests
            == fingerprint(original, tokenizer, markers).digests)


def test_rewrite_inside_a_long_turn_keeps_its_segment(tokenizer: ModelTokenizer,
                                                      markers: Markers) -> None:
    """A timestamp injected mid system prompt leaves the system segment unchanged."""
    def system(stamp: str) -> Message:
        return {"role": "system", "content": "You are a coding agent working in a large "
                f"repository. Current time: {stamp}. Follow the style guide and keep "
                "answers short, precise and free of speculation."}

    first = fingerprint([system("2025-01-01 10:00")], tokenizer, markers)
    later = fingerprint([system("2025-01-01 10:07")], tokenizer, markers)
    assert first.digests == later.digests


def test_a_continuation_nominates_its_session(tokenizer: ModelTokenizer,
                                              markers: Markers) -> None:
    """The next turn of a session (after client rewrites) nominates the session."""
    session = fingerprint(agent_conversation(), tokenizer, markers)
    next_turn = [*rewritten_by_client(agent_conversation()),
                 {"role": "assistant", "content": "Here it is."},
                 {"role": "user", "content": "Thanks."}]
    incoming = fingerprint(next_turn, tokenizer, markers)
    assert shared_leading(incoming, session) == len(session)
    assert nominates(incoming, session)


def test_conversations_sharing_system_and_first_message_do_not_nominate(
        tokenizer: ModelTokenizer, markers: Markers) -> None:
    """Same system prompt, same first user message, different replies: no nomination."""
    start = agent_conversation()[:2]
    one = fingerprint([*start, {"role": "assistant", "content": "Let me check with ls."},
                       {"role": "user", "content": "ok"}], tokenizer, markers)
    two = fingerprint([*start, {"role": "assistant", "content": "I will use find."},
                       {"role": "user", "content": "ok"}], tokenizer, markers)
    assert shared_leading(one, two) == 2
    assert not nominates(one, two)
    assert not nominates(two, one)


def test_sharing_only_the_system_prompt_never_clears_the_bar(tokenizer: ModelTokenizer,
                                                             markers: Markers) -> None:
    """A fresh conversation of the same client shares one segment, far below the bar."""
    session = fingerprint(agent_conversation(), tokenizer, markers)
    fresh = fingerprint([agent_conversation()[0],
                         {"role": "user", "content": "Write a haiku about caches."}],
                        tokenizer, markers)
    assert shared_leading(fresh, session) == 1
    assert not nominates(fresh, session)


def test_markerless_prompts_never_clear_the_bar(tokenizer: ModelTokenizer,
                                                markers: Markers) -> None:
    """A raw prompt without message markers never nominates, even an identical one."""
    raw = "\n\n".join(fingerprint_view(message) for message in agent_conversation())
    prompt = chain(tokenizer.encode(raw), markers.openers)
    assert len(prompt) == 1
    assert not nominates(prompt, prompt, bar=1)
    assert not nominates(prompt, fingerprint(agent_conversation(), tokenizer, markers))


def test_a_long_conversation_tokenizes_only_its_new_messages(tokenizer: ModelTokenizer,
                                                             markers: Markers) -> None:
    """With a warm cache, a request with one more message costs exactly one tokenization."""
    cache = MessageTokenCache()
    messages = agent_conversation()
    chain_for_messages(messages[:-1], tokenizer, cache, markers)
    misses = cache.stats.misses
    warm = chain_for_messages(messages, tokenizer, cache, markers)
    assert cache.stats.misses == misses + 1
    assert warm == fingerprint(messages, tokenizer, markers)


# -- the memo of prefix chains -----------------------------------------------------------

def long_conversation(turns: int) -> list[Message]:
    """``turns`` user/assistant exchanges after the agent conversation."""
    messages = agent_conversation()
    for turn in range(turns):
        messages.append({"role": "assistant", "content": f"Done step {turn}."})
        messages.append({"role": "user", "content": f"Now do step {turn + 1} of the plan."})
    return messages


def keys_of(messages: list[Message]) -> list[bytes]:
    return prefix_keys([digest(m) for m in messages])


def test_prefix_keys_commit_to_every_message_before_them() -> None:
    """keys[i] changes when any message up to i changes, and only then."""
    messages = agent_conversation()
    keys = keys_of(messages)
    assert len(keys) == len(messages) == len(set(keys))
    edited = copy.deepcopy(messages)
    edited[2]["content"] = "edited"
    changed = keys_of(edited)
    assert changed[:2] == keys[:2]
    assert all(a != b for a, b in zip(changed[2:], keys[2:], strict=True))
    assert prefix_keys([]) == []
    digests = [digest(m) for m in messages]
    scoped = prefix_keys(digests, b"tenant")
    assert scoped == prefix_keys(digests, b"tenant")
    assert not set(scoped) & set(keys)
    assert not set(scoped) & set(prefix_keys(digests, b"tenan"))


def test_the_token_cache_keeps_scopes_apart(smollm: ModelTokenizer) -> None:
    cache = MessageTokenCache()
    first = cache.tokens("hello", smollm, b"a")
    assert cache.tokens("hello", smollm, b"b") == first
    assert (cache.stats.hits, cache.stats.misses) == (0, 2)
    cache.tokens("hello", smollm, b"a")
    assert cache.stats.hits == 1


def test_memo_extends_the_longest_known_prefix_to_the_whole_chain(
        tokenizer: ModelTokenizer, markers: Markers) -> None:
    """A resent history with new messages is extended from the chain memoised for the last
    request: equal to the chain computed whole, tokenizing only the new messages."""
    memo, cache = ChainMemo(), MessageTokenCache()
    messages = long_conversation(20)
    first, later = messages[:-3], messages
    keys = keys_of(later)
    assert memo.longest(keys) == (0, None)
    start = chain_for_messages([], tokenizer, cache, markers)
    memo.extend(keys, 0, start, first, tokenizer, cache, markers)
    covered, known = memo.longest(keys)
    assert covered == len(first)
    assert known == fingerprint(first, tokenizer, markers)
    misses = cache.stats.misses
    whole = memo.extend(keys, covered, known, later[covered:], tokenizer, cache, markers)
    assert whole == fingerprint(later, tokenizer, markers)
    assert cache.stats.misses == misses + 3
    assert memo.longest(keys) == (len(later), whole)


def test_memo_keeps_checkpoints_so_an_edit_costs_only_the_rest(
        tokenizer: ModelTokenizer, markers: Markers) -> None:
    """A client that rewrites a message deep in its history still finds the chain of the
    last checkpoint before the edit; the chain it gets is the one computed whole."""
    memo, cache = ChainMemo(), MessageTokenCache()
    messages = long_conversation(2 * CHECKPOINT_EVERY)
    keys = keys_of(messages)
    start = chain_for_messages([], tokenizer, cache, markers)
    memo.extend(keys, 0, start, messages, tokenizer, cache, markers)
    # the first message (the system prompt new conversations share), every
    # CHECKPOINT_EVERY-th, and the whole request
    assert len(memo) == len(messages) // CHECKPOINT_EVERY + 2
    assert memo.longest(keys[:1]) == (1, fingerprint(messages[:1], tokenizer, markers))
    edited = copy.deepcopy(messages)
    at = CHECKPOINT_EVERY + 5
    edited[at]["content"] += " (edited)"
    edited_keys = keys_of(edited)
    covered, known = memo.longest(edited_keys)
    assert covered == CHECKPOINT_EVERY
    assert known == fingerprint(messages[:CHECKPOINT_EVERY], tokenizer, markers)
    assert known is not None
    rebuilt = memo.extend(edited_keys, covered, known, edited[covered:], tokenizer, cache,
                          markers)
    assert rebuilt == fingerprint(edited, tokenizer, markers)
    assert shared_leading(rebuilt, fingerprint(messages, tokenizer, markers)) == at


def test_memo_is_a_bounded_lru(smollm: ModelTokenizer) -> None:
    markers = markers_for(smollm)
    assert markers is not None
    memo, cache = ChainMemo(max_entries=2), MessageTokenCache()
    start = chain_for_messages([], smollm, cache, markers)
    conversations = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
    keys = [keys_of(c) for c in conversations]
    memo.extend(keys[0], 0, start, conversations[0], smollm, cache, markers)
    memo.extend(keys[1], 0, start, conversations[1], smollm, cache, markers)
    assert memo.longest(keys[0])[0] == 1  # used: now the most recent
    memo.extend(keys[2], 0, start, conversations[2], smollm, cache, markers)
    assert len(memo) == 2
    assert memo.longest(keys[1]) == (0, None)
    assert memo.longest(keys[0])[0] == memo.longest(keys[2])[0] == 1
    with pytest.raises(ValueError, match="at least 1"):
        ChainMemo(max_entries=0)


class CharCounter:
    """A tokenizer that counts the characters it is handed."""

    def __init__(self, inner: ModelTokenizer) -> None:
        self.inner = inner
        self.chars = 0

    def encode(self, text: str) -> list[int]:
        self.chars += len(text)
        return self.inner.encode(text)


def test_a_long_message_is_tokenized_by_its_edges_alone(tokenizer: ModelTokenizer,
                                                        markers: Markers) -> None:
    """A new session arriving with a long history pays a few dozen characters a message:
    its segment hashes only its first and last tokens, so only its two ends are tokenized,
    and an edit of its interior leaves its digest as it was."""
    body = " ".join(f"line {i}: the parser reads token {i * 7} of the stream" for i in range(400))
    message: Message = {"role": "user", "content": f"Start here. {body} End here."}
    counter = CharCounter(tokenizer)
    chained = chain_for_messages([message], counter, MessageTokenCache(), markers)
    assert counter.chars <= 2 * EDGE_CHARS + len(markers.open) + len(markers.close)
    edited: Message = {**message, "content": message["content"].replace("token 700", "token 9")}
    assert fingerprint([edited], tokenizer, markers).digests == chained.digests
    shorter: Message = {**message, "content": message["content"].replace(" End here.", "")}
    assert fingerprint([shorter], tokenizer, markers).digests != chained.digests


def test_edges_of_a_short_view_are_the_whole_wrapped_view(markers: Markers) -> None:
    assert edge_texts("user\nhello", markers) == (markers.wrap("user\nhello"),)
    long = "x" * (2 * EDGE_CHARS + 1)
    opening, end = edge_texts(long, markers)
    assert opening == markers.open + long[:EDGE_CHARS]
    assert end == long[-EDGE_CHARS:] + markers.close

"""Tenant B attacks tenant A through the tenant listener (issue 16), in front of a real
llama-server, in its two configurations: default flags (its host prompt cache, shared by
all slots, is on) and ``--cache-ram 0``.

A is the victim: a session holding a ~300-token system prompt. B has its own bearer token
and guesses A's system prompt. Every attack must end in a 4xx, or in B seeing no more
cached tokens than a fresh conversation of its own would: the control is B's cached
tokens for a *wrong* guess of the same length, and a right guess may see at most
``SLACK`` tokens more (the template's shared opening is in both).

The proxy runs under a real uvicorn (its two listeners, as ``proxy.listen.server`` serves them);
the operator listener is only used for A's checks, never by B.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.listen.http_limits import http_options
from prefixpin.proxy.settings import Settings
from tests.e2e.helpers import filler
from tests.fakes.servers import serve_in_thread
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.scrape import metric
from tests.unit.test_paths import REJECT, aliases

pytestmark = [pytest.mark.llama, pytest.mark.slow]

Json = dict[str, Any]
SLACK = 8  # tokens: a right guess may see this many more cached tokens than a wrong one
A_TOKEN, B_TOKEN = "tenant-a-secret-token", "tenant-b-other-token"
A_SESSION = "a-support-desk"
SECRET = ("You are the support assistant of ACME tenant A. Confidential instructions: "
          + filler(220, seed=11))
WRONG = ("You are the support assistant of ACME tenant A. Confidential instructions: "
         + filler(220, seed=97))
PROMPT_COUNTER = "llamacpp:prompt_tokens_total"


# ------------------------------------------------------------------------------ rig

@pytest.fixture(scope="module", params=["host-cache", "cache-ram-0"])
def engine(request: pytest.FixtureRequest) -> Iterator[LlamaServerProcess]:
    """2 slots of 2k, --slot-save-path; default flags (host cache on) or --cache-ram 0."""
    extra = [] if request.param == "host-cache" else ["--cache-ram", "0"]
    with run_llama_server("smollm2", slots=2, ctx_per_slot=2048, extra=extra) as handle:
        yield handle


# B on the engine whose host cache is on: the backend is A's (namespace= in an upstreams
# file), so B's request is refused before placement.
B_REFUSED = "namespace_not_served"


def host_cache(engine: LlamaServerProcess) -> bool:
    return "--cache-ram" not in engine.args


@dataclass
class Rig:
    url: str  # the tenant listener
    admin: str  # the operator listener (A's checks only)
    engine: LlamaServerProcess

    def chat(self, token: str, system: str, user: str, *, session: str | None = None,
             path: str = "/v1/chat/completions", extra: Json | None = None,
             headers: dict[str, str] | None = None, history: list[Json] | None = None,
             ) -> httpx.Response:
        body: Json = {"model": "m", "max_tokens": 3, "temperature": 0,
                      "messages": [{"role": "system", "content": system}, *(history or []),
                                   {"role": "user", "content": user}], **(extra or {})}
        sent = {"authorization": f"Bearer {token}", **(headers or {})}
        if session is not None:
            sent["x-session-id"] = session
        return httpx.post(f"{self.url}{path}", json=body, headers=sent, timeout=180)

    def engine_slots(self) -> list[Json]:
        slots: list[Json] = httpx.get(f"{self.engine.url}/slots", timeout=30).json()
        return slots

    def prefilled(self) -> float:
        return metric(self.engine.url, PROMPT_COUNTER)


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    value: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return value


def prompt_tokens(response: httpx.Response) -> int:
    value: int = response.json()["usage"]["prompt_tokens"]
    return value


@contextlib.contextmanager
def proxy(engine: LlamaServerProcess, **settings: Any) -> Iterator[Rig]:
    for slot in range(2):
        httpx.post(f"{engine.url}/slots/{slot}", params={"action": "erase"}, json={},
                   timeout=30).raise_for_status()
    # A park index of this proxy's own: no test revives what an earlier test parked.
    index = Path(tempfile.mkdtemp(prefix="prefixpin-adversarial-index-"))
    # A and B are configured tenants (``proxy.listen.tenants``); the engine with its host cache
    # on is A's alone (dedicated), so B is refused there.
    tenants = index / "tenants.toml"
    tenants.write_text(f'[tenants]\na = "{A_TOKEN}"\nb = "{B_TOKEN}"\n')
    dedicated = {engine.url: ["a"]} if host_cache(engine) else {}
    apps = create_apps(Settings(upstream=engine.url, health_interval_s=0.5,
                                park_index_dir=index, tenants_file=tenants,
                                upstream_namespaces=dedicated, **settings))
    with serve_in_thread(apps.tenant_listener, **http_options()) as url, serve_in_thread(
            apps.operator_listener, **http_options()) as admin:
        yield Rig(url, admin, engine)


@dataclass
class Victim:
    first: httpx.Response
    reply: str

    def next_turn(self, rig: Rig) -> httpx.Response:
        history = [{"role": "user", "content": "How do I reset my password?"},
                   {"role": "assistant", "content": self.reply}]
        return rig.chat(A_TOKEN, SECRET, "And my username?", session=A_SESSION,
                        history=history)


def victim(rig: Rig) -> Victim:
    first = rig.chat(A_TOKEN, SECRET, "How do I reset my password?", session=A_SESSION)
    assert first.status_code == 200, first.text
    assert prompt_tokens(first) > 250
    return Victim(first, first.json()["choices"][0]["message"]["content"])


def assert_a_still_cached(rig: Rig, a: Victim) -> None:
    """A's next turn reuses its whole prompt (nothing B did erased or replaced it)."""
    again = a.next_turn(rig)
    assert cached(again) >= prompt_tokens(a.first) - 1, again.json()["usage"]
    view = httpx.get(f"{rig.admin}/sessions", timeout=30).json()
    [session] = [s for group in view["namespaces"].values() for s in group
                 if s["key"] == A_SESSION]
    assert session["turns"][-1]["cached_tokens"] >= prompt_tokens(a.first) - 1


def control(rig: Rig, *, session: str, **kwargs: Any) -> int:
    """B's cached tokens for a wrong guess of the same length: what a fresh conversation of
    B's own sees (its own namespace, the same slot history)."""
    return cached(control_turn(rig, session=session, **kwargs))


def control_turn(rig: Rig, *, session: str, **kwargs: Any) -> httpx.Response:
    """``control``'s request itself (for a test that goes on with its conversation)."""
    return rig.chat(B_TOKEN, WRONG, "hello", session=session, **kwargs)


@contextlib.contextmanager
def busy_slot(rig: Rig, session: str, system: str, first: httpx.Response) -> Iterator[None]:
    """B's session ``session`` generating a long answer meanwhile (its slot is busy).

    The long answer is the next turn of the conversation ``first`` opened (same system
    prompt, its "hello" and reply as history), so it resumes on that conversation's own
    slot. A different opening under the same key would be a side history, free to take
    whichever main slot is worth least, A's included, and the test would not reach A's."""
    assert first.status_code == 200, first.text
    history = [{"role": "user", "content": "hello"},
               {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}]
    done = threading.Event()

    def generate() -> None:
        try:
            rig.chat(B_TOKEN, system, "Write a long story about the sea.", session=session,
                     history=history, extra={"max_tokens": 400, "ignore_eos": True})
        finally:
            done.set()

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not any(s.get("is_processing") for s in rig.engine_slots()):
        assert time.monotonic() < deadline, "b-1 never ran"
        assert not done.is_set(), "b-1 ended before its slot was seen busy"
        time.sleep(0.05)
    try:
        yield
    finally:
        thread.join(300)


def assert_refused(response: httpx.Response, code: str) -> None:
    assert 400 <= response.status_code < 500, response.text
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == code, response.text


# ------------------------------------------------ 1. operator paths on the tenant port

OPERATOR_ATTACKS: list[tuple[str, str, Json | None]] = [
    ("POST", "/slots/0?action=erase", {}),
    ("POST", "/slots/1?action=erase", {}),
    ("POST", "/slots/0?action=save", {"filename": "park-index.sqlite3"}),
    ("POST", "/slots/0?action=restore", {"filename": "park-index.sqlite3"}),
    ("POST", "/slots/0?action=restore", {"filename": "../../etc/passwd"}),
    ("POST", "/slots/1?action=restore", {"filename": "a-support-desk.bin"}),
    ("GET", "/slots", None), ("GET", "/slots?fail_on_no_slot=1", None),
    ("GET", "/metrics", None), ("GET", "/sessions", None), ("GET", "/", None),
    ("GET", "/_prefixpin/index.html", None), ("POST", "/slots", {}),
    ("DELETE", "/slots/0", None), ("POST", "/props", {"default_generation_settings": {}}),
]


def test_operator_paths_are_refused_and_a_keeps_its_cache(engine: LlamaServerProcess) -> None:
    with proxy(engine) as rig:
        a = victim(rig)
        held = {s["id"]: s.get("n_prompt_tokens") for s in rig.engine_slots()}
        before = rig.prefilled()
        for method, path, body in OPERATOR_ATTACKS:
            response = httpx.request(method, f"{rig.url}{path}", json=body, timeout=30,
                                     headers={"authorization": f"Bearer {B_TOKEN}"})
            assert_refused(response, "operator_only")
            assert "--admin-listen" in response.json()["error"]["message"]
        # Nothing reached the engine: no slot erased or restored, no file saved.
        assert {s["id"]: s.get("n_prompt_tokens") for s in rig.engine_slots()} == held
        assert rig.prefilled() == before
        assert engine.slot_save_path is not None
        assert list(engine.slot_save_path.iterdir()) == []
        assert_a_still_cached(rig, a)


# ------------------------------------------------------------ 2. slot and cache controls

@pytest.mark.parametrize("path", ["/completion", "/infill", "/completions?x=1"])
def test_native_routes_with_id_slot_get_the_proxys_slot(engine: LlamaServerProcess,
                                                       path: str) -> None:
    """llama-server's native /completion, /completions and /infill take id_slot,
    cache_prompt and n_cmpl and report cache_n: the pipeline serves them with the proxy's
    own slot and cache controls, gated like chat, so B naming A's slot with A's prompt
    sees no more of A's cache than a fresh prompt would."""
    with proxy(engine) as rig:
        a = victim(rig)
        body = {"prompt": SECRET, "id_slot": a_slot_of(rig), "n_cmpl": 2, "n": 2,
                "cache_prompt": True, "n_predict": 1, "input_prefix": SECRET,
                "input_suffix": ""}
        response = httpx.post(f"{rig.url}{path}", json=body, timeout=60,
                              headers={"authorization": f"Bearer {B_TOKEN}"})
        if host_cache(engine):
            assert_refused(response, B_REFUSED)
        elif path == "/infill":
            # SmolLM2 has no fill-in-the-middle tokens: llama-server's own refusal.
            assert response.status_code == 501, response.text
        else:
            assert response.status_code == 200, response.text
            assert response.json()["timings"]["cache_n"] <= SLACK
        assert_a_still_cached(rig, a)


def a_slot_of(rig: Rig) -> int:
    return slot_of(rig, A_SESSION)


def slot_of(rig: Rig, key: str) -> int:
    """The slot the main session under ``key`` holds (the whole view when it is not one)."""
    view = httpx.get(f"{rig.admin}/sessions", timeout=30).json()
    [session] = [s for group in view["namespaces"].values() for s in group
                 if s["key"] == key and s["kind"] == "main"]
    slot = session["slot"]
    assert isinstance(slot, int), view
    return slot


def test_slot_and_cache_controls_in_the_body_buy_nothing(engine: LlamaServerProcess) -> None:
    """B names A's slot, asks for cache_prompt and n_cmpl, with a right guess of A's system
    prompt: it sees no more cached tokens than its wrong guess on the same footing."""
    controls = {"cache_prompt": True, "n_cmpl": 2}
    with proxy(engine) as rig:
        a = victim(rig)
        controls["id_slot"] = a_slot_of(rig)
        right = rig.chat(B_TOKEN, SECRET, "hello", session="b-right", extra=controls)
        if host_cache(engine):
            assert_refused(right, B_REFUSED)
            assert_a_still_cached(rig, a)
            return
        right_cached = cached(right)
        assert_a_still_cached(rig, a)
    with proxy(engine) as rig:  # the same history with a wrong guess
        victim(rig)
        controls["id_slot"] = a_slot_of(rig)
        wrong = control(rig, session="b-right", extra=controls)
    assert right_cached <= wrong + SLACK, (right_cached, wrong)
    assert right_cached < prompt_tokens(right) // 2


def test_b_gets_the_raw_template_of_a_guess_and_sends_it_as_a_prompt(
        engine: LlamaServerProcess) -> None:
    """/apply-template is a tenant's path: B renders its guess exactly as A's prompt was
    rendered and sends the text to /v1/completions, so the tokens match A's one for one.
    Still no more cached tokens than a wrong guess rendered the same way."""
    messages = [{"role": "system", "content": SECRET},
                {"role": "user", "content": "How do I reset my password?"}]
    with proxy(engine) as rig:
        a = victim(rig)
        rendered = httpx.post(f"{rig.url}/apply-template", json={"messages": messages},
                              headers={"authorization": f"Bearer {B_TOKEN}"}, timeout=30)
        assert rendered.status_code == 200, rendered.text
        prompt = rendered.json()["prompt"]
        right = httpx.post(f"{rig.url}/v1/completions", timeout=120,
                           headers={"authorization": f"Bearer {B_TOKEN}"},
                           json={"model": "m", "prompt": prompt, "max_tokens": 1,
                                 "id_slot": a_slot_of(rig), "cache_prompt": True})
        if host_cache(engine):
            assert_refused(right, B_REFUSED)
            return
        right_cached = cached(right)
        wrong_prompt = prompt.replace(SECRET, WRONG)
        wrong = httpx.post(f"{rig.url}/v1/completions", timeout=120,
                           headers={"authorization": f"Bearer {B_TOKEN}"},
                           json={"model": "m", "prompt": wrong_prompt, "max_tokens": 1})
        assert_a_still_cached(rig, a)
    assert right_cached <= cached(wrong) + SLACK, (right_cached, cached(wrong))


# ------------------------------------------------------------- 3. the host prompt cache

def test_a_new_session_guessing_a_prompt(engine: LlamaServerProcess) -> None:
    """Default flags: B is refused outright (the engine's host cache crosses slots).
    --cache-ram 0: B is served, and a right guess sees no more than a wrong one, on a free
    slot and on A's slot (B pushes A out of its slot first)."""
    with proxy(engine) as rig:
        a = victim(rig)
        right = rig.chat(B_TOKEN, SECRET, "hello", session="b-1")
        if host_cache(engine):
            assert_refused(right, B_REFUSED)
            assert "dedicated to other" in right.json()["error"]["message"]
            health = httpx.get(f"{rig.url}/healthz", timeout=30).json()
            assert health["upstreams"][0]["shared_cache"]
            assert_a_still_cached(rig, a)
            return
        on_free_slot = cached(right)
        # B keeps its own slot busy (a long answer in b-1), so its next session can only
        # take A's slot: the slot changes namespace with A's KV still in it.
        a_slot = a_slot_of(rig)
        with busy_slot(rig, "b-1", SECRET, right):
            on_a_slot = rig.chat(B_TOKEN, SECRET, "hello", session="b-2")
        on_a_slot_cached = cached(on_a_slot)
        assert slot_of(rig, "b-2") == a_slot  # the test reached A's slot
    with proxy(engine) as rig:  # the control: the same moves with a wrong guess
        victim(rig)
        first_control = control_turn(rig, session="b-1")
        free_control = cached(first_control)
        a_slot = a_slot_of(rig)
        with busy_slot(rig, "b-1", WRONG, first_control):
            a_slot_control = control(rig, session="b-2")
        assert slot_of(rig, "b-2") == a_slot  # the control reached A's slot too
    assert on_free_slot <= free_control + SLACK, (on_free_slot, free_control)
    assert on_a_slot_cached <= a_slot_control + SLACK, (on_a_slot_cached, a_slot_control)


# ------------------------------------------------------------------- 4. path aliases

PIPELINE = ["/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
            "/completion"]
NATIVE = ("/completions", "/completion")  # llama-server's own answer: no "usage"
ADMIN = ["/slots/0"]


def raw_request(base: str, method: bytes, target: bytes, body: bytes,
                token: str = B_TOKEN) -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    request = (method + b" " + target + b" HTTP/1.1\r\nhost: proxy\r\n"
               b"authorization: Bearer " + token.encode() + b"\r\n"
               b"content-type: application/json\r\n"
               b"content-length: " + str(len(body)).encode() + b"\r\n"
               b"connection: close\r\n\r\n" + body)
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


def pipeline_body(path: str) -> bytes:
    if "chat" in path:
        body: Json = {"model": "m", "max_tokens": 1, "temperature": 0, "id_slot": 1,
                      "cache_prompt": True, "messages": [{"role": "user", "content": "hi"}]}
    else:
        body = {"model": "m", "max_tokens": 1, "temperature": 0, "prompt": "hi",
                "id_slot": 1, "cache_prompt": True}
    return httpx.Request("POST", "http://x", json=body).content


def wire_aliases(path: str) -> list[tuple[str, bytes, object]]:
    """The aliases a request line can carry: a space or a tab ends the request target
    (the HTTP parser reads ``/completion `` as ``/completion``), so those are the path
    itself on the wire, tested as paths in tests/unit/test_paths.py."""
    return [(how, raw, expected) for how, raw, expected in aliases(path)
            if b" " not in raw and b"\t" not in raw]


# Path handling does not depend on the engine's flags: run once, on one engine.
@pytest.mark.parametrize("engine", ["cache-ram-0"], indirect=True)
def test_path_aliases_are_the_route_they_mean_or_400(engine: LlamaServerProcess) -> None:
    """Every alias we know how to make (``tests.unit.test_paths.aliases``) of the pipeline
    routes and of /slots/0, sent raw over a socket: served by the route it
    means with the proxy's guards (the pipeline; a 403 for an operator path) or a 400;
    never a 500, never an engine admin route reached (no slot erased, nothing prefilled
    past the pipeline's own requests)."""
    outcomes: dict[str, dict[int, int]] = {}
    with proxy(engine) as rig:
        a = victim(rig)
        held = {s["id"]: s.get("n_prompt_tokens") for s in rig.engine_slots()}
        for path in ADMIN:
            query = b"?action=erase" if path.startswith("/slots") else b""
            body = b'{"id_slot": 0, "prompt": "x", "n_predict": 1}'
            seen = outcomes.setdefault(path, {})
            for how, raw, expected in wire_aliases(path):
                status, payload = raw_request(rig.url, b"POST", raw + query, body)
                seen[status] = seen.get(status, 0) + 1
                assert status < 500, (how, raw, payload)
                if expected is REJECT:
                    assert status == 400, (how, raw, payload)
                else:
                    assert status == 403, (how, raw, payload)
                    assert b"operator_only" in payload, (how, raw, payload)
        assert {s["id"]: s.get("n_prompt_tokens") for s in rig.engine_slots()} == held
        for path in PIPELINE:
            body = pipeline_body(path)
            seen = outcomes.setdefault(path, {})
            for how, raw, expected in wire_aliases(path):
                status, payload = raw_request(rig.url, b"POST", raw, body)
                seen[status] = seen.get(status, 0) + 1
                assert status < 500, (how, raw, payload)
                if expected is REJECT:
                    assert status == 400, (how, raw, payload)
                elif expected == path:
                    assert status == 200, (how, raw, payload)
                    answer = b'"stop":true' if path in NATIVE else b'"usage"'
                    assert answer in payload, (how, raw, payload)
                else:  # an alias meaning another path (e.g. '/..' at the end): not served
                    assert status in (400, 403, 404), (how, raw, payload)
        # A is untouched: its slot still holds its prompt (B's aliases were pinned to
        # slots of their own by the proxy, whatever id_slot said).
        assert_a_still_cached(rig, a)
    for path, seen in outcomes.items():
        assert seen.get(400, 0) > 100, (path, seen)
        assert seen.get(200 if path in PIPELINE else 403, 0) > 10, (path, seen)


# ------------------------------------------------------------------------- 5. join

def engine_tasks(engine: LlamaServerProcess) -> int:
    return Path(engine.log_path).read_text(errors="replace").count("processing task")


def long_body() -> Json:
    return {"model": "m", "max_tokens": 96, "temperature": 0, "stream": False,
            "messages": [{"role": "system", "content": SECRET},
                         {"role": "user", "content": "Write a long story about a ship."}]}


@pytest.mark.parametrize("retry", [False, True])
def test_b_never_joins_a_generation(engine: LlamaServerProcess, retry: bool,
                                    caplog: pytest.LogCaptureFixture) -> None:
    """B sends A's exact body (session header included) while A's generation runs: B gets
    a generation of its own (the engine runs one more task), never A's answer, even when
    it says it retries (x-stainless-retry-count: 1): another namespace never joins. A's own
    retry does join (the join is on, so the test means something)."""
    caplog.set_level(logging.INFO, "prefixpin")
    headers = {"x-session-id": A_SESSION}
    retried = {"x-stainless-retry-count": "1"} if retry else {}
    with proxy(engine) as rig:
        victim(rig)
        results: dict[str, httpx.Response] = {}

        def send(name: str, token: str, extra: dict[str, str]) -> None:
            results[name] = httpx.post(
                f"{rig.url}/v1/chat/completions", json=long_body(), timeout=300,
                headers={"authorization": f"Bearer {token}", **headers, **extra})

        tasks_before = engine_tasks(engine)
        first = threading.Thread(target=send, args=("a", A_TOKEN, {}))
        first.start()
        deadline = time.monotonic() + 60
        while engine_tasks(engine) == tasks_before and time.monotonic() < deadline:
            time.sleep(0.02)  # A's generation is running on the engine
        b = threading.Thread(target=send, args=("b", B_TOKEN, retried))
        a_retry = threading.Thread(target=send, args=("a-retry", A_TOKEN,
                                                      {"x-stainless-retry-count": "1"}))
        b.start()
        time.sleep(0.1)
        a_retry.start()
        for thread in (first, b, a_retry):
            thread.join(300)
        tasks = engine_tasks(engine) - tasks_before
    a_answer, b_answer = results["a"], results["b"]
    assert a_answer.status_code == 200, a_answer.text
    assert results["a-retry"].status_code == 200
    assert results["a-retry"].json()["id"] == a_answer.json()["id"]  # A's retry joined
    joined = [r for r in caplog.records if r.getMessage() == "joined in flight"]
    assert len(joined) == 1, [getattr(r, "fields", {}) for r in joined]
    if host_cache(engine):
        assert_refused(b_answer, B_REFUSED)
        assert tasks == 1
        return
    assert b_answer.status_code == 200, b_answer.text
    assert b_answer.json()["id"] != a_answer.json()["id"]
    assert tasks == 2, tasks  # A's and B's own; A's retry ran none
    assert b_answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] <= SLACK


# ----------------------------------------------- 6. an API no lane serves, passed through

def test_an_api_no_lane_serves_is_not_a_side_door(engine: LlamaServerProcess) -> None:
    """``POST /api/chat`` on a llama-server lane: no lane serves the Ollama API, so the
    router forwards it as it came (``Router.handle``), past the gate and the slot pin.
    Upstream llama-server routes ``/api/chat`` to its chat handler; the rig's build
    answers 404. Either way B must see a 4xx or no more cached tokens than a wrong guess."""
    def guess(rig: Rig, system: str) -> httpx.Response:
        return httpx.post(f"{rig.url}/api/chat", timeout=120, headers={
            "authorization": f"Bearer {B_TOKEN}"}, json={
            "model": "m", "stream": False, "max_tokens": 1, "cache_prompt": True,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "How do I reset my password?"}]})

    with proxy(engine) as rig:
        a = victim(rig)
        right = guess(rig, SECRET)
        assert right.status_code != 500, right.text
        if 400 <= right.status_code < 500:
            assert_a_still_cached(rig, a)
            return
        wrong = guess(rig, WRONG)
    assert right.json()["timings"]["cache_n"] <= wrong.json()["timings"]["cache_n"] + SLACK


# ------------------------------------------------ unknown keys

@pytest.mark.parametrize("token", ["", "tenant-a-secret-toke", "guess"])
def test_an_unknown_key_is_a_401_and_reaches_nothing(engine: LlamaServerProcess,
                                                     token: str) -> None:
    """B without a configured key (none, a near miss of A's, a guess) is a 401 on the
    pipeline and the pass-through paths: the engine prefills nothing, A keeps its cache."""
    with proxy(engine) as rig:
        a = victim(rig)
        before = rig.prefilled()
        headers = {"authorization": f"Bearer {token}"} if token else {}
        chat = httpx.post(f"{rig.url}/v1/chat/completions", headers=headers, timeout=60,
                          json={"messages": [{"role": "system", "content": SECRET},
                                             {"role": "user", "content": "hi"}]})
        tokenize = httpx.post(f"{rig.url}/tokenize", headers=headers, timeout=60,
                              json={"content": SECRET})
        assert rig.prefilled() == before
        assert_a_still_cached(rig, a)
    assert chat.status_code == tokenize.status_code == 401
    assert chat.json()["error"]["code"] == "invalid_api_key"

"""core/serve.py's guards over real HTTP (uvicorn on 127.0.0.1, or `python -m core.serve` as its
own process): numerics as the other entry points, API key, JSON only, body / prompt / answer /
queue limits, a non-streamed answer stopped by a disconnect, tokenising off the event loop."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from app.remote import RemoteBackend, parse_metrics
from core.config import ConfigError
from core.decoding.engine import Engine
from core.serve import API_KEY_ENV, ServeConfig, build_app, check_args, is_loopback, main, parse_args
from tests.test_serve import ServeProcess, ServerThread, engine_text, saved_tiny, user
from tests.tiny import oracle_head, tiny_target

KEY = "k3y-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"messages": user("w5 w6"), "max_tokens": 4000, "temperature": 0}


def test_tree_settings_go_over_the_engines_default_tree():
    """--depth, --top-k, --total-tokens, --lookup: TreeConfig.override on the engine's default tree,
    for every answer (the server ignored them before)."""
    from core.config import TreeConfig
    from core.serve import parse
    from core.decoding.treestore import TreeChoice

    limits = check_args(parse_args(["--depth", "2", "--lookup", "0"]))
    assert limits.tree == (("depth", 2), ("lookup", 0)) and check_args(parse_args([])).tree == ()
    engine = eos_free_engine()
    shipped = TreeConfig(depth=3, top_k=8, total_tokens=10, lookup=24, lookup_total_tokens=6,
                         long_context=((2048, 0, 0),))
    engine.tree_choice = TreeChoice(shipped, "shipped with the head")
    body = {"messages": user("w5 w6"), "max_tokens": 4}
    assert parse(body, engine, "tiny", True, limits).config.tree == shipped.override(depth=2, lookup=0)
    assert parse(body, engine, "tiny", True).config.tree == shipped
    with pytest.raises(ConfigError, match="tree depth"):
        check_args(parse_args(["--depth", "0"]))


def eos_free_engine() -> Engine:
    target = tiny_target(mix=0.005, seed=3, max_pos=4096)
    target.model.lm_head.weight[0].zero_()  # eos logit 0: never the argmax, so answers run to their cap
    return Engine(target, oracle_head(target))


class SlowTemplate:
    """Wraps a tokenizer's chat template: a message containing "slow" takes 1.5 s to tokenise."""

    def __init__(self, tokenizer):
        self.original, self.entered = tokenizer.apply_chat_template, threading.Event()
        tokenizer.apply_chat_template = self

    def __call__(self, messages, *args, **kwargs):
        if any("slow" in m["content"] for m in messages):
            self.entered.set()
            time.sleep(1.5)
        return self.original(messages, *args, **kwargs)


@pytest.fixture(scope="module")
def guarded():
    """Every guard set tight, so each limit is reached with tiny requests."""
    server = ServerThread(build_app(eos_free_engine(), "tiny", ServeConfig(
        api_key=KEY, max_body_bytes=4096, max_prompt_tokens=40, default_max_tokens=7, max_queue=1)))
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def open_server():
    """The default settings (no key, as `python -m core.serve` on 127.0.0.1), a slow chat template."""
    engine = eos_free_engine()
    slow = SlowTemplate(engine.target.tokenizer)
    server = ServerThread(build_app(engine, "tiny"))
    yield server.url, engine, slow
    server.stop()


def metric(url: str, name: str, headers=None) -> float:
    return parse_metrics(httpx.get(url + "/metrics", headers=headers).text)[name]


def chat(url: str, body: dict, headers=None, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=kw.pop("timeout", 30), **kw)


def error(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


# ---- 1. numerics, threads ------------------------------------------------------------------
def test_serve_defaults_to_the_numerics_of_generate_and_the_app(tmp_path):
    model, head = saved_tiny(tmp_path)
    server = ServeProcess(model, head, tmp_path, "--threads", "1", dtype=None)
    try:
        local = Engine.load(str(model), str(head))  # core.generate's and the launcher's defaults: auto, auto
        numerics = [line.strip() for line in server.lines if line.startswith("[numerics] ")]
        kernels = local.numerics.describe().split(";")[0]  # e.g. "bf16, batch-invariant kernels, ..."
        assert len(numerics) == 1 and numerics[0].startswith(f"[numerics] {kernels};"), server.output
        assert local.numerics.dtype != "float32" or local.numerics.note, "auto is bf16 unless the probe fails"
        assert "[threads] 1 torch threads" in server.output
        msgs = user("w5 w6")
        text = "".join(ev.text for ev in RemoteBackend(server.url).chat(msgs, max_tokens=24))
        assert text == engine_text(local, msgs, 24)
    finally:
        server.kill()


def test_settings_are_refused_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    for argv, says in [(["--host", "0.0.0.0"], "--host 0.0.0.0 is not a loopback address"),
                       (["--host", "192.168.1.20"], "give --api-key KEY"),
                       (["--threads", "0"], "--threads must be >= 1"),
                       (["--dtype", "float8"], "unknown --dtype 'float8'"),
                       (["--api-key", " "], "--api-key is empty"),
                       (["--max-queue", "-1"], "--max-queue must be an integer >= 0"),
                       (["--max-body-bytes", "0"], "--max-body-bytes must be an integer >= 1")]:
        assert main([*argv, "--model", "/nonexistent"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and "Traceback" not in err, (argv, err)
    with pytest.raises(SystemExit):
        parse_args(["--attention", "fast"])
    assert check_args(parse_args(["--host", "0.0.0.0", "--api-key", KEY])).api_key == KEY
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert check_args(parse_args(["--host", "0.0.0.0"])).api_key == KEY, "the key may come from the environment"
    defaults = check_args(parse_args([]))
    assert (defaults.max_body_bytes, defaults.default_max_tokens, defaults.max_prompt_tokens) == (1 << 20, 512, 8192)
    with pytest.raises(ConfigError, match="--default-max-tokens"):
        ServeConfig(default_max_tokens=0)


def test_loopback_hosts():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.4.5.6", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.2", "example.com", "10.0.0.1"))


# ---- 2. who may ask ------------------------------------------------------------------------
def test_an_api_key_is_required_when_set(guarded):
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(guarded + path)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert "needs an API key" in error(r) and "Authorization: Bearer <key>" in error(r)
    body = {"messages": user("w5"), "max_tokens": 3}
    assert chat(guarded, body).status_code == 401
    wrong = chat(guarded, body, {"Authorization": f"Bearer {KEY}x"})
    assert wrong.status_code == 401 and "the API key is wrong" in error(wrong)
    assert chat(guarded, body, {"Authorization": KEY}).status_code == 401, "the Bearer scheme is required"
    assert chat(guarded, body, AUTH).json()["usage"]["completion_tokens"] == 3
    client = openai.OpenAI(base_url=guarded + "/v1", api_key=KEY, max_retries=0)
    assert client.chat.completions.create(model="tiny", messages=user("w5"), max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError, match="API key is wrong"):
        openai.OpenAI(base_url=guarded + "/v1", api_key="guess", max_retries=0).models.list()


def test_only_json_bodies_are_read_and_no_cors_headers_are_sent(open_server):
    url = open_server[0]
    body = json.dumps({"messages": user("w5"), "max_tokens": 3})
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        r = httpx.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": kind} if kind else {})
        assert r.status_code == 415, kind  # a cross-site page can send these without a CORS preflight
        assert "must be JSON sent with 'Content-Type: application/json'" in error(r) and "set that header" in error(r)
    ok = httpx.post(url + "/v1/chat/completions", content=body,
                    headers={"Content-Type": "application/json; charset=utf-8"}, timeout=30)
    assert ok.status_code == 200
    evil = {"Origin": "https://evil.example"}
    preflight = httpx.options(url + "/v1/chat/completions", headers={
        **evil, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    answered = chat(url, {"messages": user("w5"), "max_tokens": 2}, evil)
    assert answered.status_code == 200
    for r in (preflight, answered, httpx.get(url + "/v1/models", headers=evil)):
        assert not [h for h in r.headers if h.lower().startswith("access-control-")], r.headers


# ---- 3. limits -----------------------------------------------------------------------------
def test_request_bodies_over_the_limit_get_413(guarded, open_server):
    big = json.dumps({"messages": user("w5"), "max_tokens": 3, "pad": "x" * 5000}).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(guarded + "/v1/chat/completions", content=big, headers=headers)
    assert r.status_code == 413
    assert error(r) == (f"the request body is {len(big)} bytes but this server accepts at most 4096 "
                        "(its --max-body-bytes); send a shorter request")
    chunked = httpx.post(guarded + "/v1/chat/completions", content=iter([big[:3000], big[3000:]]), headers=headers)
    assert chunked.status_code == 413 and "is over 4096 bytes" in error(chunked), "no Content-Length to trust"
    url, json_only = open_server[0] + "/v1/chat/completions", {"Content-Type": "application/json"}
    short = json.dumps({"messages": user("w5"), "max_tokens": 2, "pad": ""}).encode()
    limit = short[:-2] + b"x" * ((1 << 20) - len(short)) + b'"}'  # 1 MiB exactly, the default limit
    assert len(limit) == 1 << 20 and httpx.post(url, content=limit, headers=json_only, timeout=30).status_code == 200
    over = httpx.post(url, content=limit[:-2] + b'x"}', headers=json_only, timeout=30)
    assert over.status_code == 413 and f"is {(1 << 20) + 1} bytes" in error(over)


def test_prompts_over_the_token_limit_get_400_with_the_numbers(guarded, open_server):
    msgs = user("w5 " * 50)
    n = len(open_server[1].encode(msgs))  # the same tokenizer and template
    r = chat(guarded, {"messages": msgs, "max_tokens": 3}, AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert error(r) == (f"the prompt is {n} tokens but this server accepts at most 40 (its --max-prompt-tokens); "
                        "shorten the prompt")
    ids = httpx.post(guarded + "/v1/completions", json={"prompt": [5] * 41, "max_tokens": 3}, headers=AUTH)
    assert ids.status_code == 400 and "the prompt is 41 tokens" in error(ids)
    assert httpx.post(guarded + "/v1/completions", json={"prompt": [5] * 40, "max_tokens": 3},
                      headers=AUTH).status_code == 200


def test_max_tokens_left_out_defaults_to_a_cap_not_the_context(guarded, open_server):
    r = chat(guarded, {"messages": user("w5 w6"), "temperature": 0}, AUTH).json()
    assert r["usage"]["completion_tokens"] == 7 and r["choices"][0]["finish_reason"] == "length"
    done = httpx.post(guarded + "/v1/completions", json={"prompt": "w5 w6", "temperature": 0}, headers=AUTH).json()
    assert done["usage"]["completion_tokens"] == 16, "completions keep OpenAI's default of 16"
    r = chat(open_server[0], {"messages": user("w5 w6"), "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] == 512, "the default cap, not the 4,000 tokens the context leaves"


def test_a_full_queue_gets_429_with_retry_after(guarded):
    url = guarded + "/v1/chat/completions"
    with httpx.stream("POST", url, json={**LONG, "stream": True}, headers=AUTH, timeout=30) as running:
        lines = running.iter_lines()  # kept: closing this iterator would close the stream
        while "eagle" not in next(lines):  # the first answer runs
            pass
        with httpx.stream("POST", url, json={**LONG, "stream": True}, headers=AUTH, timeout=30) as waiting:
            assert waiting.status_code == 200  # admitted: it waits for the engine (--max-queue 1)
            full = chat(guarded, {"messages": user("w5"), "max_tokens": 2}, AUTH)
            assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
            assert int(full.headers["Retry-After"]) >= 1
            assert "the server is busy: one answer runs and 1 wait" in error(full) and "--max-queue" in error(full)
    deadline = time.time() + 20  # both clients left: their places free up within a step
    while (r := chat(guarded, {"messages": user("w5"), "max_tokens": 2}, AUTH)).status_code == 429:
        assert time.time() < deadline, "the queue places were not given back"
        time.sleep(0.1)
    assert r.status_code == 200 and metric(guarded, "eagle_chat_refused_busy_total", AUTH) >= 1


def test_a_non_streamed_answer_stops_when_the_client_disconnects(open_server):
    url = open_server[0]
    before = metric(url, "eagle_chat_generated_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        chat(url, LONG, timeout=0.5)  # about 5 s of work; the client gives up after 0.5 s
    deadline = time.time() + 10
    while metric(url, "eagle_chat_disconnected_total") < 1:
        assert time.time() < deadline, "the server did not notice the client had gone"
        time.sleep(0.05)
    counts = [metric(url, "eagle_chat_generated_tokens_total")]
    time.sleep(0.5)
    counts.append(metric(url, "eagle_chat_generated_tokens_total"))
    assert counts[0] == counts[1] and counts[1] - before < 4000, "generation went on after the client left"
    t0 = time.perf_counter()
    assert chat(url, {"messages": user("w5"), "max_tokens": 4}).status_code == 200
    assert time.perf_counter() - t0 < 3, "the engine was free at once"


def test_a_client_that_leaves_while_its_long_prompt_is_read_stops_the_reading(open_server, monkeypatch):
    """The answer's stop is asked before each chunk of the prompt: a disconnect during the reading ends it
    there (StopReading: nothing generated), not after the whole prompt. Each chunk is made to take 0.4 s more."""
    url, engine, _ = open_server
    real, asked = engine.generate, []

    def generate(prompt, config, on_step=None, should_stop=None, **kwargs):
        def slow_chunks():
            time.sleep(0.4)  # this chunk's reading
            asked.append(should_stop())
            return asked[-1]
        return real(prompt, config, on_step, should_stop=slow_chunks if should_stop else None, **kwargs)

    monkeypatch.setattr(engine, "generate", generate)
    before = (metric(url, "eagle_chat_generated_tokens_total"), metric(url, "eagle_chat_disconnected_total"))
    body = {"messages": user(" ".join(["w5 w6"] * 1500)), "max_tokens": 8, "temperature": 0}  # 3,000+ tokens: 3 chunks
    with pytest.raises(httpx.ReadTimeout):
        chat(url, body, timeout=0.3)  # gone during the first chunk
    deadline = time.time() + 10
    while True not in asked:
        assert time.time() < deadline, f"the reading was not told to stop (asked: {asked})"
        time.sleep(0.05)
    assert asked[-1] and len(asked) <= 2, f"it stops at a chunk boundary soon after the client left: {asked}"
    time.sleep(0.6)
    assert len(asked) <= 2 and metric(url, "eagle_chat_generated_tokens_total") == before[0], "nothing generated"
    assert metric(url, "eagle_chat_disconnected_total") == before[1] + 1
    monkeypatch.undo()
    assert chat(url, {"messages": user("w5"), "max_tokens": 4}).status_code == 200  # the engine serves on


def test_tokenising_runs_off_the_event_loop(open_server):
    url, _, slow = open_server
    slow.entered.clear()
    result = {}
    asker = threading.Thread(target=lambda: result.update(r=chat(url, {"messages": user("w5 slow"), "max_tokens": 2})))
    asker.start()
    assert slow.entered.wait(10), "the slow request did not reach the tokenizer"
    t0 = time.perf_counter()
    assert httpx.get(url + "/v1/models", timeout=5).status_code == 200
    assert time.perf_counter() - t0 < 0.5, "the event loop waited for the 1.5 s tokenisation"
    asker.join(30)
    assert result["r"].status_code == 200

"""The chat through a remote backend: the app's handlers against `python -m core.serve` started as
a separate process on a tiny model (real HTTP, nothing of ours mocked), the launcher's --backend
and --api, and the disabled controls in Debian's chromium."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import gradio as gr
import httpx
import pytest
import torch

from app.chat import engine_messages
from app.controls import (LOCAL_INFO, REMOTE_COMPARE, REMOTE_HIGHLIGHT, REMOTE_SPEC, REMOTE_TREE, SPEC_INFO,
                          SPEC_LABEL)
from app.manager import ModelManager
from app.session import Handlers
from app.state import Access, ModelChoice
from core.config import GenerationConfig
from core.decoding.engine import Engine
from tests.app_server import CHROMIUM, ROOT, Launched, Served, free_port, isolated_home
from tests.test_serve import ServeProcess, engine_text, saved_tiny
from tests.tiny import oracle_head, tiny_target

SYSTEM = "w3"
# temperature, top_p, max_new, spec, depth, top_k, tree_size, highlight
GREEDY = (0.0, 1.0, 24, True, 3, 2, 6, True)
LONG = (0.0, 1.0, 4000, True, 3, 2, 6, True)
SKIP = gr.skip()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remote")
    model, head = saved_tiny(tmp, max_pos=4096)
    proc = ServeProcess(model, head, tmp)
    proc.model, proc.head = model, head
    yield proc
    if proc.proc.poll() is None:
        proc.kill()


def local_handlers() -> Handlers:
    target = tiny_target(mix=0.0, max_pos=96)
    return Handlers(ModelManager(None, ModelChoice("tiny", None), Engine(target, oracle_head(target))), Access(),
                    adaptive=False)  # steps that do not depend on timing


def answer(h: Handlers, message, history, settings=GREEDY):
    return list(h.respond(message, history, SYSTEM, *settings, request=None))


def test_a_chat_streams_through_the_server_and_the_panel_says_remote(server):
    h = local_handlers()
    result, status, _tree, spec, depth, top_k, size, highlight, chart, compare, note = h.connect(server.url, "")
    assert status == f"**Chatting through** {server.url} — eagle-chat server, model `tiny-remote`"
    assert "Connected" in result and h.manager.engine is not None, "the local engine stays loaded"
    assert spec == gr.update(value=False, interactive=False, info=REMOTE_SPEC, label=SPEC_LABEL)
    assert all(c == gr.update(interactive=False, info=REMOTE_TREE) for c in (depth, top_k, size))
    assert highlight == gr.update(interactive=False, info=REMOTE_HIGHLIGHT)
    assert chart["title"] == "Per-step chart: local engine only" and compare["interactive"] is False
    assert note == gr.update(value=REMOTE_COMPARE, visible=True)

    outs, texts = [], []
    for out in h.respond("w5 w6", [], SYSTEM, *GREEDY, request=None):
        outs.append(out)
        texts.append(out[0][-1]["content"])  # as the page gets it at this update
    assert len(outs) >= 3 and 0 < len(texts[1]) < len(texts[-1]), \
        "the answer streams: its first piece shows at once (later ones at most ten times a second)"
    chat, history, box, _chart, stats_md, stats, tokens, notice = outs[-1]
    assert stats_md.startswith(f"**remote** · eagle-chat server at {server.url} · model `tiny-remote`")
    assert "**τ " in stats_md and "end of answer" not in stats_md and "max new tokens reached" in stats_md
    assert stats["backend"] == "remote" and stats["stats"]["tokens"] == 24 and stats["stats"]["tau"] > 1.5
    assert notice == "" and chat == history and history[0] == {"role": "user", "content": "w5 w6"}
    local = Engine.load(str(server.model), str(server.head), dtype="float64")
    msgs = engine_messages([{"role": "user", "content": "w5 w6"}], SYSTEM)
    assert history[1]["content"] == engine_text(local, msgs, 24), "greedy: the server's text is the model's"
    with pytest.warns(UserWarning, match="Side by side needs the local engine"):
        assert list(h.compare("w5", SYSTEM, 0.0, 1.0, 4, 2, 2, 4, request=None))[0][:2] == (SKIP, SKIP)
    # Continue through the server: its continuation of the answer, appended (the server's text is the model's)
    cut = [history[0], {"role": "assistant", "content": " ".join(history[1]["content"].split()[:3])}]
    more = list(h.continue_answer(cut, SYSTEM, *GREEDY, request=None))[-1]
    with torch.inference_mode():
        cfg = GenerationConfig(max_new_tokens=24, speculative=True, tree=local.default_tree)
        rest = "".join(ev.text for ev in local.generate(engine_messages(cut, SYSTEM), cfg, continue_final=True))
    assert rest.startswith(" w") and more[1] == [cut[0], {"role": "assistant", "content": cut[1]["content"] + rest}]

    stream = h.respond("w7", history, SYSTEM, *LONG, request=None)
    next(stream), next(stream), next(stream)
    h.stop(None)
    rest = list(stream)
    assert rest[-1][5]["stopped"] and "Stopped." in rest[-1][7] and "stopped by you" in rest[-1][4]
    assert len(rest[-1][1][-1]["content"].split()) < 4000
    again = answer(h, "w8", rest[-1][1])[-1]  # Stop closed the stream: the server serves the next answer
    assert again[7] == "" and again[5]["stats"]["tokens"] == 24

    sampled = (0.9, 1.0, 16, True, 3, 2, 6, True)
    first = answer(h, "w5 w6", [], sampled)[-1]  # a new seed, shown with the answer and sent to the server
    seed = first[5]["seed"]
    assert f"sampled with seed {seed} (type it into Sampling → Seed" in first[4]
    again = list(h.respond("w5 w6", [], SYSTEM, *sampled, seed=seed, request=None))[-1]
    assert again[5]["seed"] == seed and again[1][-1]["content"] == first[1][-1]["content"], \
        "the eagle-chat server repeats a sampled answer from its seed"
    assert "seed" not in answer(h, "w5 w6", [])[-1][5] and "sampled with seed" not in answer(h, "w5", [])[-1][4]

    result, status, _tree, spec, depth, *_ = h.use_local()
    assert status.startswith("**Serving** `tiny`") and "EAGLE speculation available" in status and "Numerics:" in result
    details = h.manager.details_markdown()
    assert "**Numerics:**" in details and "**CPU threads:**" in details, "the details sit in a collapsed section"
    assert spec == gr.update(value=True, interactive=True, info=SPEC_INFO, label=SPEC_LABEL)
    assert depth == gr.update(interactive=True, info=LOCAL_INFO["depth"])
    assert answer(h, "w5 w9", [])[-1][5]["mode"] == "speculative", "back on the local engine"


def test_server_killed_mid_answer_keeps_the_history_with_a_clear_notice(tmp_path):
    model, head = saved_tiny(tmp_path, max_pos=4096)
    server = ServeProcess(model, head, tmp_path)
    h = local_handlers()
    try:
        h.connect(server.url, "")
        before = answer(h, "w5", [])[-1][1]
        stream = h.respond("w6 w7", before, SYSTEM, *LONG, request=None)
        shown = next(stream)
        while not shown[1][-1]["content"]:
            shown = next(stream)
        server.kill()
        with pytest.warns(UserWarning, match="stopped responding mid-answer"):
            rest = list(stream)
    finally:
        if server.proc.poll() is None:
            server.kill()
    chat, history, _box, _chart, _stats_md, stats, _tokens, notice = rest[-1]
    assert history[:3] == before + [{"role": "user", "content": "w6 w7"}] and history[3]["content"], "text kept"
    assert (f"Note: the answer was cut short: the server at {server.url} stopped responding mid-answer; "
            "the text so far is kept") in notice
    with pytest.warns(UserWarning, match="cannot reach the server"):
        refused = answer(h, "w8", history)
    assert len(refused) == 2, "the message was shown, then taken back"
    chat, history_after, box, *panel, notice = refused[-1]
    assert chat == history_after == history and box == "w8", "the conversation as it was, the message in its box"
    assert panel == [SKIP] * 4 and "cannot reach the server" in notice


def test_a_server_that_is_not_there_is_refused_and_nothing_changes():
    h = local_handlers()
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.warns(UserWarning, match="Could not connect: cannot reach an OpenAI-compatible server"):
        out = h.connect(url, "")
    assert out[0].startswith("Could not connect") and all(o == SKIP for o in out[1:])
    assert len(out) == 11, "as many outputs as Connect has (result, header, tree origin, 8 controls)"
    assert "Errno" not in out[0] and "nothing is listening at that address (connection refused)" in out[0]
    assert h.manager.backend is None and h.manager.status_markdown().startswith("**Serving**")


def run_launcher(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "launcher.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_launcher_backend_flag(server, tmp_path):
    from gradio_client import Client

    dead = run_launcher("--backend", f"http://127.0.0.1:{free_port()}", "--no-browser")
    assert dead.returncode == 2 and "error: cannot reach an OpenAI-compatible server" in dead.stderr
    assert "Traceback" not in dead.stderr
    mixed = run_launcher("--backend", server.url, "--model", "smollm2")
    assert mixed.returncode == 2 and "loads no local model: drop --model" in mixed.stderr
    app = Launched(["--backend", server.url, "--no-browser", "--port", str(free_port())],
                   env={**isolated_home(tmp_path), "OMP_NUM_THREADS": "1"})
    try:
        assert f"Chatting through {server.url} — eagle-chat server, model `tiny-remote`" in app.output
        assert "Loading" not in app.output, "no local model is loaded"
        chat, _box, _chart, stats_md, _stats, _tokens, notice = Client(app.url, verbose=False).predict(
            "w5 w6", SYSTEM, *GREEDY, api_name="/chat")
        assert len(chat) == 2 and "**remote**" in stats_md and "τ" in stats_md and notice == ""
    finally:
        app.stop()


def listening(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code < 500
    except httpx.HTTPError:
        return False


def test_launcher_api_flag_serves_the_model(server, tmp_path):
    import openai

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "launcher.py"), "--api", "--api-port", str(port),
                             "--model", str(server.model), "--head", str(server.head), "--dtype", "float64"],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **isolated_home(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "API at" in line or "error" in line:
                break
        assert f"eagle-chat API at http://127.0.0.1:{port}/v1" in line, line
        deadline = time.time() + 30  # the line is printed just before uvicorn binds the port
        while not listening(f"http://127.0.0.1:{port}/v1/models"):
            assert time.time() < deadline and proc.poll() is None, "the API did not start listening"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=str(server.model), messages=[{"role": "user", "content": "w5"}],
                                               max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8 and reply.choices[0].message.content
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
    refused = run_launcher("--api", "--share")
    assert refused.returncode == 2 and "--api serves the API instead of the UI: drop --share" in refused.stderr


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian chromium is not installed")
def test_browser_connect_disables_local_controls_with_a_reason(server):
    from playwright.sync_api import expect, sync_playwright

    target = tiny_target(mix=0.0, max_pos=512)
    served = Served(Engine(target, oracle_head(target)))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(served.url)
            page.get_by_role("tab", name="Models").click()
            page.locator("#backend-url textarea, #backend-url input").first.fill(server.url)
            page.locator("#connect").click()
            page.wait_for_function("document.querySelector('#status').innerText.includes('Chatting through')",
                                   timeout=30_000)
            page.get_by_role("tab", name="Chat").click()
            # each state is awaited (expect retries for 10 s): a tab's components may show an update a frame late
            expect(page.locator("#speculative input[type=checkbox]")).to_be_disabled(timeout=10_000)
            expect(page.locator("#depth input[type=range]")).to_be_disabled(timeout=10_000)
            expect(page.locator("#speculative")).to_contain_text(REMOTE_SPEC, timeout=10_000)
            expect(page.locator("#depth")).to_contain_text(REMOTE_TREE, timeout=10_000)
            expect(page.locator("#highlight")).to_contain_text(REMOTE_HIGHLIGHT, timeout=10_000)
            page.locator("#message textarea").fill("w5 w6")
            page.locator("#send").click()
            page.wait_for_function("/max new tokens|end of answer/.test(document.querySelector('#stats').innerText)",
                                   timeout=60_000)
            assert "remote" in page.locator("#stats").inner_text() and "τ" in page.locator("#stats").inner_text()
            page.get_by_role("tab", name="Side by side").click()
            expect(page.locator("#compare")).to_be_disabled(timeout=10_000)
            expect(page.locator("#compare-note")).to_contain_text("needs the local engine", timeout=10_000)
            page.get_by_role("tab", name="Models").click()
            page.locator("#use-local").click()
            page.wait_for_function("document.querySelector('#status').innerText.includes('Serving')",
                                   timeout=30_000)
            page.get_by_role("tab", name="Chat").click()
            expect(page.locator("#speculative input[type=checkbox]")).to_be_enabled(timeout=10_000)
            expect(page.locator("#depth input[type=range]")).to_be_enabled(timeout=10_000)
            expect(page.locator("#depth")).to_contain_text(LOCAL_INFO["depth"], timeout=10_000)
            expect(page.locator("#depth")).not_to_contain_text(REMOTE_TREE, timeout=10_000)
            browser.close()
    finally:
        served.close()

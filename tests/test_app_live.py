"""The running app on the real SmolLM2 (with a seeded random EAGLE head), driven through
gradio_client like any API user, and through Debian's chromium with pip's playwright."""

from __future__ import annotations

import json
import os
import time

import pytest

from app.chat import MAX_CHART_STEPS
from tests.app_server import CHROMIUM, ROOT, Launched, free_port, isolated_home, random_head
from tests.test_app_launcher import browser_spy

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant."
# greedy, 16 new tokens, a small tree: the random head accepts little, so keep verification cheap
FAST = dict(temperature=0.0, top_p=1.0, max_new=16, depth=2, top_k=2, tree_size=4)


def chat_args(message, *, spec=True, highlight=True, **over):
    s = {**FAST, **over}
    return (message, SYSTEM, s["temperature"], s["top_p"], s["max_new"], spec, s["depth"], s["top_k"],
            s["tree_size"], highlight, s.get("seed", -1))


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The app as a user starts it, with a spy standing in for the web browser it opens."""
    tmp = tmp_path_factory.mktemp("live")
    head = random_head(tmp / "head")
    spy_env, opened = browser_spy(tmp)
    app = Launched(["--port", str(free_port()), "--head", str(head)], env={**isolated_home(tmp), **spy_env})
    app.opened = opened
    yield app
    app.stop()


@pytest.fixture(scope="module")
def app_url(launched):
    return launched.url


def test_launcher_serves_on_the_port_and_opens_the_browser(launched):
    assert "Loading `smollm2` with head" in launched.output
    deadline = time.monotonic() + 10
    while not launched.opened.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert launched.opened.read_text().split() == [launched.url]


@pytest.fixture()
def client(app_url):
    from gradio_client import Client

    return Client(app_url, verbose=False)


def stream(client, *args, api_name="/chat"):
    job = client.submit(*args, api_name=api_name)
    updates = [out for out in job]
    return updates, job.result()


def test_chat_streams_with_per_step_stats(client):
    # long enough to span several of the page's 0.1 s text updates (app.chat.Pace) however fast the engine
    updates, (chat, _box, chart, stats_md, stats, tokens_html, notice) = stream(
        client, *chat_args("Tell me about Paris, the capital of France: its history, its food and its people.",
                           max_new=160))
    answer = chat[-1]["content"][0]["text"]
    texts = [u[0][-1]["content"][0]["text"] if u[0][-1]["content"] else "" for u in updates]
    assert len(updates) >= 4 and len(set(texts)) >= 3, "the answer must arrive in several pieces"
    assert "Paris" in answer
    assert stats["mode"] == "speculative" and stats["steps"] == len(stats["per_step"]) >= 2
    assert sum(r["tokens"] for r in stats["per_step"]) == stats["tokens"]
    # every step after prefill verifies a tree, but where plain decoding measured faster (the chat's
    # adaptive speculation probes it now and then), and the stats line says how many did
    after = stats["per_step"][1:]
    spec = [r for r in after if r["tree_size"] > 0]
    assert spec and all(r["tree_size"] <= 4 for r in spec) and all(r["tokens"] == 1 for r in after if r not in spec)
    assert stats["ran"] == ("speculative" if len(spec) == len(after) else
                            f"speculative on {len(spec)} of {len(after)} steps, plain on the others: each step ran the "
                            "mode measured faster in this answer, the other probed now and then")
    assert stats["tau"] >= 1.0 and stats["tokens_per_s"] > 0 and stats["draft_share"] > 0
    # chart: the draft and target part of each of the latest steps (plus a zero bar for a legend
    # entry whose kind scrolled out of view)
    shown = min(stats["steps"], MAX_CHART_STEPS)
    data = chart["value"]["data"]
    assert 2 * shown <= len(data) <= 2 * shown + 2
    assert {row[0] for row in data} == set(range(stats["steps"] - shown + 1, stats["steps"] + 1))
    assert "τ" in stats_md and "tok/s" in stats_md
    assert tokens_html.count("<span class=\"tok-") == stats["tokens"] + 3  # tokens + legend


def test_toggle_switches_mode_and_output_is_identical(client, app_url):
    from gradio_client import Client

    _, spec_out = stream(client, *chat_args("Name a fruit.", spec=True))
    _, plain_out = stream(Client(app_url, verbose=False), *chat_args("Name a fruit.", spec=False))
    spec_stats, plain_stats = spec_out[4], plain_out[4]
    assert spec_stats["mode"] == "speculative" and plain_stats["mode"] == "plain"
    assert all(r["tree_size"] == 0 and r["tokens"] == 1 for r in plain_stats["per_step"])
    assert plain_stats["tau"] == 1.0 and plain_stats["draft_share"] == 0
    assert spec_out[0][-1]["content"] == plain_out[0][-1]["content"], "greedy speculation must be lossless"
    _, follow_up = stream(client, *chat_args("And a vegetable?", spec=False))
    assert len(follow_up[0]) == 4, "the second message continues the same conversation"
    assert follow_up[4]["mode"] == "plain", "the toggle applies to the next message"


def test_a_seed_gives_one_sampled_answer_with_speculation_on_or_off(client, app_url):
    """Sampled at 0.5 (below the shipped trees' pause) with seed 1234: the speculative answer is the
    plain one, token for token, and the stats name the seed; without a seed each answer gets a new
    one, shown, and typing it in gives that answer again."""
    from gradio_client import Client

    sampled = dict(temperature=0.5, max_new=24, seed=1234)
    _, spec_out = stream(Client(app_url, verbose=False), *chat_args("Name a fruit.", **sampled))  # new chats
    _, plain_out = stream(Client(app_url, verbose=False), *chat_args("Name a fruit.", spec=False, **sampled))
    assert spec_out[4]["mode"] == "speculative" and any(r["tree_size"] for r in spec_out[4]["per_step"])
    assert spec_out[0][-1]["content"] == plain_out[0][-1]["content"], "one seed, one sampled answer"
    assert spec_out[4]["seed"] == plain_out[4]["seed"] == 1234 and "sampled with seed 1234" in spec_out[3]
    _, fresh = stream(Client(app_url, verbose=False), *chat_args("Name a fruit.", **{**sampled, "seed": -1}))
    _, again = stream(Client(app_url, verbose=False), *chat_args("Name a fruit.", spec=False,
                                                                **{**sampled, "seed": fresh[4]["seed"]}))
    assert again[0][-1]["content"] == fresh[0][-1]["content"]


def streaming(job, outputs: int = 3, seconds: float = 60) -> None:
    """Wait until `job` has streamed `outputs` updates, i.e. it is running, not waiting to join the queue
    (a Stop or Clear sent before it joined would reach no request)."""
    deadline = time.monotonic() + seconds
    while len(job.outputs()) < outputs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(job.outputs()) >= outputs, f"the answer did not start streaming within {seconds:g} s"


def test_stop_regenerate_clear_and_bad_input(client):
    from gradio_client.exceptions import ValidationError
    from httpx import HTTPStatusError

    # the longest answer the slider allows (seconds even on a fast machine: plain decoding here ran 520 tok/s),
    # so Stop reaches it running; what it wrote by then is read off its last streamed update
    job = client.submit(*chat_args("Write a long story about a dragon.", spec=False, max_new=2048), api_name="/chat")
    streaming(job)
    seen = (job.outputs()[-1][4] or {}).get("tokens", 0)
    stopped_at = time.monotonic()
    client.predict(api_name="/stop")
    out = job.result()
    assert out[4]["stopped"] and out[4]["tokens"] < 2048
    # Stop ends the answer within its step, not at the end of the budget: the page's updates (0.1 s apart) and
    # the request's round trip are what separate the two counts, under 0.5 s of decoding at this speed
    assert out[4]["tokens"] - seen < 256, f"Stop must end the answer within a step or two ({seen} -> {out[4]['tokens']})"
    assert time.monotonic() - stopped_at < 10
    assert "Stopped" in out[6]
    _, again = stream(client, *chat_args("Say hello.", spec=False))
    assert again[4]["finish_reason"] in ("eos", "length") and len(again[0]) == 4
    _, regen = stream(client, *chat_args("ignored", spec=True)[1:], api_name="/regenerate")
    assert regen[0] == again[0] and regen[4]["mode"] == "speculative", "regenerate replaces the last answer"
    with pytest.raises(ValidationError, match="Type a message"):  # refused before it joins the queue
        client.predict(*chat_args("   "), api_name="/chat")
    with pytest.raises(HTTPStatusError, match="400"):  # the slider's own range check, on joining the queue
        client.predict(*chat_args("hi", top_p=0.0), api_name="/chat")
    _, kept = stream(client, *chat_args("Thanks!", spec=False, max_new=4))
    assert len(kept[0]) == 6, "errors never lose the conversation"
    # the longest answer the slider allows (seconds even on a fast machine), so Clear reaches it running
    job = client.submit(*chat_args("Write a long story about a dragon.", spec=False, max_new=2048), api_name="/chat")
    streaming(job)
    cleared = client.predict(api_name="/clear")
    assert cleared[0] == [] and cleared[3] == ""
    # (the client reads the answer's stream in its own thread: its last update may land just after)
    assert job.result(timeout=30)[0] == [], "Clear stops a streaming answer, which then shows the empty chat"
    _, fresh = stream(client, *chat_args("Hi", spec=False, max_new=4))
    assert len(fresh[0]) == 2, "after Clear the conversation starts over"


def test_continue_writes_on_the_cut_answer_losslessly(app_url):
    """An answer cut at 12 tokens, then Continue with 20 more, speculative and plain in two chats: one text, the cut
    answer's words first. (Not one 32-token answer's text: the model reads the cut answer as a prompt, whose
    numerics are the prefill's, as it reads every earlier turn of a chat; the join's spacing is
    test_app_handlers.py::test_continue_writes_on_where_the_token_limit_cut_the_answer.)"""
    from gradio_client import Client

    prompt, texts = "Write a short poem about the sea.", []
    for spec in (True, False):
        chat = Client(app_url, verbose=False)
        _, cut = stream(chat, *chat_args(prompt, spec=spec, max_new=12))
        assert cut[4]["finish_reason"] == "length" and "Continue writes more" in cut[3]
        _, more = stream(chat, *chat_args("ignored", spec=spec, max_new=20)[1:], api_name="/continue")
        assert more[4]["tokens"] == 20 and more[4]["mode"] == ("speculative" if spec else "plain")
        assert len(more[0]) == 2 and more[0][0] == cut[0][0], "the chat's one answer, written on"
        before, after = (out[0][-1]["content"][0]["text"] for out in (cut, more))
        assert after.startswith(before) and len(after) > len(before) + 20
        texts.append(after)
    assert texts[0] == texts[1], "greedy speculation stays lossless when it continues an answer"


def test_side_by_side_reports_identical_greedy_answers(client):
    s = FAST
    updates, (plain_md, spec_md, summary, data) = stream(
        client, "Name three colors.", SYSTEM, s["temperature"], s["top_p"], s["max_new"], s["depth"],
        s["top_k"], s["tree_size"], -1, api_name="/compare")
    # it streams: the race's first step shows before its end, then at the chat's pace (app.chat.Pace; the count
    # follows the race's length: test_app_handlers.py::test_side_by_side_updates_the_page_at_the_chats_pace)
    assert len(updates) >= 2 and updates[0][3]["final"] is False and updates[-1][3]["final"] is True
    assert data["identical"] is True and "identical" in summary
    assert data["plain"]["tokens_per_s"] > 0 and data["speculative"]["tokens_per_s"] > 0
    assert data["speedup"] == pytest.approx(
        data["speculative"]["tokens_per_s"] / data["plain"]["tokens_per_s"], rel=0.02)
    assert data["plain"]["mode"] == "plain" and 0 < data["speculative"]["tree_size"] <= 4
    assert plain_md.split("\n\n", 1)[1] == spec_md.split("\n\n", 1)[1]


def test_model_management_is_open_locally(client):
    msg, _ = client.predict("SmolLM2-135M-Instruct (embedded)", "", "", "float32", "cpu", False,
                            api_name="/download")
    assert "Nothing to download" in msg


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian chromium is not installed")
def test_browser_chat_chart_and_toggle(app_url):
    from playwright.sync_api import sync_playwright

    shot = ROOT / "test-artifacts" / "app.png"
    shot.parent.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(app_url)
            bars = page.locator("#chart .mark-rect path")
            bars.first.wait_for(state="attached", timeout=30_000)
            placeholder = bars.count()
            set_number(page, "#sampling", "#max-new", FAST["max_new"])
            page.locator("#depth input[type=number]").fill(str(FAST["depth"]))
            page.locator("#depth input[type=number]").press("Enter")
            page.locator("#message textarea").fill("What is the capital of France?")
            page.locator("#send").click()
            page.wait_for_function("document.querySelector('#stats').innerText.includes('speculative')"
                                   " && /end of answer|max new tokens/.test(document.querySelector('#stats').innerText)",
                                   timeout=90_000)
            assert "Paris" in page.locator("#chatbot").inner_text()
            assert bars.count() > placeholder, "the chart draws a bar per step"
            assert page.locator("#tokens .tok-view .tok-bonus").count() > 0, "speculative steps end in a bonus token"
            page.screenshot(path=str(shot), full_page=True)
            page.locator("#speculative input[type=checkbox]").uncheck()
            page.locator("#message textarea").fill("And of Italy?")
            page.locator("#message textarea").press("Enter")  # Enter sends, like the button
            page.wait_for_function("document.querySelector('#stats').innerText.includes('plain')"
                                   " && /end of answer|max new tokens/.test(document.querySelector('#stats').innerText)",
                                   timeout=90_000)
            view = page.locator("#tokens .tok-view")
            assert view.locator(".tok-plain").count() > 1 and view.locator(".tok-bonus").count() == 0
            # the second message edited in place: its answer is replaced, the first exchange kept
            chat = page.locator("#chatbot")
            chat.get_by_text("And of Italy?").hover()
            chat.locator(".message-buttons-right").last.get_by_role("button", name="Edit").click()  # the user's
            editor = chat.locator("textarea").last
            editor.fill("And of Spain?")
            answers, stats = chat.get_by_test_id("bot"), page.locator("#stats").inner_text()
            italy = answers.last.inner_text()
            chat.get_by_role("button", name="Submit").click()
            # a new answer's final stats (while it runs, Gradio's timer comes first: "0.1s")
            done = ("((t) => t !== {} && t.startsWith('First token') && /end of answer|max new tokens/.test(t))"
                    "(document.querySelector('#stats').innerText)")
            page.wait_for_function(done.format(json.dumps(stats)), timeout=90_000)
            text = chat.inner_text()
            assert "And of Italy?" not in text and "And of Spain?" in text and italy not in text
            assert "What is the capital of France?" in text and "Paris" in text and answers.count() == 2
            # Continue writes on the last answer (cut at max new tokens, or complete: then it may say so)
            last, stats = answers.last.inner_text(), page.locator("#stats").inner_text()
            page.locator("#continue").click()
            page.wait_for_function(done.format(json.dumps(stats)), timeout=90_000)
            assert answers.count() == 2 and answers.last.inner_text().startswith(last)
            assert (len(answers.last.inner_text()) > len(last)) != ("added nothing" in page.locator("#notice").inner_text())
            # an answer edited in place is kept as written (no answer runs), and Continue writes on from it
            answers.last.hover()
            chat.locator(".message-buttons-left").last.get_by_role("button", name="Edit").click()  # the answer's
            chat.locator("textarea").last.fill("The capital of Spain is")
            chat.get_by_role("button", name="Submit").click()
            page.wait_for_function("document.querySelector('#notice').innerText.startsWith('Answer edited')",
                                   timeout=30_000)
            assert answers.last.inner_text() == "The capital of Spain is" and answers.count() == 2
            stats = page.locator("#stats").inner_text()
            page.locator("#continue").click()
            page.wait_for_function(done.format(json.dumps(stats)), timeout=90_000)
            assert answers.last.inner_text().startswith("The capital of Spain is ")
            assert len(answers.last.inner_text()) > len("The capital of Spain is ")
            # a text file attached with the button joins the message in the box, to be read over and sent
            notes = shot.parent / "notes.txt"
            notes.write_text("Paris is the capital of France.\n")
            page.locator("#message textarea").fill("Summarise:")
            with page.expect_file_chooser() as chooser:
                page.locator("#attach").click()
            chooser.value.set_files(str(notes))
            page.wait_for_function("document.querySelector('#notice').innerText.includes('Attached “notes.txt”')",
                                   timeout=30_000)
            assert page.locator("#message textarea").input_value() == \
                "Summarise:\n\nnotes.txt:\n```\nParis is the capital of France.\n```"
            # a file over the upload limit is refused before it is stored, naming it; the box keeps its text
            huge = shot.parent / "huge.txt"
            huge.write_bytes(b"a" * (21 << 20))
            try:
                with page.expect_file_chooser() as chooser:
                    page.locator("#attach").click()
                chooser.value.set_files(str(huge))
                toast = page.locator("[data-testid='toast-body']").filter(has_text="huge.txt")
                toast.wait_for(timeout=30_000)
                assert "exceed the maximum allowed size of 20.0 Mb" in toast.inner_text()
                assert page.locator("#message textarea").input_value().startswith("Summarise:\n\nnotes.txt:")
            finally:
                huge.unlink()
            # the chat's own trash icon clears the conversation, not just the view: the next message starts anew
            chat.get_by_role("button", name="Clear").click()
            page.wait_for_function("document.querySelectorAll('#chatbot [data-testid=\"bot\"]').length === 0",
                                   timeout=10_000)
            stats = page.locator("#stats").inner_text()
            page.locator("#message textarea").fill("Hi")
            page.locator("#send").click()
            page.wait_for_function(done.format(json.dumps(stats)), timeout=90_000)
            assert chat.get_by_test_id("user").count() == 1 and answers.count() == 1
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000


def set_number(page, accordion: str, slider: str, value: int) -> None:
    box = page.locator(f"{slider} input[type=number]")
    if not box.is_visible():
        page.locator(accordion).get_by_text("Sampling").first.click()
    box.fill(str(value))
    box.press("Enter")

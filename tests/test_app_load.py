"""The app under load through a real Gradio server (served in this process on tiny models, so it
is quick), driven by gradio_client like any API user: several sessions at once, a second client
while an answer streams, the queue position, Stop while queued, session clean-up, the caps for
visitors through the public link, and user errors that stay one line on the console."""

from __future__ import annotations

import logging
import re
import time

import pytest

from app.chat import engine_messages
from app.state import Access, generation_config
from core.decoding.engine import Engine
from tests.app_server import Served
from tests.tiny import oracle_head, tiny_target

SYSTEM = "system w7"
PROMPTS = [f"w{10 + 3 * i} w{60 - 2 * i} w{11 + i}" for i in range(8)]
FAST = dict(temperature=0.0, top_p=1.0, max_new=24, depth=3, top_k=2, tree_size=6)
CAP = 8  # new tokens per answer for visitors through the public link
REMOTE = {"X-Forwarded-For": "203.0.113.7"}  # what Gradio's share tunnel adds to a visitor's request


def chat_args(message, *, spec=True, **over):
    s = {**FAST, **over}
    return (message, SYSTEM, s["temperature"], s["top_p"], s["max_new"], spec, s["depth"], s["top_k"],
            s["tree_size"], True)


@pytest.fixture(scope="module")
def served():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.5")  # a closed session is noticed within a second
        target = tiny_target(mix=0.5, max_pos=512)  # attention matters: each prompt its own answer
        server = Served(Engine(target, oracle_head(target)), Access(remote_max_new_tokens=CAP))
        yield server
        server.close()


def solo(served, message, *, spec=True, **over) -> list[int]:
    """The answer's token ids when the engine serves nobody else."""
    s = {**FAST, **over}
    cfg = generation_config(max_new_tokens=s["max_new"], temperature=s["temperature"], top_p=s["top_p"],
                            speculative=spec, depth=s["depth"], top_k=s["top_k"], tree_size=s["tree_size"])
    msgs = engine_messages([{"role": "user", "content": message}], SYSTEM)
    return [t for ev in served.manager.engine.generate(msgs, cfg) for t in ev.token_ids]


def ids_of(outputs) -> list[int]:
    """Token ids of a /chat result, from the token panel (each token carries its id)."""
    assert isinstance(outputs[5], str), f"no answer: {outputs[6]}"
    return [int(i) for i in re.findall(r'title="id (\d+)', outputs[5].split("tok-view", 1)[1])]


def paced(generate, seconds: float):
    """`engine.generate` with every step taking at least `seconds` longer."""
    def slowed(*args, **kwargs):
        for event in generate(*args, **kwargs):
            time.sleep(seconds)
            yield event
    return slowed


class Blocker:
    """A long answer from another session that holds the lane (each step slowed to 50 ms) until
    `release()`, which presses Stop in its session."""

    def __init__(self, served, monkeypatch):
        engine = served.manager.engine
        generate = engine.generate
        monkeypatch.setattr(engine, "generate", paced(generate, 0.05))
        self.owner = client(served)
        self.job = self.owner.submit(*chat_args("w5 w6", spec=False, max_new=400), api_name="/chat")
        wait_until(lambda: len(self.job.outputs()) >= 2)
        monkeypatch.setattr(engine, "generate", generate)  # only the blocker is slow

    def release(self) -> dict:
        if not self.job.done():
            self.owner.predict(api_name="/stop")
        return self.job.result()[4]


@pytest.fixture()
def blocker(served, monkeypatch):
    b = Blocker(served, monkeypatch)
    yield b
    b.release()


def client(served, **kw):
    from gradio_client import Client

    return Client(served.url, verbose=False, **kw)


def wait_until(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_second_client_calling_other_endpoints_does_not_break_a_streaming_answer(served):
    """Issue 10 item 1: Gradio runs each step of a streaming answer on any worker thread; a second
    client's calls make the steps hop threads, which must not matter."""
    prompts = PROMPTS[:4]
    expected = [solo(served, p, max_new=48) for p in prompts]
    jobs = [client(served).submit(*chat_args(p, max_new=48), api_name="/chat") for p in prompts]
    other, busy = client(served), []
    while not all(j.done() for j in jobs):
        busy.append(other.predict("SmolLM2-135M-Instruct (embedded)", "", "", "float32", "cpu", False,
                                  api_name="/download")[0])
    assert busy and all("Nothing to download" in m for m in busy)
    assert [ids_of(j.result()) for j in jobs] == expected, "every answer completes, equal to its solo answer"


def test_eight_sessions_at_once_get_their_solo_answers_and_see_their_place_in_the_queue(served, monkeypatch):
    expected = [solo(served, p) for p in PROMPTS]
    assert len({tuple(e) for e in expected}) == len(PROMPTS), "different prompts, different answers"
    plain_expected = solo(served, "w40 w41", spec=False)
    # a step takes 5 ms at least: the queue stays long enough to be seen (answers of the tiny model
    # take ~0.07 s; some 8 could finish between two looks at the queue)
    engine = served.manager.engine
    monkeypatch.setattr(engine, "generate", paced(engine.generate, 0.005))
    jobs = [client(served).submit(*chat_args(p), api_name="/chat") for p in PROMPTS]
    other = client(served)
    side = other.submit("w40 w41", SYSTEM, 0.0, 1.0, FAST["max_new"], FAST["depth"], FAST["top_k"],
                        FAST["tree_size"], api_name="/compare")
    ranks, models = set(), []
    while not all(j.done() for j in jobs + [side]):
        ranks |= {j.status().rank for j in jobs if j.status().code.value == "IN_QUEUE"}
        if len(models) < 3:
            models.append(other.predict("SmolLM2-135M-Instruct (embedded)", "", "", "float32", "cpu", False,
                                        api_name="/download")[0])
        time.sleep(0.01)
    assert max(r or 0 for r in ranks) > 0, "waiting users are told their place in the queue"
    assert [ids_of(j.result()) for j in jobs] == expected, "token for token the solo answers"
    plain_md, spec_md, summary, data = side.result()
    assert data["identical"] is True and data["plain"]["tokens"] == len(plain_expected)
    assert all("Nothing to download" in m for m in models)
    wait_until(lambda: not served.handlers.tickets.sessions(), 5)


def test_stop_pressed_while_queued_cancels_that_request_only(served, blocker):
    waiting = client(served)
    job = waiting.submit(*chat_args(PROMPTS[0]), api_name="/chat")
    wait_until(lambda: job.status().code.value == "IN_QUEUE")
    waiting.predict(api_name="/stop")
    shown = len(blocker.job.outputs())
    wait_until(lambda: len(blocker.job.outputs()) > shown + 2)
    assert not blocker.job.done(), "another session's Stop does not touch the running answer"
    assert blocker.release()["stopped"]
    chat, _box, _chart, _md, _stats, _tokens, notice = job.result()
    assert notice == "Stopped before it started." and chat == {"__type__": "update"}, "the chat is left as it was"
    again = waiting.predict(*chat_args(PROMPTS[0]), api_name="/chat")
    assert ids_of(again) == solo(served, PROMPTS[0]), "the next message runs as usual"


def test_a_closed_session_frees_its_state(served, blocker):
    leaving = client(served)
    leaving.submit(*chat_args(PROMPTS[1]), api_name="/chat")
    wait_until(lambda: leaving.session_hash in served.handlers.tickets.sessions())
    leaving.close()  # its heartbeat ends, as when a browser tab closes
    wait_until(lambda: leaving.session_hash not in served.handlers.tickets.sessions(), 10)
    assert not blocker.job.done(), "freed while the lane is still busy, not when its request would have run"
    blocker.release()
    wait_until(lambda: not served.handlers.tickets.sessions(), 5)


def test_visitors_through_the_public_link_are_capped_and_told(served):
    remote = client(served, headers=REMOTE).predict(*chat_args(PROMPTS[2], max_new=200), api_name="/chat")
    assert remote[4]["tokens"] == CAP and f"at most {CAP} new tokens" in remote[6]
    assert ids_of(remote) == solo(served, PROMPTS[2], max_new=200)[:CAP]
    local = client(served).predict(*chat_args(PROMPTS[2], max_new=40), api_name="/chat")
    assert local[4]["tokens"] > CAP and local[6] == ""
    message, _table = client(served, headers=REMOTE).predict("Custom (hub id, local folder or .gguf file)", "/etc", "",
                                                             "float32", "cpu", False, api_name="/download")
    assert "disabled for visitors through the public link" in message


def test_user_errors_are_one_log_line_without_tracebacks(served, capfd, caplog):
    from gradio_client.exceptions import ValidationError

    caplog.set_level(logging.INFO)
    c = client(served)
    with pytest.raises(ValidationError, match="Type a message first"):
        c.predict(*chat_args("   "), api_name="/chat")
    too_long = c.predict(*chat_args(" ".join(f"w{4 + i % 90}" for i in range(600))), api_name="/chat")
    assert "longer than the model's whole context" in too_long[6]
    message, table = c.predict("Custom (hub id, local folder or .gguf file)", "", "", "float32", "cpu", False,
                               api_name="/download")
    assert "enter a hub id" in message and table == {"__type__": "update"}
    with pytest.raises(Exception, match="400"):  # a slider value out of its range, refused on joining the queue
        c.predict(*chat_args("w5", top_p=0.0), api_name="/chat")
    records = [r for r in caplog.records if r.name == "eagle_chat"]
    assert [r.levelname for r in records] == ["WARNING", "WARNING"] and not any(r.exc_info for r in records)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err

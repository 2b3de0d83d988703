"""The chat handlers on a real Engine over tiny models (fast): accepted drafts reach the
panel, context overflow trims with a notice, Stop closes the stream, no head -> plain,
errors keep the conversation, and a download that cannot fit is refused at once."""

from __future__ import annotations

import time
from collections import namedtuple

import gradio as gr
import pytest

from app.chat import PLAIN
from app.manager import ModelManager
from app.session import NO_HEAD, Handlers
from app.state import Access, ModelChoice
from core.engine import Engine
from tests.tiny import oracle_head, tiny_target

SYSTEM = "system w7"
# message, history, system, temperature, top_p, max_new, spec, depth, top_k, tree_size, highlight
Settings = namedtuple("Settings", "temperature top_p max_new spec depth top_k tree_size highlight")
GREEDY = Settings(0.0, 1.0, 12, True, 3, 2, 6, True)


def handlers_for(engine) -> Handlers:
    return Handlers(ModelManager(loader=None, choice=ModelChoice("tiny", None), engine=engine), Access())


@pytest.fixture(scope="module")
def bigram():
    target = tiny_target(mix=0.0, max_pos=96)  # a bigram model: the oracle head drafts it exactly
    return target, oracle_head(target)


def answer(h: Handlers, message, history, settings=GREEDY):
    outs = list(h.respond(message, history, SYSTEM, *settings, request=None))
    chat, state, _box, _chart, stats_md, stats, tokens, notice = outs[-1]
    return outs, state, stats, tokens, notice


def test_accepted_drafts_reach_the_panel_and_output_matches_plain(bigram):
    h = handlers_for(Engine(*bigram))
    outs, state, stats, tokens, notice = answer(h, "w5 w9", [])
    assert len(outs) >= 3 and notice == ""
    assert stats["mode"] == "speculative" and stats["tau"] > 1.5, "the oracle head's drafts are accepted"
    assert sum(r["draft"] for r in stats["per_step"]) > 0
    assert tokens.split("tok-view")[1].count('class="tok-draft"') == sum(r["draft"] for r in stats["per_step"])
    chart = outs[-1][3]
    assert chart.constructor_args["value"]["tokens"].sum() == stats["tokens"]
    _, plain_state, plain_stats, plain_tokens, _ = answer(h, "w5 w9", [], GREEDY._replace(spec=False))
    assert plain_state == state and plain_stats["tau"] == 1.0
    assert "tok-draft" not in plain_tokens.split("tok-view")[1]


def test_long_conversation_is_trimmed_with_a_notice(bigram):
    h = handlers_for(Engine(*bigram))
    words = " ".join(f"w{i}" for i in range(10, 40))  # 30 tokens per turn; the context is 96
    history = [{"role": "user", "content": words}, {"role": "assistant", "content": words},
               {"role": "user", "content": words}, {"role": "assistant", "content": words}]
    with pytest.warns(UserWarning, match="left out"):  # the toast; outside a request gradio warns
        outs, state, stats, _tokens, notice = answer(h, "w5 w6", history)
    assert "oldest 1 exchange(s) were left out" in notice
    assert state[:4] == history and len(state) == 6, "trimming shortens the prompt, never the visible chat"
    assert stats["tokens"] >= 1
    with pytest.raises(gr.Error, match="longer than the model's whole context"):
        answer(h, " ".join(f"w{i}" for i in range(10, 95)) + " w5" * 20, [])


def test_stop_closes_the_stream_within_a_step(bigram):
    h = handlers_for(Engine(bigram[0]))
    stream = h.respond("w5", [], SYSTEM, *GREEDY._replace(spec=False, max_new=80), request=None)
    next(stream), next(stream)  # the user's message, then the first step
    h.stop(None)
    rest = list(stream)
    stats = rest[-1][5]
    assert stats["stopped"] and stats["tokens"] <= 3 and "Stopped." in rest[-1][7]
    outs, *_ = answer(h, "w6", rest[-1][1])  # the next message works and sees the stopped answer
    assert len(outs[-1][1]) == 4 and not outs[-1][5]["stopped"]
    stream = h.respond("w7", outs[-1][1], SYSTEM, *GREEDY._replace(spec=False, max_new=40), request=None)
    next(stream), next(stream)
    assert h.clear(None)[:2] == ([], [])
    assert list(stream)[-1][:2] == ([], []), "a Clear mid-answer ends the stream on the empty chat"


def test_without_head_speculation_falls_back_to_plain_with_a_notice(bigram):
    h = handlers_for(Engine(bigram[0]))
    _, _, stats, tokens, notice = answer(h, "w5", [])
    assert stats["mode"] == "plain" and NO_HEAD in notice
    assert 'title="id' in tokens and PLAIN in tokens
    with pytest.raises(gr.Error, match="needs an EAGLE head"):
        list(h.compare("w5", SYSTEM, 0.0, 1.0, 4, 2, 2, 4, request=None))


def test_regenerate_and_empty_input(bigram):
    h = handlers_for(Engine(*bigram))
    _, state, _, _, _ = answer(h, "w5 w9", [])
    again = list(h.regenerate(state, SYSTEM, *GREEDY, request=None))[-1]
    assert again[1] == state
    with pytest.raises(gr.Error, match="Type a message"):
        answer(h, "  ", state)
    with pytest.raises(gr.Error, match="Nothing to regenerate"):
        list(h.regenerate([], SYSTEM, *GREEDY, request=None))


def test_side_by_side_on_tiny_models(bigram):
    h = handlers_for(Engine(*bigram))
    outs = list(h.compare("w5 w9", SYSTEM, 0.0, 1.0, 12, 3, 2, 6, request=None))
    plain_md, spec_md, summary, data = outs[-1]
    assert data["identical"] is True and data["speculative"]["tau"] > 1.5 and data["plain"]["tau"] == 1.0
    assert "Speed-up" in summary


def test_download_that_cannot_fit_is_refused_at_once(monkeypatch):
    import app.manager as manager_mod

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(manager_mod.shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 10**9, 10**9))
    h = Handlers(ModelManager(loader=None, choice=ModelChoice(), engine=object(),
                              endpoint="http://127.0.0.1:9"), Access())
    start = time.monotonic()
    with pytest.raises(gr.Error, match="not enough disk space for lmsys/vicuna-7b-v1.3: about 13 GB needed"):
        h.download("Vicuna-7B v1.3", "", "", "float16", "cpu", False, progress=lambda *a, **k: None)
    assert time.monotonic() - start < 2

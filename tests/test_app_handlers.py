"""The chat handlers on a real Engine over tiny models (fast): accepted drafts reach the
panel, context overflow trims with a notice, Stop closes the stream, no head -> plain,
errors keep the conversation, and a download that cannot fit is refused at once."""

from __future__ import annotations

import re
import threading
import time
import weakref
from collections import namedtuple

import gradio as gr
import pytest
import torch

import app.session as app_session
from app.chat import PLAIN, Pace
from app.manager import ModelManager, Request
from app.session import STOPPED_READING, Handlers
from app.state import Access, ChatSettings, ModelChoice
from core.config import TreeConfig
from core.decoding.engine import Engine
from core.decoding.treestore import TreeChoice
from tests.app_server import LOCAL, SHARE_LINK, FakeRequest
from tests.tiny import oracle_head, tiny_target

SYSTEM = "system w7"
# message, history, system, temperature, top_p, max_new, spec, depth, top_k, tree_size, highlight, seed
Settings = namedtuple("Settings", ChatSettings.names(), defaults=(ChatSettings().seed,))
GREEDY = Settings(0.0, 1.0, 12, True, 3, 2, 6, True)
SKIP = gr.skip()  # an output left as it is


def slow(engine, step_s: float):
    """Make `engine` take `step_s` per step, as a bigger model on a CPU does."""
    fast = engine.generate

    def generate(*args, **kwargs):
        for ev in fast(*args, **kwargs):
            time.sleep(step_s)
            yield ev

    engine.generate = generate
    return engine


def handlers_for(engine, adaptive: bool = False) -> Handlers:
    """Handlers on `engine`; `adaptive` off (the app's default is on: Handlers.adaptive) so that an
    answer's steps do not depend on timing, except in the tests of that."""
    return Handlers(ModelManager(loader=None, choice=ModelChoice("tiny", None), engine=engine), Access(),
                    adaptive=adaptive)


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


def test_an_over_long_message_is_refused_saying_only_that(bigram, recwarn):
    h = handlers_for(Engine(*bigram))
    words = " ".join(f"w{i}" for i in range(10, 40))
    history = [{"role": "user", "content": words}, {"role": "assistant", "content": words}]
    outs = list(h.respond(" ".join(f"w{i}" for i in range(10, 95)) + " w5" * 20, history, SYSTEM, *GREEDY,
                          request=None))
    assert len(outs) == 1 and all(o == SKIP for o in outs[0][:7]), "the chat, box, chart and panel keep their content"
    assert "longer than the model's whole context (96 tokens)" in outs[0][7]
    toasts = [str(w.message) for w in recwarn]
    assert len(toasts) == 1 and "longer than" in toasts[0], "no word about left-out exchanges: only the refusal"


def test_a_streaming_answer_updates_the_page_at_a_bounded_pace(bigram):
    h = handlers_for(slow(Engine(*bigram), 0.01))
    started = time.monotonic()
    outs = list(h.respond("w5", [], SYSTEM, *GREEDY._replace(spec=False, max_new=60), request=None))
    seconds = time.monotonic() - started
    assert outs[-1][5]["tokens"] == 60 and seconds > 0.6
    assert 3 <= len(outs) <= 2 + seconds / 0.1 + 1, "at most ten updates a second, not one per step"
    panels = [o for o in outs[2:-1] if o[3] != SKIP]
    assert len(panels) <= seconds / 0.5 + 1, "the chart is redrawn at most twice a second"
    assert all((o[3] == SKIP) == (o[5] == SKIP) == (o[6] == SKIP) for o in outs), "chart, numbers, tokens together"
    assert outs[1][0][-1]["content"] != "", "the first step shows at once"
    assert outs[-1][3] != SKIP and outs[-1][6] != SKIP, "the end shows in full"


def test_the_panel_shows_the_visitors_wait_beside_the_engines_speed(bigram, monkeypatch):
    engine = Engine(*bigram)
    fast = engine.generate

    def late(*args, **kwargs):  # a wait the engine's clock does not see (the queue, the tokenizer)
        time.sleep(0.4)
        yield from fast(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", late)
    outs = list(handlers_for(engine).respond("w5", [], SYSTEM, *GREEDY._replace(max_new=30), request=None))
    stats, stats_md = outs[-1][5], outs[-1][4]
    # the visitor waited the 0.4 s the engine never saw (whatever the machine's speed: a fresh or busy
    # one may take more than 0.4 s to generate, which the engine's clock does count)
    assert 0.4 <= stats["first_token_s"] <= stats["wall_s"] and stats["wall_s"] >= stats["elapsed_s"] + 0.39
    first, engine_line, _ = stats_md.split("\n\n")
    assert first == (f"**First token after {stats['first_token_s']:.1f} s · 30 tokens in {stats['wall_s']:.1f} s** "
                     "(your wait, from Send)")
    shown = re.fullmatch(r"engine: \*\*([0-9.]+) tok/s\*\* \(30 tokens in its ([0-9.]+) s of generating\) · \*\*τ .*",
                         engine_line)
    assert shown, engine_line  # the engine's speed, to the 0.1 shown (stats hold it rounded to 0.01: 1056.35 -> 1056.4)
    assert abs(float(shown[1]) - stats["tokens_per_s"]) <= 0.051 and abs(float(shown[2]) - stats["elapsed_s"]) <= 0.051
    assert engine_line.endswith("tokens per model pass")


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


class Driven:
    """A handler's stream pulled in a thread, as Gradio's worker pulls it: every update with the time
    it was taken (`send_s`: how long sending one takes), and when the handler had ended."""

    def __init__(self, stream, send_s: float = 0.0):
        self.updates: list[tuple[float, tuple]] = []
        self.ended_at = None
        self.thread = threading.Thread(target=self._pull, args=(stream, send_s), daemon=True)
        self.thread.start()

    def _pull(self, stream, send_s):
        for update in stream:
            self.updates.append((time.monotonic(), update))
            time.sleep(send_s)
        self.ended_at = time.monotonic()

    def wait_for(self, n: int, seconds: float = 30) -> None:
        deadline = time.monotonic() + seconds
        while len(self.updates) < n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(self.updates) >= n


def test_clear_answers_after_the_running_answers_last_update(bigram):
    """Clear's empty chat must be the last thing the page shows: it returns only once a running answer
    has yielded its last update (which is the empty chat too), however slowly updates are sent."""
    h = handlers_for(slow(Engine(bigram[0]), 0.02))
    for send_s in (0.0, 0.15):  # the second: the answer's updates are still being sent when Clear arrives
        driven = Driven(h.respond("w7", [], SYSTEM, *GREEDY._replace(spec=False, max_new=60), request=None), send_s)
        driven.wait_for(2)
        assert h.clear(None)[:2] == ([], [])
        cleared_at = time.monotonic()
        driven.thread.join(10)
        assert driven.ended_at is not None and driven.ended_at <= cleared_at, "Clear replied before the answer ended"
        assert driven.updates[-1][1][:2] == ([], []), "a Clear mid-answer ends the stream on the empty chat"
        assert len(driven.updates) < 60, "the answer stopped within a step"
    assert h.tickets.sessions() == set()


def test_without_head_the_chat_speculates_by_context_lookup_and_answers_as_plain(bigram):
    """A model without an EAGLE head still speculates: the drafts are copied from the conversation where it repeats
    (a prompt that loops), each step a plain one where nothing repeats; the answer is plain decoding's, token for
    token, and the stats say what was copied. Side by side races the two."""
    h = handlers_for(Engine(bigram[0]))
    loop = " ".join(["w5 w9 w3 w6"] * 6)
    settings = GREEDY._replace(max_new=40)
    _, state, stats, tokens, notice = answer(h, loop, [], settings)
    assert stats["mode"] == "speculative" and notice == "", "nothing to warn about: the header says how it drafts"
    assert stats["copied_steps"] > 0 and stats["copied_accepted"] > 0 and stats["tau"] > 1.2, stats
    assert stats["head_nodes"] == 1, "the root alone: no head tree"
    _, plain_state, plain_stats, _, _ = answer(h, loop, [], settings._replace(spec=False))
    assert state == plain_state and plain_stats["mode"] == "plain"
    assert sum(r["draft"] for r in stats["per_step"]) == stats["copied_accepted"]
    assert 'title="id' in tokens
    sampled = settings._replace(temperature=0.9, seed=11)
    assert answer(h, loop, [], sampled)[1] == answer(h, loop, [], sampled._replace(spec=False))[1], \
        "sampled: plain sampling's tokens for the seed"
    outs = list(h.compare(loop, SYSTEM, 0.0, 1.0, 40, 2, 2, 4, request=None))
    assert "answers: **identical** token for token" in outs[-1][2], outs[-1][2]


def test_regenerate_and_empty_input(bigram):
    h = handlers_for(Engine(*bigram))
    _, state, _, _, _ = answer(h, "w5 w9", [])
    outs = list(h.regenerate(state, SYSTEM, *GREEDY, request=None))
    assert outs[-1][1] == state
    assert all(out[2] == SKIP for out in outs), "Regenerate leaves the message box (a draft in it) as it is"
    assert outs[-1][7] == app_session.SAME_AGAIN, "greedy: the same answer, and why"
    sampled = list(h.regenerate(state, SYSTEM, *GREEDY._replace(temperature=0.8, seed=7), request=None))[-1]
    assert sampled[1][-1] != state[-1] and app_session.SAME_AGAIN not in sampled[7]
    longer = list(h.regenerate(state, SYSTEM, *GREEDY._replace(max_new=20), request=None))[-1]
    assert longer[1][-1] != state[-1] and app_session.SAME_AGAIN not in longer[7], "a longer answer is another"
    assert answer(h, "w5", state)[0][0][2] == "", "Send empties the box: its message is in the chat"
    with pytest.warns(UserWarning, match="Type a message"):
        assert answer(h, "  ", state)[0] == [(*[SKIP] * 7, "Type a message first.")]
    with pytest.warns(UserWarning, match="Nothing to regenerate"):
        assert list(h.regenerate([], SYSTEM, *GREEDY, request=None))[0][7].startswith("Nothing to regenerate")


def test_side_by_side_on_tiny_models(bigram):
    h = handlers_for(Engine(*bigram))
    outs = list(h.compare("w5 w9", SYSTEM, 0.0, 1.0, 12, 3, 2, 6, request=None))
    plain_md, spec_md, summary, data = outs[-1]
    assert data["identical"] is True and data["speculative"]["tau"] > 1.5 and data["plain"]["tau"] == 1.0
    assert "Speed-up" in summary
    # sampled: both columns draw with one seed, so they agree token for token as well
    for _ in range(3):
        plain_md, spec_md, summary, data = list(h.compare("w5 w9", SYSTEM, 0.9, 1.0, 24, 3, 2, 6, request=None))[-1]
        assert data["identical"] is True and f"(sampled with seed {data['seed']}, one for both) ✓" in summary
        assert data["speculative"]["target_forwards"] < data["plain"]["target_forwards"]
    assert list(h.compare("w5 w9", SYSTEM, 0.9, 1.0, 24, 3, 2, 6, 11, request=None))[-1][3]["seed"] == 11  # the box's


def test_download_that_cannot_fit_is_refused_at_once(monkeypatch):
    import app.manager as manager_mod

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(manager_mod.shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 10**9, 10**9))
    h = Handlers(ModelManager(loader=None, choice=ModelChoice(), engine=object(),
                              endpoint="http://127.0.0.1:9"), Access())
    start = time.monotonic()
    with pytest.warns(UserWarning, match="not enough disk space for lmsys/vicuna-7b-v1.3: about 13 GB needed"):
        message, table = h.download("Vicuna-7B v1.3", "", "", "float16", "cpu", False, progress=lambda *a, **k: None)
    assert message.startswith("Download failed: not enough disk space") and table == SKIP, "the table keeps its content"
    assert time.monotonic() - start < 2


def test_a_model_switch_waits_for_the_answer_being_generated(bigram, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path))  # the switch remembers the model used
    first = Engine(bigram[0])
    old, order = weakref.ref(first), []

    def loader(**kw):
        order.append(("load", "old engine freed" if old() is None else "two models in memory"))
        return Engine(*bigram)

    manager = ModelManager(loader, ModelChoice("tiny", None), first)
    del first
    h = Handlers(manager, Access())
    stream = h.respond("w5", [], SYSTEM, *GREEDY._replace(spec=False, max_new=40), request=None)
    next(stream), next(stream)  # the answer is generating: it holds the lane
    switching = threading.Thread(target=manager.switch, args=(Request(ModelChoice("tiny-2", None)),))
    switching.start()
    time.sleep(0.3)
    assert order == [] and switching.is_alive(), "the switch waits for the answer"
    list(stream)
    order.append("answer done")
    switching.join(10)
    assert order == ["answer done", ("load", "old engine freed")]
    assert manager.engine.has_head and manager.choice.model == "tiny-2"


def test_visitors_through_the_public_link_are_cut_at_the_time_cap_and_told(bigram):
    access = Access(remote_max_new_tokens=1000, remote_max_seconds=0.3)
    h = Handlers(ModelManager(loader=None, choice=ModelChoice("tiny", None), engine=Engine(bigram[0])), access)
    settings = GREEDY._replace(spec=False, max_new=80)
    slow(h.manager.engine, 0.02)  # a slow model: 80 steps take over a second
    outs = list(h.respond("w5", [], SYSTEM, *settings, request=SHARE_LINK))
    assert "cut after 0.3 s" in outs[-1][7] and 3 < outs[-1][5]["tokens"] < 80
    local = list(h.respond("w5", [], SYSTEM, *settings, request=LOCAL))[-1]
    assert local[5]["tokens"] == 80 and local[7] == "", "local visitors are not limited"


def test_a_fault_keeps_the_conversation_and_logs_its_traceback(bigram, caplog, monkeypatch):
    engine = Engine(*bigram)
    h = handlers_for(engine)
    _, state, _, _, _ = answer(h, "w5 w9", [])

    def broken(*args, **kwargs):
        raise RuntimeError("boom")
        yield

    monkeypatch.setattr(engine, "generate", broken)
    with pytest.warns(UserWarning, match=r"Internal error \(RuntimeError: boom\)"):
        outs = list(h.respond("w6", state, SYSTEM, *GREEDY, request=None))
    chat, history, box, *panel, notice = outs[-1]
    assert chat == history == state and box == "w6", "the conversation as it was, the message back in its box"
    assert panel == [SKIP] * 4 and "Internal error" in notice
    faults = [r for r in caplog.records if r.name == "eagle_chat"]
    assert len(faults) == 1 and faults[0].levelname == "ERROR" and faults[0].exc_info, "a bug keeps its traceback"


class Unsafe:
    """An object in a pickle: torch's safe loader refuses it, with a long explanation."""


def test_a_refused_head_pickle_shows_torchs_whole_reason(tmp_path, monkeypatch):
    from transformers import AutoConfig

    from app.manager import CUSTOM
    from core.decoding.head import new_head, save_head
    from tests.test_app_downloads import tiny_llama

    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path / "home"))
    target = tiny_llama(tmp_path / "tiny")
    head = save_head(new_head(AutoConfig.from_pretrained(target), seed=0), tmp_path / "head")
    (head / "model.safetensors").unlink()
    torch.save({"fc.weight": Unsafe()}, head / "pytorch_model.bin")
    with pytest.raises(Exception) as refused:
        torch.load(head / "pytorch_model.bin", weights_only=True)
    reason = str(refused.value)
    assert len(reason) > 400
    h = Handlers(ModelManager(Engine.load, ModelChoice(str(target), None)), Access())
    with pytest.warns(UserWarning, match="Loading failed"):
        message, *_ = h.load(CUSTOM, str(target), str(head), "float32", "cpu", False, progress=lambda *a, **k: None)
    assert reason in message, "the whole reason, not its first 200 characters"


def test_the_panel_says_where_the_default_tree_came_from(bigram):
    from app.ui import build
    from core.decoding.rowcost import RowCosts

    engine = Engine(*bigram)
    engine.tree_choice = TreeChoice(TreeConfig(depth=4, top_k=3, total_tokens=9),
                                    "tuned on this machine at 2026-11-30 17:40")
    h = handlers_for(engine)
    shown = "Default tree: depth 4, top-k 3, 9 nodes · tuned on this machine at 2026-11-30 17:40"
    assert h.page_load("", LOCAL)[2] == shown
    panel = next(c for c in build(h.manager).demo.config["components"]
                 if c.get("props", {}).get("elem_id") == "tree-origin")
    assert panel["props"]["value"] == shown
    engine.tree_choice = TreeChoice(TreeConfig(depth=4, top_k=3, total_tokens=9, long_context=((1024, 4, 6), (4096, 2, 4))),
                                    "shipped with the head")
    assert h.manager.tree_markdown() == ("Default tree: depth 4, top-k 3, 9 nodes; in long chats 6 nodes from 1,024 "
                                         "tokens, depth 2 and 4 nodes from 4,096 tokens · shipped with the head")
    engine.tree_choice = TreeChoice(TreeConfig(depth=1, top_k=8, total_tokens=2, row_floor=True), "shipped with the head")
    engine.row_costs = RowCosts(one=2.6e-3, two=3.75e-3, head=0.6e-3)  # a row at 36% of a step: drafts from 36%
    assert h.manager.tree_markdown() == ("Default tree: depth 1, top-k 8, 2 nodes; greedy steps verify only drafts "
                                         "likely enough to pay for their row at the cost measured while answering "
                                         "(now 36% and up) · shipped with the head")


def test_side_by_side_updates_the_page_at_the_chats_pace(bigram, monkeypatch):
    """The race shows its first step at once, then at most one update per Pace.TEXT_S, and always its end: an update
    for each step of either column (hundreds a second) kept the page, and with it the cores, busy."""
    h = handlers_for(Engine(*bigram))
    with monkeypatch.context() as m:
        m.setattr(Pace, "TEXT_S", 0.0)
        steps = len(list(h.compare("w5 w9", SYSTEM, 0.0, 1.0, 24, 3, 2, 6, request=None)))
    assert steps > 10  # unpaced: an update per step of either column
    monkeypatch.setattr(app_session, "Pace", lambda: Pace(clock=lambda: 0.0))  # the clock stands still
    outs = list(h.compare("w5 w9", SYSTEM, 0.0, 1.0, 24, 3, 2, 6, request=None))
    assert [o[3]["final"] for o in outs] == [False, True], (len(outs), steps)
    assert outs[-1][3]["plain"]["tokens"] == outs[-1][3]["speculative"]["tokens"] == 24 and outs[-1][3]["identical"]


def test_side_by_side_is_a_race_with_both_columns_streaming(bigram, monkeypatch):
    monkeypatch.setattr(Pace, "TEXT_S", 0.0)  # every step of either column shows: tiny models race in milliseconds
    h = handlers_for(Engine(*bigram))
    outs = list(h.compare("w5 w9", SYSTEM, 0.0, 1.0, 24, 3, 2, 6, request=None))
    live = [o for o in outs if not o[3]["final"]]
    both = [o for o in live if all(0 < o[3][k]["tokens"] < 24 for k in ("plain", "speculative"))]
    assert both, "both columns stream at once, neither waits for the other to finish"
    assert all("speed-up so far" in o[2] for o in live)
    assert all(abs(o[3]["plain"]["clock_s"] - o[3]["speculative"]["clock_s"]) < 0.5 for o in live), \
        "each column advances by its own compute time"
    final = outs[-1][3]
    assert final["final"] and final["identical"] is True and "identical" in outs[-1][2]
    for k in ("plain", "speculative"):
        assert final[k]["tokens"] == 24
        clock = final[k]["clock_s"]  # rounded to 1 ms: on tiny models a few percent of the clock
        assert final[k]["tokens_per_s"] == pytest.approx(24 / clock, rel=0.02 + 0.0005 / clock), "its own clock"
    assert final["speedup"] == pytest.approx(final["speculative"]["tokens_per_s"] / final["plain"]["tokens_per_s"],
                                             rel=0.02)


def test_a_tree_capped_by_its_size_is_said_with_the_answer(bigram):
    h = handlers_for(Engine(*bigram))
    *_, notice = answer(h, "w5 w9", [], GREEDY._replace(depth=8, tree_size=4))
    assert notice == ("Note: Tree size 4 caps the tree at 3 drafted tokens in a row, so depth 8 drafts 5 levels "
                      "that cannot be used.")
    assert answer(h, "w5 w9", [], GREEDY._replace(depth=3, tree_size=4))[-1] == "", "depth 3 fits 4 nodes"


def test_the_tuned_tree_keeps_its_chain_size_and_a_hand_set_tree_its_own(bigram):
    engine = Engine(*bigram)
    engine.tree_choice = TreeChoice(TreeConfig(depth=3, top_k=2, total_tokens=6, lookup=8, lookup_total_tokens=3),
                                    "shipped with the head")
    h = handlers_for(engine)
    assert h.manager.tree_markdown().startswith(
        "Default tree: depth 3, top-k 2, 6 nodes, plus up to 8 tokens copied from earlier text when it repeats "
        "(then 3 nodes)")
    cfg, _ = h._settings(ChatSettings(*GREEDY), None, [])
    assert cfg.tree.lookup == 8 and cfg.tree.lookup_total_tokens == 3 and cfg.tree.with_chain().total_tokens == 3
    cfg, _ = h._settings(ChatSettings(*GREEDY._replace(tree_size=9)), None, [])
    assert cfg.tree.lookup == 8 and cfg.tree.with_chain().total_tokens == 9


def limited_handlers(bigram, **caps) -> Handlers:
    return Handlers(ModelManager(loader=None, choice=ModelChoice("tiny", None), engine=Engine(*bigram)), Access(**caps),
                    adaptive=False)  # steps that do not depend on timing


def test_a_visitors_prompt_is_capped_in_tokens_so_the_prefill_fits_the_time(bigram):
    # The seconds cap is checked after each engine event and the first comes after the whole
    # prefill: only a token budget keeps a long prompt's prefill inside the cap.
    h = limited_handlers(bigram, remote_max_prompt_tokens=24)
    words = " ".join(f"w{i}" for i in range(10, 40))  # 35 tokens with the system prompt
    history = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]
    with pytest.warns(UserWarning, match="prompts of at most 24 tokens"):
        outs = list(h.respond(words, history, SYSTEM, *GREEDY, request=SHARE_LINK))
    assert len(outs) == 1 and all(o == SKIP for o in outs[0][:7]), "the chat and the message in its box are kept"
    assert "at most 24 tokens" in outs[0][7] and "this one is 35 tokens" in outs[0][7] and "Shorten" in outs[0][7]
    assert list(h.respond(words, history, SYSTEM, *GREEDY, request=LOCAL))[-1][5]["tokens"] >= 1, "local: no cap"
    old = " ".join(f"w{i}" for i in range(40, 52))
    long_chat = [{"role": "user", "content": old}, {"role": "assistant", "content": old}]
    with pytest.warns(UserWarning, match="left out"):
        last = list(h.respond("w5 w6", long_chat, SYSTEM, *GREEDY, request=SHARE_LINK))[-1]
    assert "prompts of at most 24 tokens, so the oldest 1 exchange(s) were left out" in last[7]
    assert last[1][:2] == long_chat and last[5]["tokens"] >= 1, "the visible chat keeps every turn"
    with pytest.warns(UserWarning, match="this one is 35 tokens"):
        assert "at most 24 tokens" in list(h.compare(words, SYSTEM, 0.0, 1.0, 4, 2, 2, 4, request=SHARE_LINK))[-1][2]


def test_messages_have_a_length_limit_said_with_its_numbers(bigram):
    h = limited_handlers(bigram, max_message_chars=50, remote_max_message_chars=20)
    history = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]
    message = " ".join(["w5"] * 10)  # 29 characters
    with pytest.warns(UserWarning, match="29 characters long; the limit is 20 characters for visitors"):
        outs = list(h.respond(message, history, SYSTEM, *GREEDY, request=SHARE_LINK))
    assert outs == [(*[SKIP] * 7, outs[0][7])], "the chat, its history and the message in the box are kept"
    check = h.check_chat(message, history, SYSTEM, *GREEDY, request=SHARE_LINK)
    assert check[0]["is_valid"] is False and "the limit is 20 characters" in check[0]["message"]
    assert all(v["is_valid"] for v in check[1:]) and len(check) == 12
    assert list(h.respond(message, history, SYSTEM, *GREEDY, request=LOCAL))[-1][5]["tokens"] >= 1
    longer = " ".join(["w5"] * 20)  # 59 characters: over every visitor's limit
    with pytest.warns(UserWarning, match="59 characters long; the limit is 50 characters. Shorten"):
        assert list(h.respond(longer, history, SYSTEM, *GREEDY, request=LOCAL))[0][:7] == (SKIP,) * 7
    with pytest.warns(UserWarning, match="The system prompt is 59 characters long"):
        list(h.regenerate(history, longer, *GREEDY, request=LOCAL))
    assert h.check_compare(longer, SYSTEM, 0.0, 1.0, 4, 2, 2, 4, request=LOCAL)[0]["is_valid"] is False
    # the page's gates say the same in place (notice, and no new counter value: nothing is sent)
    assert h.gate_chat(message, SYSTEM, request=SHARE_LINK) == (check[0]["message"], SKIP)
    assert h.gate_compare(longer, SYSTEM, request=LOCAL)[1] == SKIP
    assert "The system prompt is 59 characters long" in h.gate_regenerate(history, longer, request=LOCAL)[0]


def test_the_pages_gates_refuse_in_place_and_let_each_good_request_go_once(bigram):
    h = handlers_for(bigram[0])
    chat = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]
    assert h.gate_chat("   ", SYSTEM, request=LOCAL) == ("Type a message first.", SKIP)
    assert h.gate_compare("", SYSTEM, request=LOCAL) == ("Type a prompt to compare.", SKIP)
    assert h.gate_regenerate([], SYSTEM, request=LOCAL) == ("Nothing to regenerate yet: send a message first.", SKIP)
    goes = [h.gate_chat("w5", SYSTEM, request=LOCAL), h.gate_regenerate(chat, SYSTEM, request=LOCAL),
            h.gate_compare("w5", SYSTEM, request=LOCAL), h.gate_chat("w5", SYSTEM, request=LOCAL)]
    assert all(notice == SKIP for notice, _ in goes), "a good request leaves the notice to its answer"
    counts = [count for _, count in goes]
    assert all(isinstance(c, int) for c in counts) and len(set(counts)) == 4, "each one moves the counter"
    assert h.tickets.sessions() == set(), "a gate holds no ticket: the request gets one when it joins the queue"


def test_a_visitor_through_the_public_link_holds_one_answer_at_a_time(bigram):
    h = limited_handlers(bigram, remote_max_new_tokens=1000)
    settings = GREEDY._replace(spec=False, max_new=40)
    first = h.respond("w5", [], SYSTEM, *settings, request=SHARE_LINK)
    next(first), next(first)  # generating
    other_tab = FakeRequest(host="abcd1234.gradio.live", forwarded="203.0.113.7", session_hash="s2")
    check = h.check_chat("w6", [], SYSTEM, *settings, request=other_tab)
    assert check[0]["is_valid"] is False and "Wait for your answer to finish" in check[0]["message"]
    with pytest.warns(UserWarning, match="1 answer at a time"):
        chat = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]
        assert list(h.regenerate(chat, SYSTEM, *settings, request=other_tab))[0][:7] == (SKIP,) * 7
    with pytest.warns(UserWarning, match="Wait for your answer to finish"):
        outs = list(h.respond("w6", [], SYSTEM, *settings, request=other_tab))
    assert outs == [(*[SKIP] * 7, outs[0][7])], "refused before it queues, the chat kept"
    someone_else = FakeRequest(host="abcd1234.gradio.live", forwarded="203.0.113.8", session_hash="s3")
    assert all(v["is_valid"] for v in h.check_chat("w6", [], SYSTEM, *settings, request=someone_else))
    assert all(v["is_valid"] for v in h.check_chat("w6", [], SYSTEM, *settings, request=LOCAL)), "local: no bound"
    assert "Wait for your answer to finish" in h.gate_chat("w6", SYSTEM, request=other_tab)[0]
    assert h.gate_chat("w6", SYSTEM, request=someone_else)[0] == SKIP
    list(first)
    assert list(h.respond("w6", [], SYSTEM, *settings, request=other_tab))[-1][5]["tokens"] == 40


def test_a_visitor_is_the_address_the_share_tunnel_saw():
    from app.lane import visitor_of

    assert visitor_of(SHARE_LINK) == "203.0.113.7"
    assert visitor_of(FakeRequest(forwarded="198.51.100.1, 203.0.113.7")) == "203.0.113.7", "a forged entry is ignored"
    assert visitor_of(FakeRequest(client="192.168.1.9")) == "192.168.1.9" and visitor_of(None) == "local"


def test_a_long_chat_says_which_mode_ran_and_why(bigram, monkeypatch):
    engine = Engine(*bigram)
    words = " ".join(f"w{i}" for i in range(10, 40))  # with the system prompt and template: about 36 tokens
    engine.tree_choice = TreeChoice(TreeConfig(depth=3, top_k=2, total_tokens=6, long_context=((30, 0, 0),)), "test")
    h = handlers_for(engine, adaptive=True)
    # measured speed chooses (the app's default): a chat past the plain cap starts plain and says so;
    # 8 tokens are 7 steps, fewer than the schedule's first probe (core.decoding.adaptive)
    _, _, stats, _, notice = answer(h, words, [], GREEDY._replace(max_new=8))
    assert notice.startswith("Long chat (35 tokens): from 30 tokens plain decoding is usually faster on this machine")
    assert "starts plain and speculates only while it measures faster" in notice
    assert stats["ran"] == ("plain: a chat this long starts plain here, and speculation did not measure faster in "
                            "this answer")
    assert "starts plain and speculates only while it measures faster" in answer(
        h, words, [], GREEDY._replace(temperature=0.5, max_new=8))[4], "sampled answers too (one seed, one answer)"
    # the caps alone (GenerationConfig.adaptive off)
    h.adaptive = False
    _, _, stats, _, notice = answer(h, words, [], GREEDY._replace(max_new=8))
    assert notice.startswith("Speculation paused for this answer: the chat holds ") and "from 30 on plain" in notice
    assert stats["ran"] == ("plain, speculation paused: the chat reached 30 tokens, from which plain decoding is "
                            "faster here (every draft-tree row reads the whole chat)")
    assert stats["ran"] in answer(h, words, [], GREEDY._replace(max_new=8))[0][-1][4], "the stats line names it"
    _, _, stats, _, notice = answer(h, "w5", [], GREEDY._replace(max_new=30))  # crosses 30 while answering
    assert notice == "" and stats["ran"].startswith("speculative, plain from step ")
    assert stats["ran"].endswith(": the chat reached 30 tokens, from which plain decoding is faster here "
                                 "(every draft-tree row reads the whole chat)")
    engine.tree_choice = TreeChoice(TreeConfig(depth=3, top_k=2, total_tokens=6, long_context=((20, 2, 4),)), "test")
    _, _, stats, _, notice = answer(h, words, [], GREEDY._replace(max_new=8))
    assert "from 20 tokens the draft tree is capped at depth 2 and 4 nodes" in notice and stats["ran"] == "speculative"


def test_hot_sampling_decodes_plain_where_the_tree_says_so_and_the_app_says_why(bigram):
    engine = Engine(*bigram)
    engine.tree_choice = TreeChoice(TreeConfig(depth=3, top_k=2, total_tokens=6, plain_from_temperature=0.9), "test")
    h = handlers_for(engine)
    _, _, stats, _, notice = answer(h, "w5 w6", [], GREEDY._replace(temperature=1.2, max_new=8))
    assert notice.startswith("Speculation paused for this answer: sampling at temperature 1.2, plain decoding is "
                             "faster on this machine (measured from 0.9 on")
    assert stats["ran"] == ("plain, speculation paused: sampling at temperature 1.2, where plain decoding is faster "
                            "here (hot sampling accepts few drafted tokens)")
    _, _, stats, _, notice = answer(h, "w5 w6", [], GREEDY._replace(temperature=0.5, max_new=8))
    assert notice == "" and stats["ran"] == "speculative", "cooler sampling speculates"
    assert "plain decoding when sampling at temperature 0.9 or above" in h.manager.tree_markdown()
    # measured speed chooses (the app's default): the pause is where the answer starts, and says so
    h.adaptive = True
    _, _, stats, _, notice = answer(h, "w5 w6", [], GREEDY._replace(temperature=1.2, max_new=8))
    assert notice.startswith("Sampling at temperature 1.2: from 0.9 on plain decoding is usually faster on this "
                             "machine") and "starts plain and speculates only while it measures faster" in notice
    assert stats["ran"] == ("plain: sampling this hot starts plain here, and speculation did not measure faster "
                            "in this answer"), "8 tokens: fewer steps than the first probe"


def test_a_long_prefill_is_shown_while_it_runs_and_a_new_chat_is_suggested(bigram, monkeypatch):
    import app.longchat

    engine = Engine(*bigram)
    fast = engine.generate

    def slow_prefill(*args, **kwargs):
        events = fast(*args, **kwargs)
        first = next(events)
        time.sleep(1.3)  # the first step reads the whole prompt
        yield first
        yield from events

    monkeypatch.setattr(engine, "generate", slow_prefill)
    monkeypatch.setattr(app.longchat, "NEW_CHAT_TOKENS", 20)
    outs = list(handlers_for(engine).respond("w5 w6 w7", [], SYSTEM, *GREEDY, request=None))
    reading = [o[4] for o in outs if isinstance(o[4], str) and o[4].startswith("Reading your prompt")]
    assert len(reading) == 2 and all(o == SKIP for o in outs[1][:4]), "only the stats line changes meanwhile"
    assert reading[0].startswith("Reading your prompt (") and " tokens) … 1 s; the answer starts after that." \
        in reading[1]
    assert "every answer first reads all of it again (this one's first token came after 1." in outs[-1][7]
    assert "start a New chat" in outs[-1][7]


def test_stop_while_the_prompt_is_read_ends_before_the_first_token(bigram, monkeypatch):
    """The engine asks the ticket's Stop before each chunk of the prompt (core.decoding.forward.prefill): a Stop
    pressed meanwhile ends the answer there, the chat as it was with the message back in the box, and the next
    message works."""
    engine = Engine(*bigram)
    h = handlers_for(engine)
    real = engine.generate

    def stop_pressed_while_reading(*args, should_stop=None, **kwargs):
        def ask() -> bool:
            h.stop(None)  # Stop, pressed while the prompt is read
            return should_stop()

        return real(*args, should_stop=ask, **kwargs)

    monkeypatch.setattr(engine, "generate", stop_pressed_while_reading)
    history = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6 w7"}]
    outs = list(h.respond("w8 w9", history, SYSTEM, *GREEDY, request=None))
    chat, state, box, *_, notice = outs[-1]
    assert chat == state == history and box == "w8 w9" and STOPPED_READING in notice
    race = list(h.compare("w8 w9", SYSTEM, 0.0, 1.0, 12, 3, 2, 6, request=None))[-1]  # side by side: the same
    assert race[3]["final"] and "Stopped." in race[2]
    assert race[3]["plain"]["tokens"] == race[3]["speculative"]["tokens"] == 0
    monkeypatch.setattr(engine, "generate", real)
    outs, state, stats, *_ = answer(h, "w8 w9", history)
    assert not stats["stopped"] and stats["tokens"] > 0 and len(state) == 4


def test_the_panel_counts_head_tree_nodes_and_copied_text_apart(bigram):
    engine = Engine(*bigram)
    engine.tree_choice = TreeChoice(TreeConfig(depth=2, top_k=2, total_tokens=4, lookup=8), "test")
    h = handlers_for(engine)
    _, _, stats, _, _ = answer(h, "w5 w9", [], GREEDY._replace(depth=2, top_k=2, tree_size=4, max_new=60))
    verified = [r["tree_size"] for r in stats["per_step"] if r["tree_size"]]
    assert stats["copied_steps"] > 0 and stats["copied_accepted"] > 0, "the bigram model repeats itself"
    assert max(verified) > 4 and 2 <= stats["head_nodes"] <= 4, "the slider's tree stays 4 nodes; copies come on top"
    assert max(r["tokens"] for r in stats["per_step"]) > 3, "a step accepted more than a depth-2 tree allows"
    stats_md = answer(h, "w5 w9", [], GREEDY._replace(depth=2, top_k=2, tree_size=4, max_new=60))[0][-1][4]
    assert (f"head tree {stats['head_nodes']} nodes · copied from earlier text on {stats['copied_steps']} steps, "
            f"{stats['copied_accepted']} tokens accepted") in stats_md


def test_the_panel_counts_copied_text_beside_drafts_drawn_from_the_head(bigram):
    """Sampled with a depth-1 tree (the head drafts on the sampler's noise, core.decoding.gumbel) the
    panel still tells the head's children from the copied chain."""
    engine = Engine(*bigram)
    engine.tree_choice = TreeChoice(TreeConfig(depth=1, top_k=2, total_tokens=3, lookup=8), "test")
    h = handlers_for(engine)
    # a seed whose answer repeats itself (3 seeds in 4 do at this temperature): one seed, one answer
    settings = GREEDY._replace(temperature=0.3, depth=1, top_k=2, tree_size=3, max_new=60, seed=2)
    _, _, stats, _, _ = answer(h, "w5 w9", [], settings)
    assert stats["copied_steps"] > 0 and stats["copied_accepted"] > 0, "the bigram model repeats itself"
    assert 2 <= stats["head_nodes"] <= 3, "the head's children beside the root"


def test_a_seed_gives_one_sampled_answer_and_each_answer_shows_its_seed(bigram):
    h = handlers_for(Engine(*bigram))
    hot = GREEDY._replace(temperature=0.9, max_new=30, seed=7)
    outs, _, spec, _, _ = answer(h, "w5 w9", [], hot)
    _, _, plain, _, _ = answer(h, "w5 w9", [], hot._replace(spec=False))
    assert spec["seed"] == plain["seed"] == 7 and spec["mode"] == "speculative" and plain["mode"] == "plain"
    assert [r["tokens"] for r in spec["per_step"]] != [1] * len(spec["per_step"]), "drafts were accepted"
    assert outs[-1][0][-1]["content"] == answer(h, "w5 w9", [], hot._replace(spec=False))[0][-1][0][-1]["content"]
    assert "sampled with seed 7 (type it into Sampling → Seed" in outs[-1][4]
    fresh_outs, _, fresh, _, _ = answer(h, "w5 w9", [], hot._replace(seed=-1))  # a new seed, shown
    assert 0 <= fresh["seed"] < 2**31
    again = answer(h, "w5 w9", [], hot._replace(seed=fresh["seed"], spec=False))[0]
    assert again[-1][0][-1]["content"] == fresh_outs[-1][0][-1]["content"]
    assert "seed" not in answer(h, "w5 w9", [], GREEDY)[2], "greedy answers have no seed"
    with pytest.warns(UserWarning, match="the seed must be a whole number"):
        assert answer(h, "w5 w9", [], hot._replace(seed=1.5))[4].startswith("Invalid setting: the seed must be")


def test_settings_load_restores_what_the_browser_kept_and_leaves_the_controls_when_nothing_is_kept(bigram):
    """A fresh browser has nothing kept: the load must not write back the page's first values over a
    slider the visitor moved meanwhile (the browser test set 60 new tokens, then saw 512 come back);
    kept settings are restored, each checked; without a local engine speculation is switched off either way (a
    model without a head speculates by context lookup: kept as it is)."""
    values = tuple(ChatSettings(max_new=60).__dict__.values())
    h = handlers_for(Engine(*bigram))
    fresh = h.settings_load(None, None, "sys", *values)
    assert len(fresh) == 1 + len(values) and all(isinstance(u, type(gr.skip())) for u in fresh)
    kept = h.settings_load({"system": "kept", "max_new": 77, "depth": "x"}, None, "sys", *values)
    assert kept[0] == "kept" and len(kept) == 1 + len(values)
    assert dict(zip(ChatSettings.names(), kept[1:]))["max_new"] == 77
    assert dict(zip(ChatSettings.names(), kept[1:]))["depth"] == ChatSettings().depth  # unparsable: the value shown
    no_head = handlers_for(Engine(bigram[0]))
    assert all(isinstance(u, type(gr.skip())) for u in no_head.settings_load(None, None, "sys", *values))
    spec_at = 1 + ChatSettings.names().index("spec")
    no_head.manager.engine = None  # a failed switch: nothing serves
    fresh = no_head.settings_load(None, None, "sys", *values)
    assert fresh[spec_at] is False and all(isinstance(u, type(gr.skip())) for i, u in enumerate(fresh) if i != spec_at)


def test_every_step_and_the_load_run_on_one_thread_whichever_thread_asks(bigram):
    """OpenMP keeps a thread pool per thread that starts parallel work, and with more pool threads than
    cores it stops spinning between regions: a chat advanced from Gradio's worker threads streamed a
    third as fast as the engine on one thread (core.threads.on_engine_thread). So the model loads, and
    every step of every answer (chat, its prompt's reading, Side by side) runs on the one engine thread,
    whichever thread advances the handler."""
    seen: set[int] = set()
    engine = Engine(*bigram)
    fast = engine.generate

    def generate(*args, **kwargs):
        for ev in fast(*args, **kwargs):
            seen.add(threading.get_ident())
            yield ev

    engine.generate = generate
    loads: list[int] = []

    def loader(**kwargs):
        loads.append(threading.get_ident())
        return engine

    h = Handlers(ModelManager(loader, ModelChoice("tiny", None)), Access(), adaptive=False)
    outs = h.respond("w5 w9", [], SYSTEM, *GREEDY, request=None)
    workers = [threading.Thread(target=lambda: next(outs, None)) for _ in range(12)]  # Gradio's way: any thread
    for w in workers:
        w.start()
        w.join()
    list(outs)
    list(h.compare("w5 w9", SYSTEM, *GREEDY[:3], 3, 2, 6, request=None))
    assert len(seen) == 1 and loads == list(seen), "one thread loads the model and runs every step"
    assert threading.get_ident() not in seen


def edited(index, text: str) -> gr.EditData:
    """What the chatbot sends when a message is edited (the page's own previous_value is not read)."""
    return gr.EditData(None, {"index": index, "value": text, "previous_value": "?"})


def test_an_edited_message_is_answered_in_place_of_the_turns_after_it(bigram):
    h = handlers_for(Engine(*bigram))
    _, first, _, _, _ = answer(h, "w5 w9", [])
    _, chat, _, _, _ = answer(h, "w3", first)
    assert len(chat) == 4
    notice, pending, go, box = h.gate_edit("", chat, SYSTEM, edited(0, " w6 w2 "), request=LOCAL)
    assert notice == SKIP and box == SKIP and isinstance(go, int), "a good edit is sent, the notice left to its answer"
    assert pending == {"index": 0, "role": "user", "text": "w6 w2", "replaces": "w5 w9"}
    outs = list(h.edit(pending, "", chat, SYSTEM, *GREEDY, request=LOCAL))
    _, fresh, stats, _, _ = answer(h, "w6 w2", [])
    assert outs[-1][0] == outs[-1][1] == fresh, "the edited chat answers as the edited text would in a new chat"
    assert stats["tokens"] >= 2 and h.tickets.sessions() == set()
    # the second user message, edited: the first exchange stays as it was
    pending = h.gate_edit("draft w1", chat, SYSTEM, edited(2, "w4"), request=LOCAL)[1]
    outs = list(h.edit(pending, "draft w1", chat, SYSTEM, *GREEDY, request=LOCAL))
    last = outs[-1]
    assert all(out[2] == SKIP for out in outs), "a draft in the message box stays"
    assert last[1][:2] == chat[:2] and last[1][2] == {"role": "user", "content": "w4"} and len(last[1]) == 4


def test_a_refused_edit_keeps_the_chat_and_puts_its_text_in_an_empty_box(bigram, monkeypatch):
    engine = Engine(*bigram)
    h = handlers_for(engine)
    _, chat, _, _, _ = answer(h, "w5 w9", [])
    # the gate: no longer in the chat, empty, too long; the text goes to the box only if the box is empty
    notice, pending, go, box = h.gate_edit("", chat, SYSTEM, edited(5, "w6"), request=LOCAL)
    assert notice == app_session.NOT_EDITABLE + app_session.TEXT_IN_BOX
    assert (pending, go, box) == (SKIP, SKIP, "w6"), "nothing sent; the edited text kept"
    notice, _, go, box = h.gate_edit("draft w1", chat, SYSTEM, edited(5, "w6"), request=LOCAL)
    assert go == box == SKIP and notice == app_session.NOT_EDITABLE, "a draft in the box is not overwritten"
    assert h.gate_edit("", chat, SYSTEM, edited(0, "  "), request=LOCAL)[:3] == ("Type a message first.", SKIP, SKIP)
    assert h.gate_edit("", chat, SYSTEM, edited(1, " "), request=LOCAL)[:3] == (app_session.EMPTY_ANSWER, SKIP, SKIP)
    capped = limited_handlers(bigram, max_message_chars=10)
    notice, _, go, box = capped.gate_edit("", chat, SYSTEM, edited(0, "w5 w5 w5 w5"), request=LOCAL)
    assert "11 characters long; the limit is 10 characters" in notice and go == SKIP and box == "w5 w5 w5 w5"
    check = capped.check_edit({"index": 0, "role": "user", "text": "w5 w5 w5 w5", "replaces": "w5 w9"}, "", chat,
                              SYSTEM, *GREEDY,
                              request=LOCAL)
    assert check[0]["is_valid"] is False and len(check) == 13, "the queue's validator refuses it too"
    # the chat changed between the edit and its answer (another chat was picked): nothing changes
    pending = h.gate_edit("", chat, SYSTEM, edited(0, "w6"), request=LOCAL)[1]
    other = [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8"}]
    with pytest.warns(UserWarning, match="The chat changed before the edit was answered"):
        outs = list(h.edit(pending, "", other, SYSTEM, *GREEDY, request=LOCAL))
    assert outs == [(SKIP, SKIP, "w6", *[SKIP] * 4, app_session.EDIT_CHANGED + app_session.TEXT_IN_BOX)]
    with pytest.warns(UserWarning, match="The chat changed"):
        outs = list(h.edit(pending, "draft w1", other, SYSTEM, *GREEDY, request=LOCAL))
    assert outs == [(*[SKIP] * 7, app_session.EDIT_CHANGED)], "a draft in the box stays"

    # a fault before the first token: the whole chat as it was, the edited text in the box
    def broken(*args, **kwargs):
        raise RuntimeError("boom")
        yield

    monkeypatch.setattr(engine, "generate", broken)
    with pytest.warns(UserWarning, match=r"Internal error \(RuntimeError: boom\)"):
        outs = list(h.edit(pending, "", chat, SYSTEM, *GREEDY, request=LOCAL))
    chat_out, history, box, *_, notice = outs[-1]
    assert chat_out == history == chat and box == "w6"
    assert "Internal error" in notice and notice.endswith(app_session.TEXT_IN_BOX)


def test_continue_writes_on_where_the_token_limit_cut_the_answer(bigram):
    h = handlers_for(Engine(*bigram))
    _, whole, stats, _, _ = answer(h, "w5 w9", [], GREEDY._replace(max_new=12))
    assert stats["finish_reason"] == "length"
    outs, cut, stats, _, notice = answer(h, "w5 w9", [], GREEDY._replace(max_new=5))
    assert stats["finish_reason"] == "length" and "max new tokens reached (Continue writes more)" in outs[-1][4]
    assert h.gate_continue(cut, SYSTEM, request=LOCAL)[0] == SKIP
    for settings in (GREEDY._replace(max_new=7), GREEDY._replace(max_new=7, spec=False)):
        outs = list(h.continue_answer(cut, SYSTEM, *settings, request=LOCAL))
        assert all(out[2] == SKIP for out in outs), "a draft in the message box stays"
        assert outs[-1][0] == outs[-1][1] == whole, "5 tokens, then 7 more: the 12-token answer, word for word"
        assert outs[-1][5]["tokens"] == 7 and outs[-1][5]["mode"] == ("plain" if not settings.spec else "speculative")
    assert h.tickets.sessions() == set()


def test_continue_needs_an_answer_to_write_on_and_says_when_it_adds_nothing(bigram):
    engine = Engine(*bigram)
    h = handlers_for(engine)
    asked = [{"role": "user", "content": "w5"}]
    for history in ([], asked, asked + [{"role": "assistant", "content": " "}]):
        assert h.gate_continue(history, SYSTEM, request=LOCAL) == (app_session.NOTHING_TO_CONTINUE, SKIP)
        with pytest.warns(UserWarning, match="Nothing to continue"):
            assert list(h.continue_answer(history, SYSTEM, *GREEDY, request=LOCAL)) == [
                (*[SKIP] * 7, app_session.NOTHING_TO_CONTINUE)]
    # an answer whose last word the bigram model follows with its end of turn: said, the chat unchanged
    model = engine.target.model
    after = model(torch.arange(model.config.vocab_size)[:, None]).logits[:, -1].argmax(-1)
    ending = next(f"w{i}" for i in range(4, len(after)) if after[i] == engine.target.eos_ids[0])
    done = asked + [{"role": "assistant", "content": f"w9 {ending}"}]
    last = list(h.continue_answer(done, SYSTEM, *GREEDY, request=LOCAL))[-1]
    assert last[1] == done and last[5]["finish_reason"] == "eos" and app_session.NOTHING_ADDED in last[7]


def test_the_stats_say_how_much_of_the_context_the_chat_fills(bigram):
    h = handlers_for(Engine(*bigram))
    outs, chat, stats, _, _ = answer(h, "w5 w9", [])
    prompt = h.manager.engine.count_tokens([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "w5 w9"}])
    assert stats["context_tokens"] == prompt + stats["tokens"] and stats["max_context"] == 96
    assert f"context {prompt + stats['tokens']} of 96 tokens" in outs[-1][4]
    outs, _, more, _, _ = answer(h, "w3", chat)
    assert more["context_tokens"] > stats["context_tokens"] + 1, "the next turn reads the whole chat"


def test_an_attached_text_file_joins_the_message_in_the_box(bigram, tmp_path):
    h = limited_handlers(bigram, max_message_chars=400, remote_max_message_chars=60)
    code = tmp_path / "prime.py"
    code.write_text("def f(n):\r\n    return n > 1\r\n", encoding="utf-8")
    box, notice = h.attach_file(str(code), "Fix this:", request=LOCAL)
    assert box == "Fix this:\n\nprime.py:\n```python\ndef f(n):\n    return n > 1\n```"
    tokens = h.manager.engine.count_tokens([{"role": "user", "content": box}])
    assert notice == f"Attached “prime.py” to your message ({tokens} tokens of the model's 96-token context): " \
                     "read it over, then Send."
    fenced = tmp_path / "notes.md"
    fenced.write_text("\ufeffsee\n```sh\nls\n```\n", encoding="utf-8")  # a BOM, and a fence of its own
    box, _ = h.attach_file(str(fenced), "", request=LOCAL)
    assert box == "notes.md:\n````markdown\nsee\n```sh\nls\n```\n````", "a longer fence holds the file's own"
    # refused: the box keeps its text (skipped), the notice names the file and the fix
    blob = tmp_path / "a.bin"
    blob.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    latin = tmp_path / "old.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    big = tmp_path / "big.txt"
    big.write_text("w5 " * 200)
    for path, request, reason in ((blob, LOCAL, "“a.bin” is not a text file"),
                                  (latin, LOCAL, "“old.txt” is not UTF-8 text (byte 3 cannot be read)"),
                                  (empty, LOCAL, "“empty.txt” is empty"),
                                  (big, LOCAL, "“big.txt” holds 600 characters; with your message that makes 628, "
                                               "more than the limit of 400 characters."),
                                  (code, SHARE_LINK, "more than the limit of 60 characters for visitors through "
                                                     "the public link"),
                                  (tmp_path / "gone.txt", LOCAL, "No file arrived")):
        with pytest.warns(UserWarning, match="."):
            box, notice = h.attach_file(str(path), "Fix this:", request=request)
        assert box == SKIP and reason in notice, notice
    huge = tmp_path / "huge.txt"
    huge.write_bytes(b"w5 " * 1000)
    with pytest.warns(UserWarning, match="3,000 bytes, more than a message may hold"):
        assert h.attach_file(str(huge), "", request=LOCAL)[0] == SKIP
    # a message longer than the context is said at once
    many = tmp_path / "many.txt"
    many.write_text(" ".join(["w5"] * 100))  # 299 characters, 100 tokens
    box, notice = h.attach_file(str(many), "", request=LOCAL)
    assert box.startswith("many.txt:") and notice.endswith("more than the model can read at once. Shorten it before "
                                                           "sending.")


def test_an_edited_answer_is_kept_as_written_and_continue_writes_on_from_it(bigram):
    h = handlers_for(Engine(*bigram))
    _, first, _, _, _ = answer(h, "w5 w9", [])
    _, chat, _, _, _ = answer(h, "w3", first)
    notice, pending, go, box = h.gate_edit("draft w1", chat, SYSTEM, edited(1, " w37 w12 "), request=LOCAL)
    assert notice == box == SKIP and isinstance(go, int)
    assert pending == {"index": 1, "role": "assistant", "text": "w37 w12", "replaces": chat[1]["content"]}
    outs = list(h.edit(pending, "draft w1", chat, SYSTEM, *GREEDY, request=LOCAL))
    kept = [chat[0], {"role": "assistant", "content": "w37 w12"}]
    assert outs == [(kept, kept, *[SKIP] * 5, app_session.EDITED_ANSWER)], "no answer runs; the later turns dropped"
    more = list(h.continue_answer(kept, SYSTEM, *GREEDY._replace(max_new=4), request=LOCAL))[-1]
    assert more[1][1]["content"].startswith("w37 w12 w") and more[5]["tokens"] == 4
    # the answer changed before the edit was kept (another answer ran): nothing changes
    with pytest.warns(UserWarning, match="The chat changed"):
        other = [chat[0], {"role": "assistant", "content": "w8"}]
        assert list(h.edit(pending, "", other, SYSTEM, *GREEDY, request=LOCAL))[-1][:2] == (SKIP, SKIP)

"""Versions of the chat from its latest turning point: what a Regenerate or an edit replaces is kept, and the chat
flips between them."""

from __future__ import annotations

import json

import gradio as gr
import pytest

from app import chats, versions
from app.chats_ui import BUSY_FLIP, CHATS_VIEW
from core.decoding.engine import Engine
from tests.app_server import LOCAL
from tests.test_app_handlers import GREEDY, SYSTEM, answer, bigram, handlers_for  # noqa: F401 (bigram: a fixture)

Q1, A1, A2, A3 = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
                  {"role": "assistant", "content": "a2"}, {"role": "assistant", "content": "a3"})


def regenerated(kept, before: list[dict], after: list[dict], chat="c1") -> dict:
    """What the page does around a Regenerate: keep the replaced answer as it is pressed, the new one after."""
    return versions.written(versions.replacing(kept, chat, before), chat, after)


def test_each_regenerated_answer_is_kept_and_the_chat_flips_between_them():
    kept = regenerated({}, [Q1, A1], [Q1, A2])
    assert versions.label(kept, "c1", [Q1, A2]) == "Answer 2 of 2"
    kept = regenerated(kept, [Q1, A2], [Q1, A3])
    assert versions.label(kept, "c1", [Q1, A3]) == "Answer 3 of 3"
    chat, kept = versions.flip(kept, "c1", [Q1, A3], -1)
    assert chat == [Q1, A2] and versions.label(kept, "c1", chat) == "Answer 2 of 3"
    chat, kept = versions.flip(kept, "c1", chat, -5)  # clamped at the first
    assert chat == [Q1, A1] and versions.label(kept, "c1", chat) == "Answer 1 of 3"
    chat, kept = versions.flip(kept, "c1", chat, 1)
    assert chat == [Q1, A2]
    # a Regenerate from a version shown keeps every version and adds the new answer last
    kept = regenerated(kept, chat, [Q1, {"role": "assistant", "content": "a4"}])
    assert versions.label(kept, "c1", [Q1, {"role": "assistant", "content": "a4"}]) == "Answer 4 of 4"
    assert versions.flip(kept, "c1", [Q1, {"role": "assistant", "content": "a4"}], -3)[0] == [Q1, A1]


def test_the_same_answer_again_is_not_a_new_version():
    kept = regenerated({}, [Q1, A1], [Q1, A1])  # greedy writes it again (or a refused Regenerate left it)
    assert versions.label(kept, "c1", [Q1, A1]) == ""
    kept = regenerated(regenerated({}, [Q1, A1], [Q1, A2]), [Q1, A2], [Q1, A1])
    assert versions.label(kept, "c1", [Q1, A1]) == "Answer 1 of 2", "the version it equals is shown"


def test_a_continued_or_edited_answer_is_what_its_version_holds():
    kept = regenerated({}, [Q1, A1], [Q1, A2])
    continued = [Q1, {"role": "assistant", "content": "a2 and more"}]
    chat, kept = versions.flip(kept, "c1", continued, -1)
    assert chat == [Q1, A1]
    chat, kept = versions.flip(kept, "c1", chat, 1)
    assert chat == continued, "flipping back shows the answer as it was continued"


def test_versions_hold_only_while_their_answer_is_the_chats_last():
    kept = regenerated({}, [Q1, A1], [Q1, A2])
    later = [Q1, A2, {"role": "user", "content": "next"}, {"role": "assistant", "content": "b"}]
    edited_question = [{"role": "user", "content": "q edited"}, A2]
    for chat in (later, edited_question, [], [Q1]):
        assert versions.label(kept, "c1", chat) == "" and versions.flip(kept, "c1", chat, -1) is None
    assert versions.label(kept, "another chat", [Q1, A2]) == "", "each chat keeps its own"
    assert versions.label(kept, "c1", [Q1, A2]) == "Answer 2 of 2", "back in that chat, they are there again"
    # a chat regenerated after a new turn starts its versions afresh
    kept = regenerated(kept, later, later[:3] + [{"role": "assistant", "content": "b2"}])
    assert versions.label(kept, "c1", later[:3] + [{"role": "assistant", "content": "b2"}]) == "Answer 2 of 2"
    assert versions.label(kept, "c1", [Q1, A2]) == ""


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


def turned(kept, before: list[dict], at: int, after: list[dict], chat="c1") -> dict:
    """What the page does around an edit of message `at`: keep what it replaces, then what it wrote."""
    return versions.written(versions.replacing(kept, chat, before, at), chat, after)


def test_an_edited_question_keeps_the_exchange_it_replaced_and_regenerations_join_them():
    kept = turned({}, [Q1, A1], 0, [user("q2"), bot("b2")])
    assert versions.label(kept, "c1", [user("q2"), bot("b2")]) == "Version 2 of 2"
    chat, kept = versions.flip(kept, "c1", [user("q2"), bot("b2")], -1)
    assert chat == [Q1, A1], "the question and its answer as they were"
    # a Regenerate of a version shown: the same question with a new answer, one more version from the same point
    kept = regenerated(kept, chat, [Q1, A2])
    assert versions.label(kept, "c1", [Q1, A2]) == "Version 3 of 3"
    assert versions.flip(kept, "c1", [Q1, A2], -1)[0] == [user("q2"), bot("b2")]
    # answers regenerated first, then the question edited: each answer stays, with the question it answered
    kept = regenerated({}, [Q1, A1], [Q1, A2])
    kept = turned(kept, [Q1, A2], 0, [user("q2"), bot("b2")])
    assert versions.label(kept, "c1", [user("q2"), bot("b2")]) == "Version 3 of 3"
    chat, kept = versions.flip(kept, "c1", [user("q2"), bot("b2")], -2)
    assert chat == [Q1, A1] and versions.flip(kept, "c1", chat, 1)[0] == [Q1, A2]
    # a new message leaves them behind
    assert versions.label(kept, "c1", [Q1, A1, user("next"), bot("n")]) == ""


def test_an_edit_of_an_earlier_message_keeps_the_turns_it_dropped():
    chat = [Q1, A1, user("q2"), bot("b2")]
    kept = turned({}, chat, 0, [user("q1 edited"), bot("c")])
    assert versions.label(kept, "c1", [user("q1 edited"), bot("c")]) == "Version 2 of 2"
    assert versions.flip(kept, "c1", [user("q1 edited"), bot("c")], -1)[0] == chat, "the whole chat as it was"
    # an earlier answer edited: kept as written, the turns after it kept in the version it replaced
    kept = turned({}, chat, 1, [Q1, bot("a1 as I wrote it")])
    assert versions.label(kept, "c1", [Q1, bot("a1 as I wrote it")]) == "Version 2 of 2"
    back, kept = versions.flip(kept, "c1", [Q1, bot("a1 as I wrote it")], -1)
    assert back == chat and versions.label(kept, "c1", back) == "Version 1 of 2"
    # the versions' point moves back to an edit before it, each version with the turns between the two before it
    kept = turned(kept, back, 0, [user("q0"), bot("z")])
    assert versions.label(kept, "c1", [user("q0"), bot("z")]) == "Version 3 of 3"
    assert versions.flip(kept, "c1", [user("q0"), bot("z")], -2)[0] == chat
    assert versions.flip(kept, "c1", [user("q0"), bot("z")], -1)[0] == [Q1, bot("a1 as I wrote it")]
    assert json.loads(json.dumps(kept)) == kept


def test_kept_versions_are_plain_json_and_a_damaged_value_is_ignored():
    import json
    kept = regenerated({}, [Q1, A1], [Q1, A2])
    assert json.loads(json.dumps(kept)) == kept
    for bad in ({"c1": {"turns": [["user", "q"]], "answers": [], "shown": 0}},
                {"c1": {"turns": [["user", "q"]], "answers": ["a1", "a2"], "shown": 5}},
                {"c1": "junk"}, None):
        assert versions.label(bad, "c1", [Q1, A1]) == ""
    many = {}
    chat = [Q1, A1]
    for i in range(versions.MAX_VERSIONS + 5):
        new = [Q1, {"role": "assistant", "content": f"v{i}"}]
        many, chat = regenerated(many, chat, new), new
    assert versions.label(many, "c1", chat) == f"Answer {versions.MAX_VERSIONS} of {versions.MAX_VERSIONS}"


def test_the_handlers_keep_each_answer_and_flip_the_chat_and_its_store(bigram):
    h = handlers_for(Engine(*bigram))
    store = chats.empty_store()
    _, first, _, _, _ = answer(h, "w5 w9", [])  # greedy
    store = chats.save(store, first)
    assert h.versions_view({}, first, store)[0]["visible"] is False, "one answer: no controls"
    sampled = GREEDY._replace(temperature=1.0, seed=7)
    second = list(h.regenerate(first, SYSTEM, *sampled, request=None))[-1][1]
    assert second[:-1] == first[:-1] and second[-1] != first[-1], "sampling wrote another answer"
    # the answer replaced comes from the chat the Regenerate itself read when its turn came (Handlers.regenerated),
    # nothing read before it: a handler outside the queue could read the page's chat mid-answer
    kept, row, label, back, forward = h.versions_written({}, second, store)
    assert row["visible"] and label == "Answer 2 of 2"
    assert back["interactive"] and not forward["interactive"]
    kept, notice, row, label, back, forward, *view = h.versions_back(kept, second, store)
    view = dict(zip(CHATS_VIEW, view))
    assert view["chatbot"] == view["history"] == first
    assert label == "Answer 1 of 2" and notice.startswith("Showing answer 1 of 2")
    assert not back["interactive"] and forward["interactive"]
    history, store = first, view["store"]
    assert chats.current(store)["messages"] == first, "the browser keeps the version shown"
    assert first[-1]["content"] in open(view["export_md"].value["path"], encoding="utf-8").read(), "and exports it"
    # a greedy Regenerate of the first (greedy) answer writes it again: that version, no third
    again = list(h.regenerate(history, SYSTEM, *GREEDY, request=None))[-1][1]
    assert again == first
    kept, row, label = h.versions_written(kept, again, store)[:3]
    assert row["visible"] and label == "Answer 1 of 2"
    assert dict(zip(CHATS_VIEW, h.versions_forward(kept, again, store)[6:]))["history"] == second
    assert h.regenerated == {}, "each Regenerate's chat is read once"
    assert h.versions_written(kept, again, store)[2] == "Answer 1 of 2", "and then nothing more is added"
    # a new message leaves the versions behind: the controls hide
    _, longer, _, _, _ = answer(h, "w6", again)
    row, label, _, _ = h.versions_view(kept, longer, store)
    assert row["visible"] is False and label == ""


def test_a_flip_waits_for_the_answer_being_written(bigram):
    h = handlers_for(Engine(*bigram))
    store = chats.save(chats.empty_store(), [Q1, A2])
    kept = regenerated({}, [Q1, A1], [Q1, A2], chats.current(store)["id"])

    ticket = h.tickets.ticket(LOCAL)  # this session's answer, running or waiting
    with pytest.warns(UserWarning, match="flip between answers"):
        out = h.versions_back(kept, [Q1, A2], store, LOCAL)
    assert BUSY_FLIP in out[1] and all(o == gr.skip() for o in out[:1] + out[2:])
    h.tickets.done(LOCAL, ticket)
    assert dict(zip(CHATS_VIEW, h.versions_back(kept, [Q1, A2], store, LOCAL)[6:]))["history"] == [Q1, A1]


def test_the_chat_store_keeps_each_chats_versions_and_exports_leave_them_out(bigram):
    h = handlers_for(Engine(*bigram))
    store = chats.save(chats.empty_store(), [Q1, A1])
    chat_id = chats.current(store)["id"]
    kept = regenerated({}, [Q1, A1], [Q1, A2], chat_id)
    view = dict(zip(CHATS_VIEW, h.chats_save([Q1, A2], store, kept)))
    store = view["store"]
    assert chats.current(store)["versions"] == kept[chat_id]
    exported = open(view["export_json"].value["path"], encoding="utf-8").read()
    assert "a1" not in exported and "a2" in exported, "an export is the chat as shown"
    # the page loads them with the chat: after a reload the controls are back
    *loaded, kept_again = h.chats_load(store, [])
    assert kept_again == kept and dict(zip(CHATS_VIEW, loaded))["history"] == [Q1, A2]
    assert h.versions_view(kept_again, [Q1, A2], store)[1] == "Answer 2 of 2"
    # another chat, and back: each keeps its own
    other = chats.start_new(store)
    other = dict(zip(CHATS_VIEW, h.chats_save([Q1, A3], other, kept)))["store"]
    assert "versions" not in chats.current(other)
    back = chats.select(other, chat_id)
    assert chats.kept_versions(back) == kept
    # versions a new message left behind are dropped from the store
    later = [Q1, A2, {"role": "user", "content": "next"}, {"role": "assistant", "content": "b"}]
    saved = dict(zip(CHATS_VIEW, h.chats_save(later, store, kept)))["store"]
    assert "versions" not in chats.current(saved) and chats.current(saved)["messages"] == later


def test_each_sessions_regenerated_chat_is_its_own_and_a_closed_tab_frees_it(bigram):
    from app import session
    from tests.app_server import FakeRequest

    h = handlers_for(Engine(*bigram))
    one, two = FakeRequest(session_hash="one"), FakeRequest(session_hash="two")
    list(h.regenerate([Q1, A1], SYSTEM, *GREEDY, request=one))
    list(h.regenerate([Q1, A2], SYSTEM, *GREEDY, request=two))
    assert h.regenerated == {"one": ([Q1, A1], None), "two": ([Q1, A2], None)}
    h.session_end(one)
    assert list(h.regenerated) == ["two"]
    for i in range(session.REGENERATED + 3):
        h.regenerated[f"s{i}"] = ([], None)
    list(h.regenerate([Q1, A1], SYSTEM, *GREEDY, request=one))
    assert len(h.regenerated) == session.REGENERATED and "one" in h.regenerated and "two" not in h.regenerated



def test_the_handlers_keep_what_an_edit_replaced_and_an_answer_edited_in_place_is_its_version(bigram):
    from tests.test_app_handlers import edited

    h = handlers_for(Engine(*bigram))
    _, first, _, _, _ = answer(h, "w5 w9", [])
    store = chats.save(chats.empty_store(), first)
    pending = h.gate_edit("", first, SYSTEM, edited(0, "w6 w2"), request=LOCAL)[1]
    second = list(h.edit(pending, "", first, SYSTEM, *GREEDY, request=LOCAL))[-1][1]
    assert second[0]["content"] == "w6 w2"
    kept, row, label, back, forward = h.versions_written({}, second, store, LOCAL)
    assert row["visible"] and label == "Version 2 of 2" and back["interactive"] and not forward["interactive"]
    out = h.versions_back(kept, second, store, LOCAL)
    kept, notice, view = out[0], out[1], dict(zip(CHATS_VIEW, out[6:]))
    assert view["history"] == first and chats.current(view["store"])["messages"] == first
    # the answer of the version shown, edited in place: what that version holds, no new one
    pending = h.gate_edit("", first, SYSTEM, edited(1, "w7 w7"), request=LOCAL)[1]
    mine = list(h.edit(pending, "", first, SYSTEM, *GREEDY, request=LOCAL))[-1][1]
    assert mine == first[:1] + [{"role": "assistant", "content": "w7 w7"}] and h.regenerated == {}
    kept, _, label, _, _ = h.versions_written(kept, mine, store, LOCAL)
    assert label == "Version 1 of 2"
    assert dict(zip(CHATS_VIEW, h.versions_forward(kept, mine, store, LOCAL)[6:]))["history"] == second
    assert versions.flip(versions.flip(kept, chats.current_id(store), mine, 1)[1], chats.current_id(store),
                         second, -1)[0] == mine, "flipping back shows the answer as edited"

"""Each chat keeps the system prompt it is written with: switching chats shows the next chat's (and keeps the one
shown, typed or not, with the chat left), a new chat starts with the one shown, a reload shows the open chat's, and
exports and imports carry it."""

from __future__ import annotations

import json

import gradio as gr
import pytest

from app import chats
from app.chats_ui import CHATS_VIEW
from app.errors import UserError
from app.state import ChatSettings
from core.decoding.engine import Engine
from tests.app_server import LOCAL
from tests.test_app_handlers import handlers_for, bigram  # noqa: F401 (bigram: a fixture)

PIRATE, POET = "You are a pirate.", "Answer in verse."
TURNS = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]
SKIP = type(gr.skip())


def view(outputs) -> dict:
    return dict(zip(CHATS_VIEW, outputs))


def test_the_store_keeps_each_chats_system_prompt_and_leaves_its_argument_alone():
    store = chats.save(chats.normal(None), TURNS, system=PIRATE)
    assert chats.system_of(chats.current(store)) == PIRATE
    assert chats.system_of(chats.current(chats.save(store, TURNS))) == PIRATE, "None leaves it as it was"
    poet = chats.start_new(store, POET)
    assert chats.system_of(chats.current(poet)) == POET and chats.system_of(chats.current(store)) == PIRATE
    assert chats.system_of(chats.current(chats.start_new(poet, "other"))) == "other", \
        "an empty current chat is reused with the system prompt given"
    kept = chats.keep_system(store, "")
    assert chats.system_of(chats.current(kept)) == "" and chats.system_of(chats.current(store)) == PIRATE
    assert chats.current(kept)["updated"] == chats.current(store)["updated"], "a setting, not a turn: its place stays"
    old = {"version": 1, "current": "a", "chats": [{"id": "a", "title": "t", "named": False, "messages": TURNS}]}
    assert chats.system_of(chats.current(chats.normal(old))) is None, "a chat kept before chats kept theirs has none"


def test_exports_carry_the_system_prompt_and_imports_read_it_back(tmp_path):
    store = chats.save(chats.normal(None), TURNS, system=PIRATE)
    md, js = chats.export_files(chats.current(store), tmp_path)
    assert open(md).read() == f"# w1 w2\n\n**System prompt:**\n\n{PIRATE}\n\n**You:**\n\nw1 w2\n\n**Assistant:**\n\nw3 w4\n"
    assert json.loads(open(js).read())["system"] == PIRATE
    [back] = chats.parse_import(open(js, "rb").read())
    assert chats.system_of(back) == PIRATE and back["messages"] == TURNS
    both = chats.save(chats.start_new(store, POET), TURNS[:1])
    every = chats.parse_import(open(chats.export_all_file(both, tmp_path), "rb").read())
    assert [chats.system_of(c) for c in every] == [POET, PIRATE]
    old = chats.parse_import(json.dumps({"messages": TURNS}).encode())[0]
    assert chats.system_of(old) is None, "a file without one: the chat takes the one shown"
    with pytest.raises(UserError, match='The "system" prompt of the file is not text') as e:
        chats.parse_import(json.dumps({"system": ["x"], "messages": TURNS}).encode())
    assert "Export JSON" in str(e.value)


def test_switching_chats_shows_each_chats_system_prompt_and_keeps_the_one_left(bigram, tmp_path):
    h = handlers_for(Engine(*bigram))
    a = view(h.chats_save(TURNS, chats.normal(None), {}, PIRATE))
    assert isinstance(a["system"], SKIP), "saving after an answer leaves the box as the visitor has it"
    a_id = a["store"]["current"]
    # typed in chat A and not sent: the new chat starts with it, and A keeps it
    b = view(h.chats_new(a["store"], "You are a sly pirate.", LOCAL))
    assert b["system"] == "You are a sly pirate." and b["store"]["current"] != a_id
    b = view(h.chats_save(TURNS[:1], b["store"], {}, POET))
    back = view(h.chats_select(a_id, b["store"], "typed in B", LOCAL))
    assert back["system"] == "You are a sly pirate." and back["chatbot"] == TURNS
    assert chats.system_of(next(c for c in back["store"]["chats"] if c["id"] == b["store"]["current"])) == \
        "typed in B", "the chat left keeps the prompt shown, typed and not sent"
    # a chat kept before chats kept theirs leaves the box as it is
    old = {"version": 1, "current": "a", "chats": [{"id": "a", "title": "t", "named": False, "messages": TURNS},
                                                   {"id": "o", "title": "o", "named": False, "messages": TURNS}]}
    assert isinstance(view(h.chats_select("o", old, "shown", LOCAL))["system"], SKIP)
    # an imported chat shows its own, and the chat left keeps the one shown; a refused import changes nothing
    path = tmp_path / "poet.json"
    path.write_text(json.dumps({"title": "Poem", "system": POET, "messages": TURNS}))
    imported = view(h.chats_import(str(path), back["store"], "typed in A", LOCAL))
    assert imported["system"] == POET and imported["chatbot"] == TURNS
    assert chats.system_of(next(c for c in imported["store"]["chats"] if c["id"] == a_id)) == "typed in A"
    with pytest.warns(UserWarning, match="No file arrived"):
        refused = view(h.chats_import(None, back["store"], "x", LOCAL))
    assert isinstance(refused["system"], SKIP) and isinstance(refused["store"], SKIP)


def test_a_reload_shows_the_open_chats_system_prompt_else_the_one_typed_last(bigram):
    h = handlers_for(Engine(*bigram))
    values = tuple(ChatSettings().__dict__.values())
    written = chats.save(chats.normal(None), TURNS, system=PIRATE)
    assert view(h.chats_load(written, [])[:len(CHATS_VIEW)])["system"] == PIRATE
    kept = {"system": "typed last", "max_new": 77}
    assert h.settings_load(kept, written, "box", *values)[0] == PIRATE, "the open chat's own"
    empty = chats.start_new(written, PIRATE)
    assert h.settings_load(kept, empty, "box", *values)[0] == "typed last", "a chat with no turns: the one typed last"
    assert h.settings_load(kept, None, "box", *values)[0] == "typed last"


def test_a_model_without_a_head_keeps_speculation_on_by_context_lookup(bigram):
    from app.controls import LOOKUP_INFO, LOOKUP_LABEL, NO_HEAD_TREE, SPEC_INFO, SPEC_LABEL, control_props, tree_updates

    no_head = handlers_for(Engine(bigram[0]))
    props = control_props(no_head.manager)
    assert props["spec"] == dict(value=True, interactive=True, info=LOOKUP_INFO, label=LOOKUP_LABEL)
    assert all(props[k] == dict(interactive=False, info=NO_HEAD_TREE) for k in ("depth", "top_k", "tree_size")), \
        "context lookup alone has no tree to shape"
    assert all(u == gr.update(interactive=False, info=NO_HEAD_TREE) for u in tree_updates(no_head.manager, True)), \
        "not even when the box is ticked again"
    assert "speculation copies from the conversation" in no_head.manager.status_markdown()
    assert no_head.manager.tree_markdown().startswith("No draft tree: this model has no EAGLE head. Each step copies "
                                                      "up to 24 tokens from earlier text")
    with_head = control_props(handlers_for(Engine(*bigram)).manager)["spec"]
    assert with_head["info"] == SPEC_INFO and with_head["label"] == SPEC_LABEL

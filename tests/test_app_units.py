"""Fast checks of the app's pure parts: event rendering, context trimming, settings parsing,
the remembered model, the access policy and the launcher's argument parsing."""

from __future__ import annotations

import json

import pytest

from app.chat import BONUS, DRAFT, PLAIN, AnswerView, engine_messages, flatten, trim_to_context
from app.compare import compare_markdown
from app.manager import CUSTOM
from app.lane import is_remote
from app.errors import UserError
from app.state import Access, ModelChoice, generation_config, recall, remember, tree_limit
from core.config import ConfigError, TreeConfig
from core.decoding.engine import StepEvent
from tests.app_server import LOCAL, SHARE_LINK, FakeRequest


def event(ids, texts, draft, tree, *, total, forwards, elapsed, finished=False, reason=None,
          draft_s=0.01, verify_s=0.03, other_s=0.0):
    return StepEvent(token_ids=tuple(ids), draft_tokens=draft, text="".join(texts), token_texts=tuple(texts),
                     tree_size=tree, draft_s=draft_s, verify_s=verify_s, other_s=other_s, finished=finished,
                     finish_reason=reason, total_tokens=total, target_forwards=forwards, elapsed_s=elapsed)


def spec_answer() -> AnswerView:
    view = AnswerView("speculative")
    view.add(event([10], ["Hi"], 0, 0, total=1, forwards=1, elapsed=0.1, draft_s=0.0))  # prefill
    view.add(event([11, 12, 13], [" <b>", "```", "x"], 2, 8, total=4, forwards=2, elapsed=0.3))  # 2 draft + bonus
    view.add(event([14], ["!"], 0, 8, total=5, forwards=3, elapsed=0.5, finished=True, reason="eos"))  # bonus only
    return view


def test_answer_view_classifies_tokens_by_id_and_position():
    view = spec_answer()
    assert view.text == "Hi <b>```x!"
    assert [(tid, kind) for tid, _, kind in view.pieces] == [
        (10, PLAIN), (11, DRAFT), (12, DRAFT), (13, BONUS), (14, BONUS)]
    assert view.tau == pytest.approx(5 / 3) and view.tokens_per_s == pytest.approx(10.0)
    d, v, o = view.shares()
    assert (d, v, o) == pytest.approx((0.02 / 0.11, 0.09 / 0.11, 0.0))
    assert view.finish_reason == "eos" and view.tree_size == 8
    frame = view.frame()
    assert frame.to_dict("records")[2:4] == [{"step": 2, "tokens": 2, "kind": DRAFT},
                                             {"step": 2, "tokens": 1, "kind": BONUS}]
    assert view.x_range() == [0.5, 3.5], "steps are numbers: the axis labels only a few of them"
    assert view.kinds() == [DRAFT, BONUS, PLAIN] and AnswerView("plain").kinds() == [PLAIN]
    assert view.clock_s == pytest.approx(0.11) and view.token_ids() == [10, 11, 12, 13, 14]
    summary = view.summary()
    assert summary["per_step"][1] == {"step": 2, "tokens": 3, "draft": 2, "tree_size": 8,
                                      "draft_ms": 10.0, "verify_ms": 30.0}


def test_highlight_is_escaped_and_separate_from_the_markdown_answer():
    html = spec_answer().highlight_html()
    assert "<b>" not in html.split("tok-view")[1] and "&lt;b&gt;" in html
    assert html.count('class="tok-draft"') == 2 + 1  # two tokens + legend
    assert 'title="id 13 · bonus (target)"' in html
    assert "```" in spec_answer().text, "the chat keeps the raw markdown, fences intact"


def test_compare_summary_flags_identity_greedy_and_sampled():
    a, b = spec_answer(), spec_answer()
    assert "**identical** token for token ✓" in compare_markdown(a, b, greedy=True)
    assert "**identical** token for token (sampled, one seed for both) ✓" in compare_markdown(a, b, greedy=False)
    b.pieces[-1] = (15, "!", BONUS)  # the same text from another token: not identical
    assert b.text == a.text and "different" in compare_markdown(a, b, greedy=True)
    assert "**different** (sampled, one seed for both) ✗" in compare_markdown(a, b, greedy=False)


def test_messages_are_flattened_and_trimmed_oldest_first():
    history = [{"role": "user", "content": [{"type": "text", "text": "a" * 40}]},
               {"role": "assistant", "content": "b" * 40},
               {"role": "user", "content": "c" * 40},
               {"role": "assistant", "content": [{"type": "text", "text": "d"}, {"type": "text", "text": "e"}]},
               {"role": "user", "content": "now"}]
    msgs = engine_messages(history, "  be brief ")
    assert msgs[0] == {"role": "system", "content": "be brief"} and msgs[4]["content"] == "de"
    count = lambda ms: sum(len(m["content"]) for m in ms)  # one "token" per character
    kept, dropped = trim_to_context(msgs, count, max_context=70, max_new_tokens=10)
    assert dropped == 1 and [m["role"] for m in kept] == ["system", "user", "assistant", "user"]
    assert kept[1]["content"] == "c" * 40
    kept, dropped = trim_to_context(msgs, count, max_context=20, max_new_tokens=10)
    assert dropped == 2 and kept == [msgs[0], msgs[-1]], "system prompt and last message always stay"
    assert trim_to_context(msgs, count, 10_000, 10) == (msgs, 0)
    # an answer being continued stays with the user message it answers, whatever else must go
    continued = msgs + [{"role": "assistant", "content": "partial"}]
    kept, dropped = trim_to_context(continued, count, max_context=20, max_new_tokens=10)
    assert dropped == 2 and kept == [msgs[0], msgs[-1], continued[-1]]
    assert flatten(None) == "" and flatten({"text": "x"}) == "x"


def test_generation_config_parses_sliders_and_refuses_bad_values():
    cfg = generation_config(max_new_tokens=24.0, temperature=0, top_p=1, speculative=True, depth=3.0,
                            top_k=4.4, tree_size=10)
    assert (cfg.max_new_tokens, cfg.tree.depth, cfg.tree.top_k, cfg.tree.total_tokens) == (24, 3, 4, 10)
    assert cfg.sampling.greedy and cfg.speculative
    with pytest.raises(ConfigError, match="top_p"):
        generation_config(max_new_tokens=8, temperature=0, top_p=0, speculative=True, depth=3, top_k=4, tree_size=10)
    with pytest.raises(ConfigError, match="tree depth"):
        generation_config(max_new_tokens=8, temperature=0, top_p=1, speculative=True, depth=None, top_k=4,
                          tree_size=10)
    with pytest.raises(ConfigError, match="max new tokens must be a number"):
        generation_config(max_new_tokens="many", temperature=0, top_p=1, speculative=True, depth=2, top_k=4,
                          tree_size=10)


def test_generation_config_puts_the_controls_over_the_engines_default_tree():
    """The app merges its controls with the default tree by core's rule (TreeConfig.override):
    lookup and long-chat caps stay; the chain-step tree stays only while the shape is the default's."""
    default = TreeConfig(depth=1, top_k=8, total_tokens=3, lookup=24, lookup_total_tokens=2,
                         long_context=((512, 0, 0),))
    same = generation_config(max_new_tokens=8, temperature=0, top_p=1, speculative=True, depth=1, top_k=8,
                             tree_size=3, default=default)
    assert same.tree == default
    deeper = generation_config(max_new_tokens=8, temperature=0, top_p=1, speculative=True, depth=4, top_k=8,
                               tree_size=10, default=default)
    assert deeper.tree == default.override(depth=4, total_tokens=10)
    assert (deeper.tree.lookup, deeper.tree.long_context, deeper.tree.lookup_total_tokens) == (24, ((512, 0, 0),), 0)
    bare = generation_config(max_new_tokens=8, temperature=0, top_p=1, speculative=True, depth=4, top_k=8,
                             tree_size=10)
    assert (bare.tree.lookup, bare.tree.long_context) == (0, ())


def test_last_model_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path / "home"))
    assert recall() is None
    choice = ModelChoice("lmsys/vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3", "bfloat16", "cuda", True)
    remember(choice)
    assert recall() == choice
    (tmp_path / "home" / "last_model.json").write_text("{not json")
    assert recall() is None
    old = {"model": "smollm2", "head": "default", "dtype": "float32", "device": "cpu", "load_in_4bit": False}
    (tmp_path / "home" / "last_model.json").write_text(json.dumps(old))  # written before the numerics choice
    assert recall() == ModelChoice("smollm2", "default", "float32", "cpu", False, "auto")
    assert ModelChoice().dtype == ModelChoice().attention == "auto"
    assert ModelChoice().describe() == "`smollm2` with its default head (auto numerics, cpu)"


def test_what_limits_the_tree():
    assert tree_limit(3, 4) == "" and tree_limit(16, 17) == ""
    assert tree_limit(16, 4) == ("Tree size 4 caps the tree at 3 drafted tokens in a row, so depth 16 drafts "
                                 "13 levels that cannot be used.")
    assert tree_limit(2, 2).startswith("Tree size 2 caps the tree at 1 drafted token in a row")




def test_remote_is_decided_per_request():
    assert not is_remote(None) and not is_remote(LOCAL) and not is_remote(FakeRequest(host="localhost:7860"))
    assert not is_remote(FakeRequest(host="[::1]:7860", client="::1"))
    assert is_remote(SHARE_LINK), "the share tunnel connects from 127.0.0.1 but names the share host"
    assert is_remote(FakeRequest(forwarded="198.51.100.2")) and is_remote(FakeRequest(client="192.168.1.9"))
    open_access, locked = Access(authenticated=True), Access()
    assert locked.can_manage_models(LOCAL) and not locked.can_manage_models(SHARE_LINK)
    assert open_access.can_manage_models(SHARE_LINK) and not open_access.limited(SHARE_LINK)


def test_public_link_without_password_closes_model_management():
    from app.models_tab import LOCKED
    from app.session import Handlers

    locked = Handlers(manager=None, access=Access())
    for call in (locked.download, locked.load):
        with pytest.warns(UserWarning, match="disabled for visitors through the public link"):
            out = call(CUSTOM, "/etc", "", "float32", "cpu", False, request=SHARE_LINK)
        assert out[0] == LOCKED and all(o == {"__type__": "update"} for o in out[1:]), "other outputs kept"
    notice, *controls = locked.models_access(SHARE_LINK)
    assert notice["visible"] is True and all(c["interactive"] is False for c in controls)
    notice, *controls = locked.models_access(LOCAL)
    assert notice["visible"] is False and all(c["interactive"] is True for c in controls), \
        "a local visitor manages models even when a share link exists (or failed: item 11)"


def test_launcher_arguments(tmp_path, monkeypatch):
    import launcher

    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path))
    args = launcher.parse_args(["--port", "7999", "--auth", "me:secret", "--no-browser", "--share"])
    assert (args.port, args.auth, args.no_browser, args.share) == (7999, ("me", "secret"), True, True)
    assert launcher.access(args) == Access(authenticated=True)
    capped = launcher.access(launcher.parse_args(["--remote-max-new-tokens", "32", "--remote-max-seconds", "7.5"]))
    assert capped == Access(authenticated=False, remote_max_new_tokens=32, remote_max_seconds=7.5)
    sized = launcher.access(launcher.parse_args(["--remote-max-prompt-tokens", "512", "--max-message-chars", "900",
                                                 "--remote-max-message-chars", "300"]))
    assert (sized.remote_max_prompt_tokens, sized.max_message_chars, sized.remote_max_message_chars) == (512, 900, 300)
    assert (Access().remote_max_prompt_tokens, Access().max_message_chars, Access().remote_max_message_chars,
            Access().remote_max_queued) == (2048, 32_000, 4_000, 1)
    assert launcher.choose(args) == ModelChoice()  # nothing remembered: the embedded model + our head
    for bad in (["--auth", "nopassword"], ["--auth", ":x"], ["--port", "70000"], ["--remote-max-new-tokens", "0"],
                ["--remote-max-seconds", "-1"], ["--remote-max-prompt-tokens", "0"], ["--max-message-chars", "0"],
                ["--remote-max-message-chars", "-5"]):
        with pytest.raises(SystemExit):
            launcher.parse_args(bad)
    (tmp_path / "last_model.json").write_text(json.dumps({"model": "/some/folder", "head": None,
                                                          "dtype": "bfloat16", "device": "cpu"}))
    assert launcher.choose(launcher.parse_args([])) == ModelChoice("/some/folder", None, "bfloat16", "cpu")
    explicit = launcher.choose(launcher.parse_args(["--model", "smollm2", "--head", "none", "--dtype", "bf16"]))
    assert explicit == ModelChoice("smollm2", None, "bf16", "cpu")
    vicuna = launcher.choose(launcher.parse_args(["--model", "lmsys/vicuna-7b-v1.3", "--load-in-4bit"]))
    assert vicuna == ModelChoice("lmsys/vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3", "auto", "cpu", True)
    numerics = launcher.parse_args(["--dtype", "bfloat16", "--attention", "eager", "--threads", "1"])
    assert launcher.choose(numerics).attention == "eager" and numerics.threads == 1
    api = launcher.parse_args(["--api", "--api-port", "8123"])
    assert api.api and api.api_port == 8123
    for bad in (["--backend", "http://x", "--head", "none"], ["--backend", "http://x", "--load-in-4bit"],
                ["--backend", "http://x", "--api"], ["--api-key", "k"], ["--api", "--port", "7000"],
                ["--api-port", "8000"], ["--api", "--api-port", "0"], ["--threads", "0"], ["--attention", "flash"]):
        with pytest.raises(SystemExit):
            launcher.parse_args(bad)


def test_the_race_advances_the_column_whose_own_clock_is_behind():
    from app.compare import race

    def steps(n, tokens, seconds, first_id):
        return iter([event(range(first_id + i * tokens, first_id + (i + 1) * tokens), ["x"] * tokens, tokens - 1,
                           4, total=(i + 1) * tokens, forwards=i + 1, elapsed=99.0, finished=i == n - 1,
                           reason="length" if i == n - 1 else None, draft_s=0.0, verify_s=seconds)
                     for i in range(n)])

    plain, spec = AnswerView("plain"), AnswerView("speculative")
    seen = []
    for _ in race(plain, steps(12, 1, 1.0, 0), spec, steps(4, 3, 2.0, 0)):
        seen.append((plain.clock_s, spec.clock_s))
        if not spec.finish_reason:
            assert abs(plain.clock_s - spec.clock_s) <= 2.0, "neither column runs ahead of the other's time"
    assert seen[:4] == [(1.0, 0.0), (1.0, 2.0), (2.0, 2.0), (3.0, 2.0)]
    assert (plain.total_tokens, spec.total_tokens) == (12, 12) and plain.token_ids() == spec.token_ids()
    assert plain.own_tokens_per_s == pytest.approx(1.0) and spec.own_tokens_per_s == pytest.approx(1.5), \
        "each run's figures come from its own clock, not the wall time of the race"


def test_the_chat_store_keeps_chats_apart_and_never_changes_its_argument():
    from app import chats

    store = chats.normal(None)
    first = chats.save(store, [{"role": "user", "content": [{"type": "text", "text": "Plan  a\ntrip to Oslo"}]},
                               {"role": "assistant", "content": "Sure."}])
    assert chats.current(store)["messages"] == [], "the argument is left as it was"
    assert chats.current(first)["title"] == "Plan a trip to Oslo"
    assert chats.current_id(first) == first["current"] and chats.current_id({**first, "current": "gone"}) == \
        first["chats"][0]["id"], "the current chat's id, as normal() chooses it"
    assert chats.current_id(None) is None and chats.current_id({"chats": [{"title": "no id"}]}) is None
    assert chats.current(first)["messages"][0] == {"role": "user", "content": "Plan  a\ntrip to Oslo"}
    second = chats.start_new(first)
    assert second["current"] != first["current"] and len(second["chats"]) == 2
    assert chats.start_new(second) == second, "an empty current chat is reused"
    second = chats.save(second, [{"role": "user", "content": "x" * 80}])
    assert chats.current(second)["title"] == "x" * 47 + "…"
    renamed = chats.rename(chats.select(second, first["current"]), "  Oslo   notes ")
    assert chats.current(renamed)["title"] == "Oslo notes"
    assert chats.current(chats.save(renamed, [{"role": "user", "content": "other"}]))["title"] == "Oslo notes"
    assert [label for label, _ in chats.choices(renamed)] == ["x" * 47 + "…", "Oslo notes"], "latest first"
    left = chats.delete(renamed)
    assert len(left["chats"]) == 1 and chats.current(left)["messages"][0]["content"] == "x" * 80
    assert len(chats.delete(left)["chats"]) == 1, "deleting the last chat leaves an empty one"
    with pytest.raises(UserError, match="Type a title first"):
        chats.rename(left, "   ")
    with pytest.raises(UserError, match="no longer in this browser"):
        chats.select(left, "gone")


def test_export_and_import_round_trip_and_bad_files_are_refused_with_the_fix(tmp_path):
    from app import chats

    store = chats.save(chats.normal(None), [{"role": "user", "content": "Hi <b>"}, {"role": "assistant", "content": "Hello"}])
    md, js = chats.export_files(chats.current(store), tmp_path)
    assert open(md).read() == "# Hi <b>\n\n**You:**\n\nHi <b>\n\n**Assistant:**\n\nHello\n"
    [back] = chats.parse_import(open(js, "rb").read())
    assert back["messages"] == chats.current(store)["messages"] and back["title"] == "Hi <b>"
    both = chats.add_imported(store, back)
    assert both["current"] == back["id"] and len(both["chats"]) == 2
    assert len(chats.add_imported(chats.normal(None), back)["chats"]) == 1, "an empty chat gives way"
    for raw, problem in [(b"{oops", "is not JSON"), (b'{"title": "t"}', 'has no "messages" list'),
                         (b'{"messages": [{"role": "system", "content": "x"}]}', "Message 1 of the file is not"),
                         (b" " * (chats.MAX_IMPORT_BYTES + 1), "chats of at most 5,000,000 bytes"),
                         (b'{"chats": []}', "holds no chats"),
                         (b'{"chats": [{"messages": []}, {"title": "t"}]}', 'chat 2 of the file has no "messages"')]:
        with pytest.raises(UserError, match=problem) as e:
            chats.parse_import(raw)
        assert "Export JSON" in str(e.value) or "shorter" in str(e.value)


def test_every_chat_exports_to_one_file_and_imports_back_the_newest_first(tmp_path):
    from app import chats

    store = chats.normal(None)
    for text in ("first", "second", "third"):
        store = chats.save(chats.start_new(store), [{"role": "user", "content": text},
                                                     {"role": "assistant", "content": text.upper()}])
    store = chats.start_new(store)  # an empty chat is left out
    path = chats.export_all_file(store, tmp_path)
    data = json.loads(open(path, encoding="utf-8").read())
    assert data["format"] == chats.FORMAT_ALL and [c["title"] for c in data["chats"]] == ["third", "second", "first"]
    back = chats.parse_import(open(path, "rb").read())
    assert [c["messages"][1]["content"] for c in back] == ["THIRD", "SECOND", "FIRST"]
    restored = chats.add_imported(chats.normal(None), back)
    assert [c["title"] for c in restored["chats"]] == ["third", "second", "first"]
    assert chats.current(restored)["title"] == "third"
    assert [label for label, _ in chats.choices(restored)] == ["third", "second", "first"], "the picker's order"
    assert chats.export_all_file(chats.normal(None), tmp_path) is None, "nothing to export without a message"


def test_stored_settings_keep_their_defaults_where_a_value_is_missing_or_invalid():
    from app.state import ChatSettings

    shown = ChatSettings(max_new=512, depth=4)
    assert ChatSettings.stored({"max_new": 60, "spec": False, "depth": "9"}, shown) == \
        ChatSettings(max_new=60, spec=False, depth=4)
    assert ChatSettings.stored({"top_p": 0.0}, shown) == shown, "an invalid value is not restored"
    assert ChatSettings.stored(None, shown) == shown


def test_errors_are_said_in_words_without_codes_or_class_names():
    import httpx

    from app.errors import plain_reason

    refused = "nothing is listening at that address (connection refused)"
    assert plain_reason(ConnectionRefusedError(111, "Connection refused")) == refused
    assert plain_reason(httpx.ConnectError("[Errno 111] Connection refused")) == refused
    assert plain_reason(OSError("[Errno 99] Cannot assign requested address")) == "Cannot assign requested address"
    assert plain_reason(ValueError("bad config")) == "bad config"


def test_every_legend_kind_keeps_a_bar_when_its_steps_scroll_out_of_the_chart():
    from app.chat import MAX_CHART_STEPS

    view = AnswerView("speculative")
    view.add(event([10], ["a"], 0, 0, total=1, forwards=1, elapsed=0.1))  # the prefill: a plain bar
    for i in range(MAX_CHART_STEPS + 5):
        view.add(event([11, 12], ["b", "c"], 1, 6, total=3 + 2 * i, forwards=2 + i, elapsed=0.2 + i))
    frame = view.frame()
    plain = frame[frame["kind"] == PLAIN]
    assert len(plain) == 1 and plain["tokens"].sum() == 0, "the prefill scrolled out: a zero-height plain bar"
    assert set(frame["kind"]) == set(view.kinds()) and frame["step"].min() > 1


def test_the_room_a_store_takes_in_the_browser_is_counted_as_gradio_writes_it():
    from app import chats
    # BrowserState writes base64(iv) ":" + CryptoJS.AES.encrypt(json, passphrase): "Salted__" + 8 bytes of salt +
    # the AES-CBC ciphertext (PKCS#7: 1..16 bytes of padding), base64
    import base64
    import os as _os

    def written(store) -> int:
        data = json.dumps(store, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        cipher = _os.urandom(len(data) + 16 - len(data) % 16)  # the ciphertext's length, whatever its bytes
        return len(base64.b64encode(_os.urandom(16))) + 1 + len(base64.b64encode(b"Salted__" + _os.urandom(8) + cipher))

    for text in ("", "a", "é" * 7, "x" * 15, "x" * 16, "日本語 " * 1000, "🙂" * 333):
        store = chats.save(chats.normal(None), [{"role": "user", "content": text}])
        assert chats.stored_chars(store) == written(store), text[:20]


def test_a_chat_that_would_not_fit_in_the_browser_is_refused_and_a_nearly_full_one_said():
    from app import chats
    from app.errors import UserError
    store = chats.save(chats.normal(None), [{"role": "user", "content": "kept"}])
    big = chats.parse_import(json.dumps({"messages": [{"role": "user", "content": "x" * 3_600_000}]}).encode())
    full = chats.add_imported(store, big)
    note = chats.storage_note(chats.stored_chars(full))
    assert "nearly full" in note and "Export all chats" in note
    with pytest.raises(UserError, match=r"This chat does not fit in this browser.s room for chats: it needs 1\.3 MB") as e:
        chats.add_imported(full, chats.parse_import(json.dumps({"messages": [
            {"role": "user", "content": "y" * 1_000_000}]}).encode()))
    assert "Delete or export old chats first" in str(e.value)
    with pytest.raises(UserError, match="Import fewer or shorter chats"):
        chats.add_imported(store, chats.parse_import(json.dumps({"messages": [
            {"role": "user", "content": "z" * 4_000_000}]}).encode()))
    over = chats.save(full, [{"role": "user", "content": "x" * 3_600_000}, {"role": "assistant", "content": "w" * 900_000}])
    assert chats.storage_note(chats.stored_chars(over)).startswith("This browser's room for chats is full")
    assert chats.storage_note(chats.stored_chars(store)) == ""

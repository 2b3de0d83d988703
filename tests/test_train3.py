"""EAGLE-3 training: fused features, the training-time-test unroll equals drafting with the
head's KV cache, a tiny memorisation run learns, and its checkpoint loads strictly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from core.decoding.head import HeadCache
from core.decoding.head3 import Drafter3, load_head3, new_head3
from core.train.data import DataError, assistant_mask
from core.train.features import FeatureConfig, build_features, load_sequences, read_manifest
from core.train.trainer import Frozen, TrainConfig, train
from core.train.trainer3 import EAGLE3, collate3, evaluate_features3, scored_rows, ttt_loss, ttt_states
from core.decoding.tree import catch_up
from tests.test_train import char_tokenizer, toy_conversations

LAYER_IDS = (1, 2, 3)


class Tiny4:
    """A 4-layer random Llama with a character tokenizer (stands in for LoadedModel)."""

    def __init__(self, seed: int = 0, lm_std: float | None = None):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        self.tokenizer = char_tokenizer()
        cfg = LlamaConfig(vocab_size=len(self.tokenizer), hidden_size=64, intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512, tie_word_embeddings=False)
        self.model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
        if lm_std is not None:  # peaky target distributions (the default init is near-uniform)
            self.model.lm_head.weight.normal_(0, lm_std)
        self.eos_ids = (2,)


def features3(tiny, convs, folder):
    build_features(tiny, convs, folder, FeatureConfig(layer_ids=LAYER_IDS))
    return load_sequences(folder)


@pytest.fixture(scope="module")
def tiny():
    return Tiny4()


def test_fused_features_stored(tiny, tmp_path):
    convs = toy_conversations(3, 1)
    seqs = features3(tiny, convs, tmp_path)
    assert read_manifest(tmp_path)["layer_ids"] == list(LAYER_IDS)
    ids, _ = assistant_mask(tiny.tokenizer, convs[1])
    out = tiny.model.model(input_ids=ids[None], output_hidden_states=True)
    want = torch.cat([out.hidden_states[i][0] for i in LAYER_IDS], dim=-1)  # (n, 3H)
    assert seqs[1].hidden.shape == (len(ids), 192) and seqs[1].final.shape == (len(ids), 64)
    torch.testing.assert_close(seqs[1].hidden.float(), want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(seqs[1].final.float(), out.last_hidden_state[0], atol=2e-3, rtol=2e-3)
    as_eagle1 = load_sequences(tmp_path, last_only=True)  # one feature pass serves both kinds
    assert torch.equal(as_eagle1[1].hidden, seqs[1].final) and torch.equal(as_eagle1[1].input_ids, seqs[1].input_ids)
    with pytest.raises(DataError, match="another head kind"):  # EAGLE-1 features never mix in
        build_features(tiny, convs + toy_conversations(1, 2), tmp_path, FeatureConfig())


def test_ttt_unroll_equals_drafting_a_chain(tiny, tmp_path):
    """Step k of row i == catch up on rows 0..i, then feed the true tokens k times, each with
    the head's previous state, through the KV cache (tree-round masks: context + own chain)."""
    seq = features3(tiny, toy_conversations(1, 4), tmp_path)[0]
    head = new_head3(tiny.model.config, torch.arange(3, 60), layer_ids=LAYER_IDS, seed=1).double().eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(10.0)  # not near the identity: attention patterns matter
    batch = collate3([seq], need_final=True)
    batch = replace(batch, fused=batch.fused.double())
    embed = tiny.model.get_input_embeddings().weight.double()
    states = ttt_states(head, embed, batch, steps=3)
    drafter = Drafter3(head=head, embed=torch.nn.Embedding.from_pretrained(embed))
    ids, g = seq.input_ids, batch.fused[0]
    for i in (0, 4, 9):
        cache = HeadCache(head.config, torch.float64, torch.device("cpu"))
        s = catch_up(drafter, cache, ids[1:i + 2], g[:i + 1])  # row i, step 0
        torch.testing.assert_close(s, states[0][0, i])
        base = cache.length
        for k in range(1, 3):
            allowed = torch.ones(1, base + k, dtype=torch.bool)  # context + the chain so far + itself
            s = drafter.feed(cache, ids[i + 1 + k:i + 2 + k], s[None], torch.tensor([i + k]), allowed)[0]
            torch.testing.assert_close(s, states[k][0, i])


def test_scored_rows_literal():
    am = torch.tensor([[False, False, True, True, True, True]])  # t2..t5 assistant
    # step 0, row i: root t_{i+1} and predicted t_{i+2} are answer tokens: i = 1..3
    assert scored_rows(am, 0).tolist() == [[False, True, True, True, False]]
    # step 1, row i also feeds t_{i+2} and predicts t_{i+3}: i = 1, 2
    assert scored_rows(am, 1).tolist() == [[False, True, True, False, False]]


TRAIN = TrainConfig(lr=5e-3, epochs=12, batch_size=8, warmup_steps=4, unroll=3, log_every=4, noise=0.0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tiny = Tiny4(lm_std=0.5)
    seqs = features3(tiny, toy_conversations(32, 2), tmp_path_factory.mktemp("f"))
    vocab = torch.arange(3, len(tiny.tokenizer))
    fz = Frozen.from_target(tiny.model, vocab)
    head = new_head3(tiny.model.config, vocab, layer_ids=LAYER_IDS, seed=1)
    before = evaluate_features3(head, fz, seqs, depth=3)
    ckpt = tmp_path_factory.mktemp("ckpt")
    res = train(head, fz, seqs, TRAIN, ckpt, tiny.model.config, recipe=EAGLE3)
    return seqs, fz, head, ckpt, res, before, evaluate_features3(head, fz, seqs, depth=3)


def test_memorisation_run_learns(trained):
    seqs, fz, head, ckpt, res, before, after = trained
    assert res.finished and res.history[-1].loss < 0.7 * res.history[0].loss
    assert all(after.top1[k] > before.top1[k] + 0.3 for k in range(3)), (before.top1, after.top1)
    greedy = replace(TrainConfig(unroll=2), soft_targets=False)  # the greedy-target loss runs too
    loss, m = ttt_loss(head, fz, collate3(seqs[:4], False), greedy, 0.0)
    assert torch.isfinite(loss) and len(m.top1) == 2


def test_checkpoint_in_published_layout_reloads(trained, tiny):
    seqs, fz, head, ckpt, res, before, after = trained
    loaded = load_head3(ckpt, tiny.model.config)  # strict: every key checked
    assert "midlayer.hidden_norm.weight" in loaded.state_dict() and loaded.config.layer_ids == LAYER_IDS
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert torch.equal(loaded.target_ids(), fz.draft_vocab)
    resumed = train(new_head3(tiny.model.config, fz.draft_vocab, layer_ids=LAYER_IDS, seed=7), fz, seqs, TRAIN,
                    ckpt, tiny.model.config, recipe=EAGLE3)
    assert resumed.finished and resumed.batches == ()  # resumed at the end: nothing left to train


def test_cli_features_and_train_eagle3(tmp_path, capsys):
    """`python -m core.train features|train --head-kind eagle3` on a tiny target folder."""
    import json

    from core.train.__main__ import main

    tiny = Tiny4(lm_std=0.5)
    tiny.model.save_pretrained(tmp_path / "target")
    tiny.tokenizer.save_pretrained(tmp_path / "target")
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in toy_conversations(12, 3)))
    common = ["--target", str(tmp_path / "target"), "--work", str(tmp_path / "work"), "--data", str(data),
              "--head-kind", "eagle3", "--layer-ids", "1,2,3"]
    assert main(["features", *common, "--feature-dtype", "float32"]) == 0
    assert read_manifest(tmp_path / "work" / "features_eagle3" / "convs")["layer_ids"] == [1, 2, 3]
    out = tmp_path / "head3"
    assert main(["train", *common, "--epochs", "1", "--unroll", "2", "--draft-vocab-size", "40",
                 "--out", str(out)]) == 0
    head = load_head3(out, tiny.model.config)
    assert head.config.layer_ids == (1, 2, 3) and head.config.draft_vocab_size <= 40
    assert (tmp_path / "work" / "ckpt_eagle3" / "trainer_state.pt").is_file()
    # an EAGLE-1 head trains on the same (EAGLE-3) features' last hidden state
    common1 = [a if a != "eagle3" else "eagle1" for a in common[:-2]]
    assert main(["train", *common1, "--epochs", "1", "--draft-vocab-size", "40", "--out", str(tmp_path / "head1")]) == 0
    from core.decoding.head import load_head

    head1, vocab1 = load_head(tmp_path / "head1", tiny.model.config)
    assert len(vocab1) <= 40 and not (tmp_path / "work" / "features").exists()
    # --ckpt gives a run its own checkpoint and report: parallel runs of one kind must not share one
    before = (tmp_path / "work" / "ckpt" / "trainer_state.pt").read_bytes()
    assert main(["train", *common1, "--epochs", "1", "--init", str(tmp_path / "head1"), "--ckpt", str(tmp_path / "ck2"),
                 "--out", str(tmp_path / "head1b")]) == 0
    assert (tmp_path / "ck2" / "trainer_state.pt").is_file()
    assert json.loads((tmp_path / "ck2" / "train_report.json").read_text())["steps"] > 0
    assert (tmp_path / "work" / "ckpt" / "trainer_state.pt").read_bytes() == before
    # warm starts continue a head of the same kind (its vocabulary kept); another kind is refused
    assert main(["train", *common, "--epochs", "1", "--unroll", "2", "--init", str(tmp_path / "head1"),
                 "--out", str(tmp_path / "head3b")]) == 2
    assert "is an eagle1 head, but --head-kind is eagle3" in capsys.readouterr().err
    assert main(["train", *common, "--epochs", "1", "--unroll", "2", "--init", str(out),
                 "--out", str(tmp_path / "head3b")]) == 0
    assert torch.equal(load_head3(tmp_path / "head3b", tiny.model.config).target_ids(), head.target_ids())
    # eval runs either kind through the real engine on held-out prompts
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"id": "h1", "category": "chat", "turns": ["repeat cat"]}) + "\n")
    for kind, folder in (("eagle3", out), ("eagle1", tmp_path / "head1")):
        assert main(["eval", *common, "--head", str(folder), "--heldout", str(held), "--eval-prompts", "1",
                     "--eval-max-new-tokens", "6", "--eval-dtype", "float32"]) == 0
        report = json.loads((tmp_path / "work" / f"eval_{kind}.json").read_text())
        assert report["kind"] == kind and report["numerics"].startswith("fp32")
        assert [p["id"] for p in report["prompts"]] == ["h1"] and report["prompts"][0]["forwards"] > 0

"""EAGLE-3 heads: the published layout loads strictly, broken ones are refused with the
problem named, save/load round-trips, and the drafting seam builds trees with tree.py."""

import json

import pytest
import torch
from safetensors.torch import save_file

from core.config import TreeConfig
from core.decoding.head import HeadCache, HeadLoadError, save_head
from core.decoding.head3 import (Drafter3, default_layer_ids, fuse, head_kind, load_any_head, load_head3, new_head3,
                        save_head3, target_features)
from core.decoding.tree import Drafter, catch_up, draft_dynamic, draft_static
from tests.tiny import random_head, tiny_target, write_checkpoint

LAYERS = 8  # default fused layers (2, 4, 5): distinct
PUBLISHED_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=LAYERS, dtype=torch.float32)


def published_checkpoint(folder, target, *, vd=40, extra=None, drop=None, as_pickle=False, arch=True,
                         hidden=None):
    """A synthetic head exactly as the reference publishes EAGLE-3 (LlamaConfig + draft_vocab_size,
    fp16 weights, d2t/t2d buffers, an embed_tokens copy), with no layer ids in its config."""
    c = target.model.config
    h, inter, kvh, v = hidden or c.hidden_size, c.intermediate_size, c.num_key_value_heads, c.vocab_size
    hd = h // c.num_attention_heads
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (h, 3 * h), "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
              "midlayer.self_attn.q_proj.weight": (h, 2 * h), "midlayer.self_attn.k_proj.weight": (kvh * hd, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kvh * hd, 2 * h), "midlayer.self_attn.o_proj.weight": (h, h),
              "midlayer.post_attention_layernorm.weight": (h,), "midlayer.mlp.gate_proj.weight": (inter, h),
              "midlayer.mlp.up_proj.weight": (inter, h), "midlayer.mlp.down_proj.weight": (h, inter),
              "norm.weight": (h,), "lm_head.weight": (vd, h), "embed_tokens.weight": (v, h)}
    shapes.update(extra or {})
    state = {k: (torch.randn(s, generator=g) * 0.1).half() for k, s in shapes.items()}
    ids = torch.randperm(v, generator=g)[:vd].sort().values
    state["d2t"] = ids - torch.arange(vd)
    state["t2d"] = torch.zeros(v, dtype=torch.bool)
    state["t2d"][ids] = True
    state = {k: t for k, t in state.items() if k not in (drop or ())}
    config = {"architectures": ["LlamaForCausalLMEagle3" if arch else "LlamaForCausalLM"], "bos_token_id": 1,
              "hidden_act": "silu", "hidden_size": h, "intermediate_size": inter, "max_position_embeddings": 2048,
              "model_type": "llama", "num_attention_heads": c.num_attention_heads, "num_hidden_layers": 1,
              "num_key_value_heads": kvh, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "torch_dtype": "float16", "vocab_size": v, "draft_vocab_size": vd}
    write_checkpoint(folder, config, state, as_pickle)
    return state


@pytest.mark.parametrize("as_pickle,arch", [(False, True), (True, False)])
def test_published_layout_loads_strictly(tmp_path, target, as_pickle, arch):
    state = published_checkpoint(tmp_path, target, as_pickle=as_pickle, arch=arch)
    assert head_kind(tmp_path) == "eagle3"  # by the architecture name or by draft_vocab_size
    head = load_head3(tmp_path, target.model.config)
    loaded = head.state_dict()
    assert set(loaded) == PUBLISHED_KEYS
    for k, v in loaded.items():
        assert torch.equal(v, state[k].to(v.dtype)), k
    assert head.config.layer_ids == default_layer_ids(LAYERS) == (2, 4, 5)
    ids = head.target_ids()
    assert torch.equal(head.t2d.nonzero()[:, 0], ids)  # d2t and t2d name the same tokens
    drafter = load_any_head(tmp_path, target.model)
    assert isinstance(drafter, Drafter3) and drafter.feature_layers == (2, 4, 5)
    assert torch.equal(drafter.to_target_ids(torch.arange(40)), ids)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(drop=["midlayer.hidden_norm.weight"]), r"missing keys \['midlayer.hidden_norm.weight'\]"),
    (dict(drop=["d2t"]), r"missing keys \['d2t'\]"),
    (dict(extra={"midlayer.self_attn.q_proj.bias": (64,)}), r"unexpected keys \['midlayer.self_attn.q_proj.bias'\]"),
    (dict(extra={"fc.weight": (64, 128)}), r"wrong shapes \['fc.weight: checkpoint \(64, 128\) vs head \(64, 192\)'\]"),
    (dict(extra={"midlayer.self_attn.q_proj.weight": (64, 64)}), "wrong shapes.*q_proj"),
    (dict(hidden=32), "another model: hidden size 32, the target has 64"),
])
def test_broken_checkpoints_refused(tmp_path, target, kwargs, fragment):
    published_checkpoint(tmp_path, target, **kwargs)
    with pytest.raises(HeadLoadError, match=fragment):
        load_head3(tmp_path, target.model.config)


def test_inconsistent_maps_and_other_vocab_refused(tmp_path, target):
    state = published_checkpoint(tmp_path, target)
    state["t2d"][int(state["t2d"].logical_not().nonzero()[0])] = True  # one token too many in t2d
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadLoadError, match="d2t and t2d disagree"):
        load_head3(tmp_path, target.model.config)
    state["d2t"][-1] = 10_000  # maps past the vocabulary
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadLoadError, match="outside the target vocabulary"):
        load_head3(tmp_path, target.model.config)
    with pytest.raises(HeadLoadError, match="vocabulary 96, the target has 50"):
        load_head3(tmp_path, tiny_target(vocab=50, layers=LAYERS).model.config)


def test_missing_and_corrupt_files_refused(tmp_path, target):
    with pytest.raises(HeadLoadError, match="does not exist"):
        load_head3(tmp_path / "nope", target.model.config)
    published_checkpoint(tmp_path, target)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HeadLoadError, match="corrupt or truncated"):
        load_head3(tmp_path, target.model.config)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(HeadLoadError, match="cannot be read safely"):
        load_head3(tmp_path, target.model.config)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["draft_vocab_size"]
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadLoadError, match="lacks the field 'draft_vocab_size'"):
        load_head3(tmp_path, target.model.config)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(HeadLoadError, match="not valid JSON"):
        head_kind(tmp_path)


def test_save_load_roundtrip_bit_identical(tmp_path, target):
    head = new_head3(target.model.config, torch.tensor([3, 9, 17, 40, 95]), layer_ids=(1, 3, 6), seed=4)
    save_head3(head, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 5
    assert cfg["eagle3_layer_ids"] == [1, 3, 6] and cfg["num_hidden_layers"] == 1
    loaded = load_head3(tmp_path, target.model.config)
    assert loaded.config == head.config
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert loaded.target_ids().tolist() == [3, 9, 17, 40, 95]
    assert int(loaded.t2d.sum()) == 5 and loaded.t2d[[3, 9, 17, 40, 95]].all()
    with pytest.raises(HeadLoadError, match=r"eagle3_layer_ids \[1, 3, 6\] must be three target layers in 0..3"):
        load_head3(tmp_path, tiny_target(layers=4).model.config)


def test_head_kind_tells_eagle1_apart(tmp_path, target):
    save_head(random_head(target), tmp_path / "e1")
    assert head_kind(tmp_path / "e1") == "eagle1"
    assert isinstance(load_any_head(tmp_path / "e1", target.model), Drafter)
    assert Drafter.feature_layers is None


# ----------------------------------------------------------------------------- drafting


def fused_features(target, ids, layer_ids):
    out = target.model.model(input_ids=ids[None], output_hidden_states=True)
    assert target_features(out, None) is out.last_hidden_state
    return fuse(out.hidden_states, layer_ids)[0]  # (n, 3H)


@pytest.fixture(scope="module")
def drafting():
    target = tiny_target(layers=LAYERS)  # float64: exact comparisons below
    vocab = torch.arange(4, 96, 2)  # 46 draft tokens, a reduced vocabulary
    head = new_head3(target.model.config, vocab, seed=5).double().eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.mul_(15.0)  # peaky drafts: no near-ties between candidates
    drafter = Drafter3(head=head, embed=target.model.get_input_embeddings())
    ids = torch.tensor([1, 7, 30, 12, 55, 2, 9, 14, 21])
    return target, drafter, ids, fused_features(target, ids, head.config.layer_ids)


def test_catch_up_in_pieces_equals_one_go(drafting):
    target, drafter, ids, g = drafting
    assert g.shape == (9, 3 * 64)
    cache = HeadCache(drafter.head.config, torch.float64, torch.device("cpu"), capacity=4)  # grows
    whole = catch_up(drafter, cache, ids[1:], g[:-1])
    cache2 = HeadCache(drafter.head.config, torch.float64, torch.device("cpu"))
    catch_up(drafter, cache2, ids[1:5], g[:4])
    parts = catch_up(drafter, cache2, ids[5:], g[4:-1])
    torch.testing.assert_close(parts, whole)
    assert cache.length == cache2.length == 8


def test_dynamic_tree_with_eagle3_head(drafting):
    target, drafter, ids, g = drafting
    cache = HeadCache(drafter.head.config, torch.float64, torch.device("cpu"))
    root_state = catch_up(drafter, cache, ids[1:], g[:-1])  # (H,)
    tree = draft_dynamic(drafter, cache, int(ids[-1]), root_state, TreeConfig(depth=4, top_k=3, total_tokens=12))
    assert cache.length == 8  # draft entries were temporary
    assert tree.size == 12 and int(tree.depths.max()) <= 4
    assert bool(drafter.head.t2d[tree.tokens[1:]].all())  # every drafted token is a draft-vocab token
    # the best chain, drafted one token at a time with plain causal attention, is in the tree
    chain, state, pos = [], root_state, 8
    for _ in range(3):
        tok = drafter.to_target_ids(drafter.log_probs(state[None]).argmax(-1))  # (1,)
        chain.append(int(tok))
        state = drafter.feed(cache, tok, state[None], torch.tensor([pos]))[0]  # fc skipped: H wide
        pos += 1
    node = 0
    for tok in chain:
        kids = [i for i in range(tree.size) if int(tree.parents[i]) == node]
        node = next(i for i in kids if int(tree.tokens[i]) == tok)
    assert int(tree.depths[node]) == 3


def test_static_tree_with_eagle3_head(drafting):
    target, drafter, ids, g = drafting
    cache = HeadCache(drafter.head.config, torch.float64, torch.device("cpu"))
    root_state = catch_up(drafter, cache, ids[1:], g[:-1])
    cfg = TreeConfig(static_paths=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))
    tree = draft_static(drafter, cache, int(ids[-1]), root_state, cfg)
    assert tree.size == 6 and tree.parents.tolist() == [-1, 0, 0, 1, 1, 3] and cache.length == 8
    top2 = drafter.log_probs(root_state[None])[0].topk(2).indices
    assert tree.tokens[1:3].tolist() == drafter.to_target_ids(top2).tolist()


def test_new_head_can_start_at_the_targets_norm_and_lm_rows(target):
    ids = torch.tensor([3, 9, 17, 40, 95])
    model = target.model
    head = new_head3(model.config, ids, layer_ids=(1, 3, 6), seed=4, lm_rows=model.lm_head.weight[ids].float(),
                     norm_weight=model.model.norm.weight.float() + 0.5)
    assert torch.equal(head.lm_head.weight, model.lm_head.weight[ids].float())
    assert torch.equal(head.norm.weight, model.model.norm.weight.float() + 0.5)
    plain = new_head3(model.config, ids, layer_ids=(1, 3, 6), seed=4)
    assert torch.equal(plain.norm.weight, torch.ones_like(plain.norm.weight))

"""Head checkpoints: the published EAGLE-1 layout loads strictly; broken ones are refused."""

import json

import pytest
import torch

from core.decoding.head import HeadCache, HeadLoadError, load_head, new_head, save_head
from tests.tiny import tiny_target, write_checkpoint

PUBLISHED_KEYS = {
    "fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight",
}


@pytest.fixture(scope="module")
def target():
    return tiny_target(dtype=torch.float32)


def published_checkpoint(folder, target, *, bias=True, extra=None, drop=None, as_pickle=True):
    """Write a synthetic head exactly as the reference repo publishes it (LlamaConfig with
    num_hidden_layers 1 and a `bias` flag, pytorch_model.bin with an embed_tokens copy)."""
    c = target.model.config
    h, inter, kvh = c.hidden_size, c.intermediate_size, c.num_key_value_heads
    hd = h // c.num_attention_heads
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (h, 2 * h), "layers.0.self_attn.q_proj.weight": (h, h),
              "layers.0.self_attn.k_proj.weight": (kvh * hd, h), "layers.0.self_attn.v_proj.weight": (kvh * hd, h),
              "layers.0.self_attn.o_proj.weight": (h, h), "layers.0.mlp.gate_proj.weight": (inter, h),
              "layers.0.mlp.up_proj.weight": (inter, h), "layers.0.mlp.down_proj.weight": (h, inter),
              "layers.0.post_attention_layernorm.weight": (h,), "embed_tokens.weight": (c.vocab_size, h)}
    if bias:
        shapes["fc.bias"] = (h,)
    shapes.update(extra or {})
    state = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items() if k not in (drop or ())}
    config = {"architectures": ["LlamaForCausalLM"], "bias": bias, "hidden_act": "silu", "hidden_size": h,
              "intermediate_size": inter, "max_position_embeddings": 2048, "model_type": "llama",
              "num_attention_heads": c.num_attention_heads, "num_hidden_layers": 1,
              "num_key_value_heads": kvh, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "torch_dtype": "float16", "vocab_size": c.vocab_size}
    write_checkpoint(folder, config, state, as_pickle)
    return state


@pytest.mark.parametrize("as_pickle", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_published_layout_loads_strictly(tmp_path, target, as_pickle, bias):
    state = published_checkpoint(tmp_path, target, bias=bias, as_pickle=as_pickle)
    head, vocab = load_head(tmp_path, target.model.config)
    loaded = head.state_dict()
    assert set(loaded) == (PUBLISHED_KEYS if bias else PUBLISHED_KEYS - {"fc.bias"})
    for k, v in loaded.items():
        assert torch.equal(v, state[k]), k
    assert vocab is None


def test_save_roundtrip_same_layout(tmp_path, target):
    head = new_head(target.model.config, seed=3)
    vocab = torch.tensor([5, 9, 2])
    save_head(head, tmp_path, draft_vocab=vocab)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["bias"] is True and cfg["hidden_size"] == 64
    loaded, loaded_vocab = load_head(tmp_path, target.model.config)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    assert loaded_vocab.tolist() == [5, 9, 2]


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(drop=["layers.0.mlp.up_proj.weight"]), "missing keys \\['layers.0.mlp.up_proj.weight'\\]"),
    (dict(extra={"layers.0.input_layernorm.weight": (64,)}), "unexpected keys \\['layers.0.input_layernorm.weight'\\]"),
    (dict(extra={"layers.0.mlp.up_proj.weight": (100, 64)}), "wrong shapes"),
    (dict(as_pickle=False, drop=["fc.bias"]), "missing keys \\['fc.bias'\\]"),
])
def test_broken_checkpoints_refused(tmp_path, target, kwargs, fragment):
    published_checkpoint(tmp_path, target, **kwargs)
    with pytest.raises(HeadLoadError, match=fragment):
        load_head(tmp_path, target.model.config)


def test_head_for_another_model_refused(tmp_path, target):
    published_checkpoint(tmp_path, target)
    other = tiny_target(hidden=32).model.config
    with pytest.raises(HeadLoadError, match="another model: hidden size 64, the target has 32"):
        load_head(tmp_path, other)
    other = tiny_target(vocab=50).model.config
    with pytest.raises(HeadLoadError, match="another model: vocabulary 96, the target has 50"):
        load_head(tmp_path, other)


def test_missing_and_corrupt_files_refused(tmp_path, target):
    with pytest.raises(HeadLoadError, match="does not exist"):
        load_head(tmp_path / "nope", target.model.config)
    published_checkpoint(tmp_path, target, as_pickle=False)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HeadLoadError, match="corrupt or truncated"):
        load_head(tmp_path, target.model.config)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(HeadLoadError, match="neither model.safetensors nor pytorch_model.bin"):
        load_head(tmp_path, target.model.config)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(HeadLoadError, match="cannot be read safely"):
        load_head(tmp_path, target.model.config)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(HeadLoadError, match="not valid JSON"):
        load_head(tmp_path, target.model.config)


def test_pickle_with_code_is_refused(tmp_path, target):
    published_checkpoint(tmp_path, target)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"fc.weight": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(HeadLoadError, match="cannot be read safely"):
        load_head(tmp_path, target.model.config)


def test_head_cache_forward_equals_full_causal(target):
    head = new_head(target.model.config, seed=1).eval()
    x, f = torch.randn(1, 9, 64), torch.randn(1, 9, 64)
    full = head(x, f, torch.arange(9))
    cache = HeadCache(head.config, torch.float32, torch.device("cpu"), capacity=4)  # forces growth
    from core.decoding.head import causal_mask
    a = head(x[:, :5], f[:, :5], torch.arange(5), cache=cache)
    b = head(x[:, 5:], f[:, 5:], torch.arange(5, 9), mask=causal_mask(4, 5, torch.float32, "cpu"), cache=cache)
    assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)


def test_head_cache_grows_for_a_write_longer_than_twice_its_capacity():
    """A long prompt's catch-up writes thousands of entries at once (it crashed past 2x)."""
    from core.decoding.head import HeadCache, HeadConfig

    cfg = HeadConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, vocab_size=10)
    cache = HeadCache(cfg, torch.float32, torch.device("cpu"), capacity=4)
    k = torch.randn(1, 1, 21, 4)
    keys, values = cache.write(k, k + 1)
    assert cache.length == 21 and torch.equal(keys, k) and torch.equal(values, k + 1)
    keys, _ = cache.write(k[:, :, :3], k[:, :, :3])
    assert cache.length == 24 and torch.equal(keys[:, :, 21:], k[:, :, :3])


def _two_layer_head(target, seed=3):
    """A grown head whose second layer computes something (output projections made non-zero)."""
    from core.decoding.head import grow_head

    head = grow_head(new_head(target.model.config, seed=1), 2, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.layers[1].named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return head.eval()


def test_grown_head_computes_what_it_did_and_round_trips_strictly(tmp_path, target):
    """grow_head appends decoder layers whose output projections start at zero: the grown head
    computes exactly what the one-layer head did. Its checkpoint keeps the published key names
    (layers.1.* beside layers.0.*) and num_hidden_layers, and loads strictly."""
    from core.decoding.head import grow_head

    one = new_head(target.model.config, seed=1).eval()
    two = grow_head(one, 2, seed=5).eval()
    assert two.config.num_hidden_layers == 2 and len(two.layers) == 2
    x, f = torch.randn(1, 7, 64), torch.randn(1, 7, 64)
    assert torch.equal(two(x, f, torch.arange(7)), one(x, f, torch.arange(7)))
    assert not torch.equal(two.layers[1].self_attn.q_proj.weight, one.layers[0].self_attn.q_proj.weight)
    two = _two_layer_head(target)
    save_head(two, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 2
    loaded, _ = load_head(tmp_path, target.model.config)
    assert set(loaded.state_dict()) == set(two.state_dict()) >= {k.replace("layers.0", "layers.1") for k in PUBLISHED_KEYS}
    assert torch.equal(loaded(x, f, torch.arange(7)), two(x, f, torch.arange(7)))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(HeadLoadError, match=r"missing keys \['layers\.2\."):
        load_head(tmp_path, target.model.config)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 0}))
    with pytest.raises(HeadLoadError, match="num_hidden_layers 0; a head has at least one decoder layer"):
        load_head(tmp_path, target.model.config)
    with pytest.raises(ValueError, match="cannot grow a 2-layer head to 1 layers"):
        grow_head(two, 1)


def test_two_layer_head_cache_forward_equals_full_causal(target):
    """Each decoder layer keeps its own keys and values in the head cache."""
    from core.decoding.head import causal_mask

    head = _two_layer_head(target)
    x, f = torch.randn(1, 9, 64), torch.randn(1, 9, 64)
    full = head(x, f, torch.arange(9))
    one_layer = new_head(target.model.config, seed=1).eval()(x, f, torch.arange(9))
    assert not torch.allclose(full, one_layer, atol=1e-3)  # the second layer does something
    cache = HeadCache(head.config, torch.float32, torch.device("cpu"), capacity=4)  # forces growth
    a = head(x[:, :5], f[:, :5], torch.arange(5), cache=cache)
    assert cache.length == 5
    b = head(x[:, 5:], f[:, 5:], torch.arange(5, 9), mask=causal_mask(4, 5, torch.float32, "cpu"), cache=cache)
    assert cache.length == 9 and len(cache.layer_keys) == 2
    assert not torch.equal(cache.layer_keys[0][:, :, :9], cache.layer_keys[1][:, :, :9])
    assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)


@pytest.mark.parametrize("layers", [1, 2])
def test_head_calls_through_the_native_attention_match_sdpa(layers):
    """bf16 decoding sends short head calls through core.kernels.native's attention kernel
    (KeyLayout): causal ones (catch-up) and draft rounds given the tree part of their mask.
    They compute what sdpa with the whole additive mask computes."""
    from core.kernels import native
    from core.decoding.head import EagleHead, HeadConfig, KeyLayout, TreeRows, additive, causal_allowed, head_mask

    if not native.status().available:
        pytest.skip(f"core.kernels.native kernel unavailable here: {native.status().reason}")
    cfg = HeadConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=100, num_hidden_layers=layers)  # head_dim 32
    torch.manual_seed(0)
    head = EagleHead(cfg).to(torch.bfloat16).eval()
    emb, feats = torch.randn(1, 42, 128).bfloat16(), torch.randn(1, 42, 128).bfloat16()
    # a draft round: 3 new rows after 35 committed keys and 2 fed draft nodes (slots 35, 36);
    # row 0 sees node 0 and itself, row 1 node 1 and itself, row 2 only itself
    tree = torch.tensor([[1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [0, 0, 0, 0, 1]], dtype=torch.bool)
    whole = torch.cat([torch.ones(3, 35, dtype=torch.bool), tree], 1)
    with torch.inference_mode():
        for past, allowed, reference in ((37, None, causal_allowed(3, 37, "cpu")), (37, tree, whole)):
            outs = {}
            for name in ("native", "sdpa"):
                cache = HeadCache(cfg, torch.bfloat16, torch.device("cpu"))
                head(emb[:, :past], feats[:, :past], torch.arange(past), cache=cache)
                mask = head_mask(allowed, past, 3, torch.bfloat16, cfg, "cpu")
                assert isinstance(mask, KeyLayout)
                if name == "sdpa":
                    mask = additive(reference, torch.bfloat16)
                    assert torch.equal(head_mask(allowed, past, 3, torch.float32, cfg, "cpu"),
                                       additive(reference, torch.float32))  # no kernel: the whole mask
                outs[name] = head(emb[:, past:past + 3], feats[:, past:past + 3], torch.arange(past, past + 3),
                                  mask=mask, cache=cache).float()
            assert torch.allclose(outs["native"], outs["sdpa"], atol=0.05, rtol=0.02), allowed
    layout = KeyLayout.tree(tree, 35)
    assert layout.committed == 35 and layout.counts.tolist() == [2, 2, 1]
    assert [row[:c].tolist() for row, c in zip(layout.ancestors, layout.counts)] == [[0, 2], [1, 3], [4]]
    # drafting's list form of the same tree part: the same layout, and the same mask without the kernel
    rows = TreeRows(((0, 2), (1, 3), (4,)), 5)
    with torch.inference_mode():
        listed = head_mask(rows, 37, 3, torch.bfloat16, cfg, "cpu")
    assert listed.committed == 35 and torch.equal(listed.counts, layout.counts)
    assert [row[:c].tolist() for row, c in zip(listed.ancestors, listed.counts)] == [[0, 2], [1, 3], [4]]
    assert torch.equal(rows.dense("cpu"), tree)
    assert torch.equal(head_mask(rows, 37, 3, torch.float32, cfg, "cpu"), additive(whole, torch.float32))
    # training and whole masks keep the additive mask
    assert not isinstance(head_mask(torch.ones(3, 40, dtype=torch.bool), 37, 3, torch.bfloat16, cfg, "cpu"), KeyLayout)
    assert not isinstance(head_mask(None, 37, 3, torch.float32, cfg, "cpu"), KeyLayout)
    with torch.enable_grad():
        assert not isinstance(head_mask(None, 37, 3, torch.bfloat16, cfg, "cpu"), KeyLayout)


def test_rotary_table_and_native_norm_compute_what_transformers_and_torch_do():
    """The head looks cos / sin up in a table (bit for bit transformers' rotary embedding) and
    runs its RMSNorms through the native kernel in bf16 inference (torch's result to bf16
    rounding); training (grad) and fp32 take torch's path."""
    from core.kernels import native
    from core.decoding.head import HeadConfig, RMSNorm, RotaryTable, _rotary

    cfg = HeadConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=100, rope_theta=50000.0)
    table = _rotary(cfg)
    assert isinstance(table, RotaryTable) and table.static
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, 3, 128, dtype=dtype)
        for positions in (torch.tensor([[0, 1, 2]]), torch.tensor([[700, 700, 3000]]), torch.tensor([[5, 9, 255]])):
            got, want = table(x, positions), table.rotary(x, positions)
            assert all(torch.equal(g, w) and g.dtype == dtype for g, w in zip(got, want))
    assert table._table[0].shape[0] >= 3001
    norm = RMSNorm(128, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(128) + 0.5)
    x = torch.randn(5, 128) * 3
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (128,), norm.weight, 1e-5))
    if native.status().available:
        with torch.inference_mode():
            got = norm.bfloat16()(x.bfloat16())
        torch.testing.assert_close(got.float(), torch.nn.functional.rms_norm(x, (128,), norm.weight.float(), 1e-5),
                                   atol=0.05, rtol=0.02)

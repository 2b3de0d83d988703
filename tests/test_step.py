"""The native decode step (core.kernels.step): one C call per forward, bit-identical to the transformers
exact path, on bf16 weights or GGUF blocks; and what happens where it cannot run."""

import types

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from core.decoding import cache as kv
from core.kernels import native, quant
from core.config import GenerationConfig, TreeConfig
from core.decoding.engine import Engine, EngineError
from core.decoding.forward import forward_tree, plain_forward, prefill, prefill_chunk
from core.kernels.invariant import (PROMPT_TILE_ROWS, BlockLinear, chunked_linear, make_invariant, reading_prompt,
                                    tree_ancestors)
from core.kernels.step import NativeStep, StepError, load_step, unsupported
from core.decoding.tree import tree_from_parents
from tests.test_exact import wide_llama

pytestmark = pytest.mark.skipif(not native.status().available,
                                reason=f"core.kernels.native unavailable: {native.status().reason}")

TYPES = {"Q4_1": GGMLQuantizationType.Q4_1, "Q4_0": GGMLQuantizationType.Q4_0, "Q8_0": GGMLQuantizationType.Q8_0,
         "Q5_1": GGMLQuantizationType.Q5_1, "Q5_0": GGMLQuantizationType.Q5_0,  # Q5, Q6: 8-bit activations only
         "Q6_K": GGMLQuantizationType.Q6_K, "Q4_K": GGMLQuantizationType.Q4_K,   # (test_w4a8)
         "Q5_K": GGMLQuantizationType.Q5_K}


def q6_k_quantize(values: np.ndarray) -> np.ndarray:
    """(n, k) fp32 values (k % 256 == 0) -> Q6_K super-blocks (n, k / 256 * 210), which gguf can read but not write:
    per 16 values a scale max|v| / 31 as d * sc (fp16 d per 256, int8 sc), codes u = round(v / (d sc)) + 32."""
    n = values.shape[0]
    v = values.reshape(-1, 16, 16).astype(np.float32)                           # (B, sub-block, 16)
    s = np.abs(v).max(-1) / 31                                                  # (B, 16)
    d = (s.max(-1) / 127).astype(np.float16)                                    # (B,)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(s, df, out=np.zeros_like(s), where=df > 0)), -128, 127).astype(np.int8)
    step = (df * sc)[..., None]
    u = np.clip(np.rint(np.divide(v, step, out=np.zeros_like(v), where=step != 0)), -32, 31).astype(np.int16) + 32
    c = u.astype(np.uint8).reshape(-1, 2, 4, 32)                     # (B, half, q, l): value 128 h + 32 q + l
    out = np.empty((len(c), 210), np.uint8)
    out[:, 0:128] = ((c[:, :, 0:2] & 15) | ((c[:, :, 2:4] & 15) << 4)).reshape(-1, 128)  # ql[64 h + 32 j + l]
    out[:, 128:192] = ((c >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(
        axis=2, dtype=np.uint8).reshape(-1, 64)                                 # qh[32 h + l]: q's pair at bits 2q
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.reshape(-1, 1).view(np.uint8)
    return out.reshape(n, -1)


def k_quantize(values: np.ndarray, bits: int = 4) -> np.ndarray:
    """(n, k) fp32 values (k % 256 == 0) -> Q4_K (bits 4) or Q5_K (5) super-blocks (n, k / 256 * 144 or 176), which
    gguf can read but not write: per 32 values a step s = (max - min(0, min)) / (2^bits - 1) and an offset o =
    -min(0, min), as d sc and dmin mn (fp16 d, dmin per 256, six-bit sc, mn), codes u = round((v + dmin mn) / (d
    sc)) in 0 .. 2^bits - 1."""
    n, top = values.shape[0], 2 ** bits - 1
    v = values.reshape(-1, 8, 32).astype(np.float32)                            # (B, sub-block, 32)
    lo = np.minimum(v.min(-1), 0)
    s, o = (v.max(-1) - lo) / top, -lo                                          # (B, 8)
    d, dmin = (s.max(-1) / 63).astype(np.float16), (o.max(-1) / 63).astype(np.float16)   # (B,)
    df, mf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(s, df, out=np.zeros_like(s), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(np.divide(o, mf, out=np.zeros_like(o), where=mf > 0)), 0, 63).astype(np.uint8)
    step, off = (df * sc)[..., None], (mf * mn)[..., None]
    u = np.clip(np.rint(np.divide(v + off, step, out=np.zeros_like(v), where=step > 0)), 0, top).astype(np.uint8)
    out = np.empty((len(v), 144 if bits == 4 else 176), np.uint8)
    out[:, 0:2] = d.reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = dmin.reshape(-1, 1).view(np.uint8)
    out[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)                           # k_scales_mins' inverse
    out[:, 8:12] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    out[:, -128:] = ((u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c, 2c + 1
    if bits == 5:                                                               # qh[l], bit s: sub-block s's fifth bit
        out[:, 16:48] = ((u >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)
    return out.reshape(n, -1)


def quantize(values: np.ndarray, kind) -> np.ndarray:
    """gguf's quantization, and our own encoders for Q6_K, Q4_K and Q5_K (gguf reads them, but cannot write them)."""
    if kind == GGMLQuantizationType.Q6_K:
        return q6_k_quantize(values)
    if kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        return k_quantize(values, 4 if kind == GGMLQuantizationType.Q4_K else 5)
    return quants.quantize(values, kind)


def random_tree(gen: torch.Generator, size: int, vocab: int):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    return tree_from_parents(torch.randint(0, vocab, (size,), generator=gen).tolist(), parents, "cpu")


def quantized_llama(kind: str, tiled: bool) -> tuple[torch.nn.Module, dict]:
    """wide_llama whose linear weights are GGUF blocks of `kind` (quantized by the gguf package),
    the model holding their dequantization rounded to bf16, as the embedded model's copy does. Q4_K, Q5_K, Q6_K:
    the weights whose K is a multiple of 256 (the down projections, as in a Q4_K_M file), Q4_1 the others."""
    model = wide_llama()
    blocks = {}
    for name, p in model.named_parameters():
        if name.endswith("proj.weight"):
            t = TYPES[kind if not kind.endswith("_K") or p.shape[1] % 256 == 0 else "Q4_1"]
            raw = quantize(p.float().numpy(), t)  # (N, K // 32 * block bytes) uint8
            p.copy_(torch.from_numpy(quants.dequantize(raw, t)).to(torch.bfloat16))
            b = quant.Blocks(int(t), torch.from_numpy(raw.copy()), *p.shape)
            blocks[name] = quant.tile_blocks(b) if tiled else b
    make_invariant(model)
    return model, blocks


@pytest.mark.tiles  # the bf16 reference (native.linear) runs on tiles where they serve
@pytest.mark.parametrize("kind,tiled", [("Q4_1", True), ("Q4_1", False), ("Q4_0", True), ("Q8_0", True)])
def test_block_weights_dequantize_to_the_bf16_copy_and_multiply_the_same(kind, tiled):
    model, blocks = quantized_llama(kind, tiled)
    params = dict(model.named_parameters())
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    for name, b in list(blocks.items())[:7]:
        w = native.wmat(blocks=b)
        assert torch.equal(native.dequantize(w), params[name]), name
        k = b.k
        rows = x if k == 576 else torch.randn(19, k).bfloat16()
        for m in (1, 5, 17, 19):  # one x block, a pair, a pair and a leftover
            assert torch.equal(native.linear_w(rows[:m], w), native.linear(rows[:m], params[name])), (name, m)


@pytest.mark.tiles
@pytest.mark.skipif(not native.status().amx, reason="no AMX tiles here: a prompt's block layers dequantize for oneDNN")
@pytest.mark.parametrize("kind,tiled,packed", [("Q4_1", True, False), ("Q4_1", False, True), ("Q4_0", False, True),
                                               ("Q4_K", False, True), ("Q8_0", True, False)])
def test_a_prompt_multiplies_block_weights_on_tiles_as_their_bf16_copy(kind, tiled, packed):
    """linear_tiles dequantizes each 16 x 32 tile into cache (the 4-bit X8 layouts too: the 8-bit step's packing of
    Q4_1, Q4_0 and Q4_K) and gives the bits of the tile GEMM on the dequantized copy, for one x block, pairs and a
    leftover; the screened LM head's kind is not among those it reads."""
    model, blocks = quantized_llama(kind, tiled)
    gen = torch.Generator().manual_seed(4)
    for name, b in list(blocks.items())[:7]:
        b = quant.pack_x8(b) if packed else b
        w = native.wmat(blocks=b)
        assert native.tiles_serve(w)
        copy = native.dequantize(w)
        x = torch.randn(70, b.k, generator=gen).bfloat16()
        bias = torch.randn(b.n, generator=gen).bfloat16()
        for m in (1, 16, 17, 33, 70):
            assert torch.equal(native.linear_tiles(x[:m], w, bias), native.linear(x[:m], copy, bias)), (name, m)
    split = native.WMat(quant.SPLIT, 64, 64, 0, 0, 64)
    assert not native.tiles_serve(split)
    with pytest.raises(ValueError, match="check tiles_serve"):
        native.linear_tiles(torch.randn(2, 64).bfloat16(), split)


def assert_step_equals_transformers(model, step, gen: torch.Generator, cases: int) -> None:
    """Logits, features and written keys / values of the step equal the transformers path's,
    alone and in random trees (contexts straddling the attention kernel's 16-key groups,
    trees up to 24 rows); the last node again as a plain one-token step after its ancestors."""
    with torch.inference_mode():
        for case in range(cases):
            context = int(torch.randint(3, 90, (1,), generator=gen))
            ids = torch.randint(0, 512, (context,), generator=gen)
            tree = random_tree(gen, int(torch.randint(1, 25, (1,), generator=gen)), 512)
            ref_cache, cache = kv.new_cache(model), kv.new_cache(model)
            prefill(model, ids, ref_cache)
            prefill(step, ids, cache)
            ref_feat, ref_logits = forward_tree(model, tree, ref_cache, context)
            feat, logits = forward_tree(step, tree, cache, context)
            assert torch.equal(logits, ref_logits) and torch.equal(feat, ref_feat), (case, context, tree.size)
            for a, b in zip(ref_cache.layers, cache.layers):  # the keys and values it wrote, too
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            # every node again as a plain one-token step after its ancestors
            node = tree.size - 1
            path = tree_ancestors(tree.parents, tree.depths)[node, :int(tree.depths[node]) + 1]
            kv.keep(cache, context, path[:-1])
            _, row = plain_forward(step, int(tree.tokens[node]), cache, context + len(path) - 1)
            assert torch.equal(row, logits[node])


@pytest.mark.parametrize("kind", ["bf16", "Q4_1", "Q8_0"])
def test_step_logits_bit_identical_to_the_transformers_path_alone_and_in_random_trees(kind):
    model, blocks = (wide_llama(), {}) if kind == "bf16" else quantized_llama(kind, True)
    if kind == "bf16":
        make_invariant(model)
    step = NativeStep(model, blocks, "test")
    assert_step_equals_transformers(model, step, torch.Generator().manual_seed(7), cases=6)


def test_the_profiled_build_computes_the_same_bits_and_times_each_stage(monkeypatch, tmp_path):
    """EAGLE_CHAT_PROFILE=1 builds the kernels with per-stage clocks (a library of its own): the step
    still equals the transformers path bit for bit, each stage a forward runs has taken time, reading
    the times zeroes them; the default build has no clocks and says so."""
    import core.models

    assert native.stage_times() is None  # the default build
    monkeypatch.setattr(core.models, "cache_home", lambda: tmp_path / "home")
    monkeypatch.setenv(native.PROFILE_ENV, "1")
    native._library.cache_clear()
    try:
        model, blocks = quantized_llama("Q4_1", True)
        step = NativeStep(model, blocks, "test")
        native.stage_times()
        assert_step_equals_transformers(model, step, torch.Generator().manual_seed(3), cases=2)
        times = native.stage_times()
        target = times["target"]
        assert set(target) == set(native.STAGES)
        for stage in ("embed", "norm", "qkv", "rotary", "attention", "o", "add", "gate/up", "silu", "down",
                      "final norm", "lm head"):
            assert target[stage] > 0, stage
        assert all(v == 0 for v in times["head"].values())  # no draft head ran
        assert all(v == 0 for part in native.stage_times().values() for v in part.values())
        assert len(list((tmp_path / "home" / "kernels").glob("decode-*.so"))) == 1
    finally:
        native._library.cache_clear()


def test_eagle3_feature_layers_match_transformers_hidden_states():
    model = wide_llama()
    make_invariant(model)
    step = NativeStep(model)
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(3))
    tree = random_tree(torch.Generator().manual_seed(4), 6, 512)
    with torch.inference_mode():
        c1, c2 = kv.new_cache(model), kv.new_cache(model)
        prefill(model, ids, c1)
        prefill(step, ids, c2)
        ref, _ = forward_tree(model, tree, c1, 20, (0, 1))
        feat, _ = forward_tree(step, tree, c2, 20, (0, 1))
        assert feat.shape == (6, 2 * 576) and torch.equal(feat, ref)
        with pytest.raises(StepError, match="feature layers"):
            forward_tree(step, tree, c2, 26, (0, 2))  # 2 = the normed last state: transformers' own


def test_rotary_table_equals_the_models_rotary_per_position():
    model = wide_llama()
    make_invariant(model)
    step = NativeStep(model)
    emb = model.get_input_embeddings().weight
    for pos in (0, 1, 63, 511, 3000):
        cos, sin = model.model.rotary_emb(emb[:0], torch.tensor([[pos]]))
        assert torch.equal(step._cos[pos], cos[0, 0]) and torch.equal(step._sin[pos], sin[0, 0])


def test_bad_tokens_are_refused_not_read_out_of_bounds():
    model = wide_llama()
    make_invariant(model)
    step = NativeStep(model)
    with torch.inference_mode():
        cache = kv.new_cache(model)
        prefill(step, torch.tensor([1, 2, 3]), cache)
        with pytest.raises(StepError, match="outside the vocabulary"):
            plain_forward(step, 512, cache, 3)
        assert kv.cache_length(cache) == 3  # nothing appended


# ---- the GGUF side: what is read, and clear errors for what is not ----

def write_gguf(path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]], metadata=None) -> None:
    """A GGUF of `tensors`; metadata(writer) adds key-value fields first, where given."""
    w = GGUFWriter(str(path), "llama")
    if metadata is not None:
        metadata(w)
    for name, (data, kind) in tensors.items():
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_config(layers=1):
    return types.SimpleNamespace(hidden_size=64, intermediate_size=96, vocab_size=128, num_attention_heads=2,
                                 num_key_value_heads=1, num_hidden_layers=layers, head_dim=32)


def layer_tensors(gen, kinds=None) -> dict:
    shapes = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64),
              "ffn_gate": (96, 64), "ffn_up": (96, 64), "ffn_down": (64, 96)}
    out = {"token_embd.weight": (quants.quantize(gen.standard_normal((128, 64)).astype(np.float32),
                                                 GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)}
    for name, shape in shapes.items():
        kind = (kinds or {}).get(name, GGMLQuantizationType.Q4_1)
        data = gen.standard_normal(shape).astype(np.float32)
        out[f"blk.0.{name}.weight"] = (quants.quantize(data, kind) if kind != GGMLQuantizationType.F16
                                       else data.astype(np.float16), kind)
    return out


def test_gguf_blocks_load_with_the_rotary_rows_put_back(tmp_path):
    gen = np.random.default_rng(0)
    tensors = layer_tensors(gen)
    write_gguf(tmp_path / "m.gguf", tensors)
    blocks = quant.load_llama_blocks(tmp_path / "m.gguf", tiny_config())
    q = blocks["model.layers.0.self_attn.q_proj.weight"]
    assert q.type_name == "Q4_1" and (q.n, q.k) == (64, 64)
    stored = quants.dequantize(tensors["blk.0.attn_q.weight"][0], GGMLQuantizationType.Q4_1)  # llama.cpp's order
    ours = native.dequantize(native.wmat(blocks=q)).float().numpy()
    hd = 32  # head h, row 2i + j in the file is row j * hd/2 + i in transformers' order
    for h, i, j in ((0, 0, 1), (1, 5, 0), (1, 15, 1)):
        assert np.array_equal(ours[h * hd + j * hd // 2 + i],
                              torch.from_numpy(stored[h * hd + 2 * i + j]).bfloat16().float().numpy())


def test_an_unsupported_tensor_type_names_the_tensor_and_the_supported_types(tmp_path):
    write_gguf(tmp_path / "f16.gguf", layer_tensors(np.random.default_rng(1), {"ffn_up": GGMLQuantizationType.F16}))
    with pytest.raises(quant.QuantWeightError, match=r"blk\.0\.ffn_up\.weight has type F16.*Q4_0, Q4_1, Q8_0"):
        quant.load_llama_blocks(tmp_path / "f16.gguf", tiny_config())


def test_shapes_that_do_not_match_the_model_are_named(tmp_path):
    write_gguf(tmp_path / "m.gguf", layer_tensors(np.random.default_rng(2)))
    cfg = tiny_config()
    cfg.intermediate_size = 128
    with pytest.raises(quant.QuantWeightError, match=r"blk\.0\.ffn_gate\.weight has shape \(96, 64\), the model needs \(128, 64\)"):
        quant.load_llama_blocks(tmp_path / "m.gguf", cfg)
    with pytest.raises(quant.QuantWeightError, match=r"blk\.1\.attn_q\.weight is missing"):
        quant.load_llama_blocks(tmp_path / "m.gguf", tiny_config(layers=2))


def test_a_truncated_file_is_refused_clearly(tmp_path):
    write_gguf(tmp_path / "m.gguf", layer_tensors(np.random.default_rng(3)))
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 3000])
    with pytest.raises(quant.QuantWeightError, match="cut.gguf|truncated"):
        quant.load_llama_blocks(tmp_path / "cut.gguf", tiny_config())


def test_the_tensor_directory_is_ggufs_own_without_decoding_the_metadata(tmp_path):
    """open_gguf reads the header alone (gguf's GGUFReader decodes every metadata field first: 4.8 s
    for the embedded model): the same names, types, shapes and bytes as GGUFReader, on a file with
    string, array and number metadata; a foreign file or a header cut short is refused naming the file."""
    from gguf import GGUFReader

    def metadata(w) -> None:
        w.add_string("general.name", "tiny")
        w.add_token_list([f"tok{i}" for i in range(300)])
        w.add_token_scores([float(i) for i in range(300)])
        w.add_uint32("llama.block_count", 1)
        w.add_bool("tokenizer.ggml.add_bos_token", True)

    write_gguf(tmp_path / "m.gguf", layer_tensors(np.random.default_rng(5), {"ffn_up": GGMLQuantizationType.F16}),
               metadata)
    theirs = GGUFReader(tmp_path / "m.gguf").tensors
    ours = quant.open_gguf(tmp_path / "m.gguf")
    assert [(t.name, int(t.tensor_type), tuple(int(x) for x in t.shape)) for t in theirs] == \
           [(t.name, t.type, t.shape) for t in ours]
    for a, b in zip(theirs, ours):
        assert np.array_equal(np.asarray(a.data).reshape(-1).view(np.uint8), b.data), a.name
    assert {t.name: t.type_name for t in ours}["blk.0.ffn_up.weight"] == "F16"
    (tmp_path / "foreign.gguf").write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(quant.QuantWeightError, match=r"foreign\.gguf is not a readable GGUF file \(no GGUF magic"):
        quant.open_gguf(tmp_path / "foreign.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    for cut in (6, 40, 400):  # in the counts, in the metadata, in the tensor directory or vocabulary
        (tmp_path / "head.gguf").write_bytes(data[:cut])
        with pytest.raises(quant.QuantWeightError, match=r"head\.gguf is not a readable GGUF file"):
            quant.open_gguf(tmp_path / "head.gguf")


def test_auto_weights_fall_back_to_bf16_and_say_why_while_q4_by_name_is_an_error(tmp_path):
    write_gguf(tmp_path / "bad.gguf", layer_tensors(np.random.default_rng(4)))  # another model's file
    model = wide_llama()
    make_invariant(model)
    target = types.SimpleNamespace(model=model, gguf=tmp_path / "bad.gguf")
    step, text = load_step(target, "auto")
    assert step is not None and step.info.weights.startswith("bf16")
    # which weights serve, and why
    assert "bf16 weights: GGUF tensor token_embd.weight has shape (128, 64), the model needs (512, 576)" in text
    with pytest.raises(quant.QuantWeightError, match="token_embd.weight has shape"):
        load_step(target, "q4")
    step, text = load_step(types.SimpleNamespace(model=model, gguf=None), "auto")
    assert text.startswith("native decode step, bf16")
    with pytest.raises(StepError, match="not loaded from one"):
        load_step(types.SimpleNamespace(model=model, gguf=None), "q4")


def test_without_the_cpu_features_the_transformers_path_serves_and_says_so(monkeypatch):
    monkeypatch.setattr(native, "_library", lambda: (None, native.NativeStatus(False, "this CPU lacks avx512_bf16")))
    model = wide_llama()
    make_invariant(model)
    assert "lacks avx512_bf16" in unsupported(model)
    step, text = load_step(types.SimpleNamespace(model=model, gguf=None), "auto")
    assert step is None and text == "transformers forward (native kernels unavailable (this CPU lacks avx512_bf16))"


def test_other_numerics_keep_the_transformers_forward():
    model = wide_llama(torch.float32)
    assert "bf16" in unsupported(model)
    model = wide_llama()  # bf16 but sdpa attention: not the exact numerics the step computes
    assert "exact" in unsupported(model)


# ---- the real embedded model ----

def two_thread_engine(weights: str):
    """The embedded model's engine on 2 threads (a module fixture's body)."""
    torch.set_num_threads(2)
    yield Engine.load(weights=weights)
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def smollm2():
    yield from two_thread_engine("q4")


@pytest.mark.slow
@pytest.mark.tiles  # its prompt-sized call on tiles where they serve
def test_embedded_gguf_blocks_equal_the_bf16_weights_bit_for_bit(smollm2):
    from safetensors import safe_open

    from core.models import embedded_model_dir

    blocks = quant.load_llama_blocks(smollm2.target.gguf, smollm2.target.model.config)
    assert len(blocks) == 211 and {b.type_name for b in blocks.values()} == {"Q4_1", "Q8_0"}
    # the bf16 copy the engine computed with before: transformers' fp32 conversion, rounded to bf16
    with safe_open(embedded_model_dir() / "model.safetensors", "pt") as f:
        for name, b in blocks.items():
            assert torch.equal(native.dequantize(native.wmat(blocks=b)), f.get_tensor(name).bfloat16()), name
    assert "Q4_1 blocks from SmolLM2-135M-Instruct.Q4_1.gguf" in smollm2.numerics.describe()
    assert smollm2.numerics.exact
    # the layers' bf16 copies are gone: transformers' forward (prefill) reads the same blocks
    down = smollm2.target.model.model.layers[3].mlp.down_proj
    assert isinstance(down, BlockLinear) and down.weight.numel() == 0
    x = torch.randn(700, 1536).bfloat16()  # a prefill-sized call: dequantized per call, then AMX tiles or oneDNN
    with safe_open(embedded_model_dir() / "model.safetensors", "pt") as f:
        weight = f.get_tensor("model.layers.3.mlp.down_proj.weight").bfloat16()
    if native.status().amx:
        ref = native.linear(x, weight)
    elif native.status().isa == "avx2":  # the blocks' own kernel, MAX_ROWS rows a call (no bf16 dot product there)
        ref = torch.cat([native.linear_w(x[:native.MAX_ROWS], down.wmat), native.linear_w(x[native.MAX_ROWS:], down.wmat)])
        assert torch.equal(ref, torch.cat([native.linear_w(x[i:i + 1], down.wmat) for i in range(len(x))]))
    else:
        ref = chunked_linear(x, weight, None)
    assert torch.equal(down(x), ref) and torch.equal(down(x[:5]), native.linear_w(x[:5], down.wmat))
    # a prefill's call of PROMPT_TILE_ROWS rows or more takes the tiles too (where this machine has them);
    # decoding's calls of as many rows (a tree) keep the 8-bit kernel, whose rows do not depend on the others
    rows = PROMPT_TILE_ROWS + 3
    with reading_prompt():
        assert torch.equal(down(x[:rows]), ref[:rows] if native.status().amx else native.linear_w(x[:rows], down.wmat))
        assert torch.equal(down(x[:PROMPT_TILE_ROWS - 1]), native.linear_w(x[:PROMPT_TILE_ROWS - 1], down.wmat))
    assert torch.equal(down(x[:rows]), native.linear_w(x[:rows], down.wmat))


@pytest.mark.slow
@pytest.mark.tiles  # turns the tiles off where they serve
def test_without_tiles_a_prompts_block_layers_dequantize_for_onednn(smollm2, monkeypatch):
    """Where AMX tiles do not serve (the AMD machines; EAGLE_CHAT_AMX=0 here) a prompt-sized call dequantizes the
    blocks (on every thread) for oneDNN, and a prefill's smaller calls keep the 8-bit kernel. On AVX2 (no bf16
    dot product) the 8-bit kernel serves prompt-sized calls too."""
    down = smollm2.target.model.model.layers[3].mlp.down_proj
    x = torch.randn(700, 1536, generator=torch.Generator().manual_seed(5)).bfloat16()
    tiles = native.status().amx
    monkeypatch.setenv(native.AMX_ENV, "0")
    native._library.cache_clear()
    try:
        assert not native.status().amx and not native.tiles_serve(down.wmat)
        torch.set_num_threads(2)
        weight = native.dequantize(down.wmat)
        torch.set_num_threads(1)
        assert torch.equal(native.dequantize(down.wmat), weight)  # one thread or two: the same values
        if native.status().isa == "avx2":
            assert torch.equal(down(x), torch.cat([native.linear_w(x[i:i + 350], down.wmat) for i in (0, 350)]))
        else:
            assert torch.equal(down(x), chunked_linear(x, weight, None))
        with reading_prompt():
            assert torch.equal(down(x[:200]), native.linear_w(x[:200], down.wmat))
    finally:
        torch.set_num_threads(2)
        monkeypatch.delenv(native.AMX_ENV)
        native._library.cache_clear()
    assert native.status().amx == tiles


@pytest.mark.slow
@pytest.mark.parametrize("tail", [40, 200])
def test_the_embedded_models_prefill_in_two_parts_is_the_same_bits(smollm2, tail):
    """A kept prompt's next chunk (core.decoding.prefix) reads as a fresh prefill does, whichever kernel its
    size takes (a tail of 40 rows: the 8-bit kernel; 200: the prompt GEMM on tiles where they serve)."""
    model = smollm2.forwarder.hf
    ids = torch.randint(100, 20000, (prefill_chunk() + tail,), generator=torch.Generator().manual_seed(tail))
    with torch.inference_mode():
        whole = kv.new_cache(model)
        f1, l1 = prefill(model, ids, whole)
        parts = kv.new_cache(model)
        fa, _ = prefill(model, ids[:prefill_chunk()], parts)
        fb, lb = prefill(model, ids[prefill_chunk():], parts)
    assert torch.equal(l1, lb) and torch.equal(f1, torch.cat([fa, fb]))
    for a, b in zip(whole.layers, parts.layers):
        assert torch.equal(a.keys[..., :len(ids), :], b.keys[..., :len(ids), :])
        assert torch.equal(a.values[..., :len(ids), :], b.values[..., :len(ids), :])


def assert_greedy_speculation_equals_plain(engine) -> None:
    """6 tree settings x 5 prompts (a two-turn chat, one of >= 256 tokens), 40 tokens each."""
    long = "Summarise this text in two sentences:\n" + " ".join(
        f"Paragraph {i}: the river carries silt from the mountains to the delta, where farmers plant rice." for i in range(24))
    prompts = ["What is the capital of France?", "Write a Python function that checks whether a number is prime.",
               [{"role": "user", "content": "Name a planet."}, {"role": "assistant", "content": "Mars."},
                {"role": "user", "content": "Tell me one fact about it."}],
               long, "List three ways to save water at home."]
    assert len(engine.encode(long)) >= 256
    trees = [TreeConfig(depth=1, top_k=1, total_tokens=2), TreeConfig(depth=3, top_k=4, total_tokens=8),
             TreeConfig(depth=4, top_k=6, total_tokens=10), TreeConfig(depth=5, top_k=8, total_tokens=16),
             TreeConfig(depth=6, top_k=10, total_tokens=32), TreeConfig(depth=4, top_k=8, total_tokens=24, lookup=8)]
    for prompt in prompts:
        run = lambda **kw: [t for ev in engine.generate(prompt, GenerationConfig(max_new_tokens=40, **kw))
                            for t in ev.token_ids]
        plain = run(speculative=False)
        for tree in trees:
            assert run(tree=tree) == plain, (prompt, tree)


@pytest.mark.slow
def test_greedy_speculation_equals_plain_on_the_q4_step(smollm2):
    assert isinstance(smollm2.forwarder, NativeStep)
    assert_greedy_speculation_equals_plain(smollm2)


def test_engine_refuses_unknown_weights():
    with pytest.raises(EngineError, match="unknown weights 'q8'"):
        Engine.load(weights="q8")


def test_silu_mul_is_row_invariant_over_rows_and_threads_and_matches_torchs_formula():
    """Issue 32 item 6: SiLU x up is native (one vector sequence per element, masked tails), so an
    element's bits do not depend on the row count, its row's place or the threads."""
    gen = torch.Generator().manual_seed(5)
    gate = (torch.randn(128, 1536, generator=gen) * 4).bfloat16()
    up = torch.randn(128, 1536, generator=gen).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([native.silu_mul(gate[i:i + 1], up[i:i + 1]) for i in range(128)])
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            for rows in (1, 2, 7, 16, 33, 64, 128):
                assert torch.equal(native.silu_mul(gate[:rows], up[:rows]), alone[:rows]), (threads, rows)
        # an odd width: the masked tail takes the same instructions as the body
        assert torch.equal(native.silu_mul(gate[:5, :37], up[:5, :37]), alone[:5, :37])
    finally:
        torch.set_num_threads(before)
    ref = (torch.nn.functional.silu(gate.float()).bfloat16().float() * up.float()).bfloat16()
    assert (alone.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max()  # torch's formula, ~1 ulp


def test_rotary_tables_are_computed_on_one_thread(monkeypatch):
    """The native step's rotary table comes from one thread (core.threads.one_torch_thread: a
    parallel first cos was process-dependent), and the caller's thread count comes back."""
    model = wide_llama()
    make_invariant(model)
    seen = []
    rotary = model.model.rotary_emb
    original = type(rotary).forward

    def spy(self, x, positions):
        seen.append(torch.get_num_threads())
        return original(self, x, positions)

    monkeypatch.setattr(type(rotary), "forward", spy)
    torch.set_num_threads(2)
    step = NativeStep(model)
    assert seen == [1] and torch.get_num_threads() == 2
    assert step._cos.shape == (4096, 64)
    emb = model.get_input_embeddings().weight
    cos, sin = original(rotary, emb[:0], torch.arange(4096)[None])
    assert torch.equal(step._cos, cos[0]) and torch.equal(step._sin, sin[0])


def test_greedy_forwards_return_the_argmax_of_the_same_logits_from_the_step_and_from_transformers():
    """forward_tree_greedy / plain_forward_greedy (the step's forward_rows / forward_one: arguments built on the
    host): the native step finds each row's argmax inside its call;
    they are greedy_tokens of the logits forward_tree gives (random trees, rows 1-2 screened or not, more
    rows), on the step and on the transformers path alike; a malformed choices buffer is refused."""
    from core.decoding.forward import forward_tree_greedy, plain_forward_greedy
    from core.decoding.verify import greedy_tokens

    model, blocks = quantized_llama("Q4_1", True)
    step = NativeStep(model, blocks, "test")
    gen = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        for case, size in enumerate((1, 2, 3, 9, 17)):
            context = int(torch.randint(3, 60, (1,), generator=gen))
            ids = torch.randint(0, 512, (context,), generator=gen)
            tree = random_tree(gen, size, 512)
            for forwarder in (step, model):
                a, b = kv.new_cache(model), kv.new_cache(model)
                prefill(forwarder, ids, a)
                prefill(forwarder, ids, b)
                feat, logits = forward_tree(forwarder, tree, a, context, None, True)
                feat2, choices = forward_tree_greedy(forwarder, tree, b, context)
                assert choices == greedy_tokens(logits).tolist() and torch.equal(feat, feat2), (case, forwarder)
                if forwarder is step:  # the tree as lists, not greedy: forward's features and logits
                    c, d = kv.new_cache(model), kv.new_cache(model)
                    prefill(step, ids, c)
                    prefill(step, ids, d)
                    ref_feat, ref_logits = forward_tree(step, tree, c, context)
                    feat3, logits3, none = step.forward_rows(tree.tokens.tolist(), tree.parents.tolist(),
                                                             tree.depths.tolist(), context, d)
                    assert torch.equal(feat3, ref_feat) and torch.equal(logits3, ref_logits) and none is None, case
                kv.keep(a, context, [])
                kv.keep(b, context, [])
                feat, row = plain_forward(forwarder, int(tree.tokens[0]), a, context, None, True)
                feat2, choice = plain_forward_greedy(forwarder, int(tree.tokens[0]), b, context)
                assert choice == int(greedy_tokens(row)) and torch.equal(feat, feat2), (case, forwarder)
        cache = kv.new_cache(model)
        prefill(step, ids, cache)
        one = torch.ones(1, dtype=torch.long)
        with pytest.raises(StepError, match="choices must be a contiguous CPU int64 tensor of 1 elements"):
            step.forward(torch.tensor([5]), torch.tensor([len(ids)]), len(ids), one[:, None] - 1, one, cache,
                         None, True, torch.empty(1, dtype=torch.int32))


def test_one_row_calls_follow_caches_that_grow_and_alternate():
    """The step keeps a cache's buffer addresses between calls (core.decoding.cache.buffers_epoch says
    when to read them again): two caches taken in turns, each growing past its first buffer (256
    positions), then one emptied and filled again: the one-row call without argument tensors
    (forward_one, plain and greedy) gives the transformers path's logits and features at every
    step, and its argmax."""
    from core.decoding.forward import plain_forward_greedy
    from core.decoding.verify import greedy_tokens

    model, blocks = quantized_llama("Q4_1", True)
    step = NativeStep(model, blocks, "test")
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        prompts = [torch.randint(0, 512, (n,), generator=gen) for n in (250, 244)]
        ours, ref = [kv.new_cache(model) for _ in prompts], [kv.new_cache(model) for _ in prompts]
        for i, ids in enumerate(prompts):
            prefill(step, ids, ours[i])
            prefill(model, ids, ref[i])
        token = [5, 7]
        for n in range(16):  # past 256 positions: both caches reallocate their buffers
            for i, ids in enumerate(prompts):
                at = len(ids) + n
                ref_feat, ref_logits = plain_forward(model, token[i], ref[i], at)
                if n % 2:
                    feat, choice = plain_forward_greedy(step, token[i], ours[i], at)
                    assert choice == int(greedy_tokens(ref_logits)), (n, i)
                else:
                    feat, logits = plain_forward(step, token[i], ours[i], at)
                    assert torch.equal(logits, ref_logits), (n, i)
                assert torch.equal(feat, ref_feat), (n, i)
                token[i] = int(greedy_tokens(ref_logits))
        assert all(l._k.shape[-2] > 256 for c in ours for l in c.layers), "the buffers grew"
        for a, b in zip(ref[0].layers, ours[0].layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        # the cache the step served last, emptied and filled again: new buffers, within the room it had
        ids = torch.randint(0, 512, (40,), generator=gen)
        for c, forwarder in ((ours[1], step), (ref[1], model)):
            c.reset()
            prefill(forwarder, ids, c)
        for n in range(3):
            ref_feat, ref_logits = plain_forward(model, token[1], ref[1], len(ids) + n)
            feat, logits = plain_forward(step, token[1], ours[1], len(ids) + n)
            assert torch.equal(logits, ref_logits) and torch.equal(feat, ref_feat), n
            token[1] = int(greedy_tokens(ref_logits))

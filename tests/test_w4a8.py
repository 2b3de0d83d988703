"""W4A8 (issue 30, the integer-activation design): the GGUF's 4-/8-bit blocks times 8-bit
activations (csrc/gemm_x8.c). These numerics are their own reference: a row computes the same
bits alone or in a tree (integer block sums, one fixed fp32 sequence per element), VNNI and
AMX-INT8 give the same bits, the native step equals the transformers path on them, and greedy
speculation equals plain decoding (tests/test_exact.py runs that on the default engine, which is
w4a8: 6 trees x 6 prompts and a 256-token answer); their distance from bf16 is measured."""

import numpy as np
import pytest
import torch

from core.decoding import cache as kv
from core.kernels import native, quant
from core.decoding.engine import Engine, plain_forward, prefill
from core.kernels.invariant import BlockLinear
from core.kernels.step import NativeStep
from tests.test_step import TYPES, assert_step_equals_transformers, quantized_llama, two_thread_engine

pytestmark = pytest.mark.skipif(not native.status().available,
                                reason=f"core.kernels.native unavailable: {native.status().reason}")


def as_loaded(b: quant.Blocks) -> quant.Blocks:
    """A weight as the loader reads it for 8-bit activations: Q5_0 and Q6_K repacked (quant.repacked: Q5_1 and
    Q6_HALVES blocks); others as they are."""
    if b.type not in (int(TYPES["Q5_0"]), int(TYPES["Q6_K"])):
        return b
    return quant.repacked(quant.GGUFTensor("w", b.type, (b.k, b.n), b.data.numpy().reshape(-1)), b.n, b.k)


def x8_model(kind: str):
    """quantized_llama with its layers packed for 8-bit activations and a Q8_0 LM head."""
    from gguf import quants

    model, blocks = quantized_llama(kind, tiled=False)
    packed = {name: quant.pack_x8(as_loaded(b)) for name, b in blocks.items()}
    lm = model.lm_head.weight
    raw = quants.quantize(lm.float().numpy(), TYPES["Q8_0"])
    packed["lm_head.weight"] = quant.pack_x8(quant.Blocks(int(TYPES["Q8_0"]), torch.from_numpy(raw.copy()), *lm.shape))
    return model, blocks, packed


def reference(x: torch.Tensor, b: quant.Blocks) -> np.ndarray:
    """csrc/gemm_x8.c's numerics from their definition, in float64 after the exact integer sums:
    x per block of 32 -> d = max|x| / 127, q = rint(x * (127 / max|x|)) (fp32), weights from the
    file's blocks."""
    xf = x.float().numpy().reshape(x.shape[0], -1, 32)                         # (M, KB, 32)
    amax = np.abs(xf).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint((xf * inv).astype(np.float32)), -127, 127).astype(np.int64)
    d = (amax / np.float32(127)).astype(np.float32)[..., 0].astype(np.float64)   # (M, KB)
    n, kb, bs = b.n, b.k // 32, quant.BLOCK_TYPES[b.type][1]
    k_quant = b.type in quant.K_SUPER
    raw = b.data.numpy().reshape(n, -1, quant.K_SUPER[b.type]) if k_quant else b.data.numpy().reshape(n, kb, bs)
    dw = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)      # (N, KB)
    if k_quant:                                                                  # d sc u - dmin mn per 32 values
        sc, mn = quant.k_scales_mins(raw[..., 4:16])                             # (N, KB / 8, 8)
        dmin = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        mw = (-dmin[..., None] * mn).reshape(n, kb)
        dw = (dw[..., None] * sc).reshape(n, kb)
        qw = quant.k_quant_codes(raw).reshape(n, kb, 32).astype(np.int64)
    elif b.type == quant.Q5_1:                                                     # d u + m, u in 0..31
        qw = quant.q5_codes(raw[..., 4:24]).astype(np.int64)
        mw = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    elif b.type == quant.Q6_HALVES:                                              # d s (u - 32), s per 16 values
        scales = np.repeat(raw[..., 2:4].view(np.int8).astype(np.int64), 16, axis=-1)
        qw, mw = scales * (quant.q6_halves_codes(raw).astype(np.int64) - 32), np.zeros((n, kb))
    elif b.type == 8:
        qw, mw = raw[..., 2:34].view(np.int8).astype(np.int64), np.zeros((n, kb))
    else:
        qs = raw[..., 4:20] if b.type == 3 else raw[..., 2:18]
        qw = np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64)             # (N, KB, 32)
        mw = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64) if b.type == 3 else -8 * dw
    isum = np.einsum("mbk,nbk->mnb", q, qw)                                      # exact integers
    return (isum * dw[None] * d[:, None] + mw[None] * (d * q.sum(-1))[:, None]).sum(-1)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0", "Q5_1", "Q5_0", "Q6_K", "Q4_K", "Q5_K"])
def test_packed_blocks_hold_the_same_weights_and_multiply_as_defined(kind):
    """Q5_0 and Q5_1 reach the kernels as Q5_1 blocks: 5-bit codes in Q4's nibble order plus a plane of fifth
    bits; Q6_K as Q6_HALVES blocks: two planes of high bits and a scale per 16 values; Q4_K and Q5_K as their own
    super-blocks (a header of d and dmin, a byte per six-bit scale and minimum); Q4_0 with d alone. Their values
    are the file's (gguf's dequantization) exactly."""
    model, blocks = quantized_llama(kind, tiled=False)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(3)
    for name, b in [(n, b) for n, b in blocks.items() if b.type == int(TYPES[kind])][:4]:
        b = as_loaded(b)
        packed = quant.pack_x8(b)
        bits = {"Q4_0": 4.5, "Q4_1": 5, "Q4_K": 4.625, "Q5_0": 6, "Q5_1": 6, "Q5_K": 5.625, "Q6_K": 6.5625, "Q8_0": 8.5}
        assert packed.nbytes * 8 == b.n * b.k * bits[kind], (kind, packed.nbytes)  # the file's (Q5_0: as Q5_1; Q4_K,
                                                                                   # Q5_K: a byte per six-bit scale)
        assert torch.equal(native.dequantize(native.wmat(blocks=packed)), params[name])  # gguf's values, in bf16
        x = torch.randn(6, b.k, generator=gen).bfloat16()
        x[0, 5] = 40.0  # an outlier: its block's scale, not the row's
        y = native.linear_w(x, native.wmat(blocks=packed)).float().numpy()
        ref = reference(x, b)
        assert np.all(np.abs(y - ref) <= np.abs(ref) * 2 ** -8 + 1e-4), (name, np.abs(y - ref).max())


def test_packing_refuses_what_the_kernel_cannot_read():
    model, blocks = quantized_llama("Q4_1", tiled=True)
    name, b = next(iter(blocks.items()))
    with pytest.raises(quant.QuantWeightError, match="cannot be packed for 8-bit activations"):
        quant.pack_x8(b)
    odd = quant.Blocks(3, torch.zeros(24, 20, dtype=torch.uint8), 24, 32)  # 24 rows: not a multiple of 16
    with pytest.raises(quant.QuantWeightError, match="Q4_1 weight 24 x 32"):
        quant.pack_x8(odd)


@pytest.mark.tiles
def test_rows_compute_the_same_bits_alone_in_any_batch_and_on_amx_or_vnni():
    model, blocks, packed = x8_model("Q4_1")
    packed["five"] = x8_model("Q5_1")[2]["model.layers.0.mlp.up_proj.weight"]  # Q5, Q6: VNNI at every row count
    packed["six"] = x8_model("Q6_K")[2]["model.layers.0.mlp.down_proj.weight"]
    packed["q4k"] = x8_model("Q4_K")[2]["model.layers.0.mlp.down_proj.weight"]
    packed["q40"] = x8_model("Q4_0")[2]["model.layers.0.mlp.up_proj.weight"]
    packed["q5k"] = x8_model("Q5_K")[2]["model.layers.0.mlp.down_proj.weight"]
    kinds = ("five", "six", "q4k", "q40", "q5k")
    assert [packed[k].type_name for k in kinds] == ["Q5x8", "Q6x8", "Q4Kx8", "Q40x8", "Q5Kx8"]
    gen = torch.Generator().manual_seed(5)
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
                 *kinds):
        w = native.wmat(blocks=packed[name])
        x = torch.randn(40, w.K, generator=gen).bfloat16()
        alone = torch.cat([native.linear_w(x[i:i + 1], w) for i in range(40)])
        had = native.set_x8_amx(True)  # True where this machine has AMX-INT8
        try:
            for m in (2, 5, 9, 13, 16, 17, 40):  # chunks of 16 rows (AMX from 13 rows), and leftovers
                for amx in {False, had}:
                    native.set_x8_amx(amx)
                    assert torch.equal(native.linear_w(x[:m], w), alone[:m]), (name, m, amx)
        finally:
            native.set_x8_amx(had)


@pytest.mark.parametrize("kind,bits", [("Q4_1", "4"), ("Q4_0", "4"), ("Q5_0", "5"), ("Q6_K", "4/6"), ("Q4_K", "4"),
                                       ("Q5_K", "4/5")])
def test_step_on_w4a8_equals_the_transformers_path_alone_and_in_random_trees(kind, bits):
    model, _, packed = x8_model(kind)
    step = NativeStep(model, packed, "test")
    assert step.info.weights.startswith(f"{bits}-bit weights x 8-bit activations")  # the layers' code widths
    step.drop_bf16_layers()  # transformers' linears (and LM head) now read the same packed blocks
    assert isinstance(model.lm_head, BlockLinear) and model.lm_head.wmat.type == 101
    assert_step_equals_transformers(model, step, torch.Generator().manual_seed(11), cases=5)


# ---- the real embedded model ----

@pytest.fixture(scope="module")
def smollm2_w4a8():
    yield from two_thread_engine("w4a8")


@pytest.mark.slow
def test_w4a8_stays_close_to_the_bf16_numerics_on_a_fixed_text(smollm2_w4a8):
    """Quality against the bf16 path (the same weights, bf16 activations): teacher-forced over a
    fixed text, the next-token choice agrees at >= 90% of positions and the perplexity is within
    5%. Measured 2026-12-02: see docs/native-step.md (w4a8 section)."""
    eng = smollm2_w4a8
    assert isinstance(eng.forwarder, NativeStep) and eng.numerics.exact  # the probe passed on these numerics
    assert "4-bit weights x 8-bit activations (Q4x8/Q8x8 split blocks from SmolLM2" in eng.numerics.describe()
    text = ("The water cycle describes how water moves between the oceans, the air and the land. The sun warms "
            "the surface of the sea, and water evaporates into the atmosphere as vapour. As the vapour rises it "
            "cools and condenses into tiny droplets that form clouds. When the droplets grow heavy they fall as "
            "rain or snow. Some of that water runs off into rivers and lakes, some soaks into the ground and "
            "refills aquifers, and some is taken up by plants, which release it again through their leaves. "
            "Over time the rivers carry the water back to the sea, and the cycle begins again.")
    ids = torch.tensor(eng.encode(text))
    scores = {}
    with torch.inference_mode():
        for name, model in (("w4a8", eng.step), ("bf16", None)):
            if model is None:
                bf16 = Engine.load(weights="bf16")
                model = bf16.step
            cache = kv.new_cache(model.hf)
            prefill(model, ids[:1], cache)
            rows = [plain_forward(model, int(ids[i]), cache, i)[1].float() for i in range(1, len(ids) - 1)]
            logits = torch.stack(rows)                                   # (T - 2, V): predicts ids[2:]
            scores[name] = (logits.argmax(-1), torch.nn.functional.cross_entropy(logits, ids[2:]).exp().item())
    agree = (scores["w4a8"][0] == scores["bf16"][0]).float().mean().item()
    ppl_w, ppl_b = scores["w4a8"][1], scores["bf16"][1]
    assert agree >= 0.90, agree
    assert abs(ppl_w / ppl_b - 1) <= 0.05, (ppl_w, ppl_b)


@pytest.mark.slow
@pytest.mark.tiles
@pytest.mark.skipif(not native.status().amx_attention, reason="no AMX attention on this machine")
def test_attention_on_tiles_stays_close_to_the_vector_kernel_on_a_long_text(smollm2_w4a8):
    """Past 256 keys a row attends on AMX tiles (csrc/attention_amx.c), in other numerics: teacher-forced
    over 560 tokens of a fixed document, the logits below 256 keys are the vector kernel's bit for bit,
    and past it the next-token choice agrees at >= 90% of positions and the perplexity is within 3%
    (measured over 1,200 tokens: 97.7%, 9.557 against 9.521; docs/native-step.md)."""
    from core.autotune import _document_ids

    eng = smollm2_w4a8
    st = native.status()
    ids = torch.tensor(list(_document_ids(eng.target.tokenizer)[:560]))
    logits = {}
    try:
        with torch.inference_mode():
            for on in (False, True):
                native.set_amx_attention(on)
                cache = kv.new_cache(eng.step.hf)
                prefill(eng.step, ids[:1], cache)
                logits[on] = torch.stack([plain_forward(eng.step, int(ids[i]), cache, i)[1].float()
                                          for i in range(1, len(ids) - 1)])  # row i - 1 predicts ids[i + 1]
    finally:
        native.set_amx_attention(st.amx_attention, from_keys=st.amx_attention_from)
    below = st.amx_attention_from - 2  # rows with fewer keys than the threshold: positions 1 .. from - 2
    assert torch.equal(logits[False][:below], logits[True][:below])
    a, b, target = logits[False][below:], logits[True][below:], ids[below + 2:]
    assert not torch.equal(a, b)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.90
    ppl = [torch.nn.functional.cross_entropy(x, target).exp().item() for x in (a, b)]
    assert abs(ppl[1] / ppl[0] - 1) <= 0.03, ppl


@pytest.mark.slow
@pytest.mark.tiles
def test_w4a8_logits_and_probe_do_not_depend_on_threads_or_amx(smollm2_w4a8):
    """A process's thread count follows how busy the machine is at start (core.threads), so a
    plain run and a speculative run started a minute apart can get 1 and 2 threads: their texts
    stay equal only if no logit depends on the thread count (columns are split among threads,
    never the sum over K), nor on AMX-INT8 vs VNNI. The probe passes on every combination too, at
    its short context and at the one it runs at (where attention moves to AMX tiles from 256 keys,
    its tree's rows straddle that: both kernels in one call)."""
    from core.decoding.probe import probe_context, run_probe

    st = native.status()
    assert probe_context() == (st.amx_attention_from - 2 if st.amx_attention else 62)

    step = smollm2_w4a8.step
    ids = torch.tensor(smollm2_w4a8.encode("Name three rivers in Europe and the seas they flow into."))
    before, had = torch.get_num_threads(), native.set_x8_amx(True)
    seen = {}
    try:
        for threads in (1, 2, 3):
            for amx in sorted({False, had}):
                torch.set_num_threads(threads)
                native.set_x8_amx(amx)
                with torch.inference_mode():
                    cache = kv.new_cache(step.hf)
                    _, last = prefill(step, ids, cache)
                    rows = [last.reshape(-1)[-step.hf.config.vocab_size:]]
                    for i, token in enumerate((504, 28, 1034)):  # three plain steps after the prompt
                        rows.append(plain_forward(step, token, cache, len(ids) + i)[1].reshape(-1))
                seen[threads, amx] = torch.stack(rows)
                for context in sorted({62, probe_context()}):
                    result = run_probe(step, context=context)
                    assert result.exact, (threads, amx, context, result.reason)
    finally:
        torch.set_num_threads(before)
        native.set_x8_amx(had)
    first = next(iter(seen.values()))
    for key, logits in seen.items():
        assert torch.equal(logits, first), (key, float((logits.float() - first.float()).abs().max()))


@pytest.mark.slow
def test_greedy_steps_screen_the_lm_head_and_choose_what_the_full_head_chooses(smollm2_w4a8):
    """The embedded engine screens its LM head on greedy steps (core.kernels.screen): along greedy
    answers, a screened forward of one row and of a two-row chain (and a five-row one on AVX2, where the
    screen serves up to 16 rows: core.kernels.step.screen_rows) chooses the full head's token at
    every row, its computed logits are the full head's bits, and it leaves most of the head unread."""
    eng, step = smollm2_w4a8, smollm2_w4a8.step
    assert step.screen is not None and "greedy steps screen the LM head" in eng.numerics.describe()
    computed = []
    with torch.inference_mode():
        for prompt in ("Give me three tips for learning to play the guitar.",
                       "Write a haiku about autumn rain, then explain its imagery."):
            ids = torch.tensor(eng.encode(prompt))
            cache = kv.new_cache(step.hf)
            _, last = prefill(step, ids, cache)
            token, pos = int(last.float().argmax()), len(ids)
            for _ in range(40):
                # a plain step; chains whose drafts repeat the token (5 rows where the screen serves them: AVX2)
                for n in (1, 2, 5) if step.screen_rows >= 5 else (1, 2):
                    args = (torch.tensor([token] * n), torch.arange(pos, pos + n), pos,
                            torch.arange(n).repeat(n, 1), torch.arange(1, n + 1), cache)  # row i: nodes 0..i
                    _, screened = step.forward(*args, only_max=True)
                    for layer in cache.layers:
                        layer._set_length(pos)
                    _, full = step.forward(*args, only_max=False)
                    for layer in cache.layers:
                        layer._set_length(pos)
                    finite = torch.isfinite(screened.float())
                    assert torch.equal(native.argmax(screened), native.argmax(full))
                    assert torch.equal(screened[finite], full[finite])
                    computed.append(finite.float().mean().item())
                _, logits = plain_forward(step, token, cache, pos)
                token, pos = int(native.argmax(logits[None])[0]), pos + 1
    assert np.mean(computed) < 0.5, np.mean(computed)


def test_w4a8_training_features_are_the_served_steps_bit_for_bit(smollm2_w4a8, tmp_path):
    """`features --feature-weights w4a8` (core.train.features.native_features): a two-turn chat's
    features where the last answer is served: the text before it prefilled through transformers,
    each answer token's row bit for bit what a plain decode step on the native step computes (its
    feature, and the greedy next token); a folder of bf16 features is not continued in w4a8."""
    from core.train.data import DataError, assistant_mask
    from core.train.features import FeatureConfig, build_features, native_features

    eng = smollm2_w4a8
    conv = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Danube."},
            {"role": "user", "content": "And a sea?"}, {"role": "assistant", "content": "The Black Sea, where "
                                                                                        "the Danube ends."}]
    ids, mask = assistant_mask(eng.target.tokenizer, conv)
    hidden, top = native_features(eng.step, ids, mask)
    assert hidden.shape == (len(ids), eng.target.model.config.hidden_size) and hidden.dtype == torch.float16
    start = int(torch.nonzero(mask)[-1])  # where the last answer starts
    while mask[start - 1]:
        start -= 1
    with torch.inference_mode():
        cache = kv.new_cache(eng.step)
        before, _ = prefill(eng.step, ids[:start], cache)
        assert torch.equal(before.to(torch.float16), hidden[:start])
        for j in range(start, len(ids)):
            feature, logits = plain_forward(eng.step, int(ids[j]), cache, j)
            assert torch.equal(feature[0].to(torch.float16), hidden[j]), f"row {j}"
            assert int(logits.float().argmax()) == int(top[j]), f"row {j}"
    convs = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]]
    build_features(eng.target, convs, tmp_path, FeatureConfig())
    with pytest.raises(DataError, match="caches features in bf16 numerics, not w4a8"):
        build_features(eng.target, convs + convs, tmp_path, FeatureConfig(weights="w4a8"), eng.step)
    with pytest.raises(DataError, match="EAGLE-1"):
        build_features(eng.target, convs, tmp_path / "e3", FeatureConfig(weights="w4a8", layer_ids=(1, 2)), eng.step)


@pytest.mark.slow
def test_branches_of_one_cache_answer_as_the_served_engine_does(smollm2_w4a8):
    """core.decoding.batched on the served numerics: answers written four at a time as branches of one
    cache (a long prompt and a two-turn chat among them) are the engine's own, token for token, greedy
    and sampled with each answer's seed."""
    from core.config import GenerationConfig, SamplingConfig
    from core.decoding import batched

    eng = smollm2_w4a8
    chats = [[{"role": "user", "content": "Give me three tips for staying focused while studying."}],
             [{"role": "user", "content": "Write a haiku about autumn rain."}],
             [{"role": "user", "content": "What is the capital of France?"},
              {"role": "assistant", "content": "The capital of France is Paris."},
              {"role": "user", "content": "And what river runs through it?"}],
             [{"role": "user", "content": "Summarise this in one sentence: " + "The committee met on Tuesday to "
               "review the budget, the new library hours and the plan for the summer festival. " * 11}],
             [{"role": "user", "content": "def add(a, b):\n    return a - b\n\nFix the bug in this function."}],
             [{"role": "user", "content": "Name a fruit that is yellow."}]]
    requests = [batched.Request(tuple(eng.encode(c)), 48, SamplingConfig(temperature=0.0 if i % 2 else 0.8), 7 + i)
                for i, c in enumerate(chats)]
    assert max(len(r.ids) for r in requests) >= 256
    with torch.inference_mode():
        got = {a.index: a.tokens for a in batched.answers(eng, requests, rows=4)}
    for i, r in enumerate(requests):
        config = GenerationConfig(max_new_tokens=48, sampling=r.sampling, seed=r.seed, reuse_prompt=False)
        assert got[i] == tuple(t for ev in eng.generate(list(r.ids), config) for t in ev.token_ids), i


def test_context_lookup_alone_on_the_served_numerics_writes_plain_decodings_tokens(smollm2_w4a8):
    """What a model without a head serves (speculation by context lookup alone), on the embedded model's served
    numerics: greedy and sampled answers are plain decoding's, token for token, for a long prompt that the answer
    copies from, a two-turn chat and a short question."""
    from core.config import GenerationConfig, SamplingConfig

    eng = smollm2_w4a8
    chats = [[{"role": "user", "content": "Repeat this text exactly: " + "The committee met on Tuesday to review "
               "the budget, the new library hours and the plan for the summer festival. " * 12}],
             [{"role": "user", "content": "What is the capital of France?"},
              {"role": "assistant", "content": "The capital of France is Paris."},
              {"role": "user", "content": "And what river runs through it?"}],
             [{"role": "user", "content": "Name a fruit that is yellow."}]]
    assert len(eng.encode(chats[0])) >= 256
    copied = 0
    for chat in chats:
        for sampling in (SamplingConfig(), SamplingConfig(temperature=0.8)):
            def answer(**kw):
                config = GenerationConfig(max_new_tokens=64, sampling=sampling, seed=3, reuse_prompt=False, **kw)
                events = list(eng.generate(chat, config))
                return [t for ev in events for t in ev.token_ids], events
            plain, _ = answer(speculative=False)
            lookup, events = answer(head=False, tree=eng.default_tree)
            assert lookup == plain, (chat[-1]["content"][:40], sampling)
            copied += sum(len(ev.token_ids) - 1 for ev in events[1:] if ev.tree_size)
    assert copied > 20, "the copying answer is copied"

"""Exact by construction: with the batch-invariant kernels a tree row computes bit for bit
what a plain step computes, so speculative greedy output equals plain decoding in bf16."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.decoding import cache as kv
from core.kernels import native
from core.config import GenerationConfig, TreeConfig
from core.decoding.engine import Engine
from core.decoding.forward import forward_tree, plain_logits, prefill
from core.kernels.invariant import InvariantLinear, make_invariant, undo_invariant
from core.decoding.probe import probe, probe_key, run_probe
from core.decoding.tree import tree_from_parents
from tests.tiny import oracle_head, tiny_target


def wide_llama(dtype=torch.bfloat16) -> torch.nn.Module:
    """SmolLM2's layer shapes (hidden 576, FFN 1536), two layers: fast, and wide enough that
    stock bf16 kernels are not row-invariant (the FFN's inner size exceeds 768)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).to(dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_probe_passes_with_exact_kernels_and_flags_stock_ones(kernel, monkeypatch):
    if kernel == "torch":  # the fallback where core.kernels.native cannot run: oneDNN GEMMs, the block attention
        monkeypatch.setattr(native, "_library", lambda: (None, native.NativeStatus(False, "off for this test")))
    elif not native.status().available:
        pytest.skip(f"core.kernels.native kernel unavailable here: {native.status().reason}")
    model = wide_llama()
    model.set_attn_implementation("sdpa")
    stock = run_probe(model)
    assert not stock.exact and "differs from its plain step" in stock.reason
    swapped = make_invariant(model)
    # the kernel takes every linear (2 layers x 7 + lm_head); oneDNN only the K > 768 down_proj
    assert swapped == (15 if kernel == "native" else 2)
    assert isinstance(model.model.layers[0].mlp.down_proj, InvariantLinear)
    exact = run_probe(model)
    assert exact.exact, exact.reason
    assert "bit-identical" in exact.reason
    undo_invariant(model)
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear


def test_probe_flags_fp32():
    """fp32 GEMMs change a row's reduction order with the batch: the probe must see it."""
    model = wide_llama(torch.float32)
    assert not run_probe(model).exact


def test_probe_verdict_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path))
    model = tiny_target(dtype=torch.bfloat16).model
    make_invariant(model)
    first = probe(model, torch.bfloat16, "exact", "cpu")
    again = probe(model, torch.bfloat16, "exact", "cpu")
    assert first.exact and not first.cached and again.cached and again.reason == first.reason
    assert len(list((tmp_path / "probe").glob("*.json"))) == 1


def test_probe_key_names_the_versions_of_what_computes(tmp_path, monkeypatch):
    """An upgrade (the C kernels' source, this project, transformers) checks again instead of
    showing a verdict about code that no longer runs."""
    import transformers

    import core.decoding.probe

    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path))
    model = tiny_target(dtype=torch.bfloat16).model
    make_invariant(model)
    key = lambda: probe_key(model, torch.bfloat16, "exact", "cpu")
    before = key()
    for owner, name, value in ((native, "source_digest", lambda: "other kernels"),
                               (core.decoding.probe, "project_version", lambda: "99.0"), (transformers, "__version__", "99.0")):
        with monkeypatch.context() as m:
            m.setattr(owner, name, value)
            assert key() != before, name
    assert key() == before
    stale = {"exact": True, "reason": "a verdict about older code", "seconds": 0.0, "checked_at": "then"}
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / f"{before}.json").write_text(json.dumps(stale))
    assert probe(model, torch.bfloat16, "exact", "cpu").reason == stale["reason"]  # the key it was stored under
    monkeypatch.setattr(transformers, "__version__", "99.0")
    again = probe(model, torch.bfloat16, "exact", "cpu")
    assert not again.cached and again.reason != stale["reason"] and again.exact


def test_tiny_bf16_exact_greedy_equals_plain():
    target = tiny_target(dtype=torch.bfloat16, mix=0.5, seed=3)
    make_invariant(target.model)
    engine = Engine(target, oracle_head(target))
    for tree in (TreeConfig(3, 3, 8), TreeConfig(6, 4, 24), TreeConfig(static_paths=((0,), (1,), (0, 0)))):
        out = {}
        for spec in (False, True):
            cfg = GenerationConfig(max_new_tokens=40, speculative=spec, tree=tree)
            out[spec] = [t for ev in engine.generate([5, 6, 7], cfg) for t in ev.token_ids]
        assert out[True] == out[False]


# ---- the real embedded model in its default numerics ----

@pytest.fixture(scope="module")
def smol():
    torch.set_num_threads(2)
    engine = Engine.load()  # auto: w4a8 on the native step (the embedded GGUF) + exact kernels where the probe passes
    if not engine.numerics.exact:
        why = engine.numerics.note or (engine.numerics.probe and engine.numerics.probe.reason)
        if native.status().available:  # the kernels that make it exact run here: a failure is a bug
            pytest.fail(f"the batch-invariance probe fails with the native kernels: {why}")
        pytest.skip(f"no native kernels here ({native.status().reason}), and the probe fails: {why}")
    yield engine
    torch.set_num_threads(1)


def test_default_numerics_on_cpu(smol):
    assert smol.numerics.dtype == "bfloat16" and smol.numerics.attention == "exact"
    assert "exact: verified on this machine" in smol.numerics.describe()


def test_tree_rows_bit_identical_random_cases(smol):
    """Many (context length, tree shape) cases at the row level: logits of every tree node
    equal those of plain steps along its path, bit for bit."""
    model = smol.target.model
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        context = int(torch.randint(3, 140, (1,), generator=gen))
        n = int(torch.randint(2, 20, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tree = tree_from_parents(torch.randint(0, 49152, (n,), generator=gen).tolist(), parents)
        cache = kv.new_cache(model)
        with torch.inference_mode():
            model.model(input_ids=torch.randint(0, 49152, (1, context), generator=gen), cache=cache)
            _, logits = forward_tree(model, tree, cache, context)
            for leaf in set(range(n)) - set(parents):
                kv.keep(cache, context, [])
                for depth, node in enumerate(tree.mask[leaf].nonzero().flatten().tolist()):
                    row = plain_logits(model, int(tree.tokens[node]), cache, context + depth)
                    assert torch.equal(row, logits[node]), (context, parents, node)


TREES = [TreeConfig(1, 4, 4), TreeConfig(2, 8, 8), TreeConfig(4, 8, 16), TreeConfig(6, 8, 32),
         TreeConfig(8, 10, 64), TreeConfig(static_paths=((0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)))]
CHATS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Give me three tips for staying focused while studying.",
    [{"role": "user", "content": "Name a primary colour."}, {"role": "assistant", "content": "Red."},
     {"role": "user", "content": "And another one?"}],
    "Explain how a refrigerator keeps food cold.",
    "Write a haiku about the sea.",
]


def answer(engine, prompt, max_new, **kw):
    cfg = GenerationConfig(max_new_tokens=max_new, **kw)
    return [t for ev in engine.generate(prompt, cfg) for t in ev.token_ids]


@pytest.mark.slow
def test_greedy_speculative_bit_identical_to_plain(smol):
    """Six tree settings (depth 1..8, sizes 4..64, a static tree) over six prompts (a
    two-turn chat among them), 40 tokens each, plus one 256-token answer."""
    for tree, prompt in zip(TREES, CHATS):
        plain = answer(smol, prompt, 40, speculative=False)
        assert answer(smol, prompt, 40, tree=tree) == plain, (tree, prompt)
    long_plain = answer(smol, CHATS[4], 256, speculative=False)
    assert len(long_plain) > 128
    assert answer(smol, CHATS[4], 256, tree=TreeConfig(5, 8, 16)) == long_plain


@pytest.mark.slow
def test_fp32_variant_agrees_within_fp32_noise():
    """fp32 with sdpa (the fallback where the probe fails) is not row-invariant: a tree row may
    differ from its plain step in the last bits, so greedy answers equal plain decoding's only
    while no two logits nearly tie (they did on a few prompts: luck, not construction). What
    holds: every tree row is within fp32 noise of its plain step, and picks the same token
    wherever the best logit leads by more than that noise."""
    torch.set_num_threads(2)
    try:
        engine = Engine.load(dtype="float32", attention="sdpa")
        assert engine.numerics.attention == "sdpa" and not engine.numerics.exact
        assert "exact: not guaranteed" in engine.numerics.describe()
        model, gen = engine.target.model, torch.Generator().manual_seed(3)
        context, parents = 70, [-1, 0, 0, 1, 1, 3, 2, 6, 7, 0]
        tree = tree_from_parents(torch.randint(0, 49152, (len(parents),), generator=gen).tolist(), parents)
        cache = kv.new_cache(model)
        with torch.inference_mode():
            prefill(model, torch.randint(0, 49152, (context,), generator=gen), cache)
            _, logits = forward_tree(model, tree, cache, context)
            for leaf in set(range(len(parents))) - set(parents):
                kv.keep(cache, context, [])
                for depth, node in enumerate(tree.mask[leaf].nonzero().flatten().tolist()):
                    row, in_tree = plain_logits(model, int(tree.tokens[node]), cache, context + depth).float(), logits[node].float()
                    noise = 1e-3 * float(row.abs().max())  # summation order only: about 1e-6 relative per layer
                    assert float((row - in_tree).abs().max()) <= noise, (leaf, node)
                    best, second = row.topk(2).values.tolist()
                    if best - second > 2 * noise:
                        assert int(row.argmax()) == int(in_tree.argmax()), (leaf, node)
    finally:
        torch.set_num_threads(1)

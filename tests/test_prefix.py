"""The last prompt's rows kept for the next one (core.decoding.prefix), and the chunked prefill that makes
them exact: a turn that continues a kept prompt answers exactly what reading it all would."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch

import core.decoding.forward as forward_mod
from core.config import GenerationConfig, SamplingConfig, TreeConfig
from core.decoding import cache as kv, prefix
from core.decoding.engine import Engine
from core.decoding.forward import StopReading, prefill, prefill_chunk
from core.kernels.invariant import make_invariant
from tests.tiny import oracle_head, tiny_target


@pytest.fixture(scope="module")
def target():
    t = tiny_target(dtype=torch.bfloat16, max_pos=4096, mix=0.3)
    make_invariant(t.model)
    return t


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(4, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_prefill_in_two_parts_at_a_chunk_boundary_is_the_same_bits(target):
    """Chunks start at fixed positions, so rows read after kept ones are a fresh read's, bit for bit."""
    ids = torch.tensor(ids_of(2 * prefill_chunk() + 77, 0))
    with torch.inference_mode():
        whole = kv.new_cache(target.model)
        f1, l1 = prefill(target.model, ids, whole)
        parts = kv.new_cache(target.model)
        fa, _ = prefill(target.model, ids[:prefill_chunk()], parts)
        fb, lb = prefill(target.model, ids[prefill_chunk():], parts)
    assert torch.equal(l1, lb) and torch.equal(f1, torch.cat([fa, fb]))
    for a, b in zip(whole.layers, parts.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def answer(engine, prompt, config):
    events = list(engine.generate(prompt, config))
    return [t for ev in events for t in ev.token_ids]


@pytest.mark.parametrize("speculative,temperature", [(False, 0.0), (True, 0.0), (True, 0.8)])
def test_a_next_turn_reads_only_what_follows_the_kept_rows_and_answers_the_same(target, monkeypatch, speculative,
                                                                                temperature):
    engine = Engine(target, oracle_head(target))
    read = []
    real = forward_mod.prefill
    monkeypatch.setattr("core.decoding.engine.prefill", lambda m, ids, *a, **k: read.append(len(ids)) or real(m, ids, *a, **k))
    config = GenerationConfig(max_new_tokens=20, speculative=speculative, sampling=SamplingConfig(temperature=temperature),
                              seed=7)
    turn1 = ids_of(prefill_chunk() + 100, 1)
    first = answer(engine, turn1, config)
    assert read == [len(turn1)] and engine.prefix is not None and len(engine.prefix.ids) == prefill_chunk()
    turn2 = turn1 + first + ids_of(40, 2)
    read.clear()
    kept = answer(engine, turn2, config)
    assert read == [len(turn2) - prefill_chunk()], "the kept chunk is not read again"
    engine.prefix = None  # the same turn read from its start
    read.clear()
    assert answer(engine, turn2, config) == kept and read == [len(turn2)]


def test_a_stop_between_chunks_ends_the_answer_before_its_first_token(target):
    """should_stop is asked before each chunk of the prompt: True ends the answer (nothing yielded, nothing
    kept); False throughout gives the answer reading without it gives."""
    engine = Engine(target, oracle_head(target))
    prompt = ids_of(2 * prefill_chunk() + 5, 9)
    config = GenerationConfig(max_new_tokens=6, speculative=True, tree=TreeConfig(depth=2, top_k=2, total_tokens=4))
    asked = []

    def after_one_chunk() -> bool:
        asked.append(len(asked))
        return len(asked) > 1

    assert list(engine.generate(prompt, config, should_stop=after_one_chunk)) == []
    assert asked == [0, 1] and engine.prefix is None, "stopped before the second chunk; no rows kept"
    with torch.inference_mode(), pytest.raises(StopReading, match=f"after 0 of {len(prompt)} prompt tokens"):
        prefill(target.model, torch.tensor(prompt), kv.new_cache(target.model), should_stop=lambda: True)
    quiet = answer(engine, prompt, replace(config, reuse_prompt=False))
    assert [t for ev in engine.generate(prompt, replace(config, reuse_prompt=False), should_stop=lambda: False)
            for t in ev.token_ids] == quiet and len(quiet) == 6


def test_what_is_kept_and_when_it_serves(target, monkeypatch):
    engine = Engine(target, oracle_head(target))
    config = GenerationConfig(max_new_tokens=4, speculative=False)
    answer(engine, ids_of(prefill_chunk() - 1, 3), config)
    assert engine.prefix is None, "a prompt shorter than a chunk keeps nothing"
    long = ids_of(3 * prefill_chunk() + 5, 4)
    answer(engine, long, config)
    kept = engine.prefix
    assert kept.ids == tuple(long[:3 * prefill_chunk()]) and kept.features.shape[0] == 3 * prefill_chunk()
    assert prefix.reusable(kept, long, None) == 3 * prefill_chunk()
    assert prefix.reusable(kept, long[:3 * prefill_chunk()], None) == 2 * prefill_chunk(), "one token is left to read"
    changed = long[:prefill_chunk() + 9] + [(long[prefill_chunk() + 9] + 1) % 96] + long[prefill_chunk() + 10:]
    assert prefix.reusable(kept, changed, None) == prefill_chunk(), "whole chunks before the first change"
    assert prefix.reusable(kept, long, (0, 1)) == 0, "features of other layers"
    fused = dataclasses.replace(kept, feature_layers=(0, 1))  # as an EAGLE-3 drafter's run keeps them
    assert prefix.reusable(fused, long, [0, 1]) == 3 * prefill_chunk(), "the same layers, as a list"
    monkeypatch.setenv(prefix.ENV, "0")
    assert prefix.reusable(kept, long, None) == 0
    assert prefix.keep(long, kv.new_cache(target.model), kept.features, None, kept) is None
    monkeypatch.delenv(prefix.ENV)
    # the kept rows are bounded in bytes: the whole chunks that fit
    per_row = sum(2 * k.shape[1] * k.shape[-1] * k.element_size() for k in kept.keys)
    limit = prefix.MAX_BYTES
    monkeypatch.setattr(prefix, "MAX_BYTES", per_row * (prefill_chunk() + 10))
    cache = kv.new_cache(target.model)
    with torch.inference_mode():
        features, _ = prefill(target.model, torch.tensor(long), cache)
    small = prefix.keep(long, cache, features, None)
    assert len(small.ids) == prefill_chunk() and small.keys[0].shape[-2] == prefill_chunk()
    monkeypatch.setattr(prefix, "MAX_BYTES", limit)
    # another chat's prompt replaces the kept one; the same prompt again keeps it
    other = ids_of(2 * prefill_chunk(), 5)
    answer(engine, other, config)
    assert engine.prefix.ids == tuple(other)
    again = engine.prefix
    answer(engine, other, config)
    assert engine.prefix is again, "the same prompt again: nothing new to keep"
    answer(engine, ids_of(30, 6), config)
    assert engine.prefix is again, "a short prompt of another chat keeps the longer one"


def test_a_race_or_a_benchmark_reads_the_prompt_from_its_start(target, monkeypatch):
    """reuse_prompt=False (the app's side-by-side race, core.bench, autotune, scripts/ab.py): the second
    reader of a prompt must not start ahead of the first."""
    engine = Engine(target, oracle_head(target))
    read = []
    real = forward_mod.prefill
    monkeypatch.setattr("core.decoding.engine.prefill", lambda m, ids, *a, **k: read.append(len(ids)) or real(m, ids, *a, **k))
    prompt = ids_of(2 * prefill_chunk() + 3, 8)
    for speculative in (False, True):
        answer(engine, prompt, GenerationConfig(max_new_tokens=4, speculative=speculative, reuse_prompt=False))
    assert read == [len(prompt)] * 2 and engine.prefix is not None  # read twice in full; still kept for a chat
    read.clear()
    answer(engine, prompt, GenerationConfig(max_new_tokens=4))
    assert read == [len(prompt) - 2 * prefill_chunk()]
    with pytest.raises(Exception, match="reuse_prompt must be True or False"):
        GenerationConfig(reuse_prompt="yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_attends_to_the_cache_and_causally_to_itself(dtype):
    """invariant.cached_then_causal (a prefill chunk after cached rows: two flash calls merged by their
    log-sum-exp, the query heads of a kv head as one query) against attention with the explicit mask, fp64."""
    from core.kernels.invariant import cached_then_causal

    gen = torch.Generator().manual_seed(3)
    past, n, nh, kvh, hd = 70, 33, 6, 2, 32
    q = torch.randn(1, nh, n, hd, generator=gen)
    k, v = torch.randn(1, kvh, past + n, hd, generator=gen), torch.randn(1, kvh, past + n, hd, generator=gen)
    allowed = torch.ones(n, past + n, dtype=torch.bool)
    allowed[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
    kk, vv = (t.double().repeat_interleave(nh // kvh, dim=1) for t in (k, v))
    scores = (q.double() @ kk.transpose(-1, -2)) * 0.2
    ref = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vv).transpose(1, 2)  # (1, n, nh, hd)
    out = cached_then_causal(q.to(dtype), k.to(dtype), v.to(dtype), past, 0.2)
    assert out.shape == (1, n, nh, hd) and out.dtype is dtype
    assert torch.allclose(out.double(), ref, atol=2e-2 if dtype is torch.bfloat16 else 1e-5)
    assert cached_then_causal(q.double(), k.double(), v.double(), past, 0.2) is None  # fp64: the masked path serves

"""core.decoding.batched: answers written as branches of one cache are the engine's own answers."""

import pytest
import torch

from core.config import GenerationConfig, SamplingConfig
from core.decoding import batched
from core.decoding.engine import Engine
from core.kernels import native
from core.kernels.invariant import make_invariant
from core.kernels.step import NativeStep
from core.models import LoadedModel
from tests.test_exact import wide_llama
from tests.tiny import tiny_target, tiny_tokenizer


def native_engine() -> Engine:
    """SmolLM2's layer shapes (two layers, 512 tokens) on the native bf16 step."""
    if not native.status().available:
        pytest.skip(f"core.kernels.native unavailable here: {native.status().reason}")
    model = wide_llama()
    make_invariant(model)
    target = LoadedModel(model=model, tokenizer=tiny_tokenizer(512), name="wide", device=torch.device("cpu"),
                         dtype=torch.bfloat16, quantized=False, max_context=512)
    return Engine(target, step=NativeStep(model))


def one_at_a_time(engine: Engine, r: batched.Request) -> tuple[tuple[int, ...], str]:
    config = GenerationConfig(max_new_tokens=r.max_new_tokens, speculative=False, sampling=r.sampling, seed=r.seed,
                              reuse_prompt=False)
    events = list(engine.generate(list(r.ids), config))
    return tuple(t for ev in events for t in ev.token_ids), events[-1].finish_reason


def test_branches_answer_token_for_token_as_the_engine_alone_greedy_and_sampled(monkeypatch):
    engine = native_engine()
    gen = torch.Generator().manual_seed(11)
    lengths, budgets = [3, 17, 6, 30, 9, 12, 4], [24, 9, 40, 16, 30, 20, 25]
    requests = [batched.Request(tuple(torch.randint(4, 512, (n,), generator=gen).tolist()), budget,
                                SamplingConfig(temperature=[0.0, 0.7, 1.0][i % 3]), seed=50 + i)
                for i, (n, budget) in enumerate(zip(lengths, budgets))]
    # a token the first answer writes as its 6th becomes the stop token, so some answers stop on it
    engine.target.model.generation_config.eos_token_id = one_at_a_time(engine, requests[0])[0][5]
    expected = [one_at_a_time(engine, r) for r in requests]
    assert {reason for _, reason in expected} == {"eos", "length"}
    compactions, compact = [], batched.compact
    monkeypatch.setattr(batched, "compact", lambda cache, live: (compactions.append(len(live)), compact(cache, live)))
    with torch.inference_mode():
        got = sorted(batched.answers(engine, iter(requests), rows=3, max_slots=120), key=lambda a: a.index)
    assert [a.index for a in got] == list(range(len(requests)))
    assert [(a.tokens, a.finish_reason) for a in got] == expected
    assert compactions  # the cache was compacted under live branches and the answers stayed the same


def test_a_branch_never_sees_another_answers_rows(monkeypatch):
    """Negative control: the same rows fed with every cached slot visible (committed = the cache's
    length, as a single sequence would) give other answers, so the ancestry is what keeps them apart."""
    engine = native_engine()
    requests = [batched.Request((5 + i, 40 + i, 90 + i), 12) for i in range(3)]
    expected = [one_at_a_time(engine, r)[0] for r in requests]

    def leaky(step, cache, live):
        at, n = batched.kv.cache_length(cache), len(live)
        anc, counts = torch.arange(n)[:, None], torch.ones(n, dtype=torch.int64)  # (n, 1): itself only
        tokens = torch.tensor([b.tokens[-1] for b in live])
        positions = torch.tensor([b.position for b in live])
        _, logits = step.forward(tokens, positions, at, anc, counts, cache)
        for i, b in enumerate(live):
            b.slots.append(at + i)
            b.tokens.append(int(logits[i].float().argmax()))

    with torch.inference_mode():
        right = {a.index: a.tokens for a in batched.answers(engine, requests, rows=3)}
        monkeypatch.setattr(batched, "step_branches", leaky)
        wrong = {a.index: a.tokens for a in batched.answers(engine, requests, rows=3)}
    assert [right[i] for i in range(3)] == expected
    assert [wrong[i] for i in range(3)] != expected


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="native decode step"):
        next(batched.answers(Engine(tiny_target()), [batched.Request((5, 6), 4)]))
    engine = native_engine()
    with pytest.raises(ValueError, match=r"request 1: 300 prompt tokens plus its answer do not fit in max_slots=256"):
        list(batched.answers(engine, [batched.Request((5, 6), 4), batched.Request(tuple([7] * 300), 8)], max_slots=256))
    with pytest.raises(ValueError, match=r"request 0: its 512 prompt tokens leave no room in the model's context of 512"):
        list(batched.answers(engine, [batched.Request(tuple([7] * 512), 8)], max_slots=4096))
    with pytest.raises(ValueError, match="rows must be >= 1"):
        next(batched.answers(engine, [batched.Request((5, 6), 4)], rows=0))
    with pytest.raises(ValueError, match="at least one prompt token"):
        batched.Request((), 4)


def test_the_engine_distiller_writes_as_branches_what_it_writes_one_prompt_at_a_time(tmp_path):
    from core.train.data import Prompt
    from core.train.distill import DistillConfig, distill_engine, read_records

    engine = native_engine()
    prompts = [Prompt(f"p{i}", "chat", (f"w{5 + i} w{9 + 2 * i} w{30 + i}",)) for i in range(7)]
    cfg = DistillConfig(batch_size=3, max_new_tokens=15, sampled_fraction=0.5, temperature=1.0)
    assert distill_engine(engine, prompts, tmp_path / "branches.jsonl", cfg) > 0
    distill_engine(Engine(engine.target), prompts, tmp_path / "alone.jsonl", cfg)  # transformers, the same bits
    branches, alone = ({r["id"]: r for r in read_records(tmp_path / f)} for f in ("branches.jsonl", "alone.jsonl"))
    assert set(branches) == {p.id for p in prompts}
    keys = ("messages", "new_tokens", "truncated", "temperature")
    assert all([b.get(k) for k in keys] == [alone[i].get(k) for k in keys] for i, b in branches.items())
    assert {b.get("temperature") for b in branches.values()} == {None, 1.0}
    assert distill_engine(engine, prompts, tmp_path / "branches.jsonl", cfg) == 0  # resumed: nothing left

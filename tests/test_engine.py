"""The decode loop on tiny Llama targets: exactness, cache state, stops, bad input."""

import collections
import itertools

import pytest
import torch
from transformers import DynamicCache

import core.decoding.engine as engine_mod
from core.config import ConfigError, GenerationConfig, SamplingConfig, TreeConfig
from core.decoding.engine import Engine, EngineError, _Run
from core.decoding.forward import forward_tree
from core.kernels.invariant import make_invariant
from core.decoding.tree import tree_from_parents
from tests.test_tree_verify import _one_noise_for_every_depth, chi2_pvalue
from tests.tiny import oracle_head, random_head, tiny_target

PROMPTS = [[5, 9, 17, 33, 40], [7], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71], [12, 4, 88, 23]]


def run(engine, prompt, config):
    tokens, events = [], []
    for ev in engine.generate(prompt, config):
        tokens += ev.token_ids
        events.append(ev)
    return tokens, events


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def engine(target):
    return Engine(target, random_head(target))


def plain_ids(engine, prompt, n=24):
    return run(engine, prompt, GenerationConfig(max_new_tokens=n, speculative=False))[0]


def test_plain_equals_transformers_generate(engine, target):
    for prompt in PROMPTS:
        ref = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                    eos_token_id=0)[0, len(prompt):].tolist()
        assert plain_ids(engine, prompt) == ref


TREES = [TreeConfig(1, 1, 2), TreeConfig(2, 2, 4), TreeConfig(3, 4, 10), TreeConfig(4, 10, 30),
         TreeConfig(5, 3, 16), TreeConfig(6, 8, 48), TreeConfig(8, 10, 64), TreeConfig(8, 1, 9),
         TreeConfig(7, 5, 2), TreeConfig(static_paths=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))]


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"d{t.depth}k{t.top_k}n{t.total_tokens}s{t.is_static}")
def test_greedy_speculative_equals_plain_random_head(engine, tree):
    for prompt in PROMPTS:
        spec, events = run(engine, prompt, GenerationConfig(max_new_tokens=24, tree=tree))
        assert spec == plain_ids(engine, prompt)
        assert all(ev.tree_size <= tree.total_tokens for ev in events)


def test_greedy_speculative_equals_plain_two_layer_head(engine, target):
    """A head grown to two decoder layers (each with its own head-cache keys) drafts through the
    same tree code; the output stays plain greedy decoding."""
    from core.decoding.head import grow_head

    head = grow_head(random_head(target), 2, seed=4)
    with torch.no_grad():
        for p in head.layers[1].parameters():
            if p.dim() == 2:
                p.copy_(torch.randn_like(p) * 0.3)
    two = Engine(target, head.eval())
    for tree in (TreeConfig(3, 4, 10), TreeConfig(5, 3, 16), TreeConfig(8, 1, 9)):
        for prompt in PROMPTS:
            spec, events = run(two, prompt, GenerationConfig(max_new_tokens=24, tree=tree))
            assert spec == plain_ids(engine, prompt)
            assert two.head.config.num_hidden_layers == 2 and all(ev.tree_size <= tree.total_tokens for ev in events)


@pytest.mark.parametrize("tree", [TreeConfig(6, 4, 24), TreeConfig(8, 1, 9), TreeConfig(5, 8, 48)])
def test_greedy_oracle_head_high_acceptance_and_exact(tree):
    target = tiny_target(mix=0.005, seed=3)
    eng = Engine(target, oracle_head(target))
    total_tokens = total_forwards = 0
    for prompt in PROMPTS:
        spec, events = run(eng, prompt, GenerationConfig(max_new_tokens=40, tree=tree))
        assert spec == plain_ids(eng, prompt, 40)
        total_tokens += len(spec)
        total_forwards += events[-1].target_forwards
    assert total_tokens / total_forwards > 3.0  # the oracle drafts what the target says


def test_bigram_oracle_accepts_whole_chain():
    target = tiny_target(mix=0.0, seed=4)
    eng = Engine(target, oracle_head(target))
    spec, events = run(eng, [5, 6], GenerationConfig(max_new_tokens=41, tree=TreeConfig(8, 1, 9)))
    assert [ev.accepted_length for ev in events] == [1] + [9] * 4 + [4]  # 8 drafts + bonus each step
    assert [ev.draft_tokens for ev in events[1:4]] == [8, 8, 8]
    assert spec == plain_ids(eng, [5, 6], 41)


def test_chat_messages_use_template(engine, target):
    msgs = [{"role": "user", "content": "w5 w9"}, {"role": "assistant", "content": "w7"},
            {"role": "user", "content": "w8"}]
    ids = engine.encode(msgs)
    assert ids == target.tokenizer("user w5 w9 assistant w7 user w8 assistant")["input_ids"]
    spec, _ = run(engine, msgs, GenerationConfig(max_new_tokens=12, tree=TreeConfig(3, 3, 8)))
    assert spec == plain_ids(engine, ids, 12)


def test_kv_cache_after_step_equals_plain_cache(engine, target):
    prompt = PROMPTS[0]
    with torch.inference_mode():
        r = _Run(engine, prompt, GenerationConfig(max_new_tokens=30, tree=TreeConfig(4, 4, 12)))
        emitted = list(r.first_step().token_ids)
        for _ in range(3):
            emitted += r.next_step().token_ids
    # the cache holds the prompt and every emitted token but the last (the next root)
    plain = DynamicCache()
    target.model.model(input_ids=torch.tensor([prompt + emitted[:-1]]), cache=plain, use_cache=True)
    assert r.cache.get_seq_length() == len(prompt) + len(emitted) - 1
    for mine, ref in zip(r.cache.layers, plain.layers):
        assert torch.allclose(mine.keys, ref.keys, atol=1e-10)
        assert torch.allclose(mine.values, ref.values, atol=1e-10)
    assert r.head_cache.length == len(prompt) + len(emitted) - 1


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_tree_masked_forward_equals_sequential(dtype, tol):
    """The transformers seam: 4D mask + position_ids + cache in the pinned version."""
    target = tiny_target(dtype=dtype)
    model, prompt = target.model, [5, 9, 17, 33]
    tree = tree_from_parents([40, 11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 2, 3])
    cache = DynamicCache()
    model.model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    _, logits = forward_tree(model, tree, cache, len(prompt))
    for i in range(tree.size):
        path = tree.mask[i].nonzero().flatten()
        seq = model(torch.tensor([prompt + tree.tokens[path].tolist()])).logits[0, -1]
        assert torch.allclose(logits[i], seq, atol=tol), i


def test_max_new_tokens_exact_even_mid_step():
    target = tiny_target(mix=0.0, seed=4)
    eng = Engine(target, oracle_head(target))
    for n in (1, 2, 7, 13):
        spec, events = run(eng, [5, 6], GenerationConfig(max_new_tokens=n, tree=TreeConfig(8, 1, 9)))
        assert len(spec) == n and events[-1].finish_reason == "length"


def test_stops_at_eos_and_stop_string(engine, target):
    prompt = PROMPTS[0]
    ref = plain_ids(engine, prompt, 24)
    eos_before = target.model.generation_config.eos_token_id
    target.model.generation_config.eos_token_id = ref[6]
    try:
        first = ref.index(ref[6])
        for spec_on in (False, True):
            out, events = run(engine, prompt, GenerationConfig(max_new_tokens=24, speculative=spec_on))
            assert out == ref[:first + 1] and events[-1].finish_reason == "eos"
    finally:
        target.model.generation_config.eos_token_id = eos_before
    text = target.tokenizer.decode(ref)
    stop = target.tokenizer.decode([ref[8]])
    out, events = run(engine, prompt, GenerationConfig(max_new_tokens=24, stop_strings=(stop,)))
    answer = "".join(ev.text for ev in events)
    assert events[-1].finish_reason == "stop"
    assert answer == text[:text.index(stop)]


def test_text_deltas_and_token_texts_align(engine, target):
    _, events = run(engine, PROMPTS[2], GenerationConfig(max_new_tokens=20, tree=TreeConfig(3, 3, 8)))
    assert all("".join(ev.token_texts) == ev.text and len(ev.token_texts) == len(ev.token_ids) for ev in events)
    ids = [t for ev in events for t in ev.token_ids]
    assert "".join(ev.text for ev in events) == target.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("numerics,shape", [("float64", (2, 4, 9, 0)), ("bf16-exact", (2, 4, 9, 0)),
                                           ("float64", (1, 4, 3, 4))])
def test_speculative_sampling_matches_target_distribution(monkeypatch, numerics, shape):
    """End to end, tiny vocabulary: tokens 2 and 3 of the answer (drafted and verified by
    the tree) follow the target's exact distribution; a wrong rule is caught. Also in the
    CPU default numerics (bf16 with the batch-invariant kernels), and with a depth-1 tree beside a
    context-lookup chain. The wrong rule: every node reads the noise of one position."""
    # an oracle-like head proposes the likely tokens first, where a wrong rule matters most
    dtype = torch.float64 if numerics == "float64" else torch.bfloat16
    target = tiny_target(vocab=8, lm_std=0.15, seed=5, mix=0.3, dtype=dtype)
    if numerics == "bf16-exact":
        make_invariant(target.model)
    eng = Engine(target, oracle_head(target))
    prompt = [5, 6, 7]
    sampling = SamplingConfig(temperature=1.0)
    exact = collections.Counter()
    with torch.no_grad():
        p0 = target.model(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
        for a in range(8):
            if a == 0:
                continue  # EOS ends the answer after one token
            p1 = target.model(torch.tensor([prompt + [a]])).logits[0, -1].double().softmax(-1)
            for b in range(8):
                p2 = (target.model(torch.tensor([prompt + [a, b]])).logits[0, -1].double().softmax(-1)
                      if b != 0 else None)
                for c in range(8) if b != 0 else [None]:
                    exact[(b, c)] += float(p0[a] * p1[b] * (p2[c] if c is not None else 1.0))

    def sample_counts(n, seed):
        counts = collections.Counter()
        for i in range(n):
            depth, top_k, total, lookup = shape
            cfg = GenerationConfig(max_new_tokens=3, sampling=sampling, seed=seed + i,
                                   tree=TreeConfig(depth, top_k, total, lookup=lookup))
            out = run(eng, prompt, cfg)[0]
            if out[0] != 0:
                counts[(out[1], out[2] if out[1] != 0 else None)] += 1
        return counts

    keys = sorted(exact, key=str)
    n = 2000 if numerics == "float64" else 1200
    good = sample_counts(n, 0)
    assert chi2_pvalue([good[k] for k in keys], [exact[k] for k in keys]) > 1e-3
    if numerics != "float64" or shape[0] == 1:
        return  # that a wrong rule is caught is shown once, in float64
    monkeypatch.setattr(engine_mod, "verify_sampled", _one_noise_for_every_depth)
    bad = sample_counts(n, 0)
    assert chi2_pvalue([bad[k] for k in keys], [exact[k] for k in keys]) < 1e-4


def test_sampling_is_reproducible_with_seed(engine):
    cfg = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(temperature=0.8, top_p=0.9), seed=7)
    assert run(engine, PROMPTS[0], cfg)[0] == run(engine, PROMPTS[0], cfg)[0]


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.7), SamplingConfig(temperature=1.0, top_p=0.9),
                                      SamplingConfig(temperature=1.3, top_k=20)])
def test_sampled_speculation_writes_plain_samplings_tokens_with_the_same_seed(engine, sampling):
    """A sampled token is a function of the seed and its position (core.decoding.gumbel): every
    tree, static or dynamic, with or without context lookup, writes exactly what plain sampling
    writes with the same seed, and accepts drafted tokens doing so."""
    trees = [TreeConfig(depth=1, top_k=4, total_tokens=2), TreeConfig(depth=3, top_k=4, total_tokens=8, lookup=6),
             TreeConfig(depth=5, top_k=2, total_tokens=12), TreeConfig(static_paths=((0,), (1,), (0, 0), (0, 0, 0)))]
    accepted = 0
    for i, prompt in enumerate(PROMPTS[:3]):
        plain, _ = run(engine, prompt, GenerationConfig(max_new_tokens=40, speculative=False, sampling=sampling, seed=i))
        for tree in trees:
            cfg = GenerationConfig(max_new_tokens=40, tree=tree, sampling=sampling, seed=i)
            out, events = run(engine, prompt, cfg)
            assert out == plain, (prompt, tree)
            accepted += sum(ev.draft_tokens for ev in events)
    assert accepted > 0


def test_hot_sampling_decodes_plain_where_the_tree_says_so(engine):
    """plain_from_temperature: at or above it a speculative answer runs plain steps, drawing exactly
    what plain sampling draws with the same seed; below it (and greedy) it speculates."""
    tree = TreeConfig(depth=3, top_k=2, total_tokens=6, plain_from_temperature=0.9)
    hot = SamplingConfig(temperature=1.0)
    spec, events = run(engine, PROMPTS[0], GenerationConfig(max_new_tokens=20, tree=tree, sampling=hot, seed=3))
    plain, _ = run(engine, PROMPTS[0], GenerationConfig(max_new_tokens=20, speculative=False, sampling=hot, seed=3))
    assert spec == plain and all(ev.tree_size == 0 for ev in events) and events[-1].target_forwards == len(spec)
    for cool in (SamplingConfig(temperature=0.5), SamplingConfig()):
        _, events = run(engine, PROMPTS[0], GenerationConfig(max_new_tokens=20, tree=tree, sampling=cool, seed=3))
        assert any(ev.tree_size > 0 for ev in events), f"speculates at temperature {cool.temperature}"


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(depth=0), "depth"), (dict(top_k=0), "top_k"), (dict(total_tokens=1), "total_tokens"),
])
def test_tree_settings_refused(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        TreeConfig(**kwargs)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_sampling_settings_refused(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        SamplingConfig(**kwargs)


def test_bad_prompts_refused(engine, target):
    cfg = GenerationConfig(max_new_tokens=4)
    for empty in ("", "   ", [], [{"role": "user", "content": " "}]):
        with pytest.raises(EngineError, match="empty"):
            list(engine.generate(empty, cfg))
    with pytest.raises(EngineError, match="context is 512"):
        list(engine.generate([5] * 600, cfg))
    with pytest.raises(EngineError, match="draft head"):
        list(Engine(target).generate([5], cfg))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)


def test_generation_stops_at_context_end():
    target = tiny_target(max_pos=40)
    eng = Engine(target, random_head(target))
    out, events = run(eng, list(range(4, 34)), GenerationConfig(max_new_tokens=50, tree=TreeConfig(6, 4, 16)))
    assert len(out) == 10 and events[-1].finish_reason == "context"
    assert out == run(eng, list(range(4, 34)), GenerationConfig(max_new_tokens=50, speculative=False))[0]


def test_step_timings_and_counters(engine):
    _, events = run(engine, PROMPTS[0], GenerationConfig(max_new_tokens=20, tree=TreeConfig(3, 3, 8)))
    assert events[-1].total_tokens == sum(ev.accepted_length for ev in events)
    assert events[-1].target_forwards == len(events)
    assert all(ev.draft_s >= 0 and ev.verify_s > 0 and ev.other_s >= 0 for ev in events)
    assert all(ev.draft_s > 0 for ev in events[1:])


def test_every_tree_setting_grid_small(engine):
    """Sweep depth 1..8 x top_k 1..10 x total_tokens 2..64 (a sparse grid) on one prompt."""
    ref = plain_ids(engine, PROMPTS[3], 16)
    for depth, top_k, total in itertools.product((1, 3, 8), (1, 4, 10), (2, 17, 64)):
        spec, _ = run(engine, PROMPTS[3], GenerationConfig(max_new_tokens=16, tree=TreeConfig(depth, top_k, total)))
        assert spec == ref, (depth, top_k, total)


def test_reduced_draft_vocabulary_stays_lossless(target):
    """Drafting over a subset of the vocabulary is only a proposal: output is unchanged,
    and every drafted token comes from the subset."""
    vocab = torch.arange(4, 60)  # excludes every token id >= 60 and the specials
    head = random_head(target)
    eng = Engine(target, head, draft_vocab=vocab)
    drafted = []
    record = lambda tree, result: drafted.extend(tree.tokens[1:].tolist())
    for prompt in PROMPTS:
        cfg = GenerationConfig(max_new_tokens=24, tree=TreeConfig(4, 4, 12))
        spec = [t for ev in eng.generate(prompt, cfg, on_step=record) for t in ev.token_ids]
        assert spec == plain_ids(eng, prompt)
    assert drafted and set(drafted) <= set(vocab.tolist())


def test_long_context_caps_shrink_the_tree_and_output_stays_plain():
    """TreeConfig.long_context: past a context length the engine drafts the capped tree."""
    target = tiny_target()
    eng = Engine(target, random_head(target))
    prompt = PROMPTS[2]  # 12 tokens
    sizes = {}
    for caps in ((), ((16, 1, 2),)):
        tree = TreeConfig(depth=3, top_k=3, total_tokens=8, long_context=caps)
        tokens, events = run(eng, prompt, GenerationConfig(max_new_tokens=24, tree=tree))
        assert tokens == plain_ids(eng, prompt, 24)
        sizes[caps] = [ev.tree_size for ev in events[1:] if ev.tree_size]
    assert max(sizes[()]) == 8
    assert sizes[((16, 1, 2),)][0] == 8 and max(sizes[((16, 1, 2),)][-3:]) == 2  # capped once 16 are in context


def test_a_plain_cap_turns_speculation_off_and_output_stays_plain():
    target = tiny_target()
    eng = Engine(target, random_head(target))
    prompt = PROMPTS[2]  # 12 tokens
    for caps, speculative_steps in ((((20, 0, 0),), lambda n: 0 < n), (((5, 0, 0),), lambda n: n == 0)):
        tree = TreeConfig(depth=3, top_k=3, total_tokens=8, long_context=caps)
        tokens, events = run(eng, prompt, GenerationConfig(max_new_tokens=24, tree=tree))
        assert tokens == plain_ids(eng, prompt, 24)
        spec = [ev for ev in events[1:] if ev.tree_size]
        assert speculative_steps(len(spec))
        assert all(ev.tree_size == 0 for ev in events[1 + len(spec):])  # plain to the end once it switches


def test_ctrl_c_keeps_the_answer_so_far_and_exits_130(monkeypatch, capsys):
    """core.generate: KeyboardInterrupt during the answer keeps the text written so far on stdout, ends with
    the summary (finish=interrupted) and exit status 130; during the prompt's reading, it says nothing was
    generated."""
    from core.generate import INTERRUPTED, main

    target = tiny_target(mix=0.005, seed=3)
    target.model.lm_head.weight[0].zero_()  # no eos: the answer would run to its cap
    engine = Engine(target, oracle_head(target))
    real = engine.generate

    def interrupted_after(n):
        def generate(prompt, config, *args, **kwargs):
            for i, ev in enumerate(real(prompt, config, *args, **kwargs)):
                if i == n:
                    raise KeyboardInterrupt
                yield ev
        return generate

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **kw: engine))
    monkeypatch.setattr(engine, "generate", interrupted_after(3))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # main sets the process's threads: not here
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # nor its OpenMP variables (core.threads.start sets none then)
    assert main(["w5 w6", "--max-new-tokens", "200", "--threads", "1"]) == INTERRUPTED
    out, err = capsys.readouterr()
    with torch.inference_mode():
        first = [ev for _, ev in zip(range(3), real("w5 w6", GenerationConfig(
            max_new_tokens=200, tree=engine.default_tree)))]
    assert out == "".join(ev.text for ev in first) + "\n", "the text written before Ctrl-C stays, and only it"
    assert f"[stopped] interrupted (Ctrl-C) after {first[-1].total_tokens} tokens" in err
    assert "finish=interrupted" in err and "[numerics]" in err

    monkeypatch.setattr(engine, "generate", interrupted_after(0))
    assert main(["w5 w6", "--threads", "1"]) == INTERRUPTED
    out, err = capsys.readouterr()
    assert out.strip() == "" and "before the first token: nothing generated" in err and "Traceback" not in err


def test_an_answer_continued_from_its_text_reads_the_template_without_its_end_of_turn():
    engine = Engine(tiny_target(mix=0.0, max_pos=96))
    asked = [{"role": "user", "content": "w5"}]
    with pytest.raises(EngineError, match="only an assistant message can be continued: the messages end with a 'user'"):
        engine.encode(asked, continue_final=True)
    partial = asked + [{"role": "assistant", "content": "w9 w11"}]
    ids = engine.encode(partial, continue_final=True)
    assert ids == engine.encode(asked) + engine.encode([9, 11]), "the new turn's opening, then the answer's words"
    cfg = GenerationConfig(max_new_tokens=3, speculative=False)
    events = list(engine.generate(partial, cfg, continue_final=True))
    same = list(engine.generate(ids, cfg))
    assert [e.token_ids for e in events] == [e.token_ids for e in same]
    text, alone = "".join(e.text for e in events), "".join(e.text for e in same)
    assert text == " " + alone, "written on after the answer's last word: its space kept"

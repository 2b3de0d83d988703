"""Context lookup: the copied chain, its graft onto the head's tree, and exactness end to end."""

import collections
import sys

import pytest
import torch

from core.config import ConfigError, GenerationConfig, SamplingConfig, TreeConfig
from core.decoding.engine import Engine, EngineError
from core.kernels.invariant import make_invariant
from core.decoding.lookup import (CHAIN_TREE_TOKENS, DEFAULT_TOKENS, DEFAULT_TOKENS_AVX2, DEFAULT_TOKENS_INT8,
                                  MAX_NGRAM, ContextIndex, chain_length, chain_tree, default_tokens, graft,
                                  longest_repeat, lookup_chain)
from core.decoding.tree import DraftTree, tree_from_parents
from tests.test_tree_verify import chi2_pvalue
from tests.tiny import oracle_head, random_head, tiny_target


def test_chain_literals():
    # a match of 5 or more tokens: the full chain, from the latest occurrence
    assert lookup_chain([1, 2, 3, 4, 5, 8, 1, 2, 3, 4, 5, 9, 7, 1, 2, 3, 4, 5], 3) == [9, 7, 1]
    # a 4-token match gets 60% of the chain, a 3-token match 40%, a 2-token match 30% (at least 2
    # tokens, at most the setting), a 1-token match none
    assert lookup_chain([1, 2, 3, 4, 8, 1, 2, 3, 4, 9, 7, 1, 2, 3, 4], 3) == [9, 7]
    assert lookup_chain([1, 2, 3, 9, 9, 6, 1, 2, 3], 6) == [9, 9]
    assert lookup_chain([5, 1, 2, 7, 6, 3, 4, 1, 2], 8) == [7, 6]
    assert lookup_chain([5, 1, 2, 7, 1, 2], 3) == [7, 1] and lookup_chain([5, 1, 2, 7, 1, 2], 1) == [7]
    assert lookup_chain([5, 1, 7, 3, 1], 8) == []
    # the longest match wins over a later, shorter one; among equals the latest
    assert lookup_chain([1, 2, 3, 4, 5, 6, 9, 3, 4, 7, 7, 1, 2, 3, 4], 2) == [5, 6]
    assert lookup_chain([2, 3, 4, 5, 1, 2, 3, 4, 6, 8, 2, 3, 4], 6) == [6, 8]
    # where the copy runs into the present, it goes round the loop
    assert lookup_chain([4, 4, 4, 4, 4, 4], 5) == [4, 4, 4, 4, 4]
    assert lookup_chain([1, 2, 3, 4, 5, 1, 2, 3, 4, 5], 7) == [1, 2, 3, 4, 5, 1, 2]
    assert lookup_chain([1, 2, 3, 4], 5) == [] and lookup_chain([1, 2, 3, 4, 1, 2, 3, 4], 0) == []


def test_the_context_index_finds_what_a_scan_of_the_context_finds():
    """The engine's ContextIndex (positions per token, kept as tokens arrive) against the scan of the
    whole context, token by token over random texts: small vocabularies (many repeats, loops, ties
    between equal matches) and larger ones, every chain setting."""
    gen = torch.Generator().manual_seed(7)
    checked = 0
    for vocab, length in ((2, 60), (3, 120), (5, 200), (40, 300), (400, 300)):
        for _ in range(3):
            text = torch.randint(vocab, (length,), generator=gen).tolist()
            index = ContextIndex(text[:1])
            for t in text[1:]:
                index.append(t)
                assert index.longest_repeat() == longest_repeat(index.tokens)
                for max_tokens in (0, 1, 3, 10, 24):
                    assert index.chain(max_tokens) == lookup_chain(index.tokens, max_tokens)
                checked += 1
    assert checked > 900 and len(ContextIndex()) == 0 and ContextIndex([5]).chain(8) == []


def test_a_chain_follows_the_child_the_tree_already_holds():
    """Siblings stay distinct: the chain's first token is the tree's node 1, so it goes on from there."""
    tree = DraftTree(tokens=torch.tensor([9, 4, 7]), parents=torch.tensor([-1, 0, 0]), depths=torch.tensor([0, 1, 1]))
    g = graft(tree, [4, 5])
    assert g.tokens.tolist() == [9, 4, 7, 5] and g.parents.tolist() == [-1, 0, 0, 1] and g.depths.tolist() == [0, 1, 1, 2]
    assert graft(tree, [7]) is tree  # nothing to add


def test_chain_length_follows_the_match():
    assert [chain_length(n, 24) for n in (0, 1, 2, 3, 4, 5, 8)] == [0, 0, 7, 10, 14, 24, 24]
    assert [chain_length(n, 10) for n in (2, 3, 4, 5)] == [3, 4, 6, 10]
    assert [chain_length(n, 2) for n in (2, 3, 4, 5)] == [2, 2, 2, 2]  # at least 2, at most the setting
    assert [chain_length(n, 1) for n in (2, 5)] == [1, 1] and chain_length(5, 0) == 0
    assert default_tokens(True) == DEFAULT_TOKENS_INT8 < default_tokens(False) == DEFAULT_TOKENS
    # where a row costs most (the 8-bit step without VNNI) the chain is shorter; elsewhere the GEMM does not matter
    assert default_tokens(True, "avx2") == DEFAULT_TOKENS_AVX2 < default_tokens(True, "avx512") == DEFAULT_TOKENS_INT8
    assert default_tokens(True, "amx") == DEFAULT_TOKENS_INT8 and default_tokens(False, "avx2") == DEFAULT_TOKENS


def test_chain_tree_and_its_caps():
    t = chain_tree(TreeConfig(depth=4, top_k=6, total_tokens=10, lookup=24, long_context=[[2048, 3, 4]]))
    assert t.lookup_total_tokens == CHAIN_TREE_TOKENS and t.with_chain().total_tokens == CHAIN_TREE_TOKENS
    assert chain_tree(TreeConfig(depth=2, top_k=2, total_tokens=4, lookup=8)).lookup_total_tokens == 4
    assert chain_tree(TreeConfig(depth=2, top_k=2, total_tokens=4)).lookup_total_tokens == 0
    # never larger than the tree itself, and a long-context cap caps it too
    assert TreeConfig(total_tokens=4, lookup=8, lookup_total_tokens=6).with_chain().total_tokens == 4
    assert t.at(4096).total_tokens == 4 and t.at(4096).lookup_total_tokens == 4
    assert TreeConfig(total_tokens=12, lookup_total_tokens=10, long_context=[[100, 6, 11]]).at(200).total_tokens == 11
    with pytest.raises(ConfigError, match="tree lookup_total_tokens must be 0"):
        TreeConfig(lookup_total_tokens=1)


def test_graft_shares_the_trees_nodes_and_appends_the_rest():
    # root 10; children 11 (node 1), 12 (node 2); 11 -> 13 (node 3)
    tree = tree_from_parents([10, 11, 12, 13], [-1, 0, 0, 1])
    tree = type(tree)(tokens=tree.tokens, parents=tree.parents, depths=tree.depths,
                      scores=torch.tensor([0.0, -0.1, -0.5, -0.3]))
    g = graft(tree, [11, 13, 14, 15])
    assert g.tokens.tolist() == [10, 11, 12, 13, 14, 15]
    assert g.parents.tolist() == [-1, 0, 0, 1, 3, 4]
    assert g.depths.tolist() == [0, 1, 1, 2, 3, 4]
    assert g.scores[:4].tolist() == pytest.approx([0.0, -0.1, -0.5, -0.3])
    assert bool((g.scores[4:] == -float("inf")).all())
    # a chain leaving the tree at the root becomes a new sibling, distinct from the others
    h = graft(tree, [16, 11])
    assert h.tokens.tolist() == [10, 11, 12, 13, 16, 11] and h.parents.tolist() == [-1, 0, 0, 1, 0, 4]
    # a chain the tree already holds changes nothing
    assert graft(tree, [11, 13]) is tree and graft(tree, []) is tree


def run(engine, prompt, config):
    events = list(engine.generate(prompt, config))
    return [t for ev in events for t in ev.token_ids], events


@pytest.mark.parametrize("head", ["random", "oracle"])
def test_greedy_with_lookup_equals_plain_and_copies_loops(head):
    """A pure-bigram target falls into a loop; lookup then accepts more tokens per step than
    the head's one-token tree can, and the output stays plain decoding's."""
    target = tiny_target(mix=0.0, seed=4, vocab=24)
    eng = Engine(target, oracle_head(target) if head == "oracle" else random_head(target))
    for prompt in ([5, 6], [3, 9, 11, 3]):
        plain, _ = run(eng, prompt, GenerationConfig(max_new_tokens=60, speculative=False))
        assert plain and 0 not in plain[:-1]
        spec, events = run(eng, prompt, GenerationConfig(max_new_tokens=60, tree=TreeConfig(1, 1, 2, lookup=8)))
        assert spec == plain
        assert max(ev.accepted_length for ev in events) > 2  # only the copied chain reaches past depth 1
        assert all(ev.tree_size <= 2 + 8 for ev in events)


def test_steps_with_a_chain_draft_the_smaller_tree_and_stay_exact():
    target = tiny_target(mix=0.0, seed=4, vocab=24)
    eng = Engine(target, random_head(target))
    plain, _ = run(eng, [5, 6], GenerationConfig(max_new_tokens=60, speculative=False))
    head_nodes = []  # per step: (nodes the head drafted, whether a chain was grafted)

    def on_step(tree, result):
        s = tree.scores[1:]
        head_nodes.append((int(torch.isfinite(s).sum()), bool(torch.isinf(s).any())))

    tree = TreeConfig(depth=2, top_k=3, total_tokens=7, lookup=8, lookup_total_tokens=3)
    spec = [t for ev in eng.generate([5, 6], GenerationConfig(max_new_tokens=60, tree=tree), on_step=on_step)
            for t in ev.token_ids]
    assert spec == plain
    with_chain = [n for n, grafted in head_nodes if grafted]
    assert with_chain and max(with_chain) <= 2  # root + 2 head nodes
    assert max(n for n, grafted in head_nodes if not grafted) == 6


def test_bf16_exact_kernels_with_lookup_equal_plain():
    target = tiny_target(dtype=torch.bfloat16, mix=0.05, seed=3, vocab=32)
    make_invariant(target.model)
    eng = Engine(target, oracle_head(target))
    for prompt in ([5, 6, 7], [9, 1, 9, 1, 9]):
        plain, _ = run(eng, prompt, GenerationConfig(max_new_tokens=48, speculative=False))
        spec, _ = run(eng, prompt, GenerationConfig(max_new_tokens=48, tree=TreeConfig(3, 3, 8, lookup=12)))
        assert spec == plain


def test_lookup_never_writes_past_the_budget_or_context():
    target = tiny_target(mix=0.0, seed=4, vocab=24, max_pos=40)
    eng = Engine(target, oracle_head(target))
    plain, _ = run(eng, [5, 6], GenerationConfig(max_new_tokens=30, speculative=False))
    for n in (1, 2, 7, 30):
        spec, events = run(eng, [5, 6], GenerationConfig(max_new_tokens=n, tree=TreeConfig(1, 1, 2, lookup=16)))
        assert spec == plain[:n] and events[-1].finish_reason in ("length", "eos")
    long, _ = run(eng, [5, 6], GenerationConfig(max_new_tokens=200, tree=TreeConfig(1, 1, 2, lookup=16)))
    assert long == run(eng, [5, 6], GenerationConfig(max_new_tokens=200, speculative=False))[0]


@pytest.mark.parametrize("with_head", [False, True])
def test_context_lookup_alone_speculates_without_a_head_and_writes_plain_decodings_tokens(with_head, monkeypatch):
    """An engine without a head speculates by context lookup alone (GenerationConfig.head False does the same
    beside a head, which then never runs): a step where the context repeats verifies the root and the chain, one
    where it does not is a plain step; greedy and sampled answers are plain decoding's token for token."""
    target = tiny_target(mix=0.0, seed=4, vocab=24)
    head = random_head(target) if with_head else None
    eng = Engine(target, head)
    if with_head:
        import core.decoding.engine as engine_mod

        def head_used(*args, **kwargs):
            raise AssertionError("the head ran")

        for name in ("draft", "catch_up", "catch_up_top", "spec_step_greedy"):
            monkeypatch.setattr(engine_mod, name, head_used)
    else:
        assert eng.default_tree.lookup == DEFAULT_TOKENS and "no EAGLE head" in eng.tree_origin
    tree = TreeConfig(1, 1, 2, lookup=8)
    for prompt in ([5, 6], [3, 9, 11, 3], [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]):
        for sampling, seed in ((SamplingConfig(), None), (SamplingConfig(temperature=0.9, top_p=0.95), 5)):
            plain, _ = run(eng, prompt, GenerationConfig(max_new_tokens=60, speculative=False, sampling=sampling,
                                                         seed=seed))
            copied, events = run(eng, prompt, GenerationConfig(max_new_tokens=60, tree=tree, sampling=sampling,
                                                               seed=seed, head=False))
            assert copied == plain, (prompt, sampling)
            steps = events[1:]  # after the prompt's token
            assert all(ev.tree_size == 0 and len(ev.token_ids) == 1 or 2 <= ev.tree_size <= 1 + 8 for ev in steps)
            assert any(ev.tree_size == 0 for ev in steps) or prompt[0] == 7, "a plain step where nothing repeats"
        assert max(ev.accepted_length for ev in events) > 2, "the loop is copied"
        assert events[-1].target_forwards < len(copied)


def test_speculation_without_a_head_needs_a_lookup_chain():
    target = tiny_target(mix=0.0, seed=4, vocab=24)
    with pytest.raises(EngineError, match="without a draft head speculation copies from the context.*lookup"):
        list(Engine(target).generate([5, 6], GenerationConfig(max_new_tokens=4, tree=TreeConfig(lookup=0))))
    with pytest.raises(ConfigError, match="head must be True or False"):
        GenerationConfig(head="no")


def test_lookup_setting_checked():
    with pytest.raises(ConfigError, match="tree lookup must be an integer in 0..32"):
        TreeConfig(lookup=-1)
    with pytest.raises(ConfigError, match="tree lookup"):
        TreeConfig(lookup=33)


def test_sampling_with_lookup_keeps_the_target_distribution():
    """Tokens 1-3 of a sampled answer whose context repeats (so chains are grafted after the
    first token) follow the target's exact distribution."""
    target = tiny_target(vocab=6, lm_std=0.15, seed=5, mix=0.3)
    eng = Engine(target, oracle_head(target))
    prompt = [5, 3, 4, 5, 3, 4, 5, 3]
    exact = collections.Counter()
    with torch.no_grad():
        def dist(ids):
            return target.model(torch.tensor([ids])).logits[0, -1].double().softmax(-1)
        p0 = dist(prompt)
        for a in range(1, 6):
            p1 = dist(prompt + [a])
            for b in range(6):
                p2 = dist(prompt + [a, b]) if b != 0 else None
                for c in range(6) if b != 0 else [None]:
                    exact[(a, b, c)] += float(p0[a] * p1[b] * (p2[c] if c is not None else 1.0))
    counts, grafted = collections.Counter(), 0
    for i in range(2500):
        cfg = GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(temperature=1.0), seed=i,
                               tree=TreeConfig(1, 2, 3, lookup=4))
        out, events = run(eng, prompt, cfg)
        grafted += any(ev.tree_size > 3 for ev in events)
        if out[0] != 0:
            counts[(out[0], out[1], out[2] if out[1] != 0 else None)] += 1
    assert grafted > 100  # the chain was verified in many answers
    keys = sorted(exact, key=str)
    assert chi2_pvalue([counts[k] for k in keys], [exact[k] for k in keys]) > 1e-3


def test_replay_walks_answers_under_a_rule():
    """scripts/lookup_replay.py: a step accepts the longest matching path of its tree or chain."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "scripts" / "lookup_replay.py"
    spec = importlib.util.spec_from_file_location("lookup_replay", path)
    replay = importlib.util.module_from_spec(spec)
    sys.modules["lookup_replay"] = replay  # dataclasses look their module up
    spec.loader.exec_module(replay)
    answer = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    # every position's tree: one depth-1 node, right at even positions only
    trees = [{"tokens": [answer[i + 1] if i % 2 == 0 else 99], "parents": [-1], "depths": [1], "scores": [-0.1]}
             for i in range(len(answer) - 1)]
    rec = {"prompt": [7], "answer": answer, "trees": trees}
    # no lookup: steps at 0 (accepts 1), 2, 4, 6, 8 -> 5 steps + the prefill
    assert replay.replay_answer(rec, None, 4, 10, 6, 128)[:2] == (10, 6)
    # the loop is copied once a 2-token end repeats: at position 6 (context 7 1 2 3 4 1 2 3, the
    # end "1 2 3" occurred before) the chain 4 1 2 takes the rest in one step
    rule = replay.Rule("test", replay.table((2, 8)), 8)
    tokens, forwards, ms = replay.replay_answer(rec, rule, 4, 10, 6, 128)
    assert (tokens, forwards) == (10, 5) and ms > 0
    # its "shipped" rules are the engine's chain at a setting, room cap included
    for setting in (DEFAULT_TOKENS, DEFAULT_TOKENS_INT8):
        shipped = replay.Rule("shipped", replay.shipped_at(setting), MAX_NGRAM)
        for ctx in ([1, 2, 3, 9, 9, 6, 1, 2, 3], [5, 1, 2, 7, 6, 3, 4, 1, 2], [4] * 40, list(range(30)) * 2):
            for room in (1, 5, 13, 40):
                assert shipped.chain(ctx, room) == lookup_chain(ctx, min(setting, room))
    # the cost model: the w4a8 default charges every row; bf16-amx rows are nearly free up to its knee
    assert replay.verify_ms(1) == replay.VERIFY_MS and replay.verify_ms(20) == replay.verify_ms(12) + 8 * replay.ROW_MS
    v, row, knee, past = replay.COSTS["bf16-amx"][:4]
    assert knee == 12 and past > 2 * row

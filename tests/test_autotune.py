"""The tree chooser: literal replay of acceptance, and larger trees when verification is cheap."""

import pytest

from core.autotune import Profile, cached_tree, choose, choose_tree, expected_tokens
from core.config import ConfigError, TreeConfig
from core.decoding.engine import Engine
from tests.tiny import random_head, tiny_target

# one step: root, then nodes 1..6 with depths and cumulative scores; the target accepted 0 -> 2 -> 5
STEP = ((0, 1, 1, 2, 2, 3, 3), (0.0, -0.5, -1.0, -1.2, -1.6, -2.0, -3.0), (0, 2, 4, 5))


def test_expected_tokens_replays_smaller_trees():
    steps = (STEP,)
    assert expected_tokens(steps, depth=3, size=7) == 4  # whole path kept: 3 drafts + bonus
    assert expected_tokens(steps, depth=1, size=7) == 2  # depth 1: only node 2 on the path
    assert expected_tokens(steps, depth=3, size=2) == 1  # best node is 1, off the path
    assert expected_tokens(steps, depth=3, size=5) == 3  # keeps 1,2,3,4: path 2,4 then 5 is cut


def test_round_fractions_replay_pruned_drafting():
    """A round runs only where its best frontier node beats the (n - 1)-th best shallower
    candidate; the draft cost counts each round as often as it runs."""
    from core.autotune import draft_cost, round_fractions

    f = round_fractions((STEP,), depths=(1, 2, 3), sizes=(2, 3, 4, 5, 6))
    # round 1 (depth-1 frontier, best -0.5): cut = 1st / 2nd best of depth <= 1 (-0.5 / -1.0)
    assert (f[(1, 2)], f[(1, 3)]) == (0.0, 1.0)
    # round 2 (best depth-2 node -1.2): cuts -1.0, -1.2 (a tie: the earlier node wins), -1.6;
    # 6 nodes need 5 of depth <= 2, only 4 exist: it runs
    assert [f[(2, n)] for n in (3, 4, 5, 6)] == [0.0, 0.0, 1.0, 1.0]
    profile = Profile(verify_s={2: 0.01}, draft_s={1: 0.003, 2: 0.005, 3: 0.008}, other_s=0.0, steps=(STEP,), top_k=2)
    assert draft_cost(profile, f, 3, 3) == pytest.approx(0.003 + 0.002)  # round 2 skipped
    assert draft_cost(profile, f, 3, 5) == pytest.approx(0.008)
    assert draft_cost(profile, f, 2, 2) == pytest.approx(0.003)  # round 1 skipped


def _profile(verify_slope: float) -> Profile:
    # a deep, always-accepted chain (scores fall slowly) plus weak siblings at every depth
    depths, scores, parents = [0], [0.0], []
    chain = [0]
    for d in range(1, 9):
        depths += [d, d]
        scores += [-0.1 * d, -5.0 - d]
        chain.append(len(depths) - 2)
    # one step accepts the whole chain, three accept nothing: extra nodes pay off less and less
    steps = ((tuple(depths), tuple(scores), tuple(chain)),) + ((tuple(depths), tuple(scores), (0,)),) * 3
    verify = {n: 0.05 + verify_slope * n for n in (2, 4, 8, 16, 32, 64)}
    return Profile(verify_s=verify, draft_s={d: 0.002 * d for d in range(1, 9)}, other_s=0.001,
                   steps=steps, top_k=2)


def test_chooser_picks_larger_tree_when_verification_is_cheaper():
    cheap, _ = choose(_profile(verify_slope=0.0001))
    costly, _ = choose(_profile(verify_slope=0.05))
    assert cheap.total_tokens > costly.total_tokens
    assert cheap == TreeConfig(depth=8, top_k=2, total_tokens=10)  # smallest size holding the chain
    assert costly.total_tokens == 2


def test_near_ties_go_to_the_tree_that_accepts_more():
    # root -> 1 -> 2, all accepted: depth 1 / 2 nodes gives 2 tokens per step, depth 2 / 3 nodes 3
    step = ((0, 1, 2), (0.0, -0.1, -0.2), (0, 1, 2))
    profile = lambda verify3: Profile(verify_s={2: 0.010, 3: verify3}, draft_s={1: 0.0, 2: 0.0}, other_s=0.0,
                                      steps=(step,), top_k=1)
    # 3 tokens / 15.4 ms = 194.8 tok/s, 2.6% below 2 / 10 ms: a tie, and the deeper tree accepts more
    tree, rate = choose(profile(0.0154), depths=(1, 2), sizes=(2, 3))
    assert tree == TreeConfig(depth=2, top_k=1, total_tokens=3) and rate == pytest.approx(3 / 0.0154)
    # 3 / 17 ms = 176.5 tok/s, 12% below: speed wins
    tree, rate = choose(profile(0.0170), depths=(1, 2), sizes=(2, 3))
    assert tree == TreeConfig(depth=1, top_k=1, total_tokens=2) and rate == pytest.approx(200.0)


def test_choose_tree_measures_once_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path))
    target = tiny_target()
    engine = Engine(target, random_head(target))
    assert cached_tree(engine) is None
    tree = choose_tree(engine, top_k=4)
    assert isinstance(tree, TreeConfig) and tree.top_k == 4
    assert not tree.row_floor  # bf16 rows through transformers: no 8-bit integer work per row
    assert cached_tree(engine) == tree
    assert len(list((tmp_path / "autotune").glob("*.json"))) == 1
    with pytest.raises(ValueError, match="draft head"):
        choose_tree(Engine(target))


def test_end_to_end_check_picks_the_fastest_candidate(tmp_path, monkeypatch):
    """confirm_top: the cost model's choice and the next sizes answer the calibration prompts,
    interleaved; the fastest by measured tokens/s is kept and the rates are reported."""
    import json

    from core import autotune

    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path))
    target = tiny_target()
    engine = Engine(target, random_head(target))
    trees = [TreeConfig(depth=1, top_k=2, total_tokens=2), TreeConfig(depth=2, top_k=2, total_tokens=4)]
    best, rates = autotune.confirm(engine, trees, prompts=("a b c", "d e"), max_new_tokens=6, reps=1)
    assert set(rates) == set(trees) and all(r > 0 for r in rates.values())
    assert best == max(trees, key=rates.get)
    seen, hot_seen = [], []
    monkeypatch.setattr(autotune, "confirm", lambda eng, ts: (seen.append(ts) or ts[-1], {t: 1.0 + i for i, t in enumerate(ts)}))
    monkeypatch.setattr(autotune, "hot_sampling", lambda eng, t: (hot_seen.append(t) or 1.0, {"1": {"eagle": 1.0, "plain": 2.0}}))
    tree = choose_tree(engine, top_k=2, refresh=True, confirm_top=3)
    assert tree.plain_from_temperature == 1.0 and hot_seen[0].lookup == tree.lookup  # measured with the chosen chain
    assert (hot_seen[0].depth, hot_seen[0].total_tokens) == (tree.depth, tree.total_tokens)
    assert len(seen[0]) == 3 and len({t.total_tokens for t in seen[0]}) == 3  # three sizes
    assert (tree.depth, tree.total_tokens) == (seen[0][-1].depth, seen[0][-1].total_tokens)
    report = json.loads(autotune.tuned_path(engine).read_text())
    assert len(report["end_to_end_tokens_per_s"]) == 3
    # then the chain length: the chosen tree with each of LOOKUP_CHOICES, the fastest kept
    assert [t.lookup for t in seen[1]] == list(autotune.LOOKUP_CHOICES)
    assert {(t.depth, t.total_tokens) for t in seen[1]} == {(tree.depth, tree.total_tokens)}
    assert tree.lookup == autotune.LOOKUP_CHOICES[-1]  # the fake confirm rates the last one fastest
    assert list(report["end_to_end_tokens_per_s_by_lookup"]) == [str(n) for n in autotune.LOOKUP_CHOICES]
    assert report["sampled_tokens_per_s_by_temperature"] == {"1": {"eagle": 1.0, "plain": 2.0}}
    seen.clear()
    tree = choose_tree(engine, top_k=2, refresh=True, confirm_top=3, lookup=8)  # a length given: not measured
    assert len(seen) == 1 and tree.lookup == 8


def test_hot_sampling_measures_both_modes_and_finds_where_plain_wins(monkeypatch):
    """hot_sampling: both modes sample every prompt at each temperature, coolest first, with the same
    seeds; the first temperature where plain is faster is returned and the hotter ones are not
    measured (0 when the tree wins everywhere)."""
    from core import autotune

    target = tiny_target()
    engine = Engine(target, random_head(target))
    seen = []
    real = engine.generate

    def spy(prompt, cfg, *a, **k):
        seen.append((cfg.speculative, cfg.sampling.temperature, cfg.seed, cfg.tree.plain_from_temperature))
        return real(prompt, cfg, *a, **k)

    monkeypatch.setattr(engine, "generate", spy)
    tree = TreeConfig(depth=2, top_k=2, total_tokens=4, plain_from_temperature=0.5)
    plain_from, rates = autotune.hot_sampling(engine, tree, temperatures=(1.1, 0.6), prompts=("a b", "c d e"),
                                              max_new_tokens=6, reps=1)
    assert all(r["eagle"] > 0 and r["plain"] > 0 for r in rates.values())
    wins = [t for t in (0.6, 1.1) if f"{t:g}" in rates and rates[f"{t:g}"]["plain"] >= rates[f"{t:g}"]["eagle"]]
    assert plain_from == (wins[0] if wins else 0.0)
    measured = (0.6,) if plain_from == 0.6 else (0.6, 1.1)  # coolest first; none hotter than plain's first win
    assert list(rates) == [f"{t:g}" for t in measured]
    assert len(seen) == 4 * len(measured) and all(p == 0.0 for *_, p in seen), "the tree's own pause is off while measuring"
    for t in measured:  # each prompt in both modes with one seed
        assert sorted((s, seed) for s, temp, seed, _ in seen if temp == t) == [(False, 0), (False, 1), (True, 0), (True, 1)]

    # where plain decoding wins at the coolest temperature, no hotter one is sampled
    monkeypatch.setattr(engine, "generate", lambda prompt, cfg, *a, **k: (seen.append(cfg.sampling.temperature) or [
        type("Event", (), {"total_tokens": 6, "elapsed_s": 1.0 if cfg.speculative else 0.5})()]))  # plain twice as fast
    seen.clear()
    plain_from, rates = autotune.hot_sampling(engine, tree, temperatures=(0.3, 0.1, 0.7), prompts=("a b",),
                                              max_new_tokens=6, reps=1)
    assert plain_from == 0.1 and list(rates) == ["0.1"] and rates["0.1"] == {"eagle": 6.0, "plain": 12.0}
    assert seen == [0.1, 0.1]


def test_shipped_tree_beside_head(tmp_path):
    from core.autotune import shipped_tree
    from core.decoding.head import HeadLoadError

    assert shipped_tree(tmp_path) is None
    (tmp_path / "tree.json").write_text('{"depth": 5, "top_k": 6, "total_tokens": 16}')
    assert shipped_tree(tmp_path) == TreeConfig(5, 6, 16)
    (tmp_path / "tree.json").write_text('{"depth": 0, "top_k": 6, "total_tokens": 16}')
    with pytest.raises(HeadLoadError, match="tree depth must be"):
        shipped_tree(tmp_path)


def test_a_tree_shipped_for_this_machines_gemm_wins_over_tree_json(tmp_path, monkeypatch):
    """tree.<gemm>.json beside the head serves machines with that decoding GEMM (a verified row
    is dear with AVX-512, nearly free on AMX tiles); tree.json serves every other machine."""
    from types import SimpleNamespace

    from core.decoding import treestore
    from core.kernels import native

    (tmp_path / "tree.json").write_text('{"depth": 5, "top_k": 8, "total_tokens": 16}')
    (tmp_path / "tree.avx512.json").write_text('{"depth": 4, "top_k": 6, "total_tokens": 10}')
    assert treestore.shipped_tree(tmp_path, "avx512") == TreeConfig(4, 6, 10)
    assert treestore.shipped_tree(tmp_path, "amx") == TreeConfig(5, 8, 16)  # no tree.amx.json: tree.json
    assert treestore.shipped_tree(tmp_path) == TreeConfig(5, 8, 16)
    assert treestore.shipped_tree_path(tmp_path, "amx").name == "tree.json"

    monkeypatch.setattr(treestore, "tuned_tree", lambda engine: None)  # nothing tuned on this machine
    cpu, gpu = (SimpleNamespace(target=SimpleNamespace(device=d)) for d in ("cpu", "cuda:0"))
    monkeypatch.setattr(native, "gemm_kind", lambda: "avx512")
    choice = treestore.default_tree(cpu, tmp_path)
    assert choice.tree == TreeConfig(4, 6, 10) and "avx512 GEMM (tree.avx512.json)" in choice.origin
    assert treestore.default_tree(gpu, tmp_path).tree == TreeConfig(5, 8, 16)  # the CPU's GEMM is not the GPU's
    monkeypatch.setattr(native, "gemm_kind", lambda: "amx")
    choice = treestore.default_tree(cpu, tmp_path)
    assert choice.tree == TreeConfig(5, 8, 16) and choice.origin == "shipped with the head"
    (tmp_path / "tree.avx512.json").write_text('{"depth": 4, "top_k": 6')
    monkeypatch.setattr(native, "gemm_kind", lambda: "avx512")
    with pytest.raises(treestore.TreeFileError, match="tree.avx512.json is not a valid tree setting"):
        treestore.default_tree(cpu, tmp_path)


def test_long_context_caps_shrink_the_tree_as_each_row_attends_to_more():
    """attend_s: every row of a call pays for every context token; the caps choose smaller trees
    where that makes rows dear, and nothing where it does not."""
    from core.autotune import long_context_caps

    base = _profile(verify_slope=0.0001)
    tree, _ = choose(base)
    assert long_context_caps(base, tree, max_context=8192) == ()  # rows cost nothing extra
    dear = Profile(**{**base.__dict__, "attend_s": 2e-5})  # 20 ms per row per 1,000 context tokens
    assert choose(dear) == choose(base)  # at the measured context nothing changes
    caps = long_context_caps(dear, tree, max_context=8192)
    assert caps and all(c[0] > dear.context for c in caps)
    sizes = [tree.total_tokens] + [c[2] for c in caps]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)  # each entry shrinks it
    assert caps[-1][2] < tree.total_tokens
    last = (tree.depth, tree.total_tokens)
    for k, (c, depth, total) in enumerate(caps):  # each cap is the chooser's pick there, never growing
        if depth == 0:  # plain decoding beats every tree from here: the last entry
            assert k == len(caps) - 1 and total == 0
            continue
        picked, _ = choose(dear, context=c)
        assert (depth, total) == (min(picked.depth, last[0]), min(picked.total_tokens, last[1]))
        last = (depth, total)
    assert long_context_caps(dear, tree, max_context=caps[0][0]) == ()  # past the model's window: none


def test_tree_at_applies_the_last_cap_reached():
    tree = TreeConfig(depth=4, top_k=8, total_tokens=16, lookup=16, long_context=[[1000, 3, 8], [4000, 1, 3]])
    assert tree.long_context == ((1000, 3, 8), (4000, 1, 3))  # JSON lists become tuples
    assert tree.at(999) is tree
    assert tree.at(1000) == TreeConfig(depth=3, top_k=8, total_tokens=8, lookup=16)
    assert tree.at(10**6) == TreeConfig(depth=1, top_k=8, total_tokens=3, lookup=16)
    small = TreeConfig(depth=2, top_k=8, total_tokens=5, long_context=((1000, 3, 8),))
    assert small.at(5000) is small  # a cap never grows a tree
    for bad in ([[0, 3, 8]], [[100, 3, 8], [100, 2, 4]], [[200, 3, 8], [100, 2, 4]], [[100, 0, 8]], [[100, 3]], "x"):
        with pytest.raises(ConfigError, match="long_context"):
            TreeConfig(long_context=bad)


def test_long_context_caps_end_in_plain_decoding_where_no_tree_pays():
    """Acceptance calibrated on long prompts (steps_at): where the head accepts nothing there, no
    tree beats a plain step, and the caps say plain decoding from that context on."""
    from core.autotune import long_context_caps, steps_for

    base = _profile(verify_slope=0.0001)
    tree, _ = choose(base)
    rejected = tuple((d, s, (0,)) for d, s, _ in base.steps)  # nothing accepted in long prompts
    long = Profile(**{**base.__dict__, "attend_s": 1e-6, "steps_at": {2048: rejected}})
    assert steps_for(long, 1000) is base.steps and steps_for(long, 3000) is rejected
    caps = long_context_caps(long, tree, max_context=8192)
    assert caps[-1] == (2048, 0, 0) and all(c[0] < 2048 for c in caps[:-1])
    assert long_context_caps(Profile(**{**base.__dict__, "steps_at": {2048: base.steps}}), tree, 8192) == ()


def test_plain_caps_in_a_tree():
    tree = TreeConfig(depth=3, top_k=8, total_tokens=12, long_context=[[1024, 3, 8], [4096, 0, 0]])
    assert tree.speculates_at(4095) and not tree.speculates_at(4096)
    assert tree.at(5000) == TreeConfig(depth=3, top_k=8, total_tokens=8)  # the last tree cap still shapes
    with pytest.raises(ConfigError, match="long_context"):
        TreeConfig(long_context=[[100, 0, 5]])


def test_measured_costs_are_made_non_decreasing_in_rows():
    from core.autotune import monotone

    assert monotone({1: 0.02, 2: 0.025, 4: 0.021, 8: 0.03, 16: 0.028, 32: 0.05}) == \
        {1: 0.02, 2: 0.025, 4: 0.025, 8: 0.03, 16: 0.03, 32: 0.05}
    assert monotone({}) == {}

"""Literal cases for tree masks/positions and acceptance, and the sampling distribution test."""

import collections

import pytest
import torch
from scipy.stats import chisquare

from core.config import SamplingConfig
from core.decoding.draw import draw
from core.decoding.lookup import graft
from core.decoding.tree import DraftTree, ancestor_mask, tree_from_parents
from core.decoding.verify import Verification, sample, target_probs, verify_greedy, verify_sampled

#        0 (root, token 10)
#       / \
#  1 (11)  2 (12)
#   / \      \
# 3(13) 4(14) 5(15)
#  |
# 6(16)
TOKENS = [10, 11, 12, 13, 14, 15, 16]
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def test_mask_positions_parents_literal():
    tree = tree_from_parents(TOKENS, PARENTS)
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.mask, expected)
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.positions(100).tolist() == [100, 101, 101, 102, 102, 102, 103]
    assert tree.parents.tolist() == PARENTS


def test_ancestor_mask_deep_chain():
    parents = torch.tensor([-1] + list(range(0, 39)))
    assert torch.equal(ancestor_mask(parents), torch.ones(40, 40, dtype=torch.bool).tril())


def _logits_with_argmax(argmax: list[int], vocab: int = 20) -> torch.Tensor:
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def test_greedy_acceptance_literal():
    tree = tree_from_parents(TOKENS, PARENTS)
    # target argmax at each node: root -> 11 (node 1), node 1 -> 13 (node 3), node 3 -> 7 (not 16)
    logits = _logits_with_argmax([11, 13, 0, 7, 0, 0, 0])
    result = verify_greedy(tree, logits)
    assert result == Verification(path=(0, 1, 3), tokens=(11, 13, 7))  # 7 is the bonus token
    assert result.accepted == 2 and result.bonus == 7


def test_greedy_rejects_at_root():
    tree = tree_from_parents(TOKENS, PARENTS)
    result = verify_greedy(tree, _logits_with_argmax([19, 13, 0, 16, 0, 0, 0]))
    assert result == Verification(path=(0,), tokens=(19,))


def test_greedy_full_path_takes_bonus_at_leaf():
    tree = tree_from_parents(TOKENS, PARENTS)
    result = verify_greedy(tree, _logits_with_argmax([11, 13, 0, 16, 0, 0, 4]))
    assert result == Verification(path=(0, 1, 3, 6), tokens=(11, 13, 16, 4))


def _accepted_path_by_masks(tree, pred: torch.Tensor) -> tuple[int, ...]:
    """The acceptance rule in tensor form: a node is accepted iff every node on its root path
    matches the target's argmax at its parent; the deepest accepted node (first on ties) ends it."""
    match = tree.tokens == pred[tree.parents.clamp(min=0)]
    match[0] = True
    ok = (tree.mask & ~match[None, :]).sum(-1) == 0
    last = int(torch.where(ok, tree.depths, torch.full_like(tree.depths, -1)).argmax())
    return tuple(tree.mask[last].nonzero().flatten().tolist())


def test_greedy_walk_matches_the_mask_rule_on_random_trees():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n, vocab = int(torch.randint(1, 30, (), generator=g)), 6  # few tokens: many matches
        parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
        tokens = [int(t) for t in torch.randint(0, vocab, (n,), generator=g)]
        for i in range(1, n):  # siblings hold distinct tokens (as drafting and graft keep them)
            while tokens[i] in [tokens[j] for j in range(1, i) if parents[j] == parents[i]]:
                tokens[i] = (tokens[i] + 1) % (vocab * 5)
        tree = tree_from_parents(tokens, parents)
        pred = torch.randint(0, vocab, (n,), generator=g)
        result = verify_greedy(tree, _logits_with_argmax(pred.tolist(), vocab * 5))
        assert result.path == _accepted_path_by_masks(tree, pred), trial
        assert result.tokens == tuple(tokens[i] for i in result.path[1:]) + (int(pred[result.path[-1]]),)


def test_target_probs_matches_manual_processing():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = target_probs(logits, SamplingConfig(temperature=0.5, top_p=0.9, top_k=4))
    scaled = torch.tensor([4.0, 2.0, 1.0, 0.0])  # top_k=4 drops the last token
    full = scaled.softmax(-1)
    # top-p 0.9 keeps the smallest prefix (by probability) whose mass reaches 0.9
    keep = int((full.cumsum(-1) < 0.9).sum()) + 1
    expected = torch.zeros(5)
    expected[:keep] = scaled[:keep].softmax(-1)
    assert torch.allclose(p[0], expected, atol=1e-6)


# --- sampling: the output distribution equals the target's -----------------------------------

V = 6
# target distributions at each node of a two-level tree (probabilities after processing)
P_ROOT = torch.tensor([0.05, 0.30, 0.25, 0.20, 0.15, 0.05])
P_CHILD = {1: torch.tensor([0.4, 0.1, 0.1, 0.1, 0.2, 0.1]), 2: torch.tensor([0.1, 0.1, 0.5, 0.1, 0.1, 0.1]),
           3: torch.tensor([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])}
# root 0 (token 5); children tokens 1, 3, 2 (in draft order: a deliberately imperfect order);
# node 1 (token 1) has children tokens 0 and 4
SAMPLE_TREE = tree_from_parents([5, 1, 3, 2, 0, 4], [-1, 0, 0, 0, 1, 1])


def _tree_probs() -> torch.Tensor:
    leaf = torch.full((V,), 1.0 / V)  # distribution after tokens (1,0) / (1,4): uniform
    return torch.stack([P_ROOT, P_CHILD[1], P_CHILD[3], P_CHILD[2], leaf, leaf])


def _exact_two_token_distribution() -> dict[tuple[int, int], float]:
    out = {}
    for a in range(V):
        second = P_CHILD.get(a, torch.full((V,), 1.0 / V)) if a in (1, 2, 3) else torch.full((V,), 1.0 / V)
        for b in range(V):
            out[(a, b)] = float(P_ROOT[a] * second[b])
    return out


def _sample_pairs(verify, n: int, seed: int = 0) -> collections.Counter:
    """First two output tokens; the second comes from the next step's plain distribution
    when only one token was produced (what the engine would do next)."""
    gen = torch.Generator().manual_seed(seed)
    probs = _tree_probs()
    counts = collections.Counter()
    for _ in range(n):
        toks = verify(SAMPLE_TREE, probs, gen).tokens
        if len(toks) == 1:
            a = toks[0]
            nxt = P_CHILD.get(a, torch.full((V,), 1.0 / V))
            toks = (a, int(torch.multinomial(nxt, 1, generator=gen)))
        counts[toks[:2]] += 1
    return counts


def chi2_pvalue(observed: list[int], probs: list[float]) -> float:
    """Pearson chi-square of counts against exact probabilities (cells with p = 0 must be empty)."""
    n, total = sum(observed), sum(probs)
    cells = [(o, p) for o, p in zip(observed, probs) if p > 0]
    assert sum(o for o, p in zip(observed, probs) if p == 0) == 0, "a zero-probability outcome was sampled"
    expected = [p / total * n for _, p in cells]
    scale = n / sum(expected)
    return chisquare([o for o, _ in cells], [e * scale for e in expected]).pvalue


def _chi2_pvalue(counts: collections.Counter, n: int) -> float:
    exact = _exact_two_token_distribution()
    keys = sorted(exact)
    return chi2_pvalue([counts[k] for k in keys], [exact[k] for k in keys])


def test_sample_draws_in_proportion_to_the_mass_and_never_a_zero():
    """verify.sample (inverse CDF): unnormalised mass, zeros never drawn, a seed repeats its draws."""
    mass = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 4.0, 1.5])  # total 10
    g = torch.Generator().manual_seed(7)
    n = 20000
    draws = [sample(mass, g) for _ in range(n)]
    counts = collections.Counter(draws)
    assert set(counts) <= {1, 3, 4, 6, 7}
    keys = [1, 3, 4, 6, 7]
    assert chi2_pvalue([counts[k] for k in keys], [n * float(mass[k]) / 10 for k in keys]) > 1e-3
    g2 = torch.Generator().manual_seed(7)
    assert [sample(mass, g2) for _ in range(200)] == draws[:200]
    # a single token with mass, at either end of the vocabulary; a realistic vocabulary size
    for one in (0, 7):
        assert {sample(torch.eye(8)[one], g) for _ in range(50)} == {one}
    big = torch.zeros(49152)
    big[[5, 49151]] = torch.tensor([0.25, 0.75])
    counts = collections.Counter(sample(big, g) for _ in range(4000))
    assert set(counts) == {5, 49151} and 0.70 < counts[49151] / 4000 < 0.80


def test_sampled_verification_matches_target_distribution():
    n = 12000
    assert _chi2_pvalue(_sample_pairs(verify_sampled, n), n) > 1e-3


def _wrong_rule(tree, probs, generator):
    """A plausible bug: accept each sibling with p(x) WITHOUT renormalising after rejections."""
    children = [[] for _ in range(tree.size)]
    for i, p in enumerate(tree.parents.tolist()[1:], start=1):
        children[p].append(i)
    node, path, out = 0, [0], []
    while True:
        for child in children[node]:
            if float(torch.rand((), generator=generator)) < float(probs[node][tree.tokens[child]]):
                node = child
                break
        else:
            residual = probs[node].clone()
            for child in children[node]:
                residual[tree.tokens[child]] = 0
            out.append(int(torch.multinomial(residual, 1, generator=generator)))
            return Verification(path=tuple(path), tokens=tuple(out))
        path.append(node)
        out.append(int(tree.tokens[node]))


Q_DRAFT = torch.tensor([0.10, 0.15, 0.40, 0.05, 0.25, 0.05])  # the head's distribution: unlike P_ROOT


def _drawn_tree(gen: torch.Generator, n_draws: int, chain: bool) -> DraftTree:
    """The root's children drawn from Q_DRAFT (as tree.draft_sampled does), optionally with a
    lookup-style point-mass chain 1 -> 0 grafted on (lookup.graft)."""
    drawn = draw(Q_DRAFT, n_draws, gen).tolist()
    children = list(dict.fromkeys(drawn))
    tree = DraftTree(tokens=torch.tensor([5] + children), parents=torch.tensor([-1] + [0] * len(children)),
                     depths=torch.tensor([0] + [1] * len(children)), proposal=Q_DRAFT.clone(),
                     draws=tuple(1 + children.index(t) for t in drawn))
    return graft(tree, [1, 0]) if chain else tree


def _node_probs(tree: DraftTree) -> torch.Tensor:
    uniform = torch.full((V,), 1.0 / V)
    rows = [P_ROOT if d == 0 else P_CHILD.get(int(t), uniform) if d == 1 else uniform
            for t, d in zip(tree.tokens.tolist(), tree.depths.tolist())]
    return torch.stack(rows)


def _drawn_pairs(verify, n: int, n_draws: int, chain: bool, seed: int = 0) -> collections.Counter:
    gen = torch.Generator().manual_seed(seed)
    counts = collections.Counter()
    for _ in range(n):
        tree = _drawn_tree(gen, n_draws, chain)
        toks = verify(tree, _node_probs(tree), gen).tokens
        if len(toks) == 1:
            toks = (toks[0], sample(P_CHILD.get(toks[0], torch.full((V,), 1.0 / V)), gen))
        counts[toks[:2]] += 1
    return counts


@pytest.mark.parametrize("n_draws,chain", [(1, False), (3, False), (2, True)])
def test_drafts_drawn_from_the_head_keep_the_target_distribution(n_draws, chain):
    """Sampled drafts: children drawn i.i.d. from q, accepted with min(1, r/q), the residual moved
    to max(r - q, 0) on rejection; repeated draws share a node; a point-mass chain beside them."""
    n = 12000
    exact = _exact_two_token_distribution()
    counts = _drawn_pairs(verify_sampled, n, n_draws, chain)
    keys = sorted(exact)
    assert chi2_pvalue([counts[k] for k in keys], [exact[k] for k in keys]) > 1e-3


def _point_mass_rule(tree, probs, generator):
    """Drawn children taken as point masses (accepted with r(x) / mass): exact too, since the draws
    do not depend on the target, but it accepts less."""
    return verify_sampled(DraftTree(tokens=tree.tokens, parents=tree.parents, depths=tree.depths), probs, generator)


def test_drawn_distribution_test_catches_a_wrong_rule(monkeypatch):
    """Plausible bugs: a rejected draw that leaves the residual as it was; a chain that shares a
    drawn child (the draws left over are then conditioned on the chain's token not being drawn)."""
    import core.decoding.verify as verify_mod

    def no_residual_update(residual, draws, tokens, q, generator):
        for child in draws:
            x = tokens[child]
            mass = float(residual.sum())
            if float(torch.rand((), generator=generator)) * float(q[x]) * mass < float(residual[x]):
                return child
        return None

    n = 12000
    exact = _exact_two_token_distribution()
    keys = sorted(exact)
    with monkeypatch.context() as m:
        m.setattr(verify_mod, "_drawn", no_residual_update)
        counts = _drawn_pairs(verify_sampled, n, 3, False)
    assert chi2_pvalue([counts[k] for k in keys], [exact[k] for k in keys]) < 1e-6
    real_graft = graft
    def sharing_graft(tree, chain):  # as for greedy trees: the chain follows a drawn child of its token
        plain = real_graft(DraftTree(tokens=tree.tokens, parents=tree.parents, depths=tree.depths), chain)
        return DraftTree(tokens=plain.tokens, parents=plain.parents, depths=plain.depths, proposal=tree.proposal,
                         draws=tree.draws)
    with monkeypatch.context() as m:
        m.setitem(globals(), "graft", sharing_graft)
        counts = _drawn_pairs(verify_sampled, n, 2, True)
    assert chi2_pvalue([counts[k] for k in keys], [exact[k] for k in keys]) < 1e-6


def test_draws_accept_more_often_than_the_same_children_as_point_masses():
    """Why draws: with q close to p, a drawn child is accepted with probability 1 - TV(p, q) per
    draw; the same children as point masses only with p(x)."""
    gen = torch.Generator().manual_seed(1)
    probs_close = torch.tensor([0.05, 0.30, 0.25, 0.20, 0.15, 0.05])
    accepted = {"drawn": 0, "point": 0}
    for _ in range(3000):
        drawn = draw(probs_close, 1, gen).tolist()
        tree = DraftTree(tokens=torch.tensor([5] + drawn), parents=torch.tensor([-1, 0]), depths=torch.tensor([0, 1]),
                         proposal=probs_close.clone(), draws=(1,))
        probs = torch.stack([probs_close, probs_close])
        accepted["drawn"] += verify_sampled(tree, probs, gen).accepted
        accepted["point"] += _point_mass_rule(tree, probs, gen).accepted
    assert accepted["drawn"] == 3000, "q == p: every draw is accepted"
    assert 0.15 * 3000 < accepted["point"] < 0.30 * 3000  # sum of p(x)^2 = 0.22


def test_distribution_test_catches_wrong_acceptance_rule():
    n = 12000
    assert _chi2_pvalue(_sample_pairs(_wrong_rule, n), n) < 1e-6


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_leaf_bonus_uses_full_target_distribution(temperature):
    tree = tree_from_parents([3], [-1])  # root only: plain sampling
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0]])
    probs = target_probs(logits, SamplingConfig(temperature=temperature))
    gen = torch.Generator().manual_seed(1)
    n = 6000
    counts = collections.Counter(verify_sampled(tree, probs, gen).tokens[0] for _ in range(n))
    assert chi2_pvalue([counts[i] for i in range(4)], probs[0].double().tolist()) > 1e-3


def test_greedy_tokens_is_bf16_argmax_with_the_first_maximum_on_ties():
    from core.decoding.verify import greedy_tokens

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(26, 49152, generator=g) * 4).bfloat16()  # bf16 rounding makes many ties
    logits[3, [7, 70, 700]] = 100.0  # an exact three-way tie: the first index wins
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert int(greedy_tokens(logits)[3]) == 7
    assert int(greedy_tokens(logits[5])) == int(logits[5].argmax())


# ----------------------------------------------------------------------------- pruned drafting

@pytest.mark.parametrize("shape", [(6, 3, 6), (5, 4, 10), (3, 8, 12), (8, 2, 5)])
def test_pruned_drafting_selects_the_full_tree_and_skips_rounds(shape, monkeypatch):
    """Drafting skips frontier nodes that cannot make the cut; the selected tree is exactly the
    one drafting every level selects, and deep trees stop early where the head is unsure."""
    from core.config import TreeConfig
    from core.decoding.head import HeadCache
    from core.decoding.tree import Drafter, catch_up, draft_dynamic
    from tests.tiny import random_head, tiny_target

    target = tiny_target()  # float64
    head = random_head(target, seed=3, scale=0.15)
    drafter = Drafter(head=head, embed=target.model.get_input_embeddings(),
                      lm_weight=target.model.lm_head.weight, vocab=None)
    fed = []
    feed = Drafter.feed
    monkeypatch.setattr(Drafter, "feed", lambda self, *a, **k: fed.append(a[1].shape[0]) or feed(self, *a, **k))
    depth, top_k, total = shape
    cfg = TreeConfig(depth=depth, top_k=top_k, total_tokens=total)
    rows = {True: 0, False: 0}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for trial in range(12):
            ids = torch.randint(1, 96, (7,), generator=gen)
            feats = target.model.model(input_ids=ids[None]).last_hidden_state[0]  # (7, H)
            trees = {}
            for prune in (True, False):
                cache = HeadCache(head.config, torch.float64, torch.device("cpu"))
                root = catch_up(drafter, cache, ids[1:], feats[:-1])
                fed.clear()
                trees[prune] = draft_dynamic(drafter, cache, int(ids[-1]), root, cfg, prune=prune)
                assert cache.length == 6
                rows[prune] += sum(fed)
            for field in ("tokens", "parents", "depths"):
                assert torch.equal(getattr(trees[True], field), getattr(trees[False], field)), (trial, field)
            torch.testing.assert_close(trees[True].scores, trees[False].scores, rtol=0, atol=0)
    if total - 1 > top_k:  # the cut exists after the first round: something was skipped
        assert rows[True] < rows[False], rows

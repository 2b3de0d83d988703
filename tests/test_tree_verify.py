"""Literal cases for tree masks/positions and acceptance, and the sampling distribution test."""

import collections

import pytest
import torch
from scipy.stats import chisquare, kstest

from core.config import SamplingConfig
from core.decoding import gumbel
from core.decoding.gumbel import sample_at
from core.decoding.lookup import graft
from core.decoding.tree import DraftTree, ancestor_mask, tree_from_parents
from core.decoding.verify import Verification, target_probs, verify_greedy, verify_sampled, walk
from core.kernels import native

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


# --- sampling: a token is a function of (seed, position); the output has the target's distribution ---

V = 6
# target distributions at each node of a two-level tree (probabilities after processing)
P_ROOT = torch.tensor([0.05, 0.30, 0.25, 0.20, 0.15, 0.05])
P_CHILD = {1: torch.tensor([0.4, 0.1, 0.1, 0.1, 0.2, 0.1]), 2: torch.tensor([0.1, 0.1, 0.5, 0.1, 0.1, 0.1]),
           3: torch.tensor([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])}
UNIFORM = torch.full((V,), 1.0 / V)
# root 0 (token 5); children tokens 1, 3, 2 (a deliberately imperfect order); node 1 (token 1)
# has children tokens 0 and 4
SAMPLE_TREE = tree_from_parents([5, 1, 3, 2, 0, 4], [-1, 0, 0, 0, 1, 1])
T1 = SamplingConfig(temperature=1.0)


def _tree_logits(tree: DraftTree) -> torch.Tensor:
    """(n, V) log-probabilities at each node: P_ROOT at the root, P_CHILD after its token, uniform deeper."""
    rows = [P_ROOT if d == 0 else P_CHILD.get(int(t), UNIFORM) if d == 1 else UNIFORM
            for t, d in zip(tree.tokens.tolist(), tree.depths.tolist())]
    return torch.stack(rows).log()


def _exact_two_token_distribution() -> dict[tuple[int, int], float]:
    return {(a, b): float(P_ROOT[a] * P_CHILD.get(a, UNIFORM)[b]) for a in range(V) for b in range(V)}


def _sample_pairs(verify, n: int, tree: DraftTree = SAMPLE_TREE) -> collections.Counter:
    """First two output tokens over n seeds; where the step wrote one token, the second is plain
    sampling's at the next position (what the engine does next)."""
    logits = _tree_logits(tree)
    counts = collections.Counter()
    for seed in range(n):
        toks = verify(tree, logits, T1, seed, 0).tokens
        if len(toks) == 1:
            toks = (toks[0], sample_at(P_CHILD.get(toks[0], UNIFORM).log()[None], [2], T1, seed)[0])
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


def _chi2_pvalue(counts: collections.Counter) -> float:
    exact = _exact_two_token_distribution()
    keys = sorted(exact)
    return chi2_pvalue([counts[k] for k in keys], [exact[k] for k in keys])


@pytest.mark.skipif(not native.gumbel_usable("cpu"), reason="needs the native kernels")
def test_native_noise_is_the_reference_hash_and_standard_gumbel():
    key = gumbel.position_key(123, 45)
    full = native.gumbel_noise(key, None, 49152)
    assert (full - gumbel.noise_reference(key, None, 49152)).abs().max() < 2e-6  # the same hash; logs to rounding
    ids = torch.randint(0, 49152, (1000,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(native.gumbel_noise(key, ids, 1000), full[ids])  # a token's noise, whatever is asked beside it
    assert not torch.equal(native.gumbel_noise(gumbel.position_key(123, 46), None, 49152), full)
    assert not torch.equal(native.gumbel_noise(gumbel.position_key(124, 45), None, 49152), full)
    assert kstest(full.double().numpy(), "gumbel_r").pvalue > 1e-3
    assert -2.82 < float(full.min()) and float(full.max()) < 16.7  # the bounds gumbel.REACH relies on


def test_reference_noise_is_standard_gumbel():
    assert kstest(gumbel.noise_reference(gumbel.position_key(9, 0), None, 20000).double().numpy(), "gumbel_r").pvalue > 1e-3


@pytest.mark.parametrize("s", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.5, top_k=4),
                               SamplingConfig(temperature=0.8, top_p=0.7)])
def test_sample_at_draws_plain_sampling_distribution_and_never_a_dropped_token(s):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])
    probs = target_probs(logits, s)[0]
    n = 6000
    counts = collections.Counter(sample_at(logits, [t], s, seed=3)[0] for t in range(n))  # a position, a fresh draw
    assert chi2_pvalue([counts[i] for i in range(6)], probs.double().tolist()) > 1e-3
    assert sample_at(logits.repeat(3, 1), [7, 8, 7], s, 3)[0] == sample_at(logits, [7], s, 3)[0]  # rows alone or not


def test_sample_at_skips_only_tokens_that_cannot_win():
    """The noise is computed for the tokens within REACH of the best only; every draw equals the
    Gumbel-max over the whole vocabulary."""
    gen = torch.Generator().manual_seed(0)
    s = SamplingConfig(temperature=0.7)
    for t in range(40):
        logits = torch.randn(1, 4096, generator=gen) * (3.0 + t)  # from flat to very peaked
        full = gumbel.shaped_logits(logits, s)[0] + gumbel.noise(gumbel.position_key(5, t), None, 4096, "cpu")
        assert sample_at(logits, [t], s, 5)[0] == int(full.argmax())


@pytest.mark.skipif(not native.gumbel_usable("cpu"), reason="the native kernels do not run here")
def test_the_native_draws_are_the_gumbel_max_over_the_whole_row():
    """csrc/gumbel.c gathers the candidates 16 at a time before their noise: the draw is still the first
    argmax of shaped logits + noise over every token, for rows of any length (not multiples of 16
    included), with dropped (-inf) tokens, many equal logits, and from bf16 logits divided by the
    temperature in the same call (gumbel_argmax_bf16: the same numbers as torch's division)."""
    gen = torch.Generator().manual_seed(4)
    for case in range(240):
        n = (49152, 4099, 17, 1, 33, 300)[case % 6]
        logits = (torch.randn(n, generator=gen) * (0.5, 3.0, 12.0, 40.0)[case % 4]).bfloat16()
        if case % 3 == 0:
            logits[torch.rand(n, generator=gen) < 0.4] = float("-inf")
        if case % 5 == 0:
            logits = logits.round()  # many equal logits
        t = (0.7, 1.3, 0.9999, 1e-3, 2.0, 1 / 3)[case % 6]
        key = gumbel.position_key(case, 3 * case)
        shaped = logits.float() / t
        drawn = native.gumbel_argmax(shaped, key, gumbel.REACH)
        assert native.gumbel_argmax_bf16(logits, key, t, gumbel.REACH) == drawn, case
        full = shaped + gumbel.noise(key, None, n, "cpu")
        assert drawn == (int(full.argmax()) if torch.isfinite(shaped).any() else -1), case
    dropped = torch.full((40,), float("-inf")).bfloat16()
    assert native.gumbel_argmax_bf16(dropped, 1, 0.7, gumbel.REACH) == native.gumbel_argmax(dropped.float(), 1, 20.0) == -1


def test_the_torch_sampler_draws_what_the_native_one_draws(monkeypatch):
    """Where the native kernels do not run (CUDA, no compiler) sample_at takes the torch path: the
    same hash, the same candidates; the logs agree to float rounding, so the draws agree."""
    gen = torch.Generator().manual_seed(2)
    s = SamplingConfig(temperature=0.8)
    rows = [torch.randn(1, 8192, generator=gen) * 4 for _ in range(30)]
    native_draws = [sample_at(r, [t], s, 9)[0] for t, r in enumerate(rows)]
    monkeypatch.setattr(native, "gumbel_usable", lambda device: False)
    assert [sample_at(r, [t], s, 9)[0] for t, r in enumerate(rows)] == native_draws


def test_top_p_keeps_the_most_likely_tokens_until_their_mass_reaches_it():
    """The nucleus found from growing top-k sets equals the definition, for nuclei of 1 to
    thousands of tokens (past the first 64 looked at)."""
    gen = torch.Generator().manual_seed(3)
    for spread, top_p in ((0.3, 0.95), (1.0, 0.9), (4.0, 0.5), (8.0, 0.99)):
        logits = torch.randn(2, 5000, generator=gen) * spread
        x = gumbel.shaped_logits(logits, SamplingConfig(temperature=1.0, top_p=top_p))
        for row, kept in zip(logits.softmax(-1), x):
            p, order = row.double().sort(descending=True)
            n = int((p.cumsum(0) - p < top_p).sum())  # mass before each token short of top_p
            assert set(torch.nonzero(kept > float("-inf"))[:, 0].tolist()) == set(order[:n].tolist())


def test_sampled_verification_matches_target_distribution():
    assert _chi2_pvalue(_sample_pairs(verify_sampled, 12000)) > 1e-3


def _one_noise_for_every_depth(tree, logits, s, seed, committed):
    """A plausible bug: every node reads the noise of the root's children's position."""
    return walk(tree, sample_at(logits, [committed + 1] * tree.size, s, seed).__getitem__)


def test_distribution_test_catches_a_wrong_position():
    assert _chi2_pvalue(_sample_pairs(_one_noise_for_every_depth, 12000)) < 1e-6


def _toy_logits(prefix: tuple[int, ...], vocab: int = 12) -> torch.Tensor:
    """A deterministic toy language model: (vocab,) logits from the prefix alone."""
    g = torch.Generator().manual_seed(hash(prefix) % 2**31)
    return torch.randn(vocab, generator=g) * 2


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.5])
def test_sampled_speculation_is_token_identical_to_plain_sampling(temperature):
    """Random trees (some children guessed right, some not, some chains) verified step by step
    against the toy model: the tokens are plain sampling's with the same seed, every time."""
    s = SamplingConfig(temperature=temperature)
    rng = torch.Generator().manual_seed(1)
    for seed in range(25):
        prompt = (1, 2, 3)
        plain = list(prompt)
        while len(plain) < 23:
            plain.append(sample_at(_toy_logits(tuple(plain))[None], [len(plain)], s, seed)[0])
        out, steps = list(prompt), 0
        while len(out) < 23:
            committed = len(out) - 1  # the root (last token) is not cached yet
            tokens, parents = [out[-1]], [-1]
            for _ in range(int(torch.randint(0, 7, (), generator=rng))):
                parent = int(torch.randint(0, len(tokens), (), generator=rng))
                guess = plain[committed + 1 + _depth(parents, parent)] if committed + 1 + _depth(parents, parent) < len(plain) \
                    and bool(torch.rand((), generator=rng) < 0.6) else int(torch.randint(0, 12, (), generator=rng))
                if all(not (p == parent and t == guess) for t, p in zip(tokens, parents)):
                    tokens.append(guess)
                    parents.append(parent)
            tree = tree_from_parents(tokens, parents)
            logits = torch.stack([_toy_logits(tuple(out[:-1]) + _path_tokens(tokens, parents, i)) for i in range(len(tokens))])
            out += verify_sampled(tree, logits, s, seed, committed).tokens
            steps += 1
        assert out[:23] == plain, f"seed {seed}"
        assert steps < 20  # the right guesses were accepted


def test_sampled_verification_draws_only_along_the_path_and_finds_what_the_full_walk_finds(monkeypatch):
    """verify_sampled draws at the nodes its descent visits; the path equals `walk` over every
    node's draw and the acceptance rule in tensor form, on random trees whose children often hold
    the draws."""
    import core.decoding.verify as verify_mod

    gen = torch.Generator().manual_seed(4)
    s = SamplingConfig(temperature=0.9)
    for case in range(60):
        n = int(torch.randint(1, 12, (), generator=gen))
        logits = torch.randn(n, 16, generator=gen) * 2
        tokens, parents = [3], [-1]
        for i in range(1, n):
            parent = int(torch.randint(0, i, (), generator=gen))
            depth = _depth(parents, parent)
            want = sample_at(logits[parent:parent + 1], [5 + depth + 1], s, case)[0]
            tok = want if bool(torch.rand((), generator=gen) < 0.7) else int(torch.randint(0, 16, (), generator=gen))
            while any(p == parent and t == tok for t, p in zip(tokens, parents)):
                tok = (tok + 1) % 16
            tokens.append(tok)
            parents.append(parent)
        tree = tree_from_parents(tokens, parents)
        choices = sample_at(logits, [5 + d + 1 for d in tree.depths.tolist()], s, case)
        full = walk(tree, choices.__getitem__)
        assert full.path == _accepted_path_by_masks(tree, torch.tensor(choices))  # the rule, in tensor form
        drawn = []
        real = verify_mod.sample_at
        monkeypatch.setattr(verify_mod, "sample_at", lambda x, pos, s_, seed: drawn.append(pos) or real(x, pos, s_, seed))
        got = verify_sampled(tree, logits, s, case, 5)
        monkeypatch.setattr(verify_mod, "sample_at", real)
        assert got == full and len(drawn) == got.accepted + 1


def _depth(parents: list[int], i: int) -> int:
    return 0 if parents[i] < 0 else 1 + _depth(parents, parents[i])


def _path_tokens(tokens: list[int], parents: list[int], i: int) -> tuple[int, ...]:
    """The tokens from the root to node i, both included."""
    return (_path_tokens(tokens, parents, parents[i]) if parents[i] >= 0 else ()) + (tokens[i],)


class _ExactHead:
    """A drafter whose distribution is the target's: log_probs returns P_ROOT's log whatever it is asked."""
    vocab = None

    def log_probs(self, hidden):
        return P_ROOT.log().expand(hidden.shape[0], V)

    def to_target_ids(self, idx):
        return idx


def test_a_head_drafting_on_the_same_noise_is_accepted_whenever_it_equals_the_target():
    """The coupling: with q == p, the head's first guess under DraftNoise is the target's draw at
    every seed; its plain top-1 only where the draw happens to be the mode."""
    head, s = _ExactHead(), SamplingConfig(temperature=1.0)
    coupled = plain_top = 0
    for seed in range(2000):
        guess = int(gumbel.DraftNoise(1.0, seed, 1).top_log_probs(head, torch.zeros(1, 4), 0, 1)[1][0, 0])
        draw = sample_at(P_ROOT.log()[None], [1], s, seed)[0]
        coupled += guess == draw
        plain_top += draw == int(P_ROOT.argmax())
    assert coupled == 2000
    assert 0.25 * 2000 < plain_top < 0.35 * 2000  # p(mode) = 0.30


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_a_root_only_step_is_plain_sampling(temperature):
    tree = tree_from_parents([3], [-1])  # root only: plain sampling
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0]])
    s = SamplingConfig(temperature=temperature)
    for seed in range(50):
        assert verify_sampled(tree, logits, s, seed, 10).tokens == (sample_at(logits, [11], s, seed)[0],)


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


def test_a_tree_keeps_the_lists_it_was_built_from_and_reads_them_once_otherwise():
    """DraftTree.host: (tokens, parents, depths) as lists, the ones from_lists was given (no copy read
    back from the tensors), else read from the tensors once; the same values either way."""
    lists = ([5, 9, 7, 3], [-1, 0, 0, 1], [0, 1, 1, 2])
    built = DraftTree.from_lists(*lists, scores=[0.0, -0.1, -0.5, -0.2])
    assert built.host[0] is lists[0] and built.host == lists
    # the loop reads the lists alone: no tensor is made until one is read
    grafted = graft(built, [9, 3, 8])
    assert built.size == 4 and grafted.size == 5 and grafted.host[0] == [5, 9, 7, 3, 8]
    assert grafted.host_scores[:4] == built.host_scores and grafted.host_scores[4] == float("-inf")
    assert not {"tokens", "parents", "depths", "scores"} & (set(built.__dict__) | set(grafted.__dict__))
    assert grafted.scores.dtype is torch.float32 and grafted.parents.tolist() == [-1, 0, 0, 1, 3]
    assert torch.equal(grafted.tokens, torch.tensor([5, 9, 7, 3, 8])) and grafted.depths.tolist() == [0, 1, 1, 2, 3]
    assert "DraftTree(tokens=tensor([5, 9, 7, 3, 8])" in repr(grafted)
    with pytest.raises(AttributeError, match="no attribute 'nodes'"):
        built.nodes
    assert DraftTree.from_lists([4], [-1], [0]).scores is None
    assert built.tokens.tolist() == lists[0] and built.parents.tolist() == lists[1] and built.depths.tolist() == lists[2]
    assert built.scores.dtype is torch.float32 and built.scores.tolist()[1] == pytest.approx(-0.1)
    other = tree_from_parents(lists[0], lists[1])
    assert other.host == lists and other.host is other.host  # read once

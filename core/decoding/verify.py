"""Verification: which drafted tokens the target accepts, and the bonus token after them.

Glossary (after vLLM's rejection sampler; EAGLE arXiv 2401.15077, SpecInfer arXiv 2305.09781):
  accepted   drafted tokens on one root-to-node path that the target agrees with.
  bonus      one more token chosen from the target's own distribution at the last
             accepted node (its residual distribution when siblings were rejected there).
  p          the target's next-token distribution at a node, after temperature, top-k and
             top-p exactly as plain sampling applies them (`target_probs`).

Greedy: a child is accepted iff its token is the target's argmax at its parent; the bonus
is the argmax at the last accepted node. Output equals plain greedy decoding.

Sampling with deterministic top-k siblings (how EAGLE-2 proposes them): each sibling x
is a point-mass proposal, so it is accepted with probability p(x) / (mass left); on
rejection p(x) is set to 0 and the rest renormalised; if every sibling is rejected the
bonus is sampled from what is left. Every path of this procedure draws the next token
from exactly p, so the output has the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.kernels import native
from core.config import SamplingConfig
from core.decoding.draw import draw
from core.decoding.tree import DraftTree


@dataclass(frozen=True)
class Verification:
    path: tuple[int, ...]  # tree indices of the accepted nodes, root first (path[0] == 0)
    tokens: tuple[int, ...]  # accepted draft tokens, then the bonus token

    @property
    def accepted(self) -> int:
        return len(self.path) - 1

    @property
    def bonus(self) -> int:
        return self.tokens[-1]


def target_probs(logits: torch.Tensor, s: SamplingConfig) -> torch.Tensor:
    """(n, V) logits -> (n, V) float probabilities: temperature, then top-k, then top-p."""
    assert not s.greedy, "greedy decoding uses argmax, not probabilities"
    x = logits.float() / s.temperature
    if 0 < s.top_k < x.shape[-1]:
        kth = x.topk(s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        srt, order = x.sort(dim=-1)  # ascending
        cum = srt.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - s.top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        x = x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return x.softmax(-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...) argmax token ids: plain decoding's and verification's choice.

    Exact either way (bf16 -> fp32 loses nothing; the first maximum wins): bf16 logits go
    through the native kernel (core.kernels.native; 13 / 29 x 49,152 logits: 0.12 / 0.25 ms), anything
    else through torch on an fp32 copy (0.35 / 1.0 ms; torch's argmax over bf16 itself took
    2.45 ms for 26 rows).
    """
    if native.argmax_usable(logits):
        return native.argmax(logits)
    return logits.float().argmax(-1)


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verification:
    """tree of n nodes, logits (n, V) of the target at every node -> accepted path + bonus.

    A node is accepted iff it and all its ancestors match the target's argmax at their
    parents; siblings hold distinct tokens, so the accepted nodes form one path, and the
    deepest of them (the first, were two equally deep) ends it. The walk over the n nodes
    runs on Python lists: a tree is a few dozen nodes, and the dozen small tensor ops the
    same logic takes cost more than the argmax itself.
    """
    assert logits.shape[0] == tree.size
    pred = greedy_tokens(logits).tolist()  # (n,)
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()

    def accepted(i: int) -> bool:
        while i > 0:
            if tokens[i] != pred[parents[i]]:
                return False
            i = parents[i]
        return True

    last = 0
    for i in range(1, len(tokens)):
        if depths[i] > depths[last] and accepted(i):
            last = i
    path = [last]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    path.reverse()  # root first
    return Verification(path=tuple(path), tokens=tuple([tokens[i] for i in path[1:]] + [pred[last]]))


def verify_sampled(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator) -> Verification:
    """tree of n nodes, probs (n, V) from `target_probs` -> accepted path + bonus, exact in law.

    At each node its children are proposals for the next token, tried in turn against what is
    left of the target's distribution there (the residual): a point-mass child (the head's
    top-k, a lookup chain) is accepted with probability residual(x) / mass and zeroed when
    rejected; the root's children drawn from the head's distribution q (`tree.draws`, sampled
    drafts) are tried after them, in draw order, each accepted with probability
    min(1, r(x) / q(x)) for the normalised residual r, which becomes max(r - q, 0) after a
    rejection. Every step draws the next token from exactly the residual it started from, so
    the output has the target's distribution. If every child is rejected the bonus is drawn
    from what is left."""
    assert probs.shape[0] == tree.size
    children: list[list[int]] = [[] for _ in range(tree.size)]
    drawn = set(tree.draws)
    for i, p in enumerate(tree.parents.tolist()[1:], start=1):
        if not (p == 0 and i in drawn):
            children[p].append(i)  # tree order = the head's order of preference
    tokens = tree.tokens.tolist()
    node, path, out = 0, [0], []
    while True:
        residual = probs[node].clone()  # (V,) unnormalised mass still available
        nxt = _point_masses(residual, children[node], tokens, generator)
        if nxt is None and node == 0 and tree.draws:
            nxt = _drawn(residual, tree.draws, tokens, tree.proposal, generator)
        if nxt is None:
            return Verification(path=tuple(path), tokens=tuple(out + [sample(residual, generator)]))
        node = nxt
        path.append(node)
        out.append(tokens[node])


def _uniform(residual: torch.Tensor, generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, device=residual.device))


def _point_masses(residual: torch.Tensor, candidates: list[int], tokens: list[int],
                  generator: torch.Generator) -> int | None:
    """Try point-mass proposals in order; the accepted node, or None (residual zeroed at each rejected token)."""
    for child in candidates:
        x = tokens[child]
        mass = float(residual.sum())
        # point-mass proposal x: accept with probability p(x) / (mass left)
        if mass > 0 and _uniform(residual, generator) * mass < float(residual[x]):
            return child
        residual[x] = 0.0  # rejected: the next token is drawn from p restricted to the rest
    return None


def _drawn(residual: torch.Tensor, draws: tuple[int, ...], tokens: list[int], q: torch.Tensor,
           generator: torch.Generator) -> int | None:
    """Try the draws from q in order; the accepted node, or None (residual moved to max(r - q, 0) per rejection)."""
    for child in draws:
        x = tokens[child]
        mass = float(residual.sum())
        if mass <= 0:
            return None
        # accept with probability min(1, (residual(x) / mass) / q(x)); q(x) > 0 since x was drawn from q
        if _uniform(residual, generator) * float(q[x]) * mass < float(residual[x]):
            return child
        left = (residual / mass - q).clamp(min=0)  # (V,)
        if float(left.sum()) <= 0:  # r == q up to rounding: a rejection had probability ~0; keep r
            continue
        residual.copy_(left)
    return None


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a (V,) unnormalised distribution: plain sampling and verification's bonus
    (core.decoding.draw: inverse CDF, a token of mass 0 never drawn)."""
    return int(draw(probs, 1, generator)[0])

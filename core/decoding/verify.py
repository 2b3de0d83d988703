"""Verification: which drafted tokens the target accepts, and the bonus token after them.

Words used here:
  accepted   drafted tokens on one root-to-node path that the target agrees with.
  bonus      one more token: the target's own choice at the last accepted node.
  choice     what plain decoding would pick after a node: its argmax (greedy), or its Gumbel-max
             draw at the node's child position (sampled, core.decoding.gumbel.sample_at).

Both walk the tree the same way (`walk`): a child is accepted iff its token is the target's
choice at its parent, and the bonus is the choice at the last accepted node. Greedy output
equals plain greedy decoding; sampled output equals plain sampling with the same seed token for
token, since the choice at a position depends on the seed, the position and the target's logits
there alone (and those are the same bits in a tree as alone: the batch-invariant step). So it has
exactly the target's distribution (temperature, top-k and top-p as plain sampling applies them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from core.kernels import native
from core.config import SamplingConfig
from core.decoding.gumbel import sample_at, shaped_logits
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
    """(n, V) logits -> (n, V) float probabilities: temperature, then top-k, then top-p: the
    distribution plain sampling draws from (softmax of core.decoding.gumbel.shaped_logits)."""
    return shaped_logits(logits, s).softmax(-1)


def plain_choice(logits: torch.Tensor, position: int, s: SamplingConfig, seed: int) -> int:
    """Plain decoding's choice from (V,) logits for the token at `position`: the argmax, or the seed's
    Gumbel-max draw at that position (core.decoding.gumbel). The engine's steps and core.decoding.batched
    both choose through it, so their answers agree token for token."""
    return int(greedy_tokens(logits)) if s.greedy else sample_at(logits[None], [position], s, seed)[0]


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
    """tree of n nodes, logits (n, V) of the target at every node -> accepted path + bonus:
    the target's choice at a node is its argmax."""
    assert logits.shape[0] == tree.size
    return accept_greedy(tree, greedy_tokens(logits).tolist())


def accept_greedy(tree: DraftTree, choices: list[int]) -> Verification:
    """verify_greedy from the argmaxes themselves (n,), as the native step finds them in its call
    (core.decoding.forward.forward_tree_greedy)."""
    assert len(choices) == tree.size
    return walk(tree, choices.__getitem__)


def verify_sampled(tree: DraftTree, logits: torch.Tensor, s: SamplingConfig, seed: int,
                   committed: int) -> Verification:
    """tree of n nodes, logits (n, V) of the target at every node -> accepted path + bonus: the
    target's choice at a node of depth d is plain sampling's draw for position committed + d + 1
    (core.decoding.gumbel.sample_at), committed being the tokens before the root. Drawn only at the
    nodes the walk reaches: accepted + 1 draws where the tree has n nodes (a draw costs ~0.1 ms; a
    lookup chain adds up to 10 nodes)."""
    assert logits.shape[0] == tree.size
    depths = tree.host[2]
    return walk(tree, lambda node: sample_at(logits[node:node + 1], [committed + depths[node] + 1], s, seed)[0])


def walk(tree: DraftTree, choice: Callable[[int], int]) -> Verification:
    """The accepted path, given the target's choice after a node (`choice(i)`, asked only of the
    nodes reached): from the root down, the child holding the node's choice. A node is accepted
    iff it and all its ancestors are their parents' choices; siblings hold distinct tokens, so
    those nodes form one path, and this descent finds it. It runs on Python lists: a tree is a
    few dozen nodes, and the small tensor ops the same logic takes cost more than the argmax.
    """
    tokens, parents, _ = tree.host
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(tokens)):
        children.setdefault(parents[i], {})[tokens[i]] = i
    node, path = 0, [0]
    while True:
        chosen = choice(node)
        nxt = children.get(node, {}).get(chosen)
        if nxt is None:
            return Verification(path=tuple(path), tokens=tuple([tokens[i] for i in path[1:]] + [chosen]))
        node = nxt
        path.append(node)

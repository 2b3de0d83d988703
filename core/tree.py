"""Drafting: the EAGLE head proposes a tree of continuations of the last accepted token.

Words used here:
  root      the last accepted token; it is not yet in the target's KV cache, so it is
            verified (and cached) together with the tree. Tree index 0.
  node      a drafted token; `parents[i]` is the tree index of its parent (root: -1).
  fed node  a node the head has consumed to propose its children (the frontier of each round).

Tree indices are topological: a parent always comes before its children, and siblings
come in the head's order of preference (most likely first).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core import native
from core.config import TreeConfig
from core.head import EagleHead, HeadCache, head_mask


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor   # (n,) int64 token ids, tokens[0] is the root
    parents: torch.Tensor  # (n,) int64, parents[0] == -1
    depths: torch.Tensor   # (n,) int64, depths[0] == 0
    scores: torch.Tensor | None = None  # (n,) cumulative draft log-prob (dynamic trees), root 0

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        assert self.parents.shape == (n,) and self.depths.shape == (n,) and int(self.parents[0]) == -1

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """bool (n, n): mask[i, j] iff node j is node i or one of its ancestors."""
        return ancestor_mask(self.parents)

    def positions(self, offset: int) -> torch.Tensor:
        return offset + self.depths


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """(n,) parent indices -> bool (n, n): mask[i, j] iff j is i or an ancestor of i.

    Pure and loop-free over nodes: each pass ORs in the parent's row, so after
    (max depth) passes every row holds the full ancestry.
    """
    n = parents.shape[0]
    up = parents.clamp(min=0)  # root points at itself
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    for _ in range(n.bit_length() if n > 0 else 0):  # path doubling: log2(n) passes suffice
        mask = mask | mask[up]
        up = up[up]
    return mask


def tree_from_parents(tokens: list[int], parents: list[int], device=None) -> DraftTree:
    """Build a DraftTree from plain lists (used by tests, the probe and cost measurements)."""
    t = torch.tensor(tokens, dtype=torch.long, device=device)
    p = torch.tensor(parents, dtype=torch.long, device=device)
    depths = ancestor_mask(p).sum(-1) - 1
    return DraftTree(tokens=t, parents=p, depths=depths)


@dataclass(frozen=True)
class Drafter:
    """The head plus the target modules it borrows; drafts over `vocab` (None = full vocabulary)."""

    head: EagleHead
    embed: torch.nn.Embedding     # the target's input embedding
    lm_weight: torch.Tensor       # (Vd, H): rows of the target's LM head the draft scores
    vocab: torch.Tensor | None    # (Vd,) target ids of those rows, None when Vd == V
    # which target hidden states the head reads: None = the last one (after the final norm);
    # an EAGLE-3 drafter (core.head3.Drafter3) names the fused layers instead
    feature_layers = None

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: (m, H) -> (m, Vd) draft log-probabilities
        # clamp: rounding can push the top log-prob a hair above 0, and a child must never
        # outscore its parent (cumulative scores keep the selected tree connected)
        logits = native.linear(hidden, self.lm_weight) if native.usable(hidden, self.lm_weight) else hidden @ self.lm_weight.T
        return F.log_softmax(logits.float(), dim=-1).clamp(max=0.0)

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.vocab is None else self.vocab[idx]

    def feed(self, cache: HeadCache, tokens: torch.Tensor, features: torch.Tensor,
             positions: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Run the head on m new inputs; tokens (m,), features (m, H) -> next features (m, H).

        `allowed`: None = causal after the cache; bool (m, cache length + m), the whole mask; or
        bool (m, T), the tree part (the last T keys; every earlier key is seen): see head_mask.
        """
        emb = self.embed(tokens)[None].to(features.dtype)  # (1, m, H)
        mask = head_mask(allowed, cache.length, tokens.shape[0], features.dtype, self.head.config, features.device)
        return self.head(emb, features[None], positions, mask, cache)[0]


def catch_up(drafter: Drafter, cache: HeadCache, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Commit target features to the head's cache; return the head's last output (H,).

    tokens (m,) are t_{j+1} and features (m, H) are f_j for the next m positions j; the
    last output predicts the feature at the new root, i.e. the root's children.
    """
    assert tokens.shape[0] == features.shape[0]
    start = cache.length
    positions = torch.arange(start, start + tokens.shape[0], device=tokens.device)
    return drafter.feed(cache, tokens, features, positions)[-1]


def draft_dynamic(drafter: Drafter, cache: HeadCache, root_token: int, root_hidden: torch.Tensor,
                  cfg: TreeConfig, *, prune: bool = True) -> DraftTree:
    """EAGLE-2 dynamic tree: expand the top_k best nodes per level, then keep the best overall.

    root_hidden: (H,) head output predicting the root's children. The head's cache is
    left at its committed length on return (draft entries are temporary).

    Rounds that cannot change the result are skipped: a descendant never outscores its
    ancestor, so a frontier node whose score is at most the `keep`-th best score so far can
    have no descendant in the final selection (and ties go to the earlier candidate). Such
    nodes are not fed, and when no frontier node is left drafting stops early. The tree is
    the one drafting every level would select; a deep tree costs a head call per level only
    while the head is confident enough for deeper nodes to make the cut. `prune=False`
    drafts every level (the reference the tests compare with).
    """
    committed, k, device = cache.length, cfg.top_k, root_hidden.device
    keep = cfg.total_tokens - 1
    lp = drafter.log_probs(root_hidden[None])[0]  # (Vd,)
    scores, idx = lp.topk(min(k, lp.shape[0]))  # (k,)
    cand_tokens, cand_parents, cand_scores = [drafter.to_target_ids(idx)], [torch.full_like(idx, -1)], [scores]
    cand_depths = [torch.ones_like(idx)]
    frontier = torch.arange(idx.shape[0], device=device)  # candidate ids of the nodes to feed next
    frontier_feat = root_hidden.expand(idx.shape[0], -1)  # (k, H): output that proposed each node
    fed_anc = torch.zeros(0, 0, dtype=torch.bool, device=device)  # ancestry among fed nodes
    fed_parent_slot = torch.full((idx.shape[0],), -1, device=device)  # fed slot of each frontier's parent
    n_cand = idx.shape[0]
    for d in range(1, cfg.depth):
        all_scores = torch.cat(cand_scores)  # (n_cand,)
        if prune and n_cand >= keep:  # prune frontier nodes whose subtrees cannot make the cut
            cut = all_scores.topk(keep).values[-1]
            live = all_scores[frontier] > cut  # (f,)
            if not bool(live.any()):
                break
            if not bool(live.all()):
                frontier, frontier_feat, fed_parent_slot = frontier[live], frontier_feat[live], fed_parent_slot[live]
        tokens = torch.cat(cand_tokens)[frontier]
        f = frontier.shape[0]
        n_fed = fed_anc.shape[0]
        # new rows: ancestors among fed nodes (the parent's row) + itself
        rows = torch.zeros(f, n_fed + f, dtype=torch.bool, device=device)
        has_parent = fed_parent_slot >= 0
        rows[has_parent, :n_fed] = fed_anc[fed_parent_slot[has_parent]]
        rows[:, n_fed:] = torch.eye(f, dtype=torch.bool, device=device)
        fed_anc = torch.cat([torch.cat([fed_anc, torch.zeros(n_fed, f, dtype=torch.bool, device=device)], 1), rows])
        positions = torch.full((f,), committed + d - 1, device=device)
        out = drafter.feed(cache, tokens, frontier_feat, positions, rows)  # (f, H); rows: the tree part
        lp = drafter.log_probs(out)  # (f, Vd)
        child_lp, child_idx = lp.topk(min(k, lp.shape[1]), dim=-1)  # (f, k)
        child_scores = (all_scores[frontier][:, None] + child_lp).flatten()  # (f*k,)
        child_parent = frontier[:, None].expand_as(child_idx).flatten()
        cand_tokens.append(drafter.to_target_ids(child_idx.flatten()))
        cand_parents.append(child_parent)
        cand_scores.append(child_scores)
        cand_depths.append(torch.full_like(child_parent, d + 1))
        best = child_scores.topk(min(k, child_scores.shape[0])).indices  # (k,) among new children
        frontier_feat = out[best // child_idx.shape[1]]
        fed_parent_slot = n_fed + best // child_idx.shape[1]
        frontier = n_cand + best
        n_cand += child_scores.shape[0]
    cache.truncate(committed)
    return _select(torch.cat(cand_tokens), torch.cat(cand_parents), torch.cat(cand_scores),
                   torch.cat(cand_depths), root_token, keep)


def _select(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, depths: torch.Tensor,
            root_token: int, keep: int) -> DraftTree:
    """Keep the `keep` best candidates (a connected tree: a child never outscores its parent)."""
    # tokens, parents, scores, depths: (C,); parents index candidates (-1 = root)
    # stable sort: on a tie (child log-prob rounds to 0) the parent, with the lower index, wins
    order = torch.sort(-scores, stable=True).indices
    chosen = order[:keep].sort().values  # (m,) topological order
    slot = torch.full_like(parents, -1)
    slot[chosen] = torch.arange(1, chosen.shape[0] + 1, device=chosen.device)
    par = parents[chosen]
    tree_parents = torch.where(par >= 0, slot[par.clamp(min=0)], torch.zeros_like(par))
    assert bool((tree_parents >= 0).all()), "draft tree lost a parent"
    root = torch.tensor([root_token], device=tokens.device)
    zero = torch.zeros(1, dtype=torch.long, device=tokens.device)
    return DraftTree(tokens=torch.cat([root, tokens[chosen]]), parents=torch.cat([zero - 1, tree_parents]),
                     depths=torch.cat([zero, depths[chosen]]),
                     scores=torch.cat([zero.to(scores.dtype), scores[chosen]]))


def draft_static(drafter: Drafter, cache: HeadCache, root_token: int, root_hidden: torch.Tensor,
                 cfg: TreeConfig) -> DraftTree:
    """A fixed tree of child ranks (EAGLE-1 style); level by level, one head call per level."""
    paths = sorted(set(cfg.static_paths), key=lambda p: (len(p), p))
    committed, device = cache.length, root_hidden.device
    index = {(): 0}
    tokens, parents, depths = [root_token], [-1], [0]
    hidden = {(): root_hidden}
    fed_slot: dict[tuple[int, ...], int] = {}
    anc_rows: list[torch.Tensor] = []  # per fed node: bool over fed slots (its ancestry)
    max_depth = len(paths[-1])
    for d in range(1, max_depth + 1):
        level = [p for p in paths if len(p) == d]
        by_parent: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for p in level:
            by_parent.setdefault(p[:-1], []).append(p)
        for parent, children in by_parent.items():
            if parent not in hidden:  # the parent's rank exceeded the vocabulary
                continue
            lp = drafter.log_probs(hidden[parent][None])[0]
            ranked = lp.topk(min(max(c[-1] for c in children) + 1, lp.shape[0])).indices
            for c in children:
                if c[-1] < ranked.shape[0]:
                    index[c] = len(tokens)
                    tokens.append(int(drafter.to_target_ids(ranked[c[-1]])))
                    parents.append(index[parent])
                    depths.append(d)
        to_feed = [p for p in level if p in index and any(q[:-1] == p for q in paths if len(q) == d + 1)]
        if not to_feed:
            continue
        n_fed, f = len(anc_rows), len(to_feed)
        rows = torch.zeros(f, n_fed + f, dtype=torch.bool, device=device)
        for r, p in enumerate(to_feed):
            if p[:-1] in fed_slot:
                rows[r, :n_fed] = anc_rows[fed_slot[p[:-1]]][:n_fed]
            rows[r, n_fed + r] = True
        for r, p in enumerate(to_feed):
            fed_slot[p] = n_fed + r
            anc_rows.append(rows[r])
        anc_rows = [torch.cat([a, torch.zeros(n_fed + f - a.shape[0], dtype=torch.bool, device=device)])
                    for a in anc_rows]
        feats = torch.stack([hidden[p[:-1]] for p in to_feed])
        toks = torch.tensor([tokens[index[p]] for p in to_feed], device=device)
        out = drafter.feed(cache, toks, feats, torch.full((f,), committed + d - 1, device=device), rows)
        for r, p in enumerate(to_feed):
            hidden[p] = out[r]
    cache.truncate(committed)
    return DraftTree(tokens=torch.tensor(tokens, device=device), parents=torch.tensor(parents, device=device),
                     depths=torch.tensor(depths, device=device))


def draft(drafter: Drafter, cache: HeadCache, root_token: int, root_hidden: torch.Tensor,
          cfg: TreeConfig) -> DraftTree:
    fn = draft_static if cfg.is_static else draft_dynamic
    return fn(drafter, cache, root_token, root_hidden, cfg)

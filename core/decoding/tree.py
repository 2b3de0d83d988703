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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from core.kernels import native
from core.config import TreeConfig
from core.decoding.drafter import DraftModel
from core.decoding.gumbel import DraftNoise
from core.decoding.head import NATIVE_ROWS, EagleHead, HeadCache, KeyLayout, TreeRows, head_mask, native_rows

if TYPE_CHECKING:
    from core.kernels.step import HeadCall
    from core.kernels.headstep import NativeHead


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor   # (n,) int64 token ids, tokens[0] is the root
    parents: torch.Tensor  # (n,) int64, parents[0] == -1
    depths: torch.Tensor   # (n,) int64, depths[0] == 0
    # (n,) cumulative draft log-prob (dynamic trees), root 0; a factory, not a class attribute, so a tree
    # from from_lists makes it on first reading (__getattr__)
    scores: torch.Tensor | None = field(default_factory=lambda: None)

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        assert self.parents.shape == (n,) and self.depths.shape == (n,) and int(self.parents[0]) == -1

    @property
    def size(self) -> int:
        d = self.__dict__  # the tokens tensor where it exists (reading `host` would copy it off a GPU)
        return d["tokens"].shape[0] if "tokens" in d else len(d["host"][0])

    @functools.cached_property
    def host(self) -> tuple[list[int], list[int], list[int]]:
        """(tokens, parents, depths) as Python lists, what verification and the native step's tree
        call read; kept from the lists the tree was built from (`from_lists`), else read once."""
        return self.tokens.tolist(), self.parents.tolist(), self.depths.tolist()

    @functools.cached_property
    def host_scores(self) -> list[float] | None:
        """`scores` as a list (None without scores): kept from `from_lists`, else read once."""
        return None if self.scores is None else self.scores.tolist()

    @property
    def score_dtype(self) -> torch.dtype:
        lazy = self.__dict__.get("_lazy")
        if lazy is not None:
            return lazy[0]
        return self.scores.dtype if self.scores is not None else torch.float32

    @property
    def device(self) -> torch.device:
        lazy = self.__dict__.get("_lazy")
        return lazy[1] if lazy is not None else self.tokens.device

    @classmethod
    def from_lists(cls, tokens: list[int], parents: list[int], depths: list[int],
                   scores: "list[float] | torch.Tensor | None" = None, score_dtype: torch.dtype = torch.float32,
                   device=None) -> "DraftTree":
        """A tree built from host lists, which it keeps as `host` (scores: a list, or a tensor as it
        is). Its tensors are made when first read: the CPU decode loop reads the lists alone (the
        native step's tree call, verification, grafting), and four small tensors a tree cost
        ~20 us a step in the loop."""
        n = len(tokens)
        assert len(parents) == n and len(depths) == n and parents[0] == -1
        tree = object.__new__(cls)  # the fields below are read lazily (__getattr__)
        d = tree.__dict__
        d["host"] = (tokens, parents, depths)  # functools.cached_property's slot
        d["_lazy"] = (score_dtype if not isinstance(scores, torch.Tensor) else scores.dtype,
                      torch.device(device) if device is not None else torch.device("cpu"))
        if isinstance(scores, torch.Tensor):
            d["scores"] = scores
        else:
            d["host_scores"] = scores
            if scores is None:
                d["scores"] = None
        return tree

    def __getattr__(self, name: str):
        """A field of a tree built by `from_lists`, made from its lists on first reading."""
        lazy = self.__dict__.get("_lazy")
        if lazy is None or name not in _LAZY:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        dtype, device = lazy
        if name == "scores":
            value = torch.tensor(self.__dict__["host_scores"], dtype=dtype, device=device)
        else:
            value = torch.tensor(self.host[_LAZY.index(name)], dtype=torch.int64, device=device)
        object.__setattr__(self, name, value)
        return value

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """bool (n, n): mask[i, j] iff node j is node i or one of its ancestors."""
        return ancestor_mask(self.parents)

    def positions(self, offset: int) -> torch.Tensor:
        return offset + self.depths


_LAZY = ("tokens", "parents", "depths", "scores")  # DraftTree.from_lists' fields, in host order


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


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """(m, Vd) draft logits -> (m, Vd) fp32 log-probabilities. Clamped at 0: rounding can push
    the top one a hair above 0, and a child must never outscore its parent (cumulative scores
    keep the selected tree connected)."""
    return F.log_softmax(logits.float(), dim=-1).clamp(max=0.0)


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, Vd) draft logits -> the min(k, Vd) best log-probabilities (m, k), best first, and their
    indices: one native call for bf16 logits on the CPU (8 x 8,192: 30 us against 140 us for
    torch's four ops), else `log_probs(logits).topk(k)`."""
    k = min(k, logits.shape[-1])
    if native.topk_usable(logits, k):
        return native.topk_log_probs(logits, k)
    return log_probs(logits).topk(k, dim=-1)


@dataclass(frozen=True)
class Drafter:
    """An EAGLE-1/2 head plus the target modules it borrows, drafting over `vocab` (None = the full
    vocabulary): a core.decoding.drafter.DraftModel."""

    head: EagleHead
    embed: torch.nn.Embedding     # the target's input embedding
    lm_weight: torch.Tensor       # (Vd, H): rows of the target's LM head the draft scores
    vocab: torch.Tensor | None    # (Vd,) target ids of those rows, None when Vd == V
    lm_int8: native.Int8Weight | None = None  # lm_weight as int8, where drafting uses it (drafter_for)
    native: "NativeHead | None" = None  # the head as one native call (core.kernels.headstep), where it runs
    # which target hidden states the head reads: None = the last one (after the final norm);
    # an EAGLE-3 drafter (core.decoding.head3.Drafter3) names the fused layers instead
    feature_layers = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: (m, H) -> (m, Vd) draft logits
        if self.lm_int8 is not None and native.linear_s8_usable(hidden, self.lm_int8):
            return native.linear_s8(hidden, self.lm_int8)
        return native.linear(hidden, self.lm_weight) if native.usable(hidden, self.lm_weight) else hidden @ self.lm_weight.T

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: (m, H) -> (m, Vd) draft log-probabilities
        return log_probs(self.logits(hidden))

    def top_log_probs(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden: (m, H) -> the k best draft log-probabilities (m, k), best first, and their draft ids
        return top_log_probs(self.logits(hidden), k)

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.vocab is None else self.vocab[idx]

    @functools.cached_property
    def _vocab_list(self) -> list[int] | None:
        return None if self.vocab is None else self.vocab.tolist()

    def target_id_list(self, idx: torch.Tensor) -> list[int]:
        """to_target_ids(idx).flatten().tolist() through a host copy of the vocabulary (no tensor op)."""
        ids, table = idx.flatten().tolist(), self._vocab_list
        return ids if table is None else [table[i] for i in ids]

    def catch_up_top(self, cache: HeadCache, tokens: torch.Tensor, features: torch.Tensor,
                     k: int) -> "tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None":
        """core.decoding.tree.catch_up_top in one native call (csrc/decode_step.c's head_step_top: the
        same bits as feed, then top_log_probs), where the native head, the int8 draft LM head and
        the native top-k all serve this call; else None (the caller composes them)."""
        m, table = tokens.shape[0], self.embed.weight
        if (not self._top_serves(k) or features.dtype is not torch.bfloat16 or tokens.device != table.device
                or not native_rows(m, features.dtype, self.head.config, features.device)
                or not native.linear_s8_usable(features[-1:], self.lm_int8)):
            return None
        hidden, lp, idx = self.native.catch_up_top(tokens, table, features, cache, self.lm_int8, k)  # embed(tokens) in C
        return hidden, (lp[None], idx[None])

    def top_call(self, cache: HeadCache, n: int, k: int) -> "HeadCall | None":
        """catch_up_top as the head's part of a fused greedy step (core.kernels.step.NativeStep.spec_step_greedy),
        bound to `cache` with room for n rows, where catch_up_top's one native call would serve it; else None."""
        if not self._top_serves(k) or n > NATIVE_ROWS or torch.is_grad_enabled():
            return None
        return self.native.top_call(self.embed.weight, cache, self.lm_int8, k, n)

    def _top_serves(self, k: int) -> bool:
        """What catch_up_top and top_call ask of what does not change (the native head and its int8 LM head,
        the embedding table, k, the native attention for the head's shape), once per k."""
        serves = self._top_serves_k.get(k)
        if serves is None:
            table, c = self.embed.weight, self.head.config
            serves = self._top_serves_k[k] = (
                self.native is not None and self.lm_int8 is not None and table.dtype is torch.bfloat16
                and table.is_contiguous() and 1 <= k <= min(self.lm_int8.q.shape[0], native.TOPK_MAX)
                and native.attention_serves(table.dtype, table.device, c.dim_per_head, c.num_attention_heads,
                                            c.num_key_value_heads) and native.int8_available())
        return serves

    @functools.cached_property
    def _top_serves_k(self) -> dict[int, bool]:
        return {}

    def feed(self, cache: HeadCache, tokens: torch.Tensor, features: torch.Tensor,
             positions: torch.Tensor, allowed: "torch.Tensor | TreeRows | None" = None) -> torch.Tensor:
        """Run the head on m new inputs; tokens (m,), features (m, H) -> next features (m, H).

        `allowed`: None = causal after the cache; bool (m, cache length + m), the whole mask; or
        the tree part (the last T keys; every earlier key is seen), as bool (m, T) or TreeRows:
        see head_mask.
        """
        emb = self.embed(tokens)[None].to(features.dtype)  # (1, m, H)
        mask = head_mask(allowed, cache.length, tokens.shape[0], features.dtype, self.head.config, features.device)
        if self.native is not None and isinstance(mask, KeyLayout):  # the native attention's rows: one call
            return self.native.forward(emb[0], features, positions, mask, cache)
        return self.head(emb, features[None], positions, mask, cache)[0]


def catch_up(drafter: DraftModel, cache: HeadCache, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Commit target features to the head's cache; return the head's last output (H,).

    tokens (m,) are t_{j+1} and features (m, H) are f_j for the next m positions j; the
    last output predicts the feature at the new root, i.e. the root's children.
    """
    assert tokens.shape[0] == features.shape[0]
    start = cache.length
    positions = torch.arange(start, start + tokens.shape[0], device=tokens.device)
    return drafter.feed(cache, tokens, features, positions)[-1]


def catch_up_top(drafter: DraftModel, cache: HeadCache, tokens: torch.Tensor, features: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """catch_up, then the root's k best children: (hidden (H,), (log-probabilities (1, k), draft ids
    (1, k))), what draft_dynamic's first level reads. A drafter with a fused `catch_up_top` (the
    native EAGLE-1/2 head: one call) serves it where it can; else feed, then top_log_probs."""
    fused = getattr(drafter, "catch_up_top", None)
    out = fused(cache, tokens, features, k) if fused is not None else None
    if out is not None:
        return out
    hidden = catch_up(drafter, cache, tokens, features)
    return hidden, drafter.top_log_probs(hidden[None], k)


def draft_dynamic(drafter: DraftModel, cache: HeadCache, root_token: int, root_hidden: torch.Tensor,
                  cfg: TreeConfig, *, prune: bool = True, noise: DraftNoise | None = None,
                  root_top: tuple[torch.Tensor, torch.Tensor] | None = None) -> DraftTree:
    """EAGLE-2 dynamic tree: expand the top_k best nodes per level, then keep the best overall.

    root_hidden: (H,) head output predicting the root's children. The head's cache is
    left at its committed length on return (draft entries are temporary). `noise` (a sampled
    answer): the head's log-probabilities are its perturbed ones (core.decoding.gumbel.DraftNoise),
    so its guesses are coupled to the target's draws.

    Rounds that cannot change the result are skipped: a descendant never outscores its
    ancestor, so a frontier node whose score is at most the `keep`-th best score so far can
    have no descendant in the final selection (and ties go to the earlier candidate). Such
    nodes are not fed, and when no frontier node is left drafting stops early. The tree is
    the one drafting every level would select; a deep tree costs a head call per level only
    while the head is confident enough for deeper nodes to make the cut. `prune=False`
    drafts every level (the reference the tests compare with). `root_top`: the root's best children
    as catch_up_top computed them ((1, k') each, k' >= top_k; unperturbed, so greedy answers only).

    The head calls are tensor work; the bookkeeping around them (a few dozen candidates) runs
    on Python lists, which costs less than the small tensor ops it would otherwise take.
    """
    committed, k, device = cache.length, cfg.top_k, root_hidden.device
    keep = cfg.total_tokens - 1

    def top(hidden: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:  # (m, H) at depth -> (m, k) each
        return drafter.top_log_probs(hidden, k) if noise is None else noise.top_log_probs(drafter, hidden, depth, k)

    if root_top is not None and noise is None and root_top[1].shape[1] >= k:
        lp, idx = root_top[0][:, :k], root_top[1][:, :k]  # best first: the first k are the top k
    else:
        lp, idx = top(root_hidden[None], 0)  # (1, k) each
    score_dtype = lp.dtype
    # candidates, in the order drafted: target token, parent candidate (-1 = root), score, depth
    tokens = _target_ids(drafter, idx[0])
    scores = lp[0].tolist()
    parents, depths = [-1] * len(tokens), [1] * len(tokens)
    frontier = list(range(len(tokens)))  # candidates to feed next, best first
    source, source_rows = root_hidden[None], [0] * len(tokens)  # the head output that proposed each
    fed_ancestry: list[list[int]] = []  # per fed slot: the fed slots of its path, itself last
    parent_slot = [-1] * len(tokens)  # fed slot of each frontier node's parent
    for d in range(1, cfg.depth):
        if prune and len(scores) >= keep:  # prune frontier nodes whose subtrees cannot make the cut
            cut = sorted(scores, reverse=True)[keep - 1]
            live = [j for j, c in enumerate(frontier) if scores[c] > cut]
            if not live:
                break
            if len(live) < len(frontier):
                frontier = [frontier[j] for j in live]
                source_rows, parent_slot = [source_rows[j] for j in live], [parent_slot[j] for j in live]
        f, n_fed = len(frontier), len(fed_ancestry)
        for j in range(f):
            fed_ancestry.append((fed_ancestry[parent_slot[j]] if parent_slot[j] >= 0 else []) + [n_fed + j])
        rows = TreeRows(tuple(map(tuple, fed_ancestry[n_fed:])), n_fed + f)  # the tree part of the mask
        out = drafter.feed(cache, torch.tensor([tokens[c] for c in frontier], device=device),
                           source[source_rows], torch.full((f,), committed + d - 1, device=device), rows)  # (f, H)
        lp, idx = top(out, d)  # (f, kk) each
        kk = idx.shape[1]
        child_lp = lp.tolist()
        child_scores = [scores[c] + x for c, row in zip(frontier, child_lp) for x in row]  # (f * kk,)
        first = len(tokens)
        tokens += _target_ids(drafter, idx)
        parents += [c for c in frontier for _ in range(kk)]
        scores += child_scores
        depths += [d + 1] * len(child_scores)
        best = sorted(range(len(child_scores)), key=lambda i: -child_scores[i])[:k]  # ties: the earlier
        source, source_rows = out, [b // kk for b in best]
        parent_slot = [n_fed + b // kk for b in best]
        frontier = [first + b for b in best]
    cache.truncate(committed)
    return _select(tokens, parents, scores, depths, root_token, keep, score_dtype, device)


def _target_ids(drafter: DraftModel, idx: torch.Tensor) -> list[int]:
    """Draft ids (any shape) -> target ids as a flat list (the drafter's `target_id_list` where it has one)."""
    fast = getattr(drafter, "target_id_list", None)
    return fast(idx) if fast is not None else drafter.to_target_ids(idx.flatten()).tolist()


def _select(tokens: list[int], parents: list[int], scores: list[float], depths: list[int], root_token: int,
            keep: int, score_dtype: torch.dtype, device) -> DraftTree:
    """Keep the `keep` best candidates (a connected tree: a child never outscores its parent)."""
    # parents index candidates (-1 = root); on a tie (a child log-prob of 0) the parent, drafted
    # earlier, wins: the sort is stable
    chosen = sorted(sorted(range(len(scores)), key=lambda i: -scores[i])[:keep])  # topological order
    slot = {c: i + 1 for i, c in enumerate(chosen)}
    assert all(parents[c] < 0 or parents[c] in slot for c in chosen), "draft tree lost a parent"
    return DraftTree.from_lists([root_token] + [tokens[c] for c in chosen], [-1] + [slot.get(parents[c], 0) for c in chosen],
                                [0] + [depths[c] for c in chosen], [0.0] + [scores[c] for c in chosen], score_dtype, device)


def draft_static(drafter: DraftModel, cache: HeadCache, root_token: int, root_hidden: torch.Tensor,
                 cfg: TreeConfig, *, noise: DraftNoise | None = None) -> DraftTree:
    """A fixed tree of child ranks (EAGLE-1 style); level by level, one head call per level.
    `noise`: ranks of the perturbed log-probabilities, as in draft_dynamic."""
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
            h = hidden[parent][None]  # (1, H)
            lp = (drafter.log_probs(h) if noise is None else noise.log_probs(drafter, h, d - 1))[0]
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


def draft(drafter: DraftModel, cache: HeadCache, root_token: int, root_hidden: torch.Tensor,
          cfg: TreeConfig, noise: DraftNoise | None = None,
          root_top: tuple[torch.Tensor, torch.Tensor] | None = None) -> DraftTree:
    """The tree `cfg` describes; `root_top` (catch_up_top's, a dynamic tree's greedy first level) saves a head call."""
    if cfg.is_static:
        return draft_static(drafter, cache, root_token, root_hidden, cfg, noise=noise)
    return draft_dynamic(drafter, cache, root_token, root_hidden, cfg, noise=noise, root_top=root_top)

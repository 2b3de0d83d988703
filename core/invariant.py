"""Batch-invariant kernels: a token's logits come out bit-identical alone or inside a draft tree.

Why: speculative decoding is lossless only if verifying a token inside a tree gives the
bit-identical logits that a plain one-token step would give. In bf16 on CPU, `nn.Linear`
is row-invariant (a row's reduction order does not depend on how many rows are in the
batch), but attention is not: the `p @ V` reduction runs over a key axis whose length and
layout change with the tree (masked siblings sit between a node's ancestors).

How: every query at absolute position p attends to its keys laid out in plain decoding's
order, positions 0..p, cut into fixed blocks of B positions anchored at position 0:
  scores   one GEMM per block, (rows, hd) @ (hd, B)     -- same shape for every block
  softmax  over the concatenated blocks, fp32, masked tail = exact zeros
  p @ V    one GEMM per block, (rows, B) @ (B, hd)      -- a bf16 partial per block
  sum      partials added pairwise in fp32, in block order anchored at block 0
Blocks that hold only committed context are shared by all rows (one batched GEMM; bf16
GEMMs are row-invariant); the one or two blocks holding a row's own ancestors are gathered
per row. A plain step is the same code with a one-node tree, so both compute each row the
same way by construction; `core.probe` checks this on the loaded model at start-up.

Linear layers: bf16 GEMMs here are row-invariant for inner sizes up to 768, but not beyond
(SmolLM2's down_proj, K = 1536, changes rows for some batch sizes). `InvariantLinear` (swapped
in at load, same parameters and state_dict keys) reduces K in fixed chunks of at most 768 and
adds the chunk results in fp32, in order.

The attention function is registered with transformers' AttentionInterface as "eagle_exact"
and receives the tree layout as a keyword argument of the model's forward; without a layout
(the prefill) it falls back to sdpa, which both decoding modes share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAME = "eagle_exact"
BLOCK = 64  # positions per block; a tree deeper than this is refused


@dataclass(frozen=True)
class TreeLayout:
    """Which keys each of the n new rows sees: the committed context plus its own path."""

    committed: int          # L: keys already in the cache before this call
    ancestors: torch.Tensor  # (n, D + 1) int64: tree index of the row's ancestor at each depth, -1 past its own
    depths: torch.Tensor     # (n,) int64: depth of each row (root = 0); its position is L + depth

    @classmethod
    def from_tree(cls, parents: torch.Tensor, depths: torch.Tensor, ancestor_mask: torch.Tensor,
                  committed: int) -> "TreeLayout":
        # parents, depths: (n,); ancestor_mask: bool (n, n), row i marks i and its ancestors
        n, max_depth = depths.shape[0], int(depths.max())
        assert max_depth < BLOCK, f"trees deeper than {BLOCK - 1} are not supported"
        anc = torch.full((n, max_depth + 1), -1, dtype=torch.long, device=depths.device)
        rows, cols = ancestor_mask.nonzero(as_tuple=True)
        anc[rows, depths[cols]] = cols
        return cls(committed=committed, ancestors=anc, depths=depths)

    @classmethod
    def single(cls, committed: int, device) -> "TreeLayout":
        """A plain decoding step: one new token at position `committed`."""
        zero = torch.zeros(1, dtype=torch.long, device=device)
        return cls(committed=committed, ancestors=zero[:, None], depths=zero)


def _row_block_index(layout: TreeLayout, first_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the key index (into cache + new keys) of positions [first_block*B, +2B).

    Returns idx (n, 2B) int64 and valid (n, 2B) bool (False past the row's own position).
    """
    L, n = layout.committed, layout.depths.shape[0]
    pos = first_block * BLOCK + torch.arange(2 * BLOCK, device=layout.depths.device)  # (2B,)
    own = (pos - L)[None].expand(n, -1)  # depth of the ancestor at that position
    in_tree = own >= 0
    depth_idx = own.clamp(0, layout.ancestors.shape[1] - 1)
    anc = layout.ancestors.gather(1, depth_idx)  # (n, 2B)
    valid = pos[None] <= (L + layout.depths)[:, None]
    idx = torch.where(in_tree, L + anc.clamp(min=0), pos[None].clamp(max=max(L - 1, 0)))
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def _pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` in a fixed pairwise order anchored at index 0 (zero padding is exact)."""
    x = x.movedim(dim, 0)
    size = 1 << max(0, (x.shape[0] - 1).bit_length())
    if size > x.shape[0]:
        x = torch.cat([x, x.new_zeros((size - x.shape[0], *x.shape[1:]))])
    while x.shape[0] > 1:
        x = x[0::2] + x[1::2]
    return x[0]


def exact_attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                    tree_layout: TreeLayout | None = None, **kwargs):
    """AttentionInterface function. query (1, nh, n, hd); key/value (1, kvh, L + n, hd)."""
    if tree_layout is None:  # prefill: ordinary causal attention, shared by both modes
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    _, nh, n, hd = query.shape
    kvh, L = key.shape[1], tree_layout.committed
    g = nh // kvh
    assert query.shape[0] == 1 and key.shape[2] == L + n and tree_layout.depths.shape[0] == n
    c = L // BLOCK  # blocks of pure context, shared by every row
    q = query[0].view(kvh, g, n, hd)
    k, v = key[0], value[0]  # (kvh, L + n, hd)

    # shared context blocks: (kvh, c, g*n, hd) @ (kvh, c, hd, B) -> (kvh, c, g*n, B)
    kc = k[:, :c * BLOCK].view(kvh, c, BLOCK, hd)
    vc = v[:, :c * BLOCK].view(kvh, c, BLOCK, hd)
    q_shared = q.reshape(kvh, 1, g * n, hd).expand(kvh, c, g * n, hd)
    s_shared = torch.matmul(q_shared, kc.transpose(-1, -2))
    # the row's own blocks c, c+1 (context tail + its ancestors + itself), gathered per row
    idx, valid = _row_block_index(tree_layout, c)  # (n, 2B)
    kr = k[:, idx].view(kvh, n, 2, BLOCK, hd)
    vr = v[:, idx].view(kvh, n, 2, BLOCK, hd)
    q_rows = q.permute(0, 2, 1, 3)[:, :, None].expand(kvh, n, 2, g, hd)
    s_rows = torch.matmul(q_rows, kr.transpose(-1, -2))  # (kvh, n, 2, g, B)

    # canonical score rows: positions 0 .. (c+2)B - 1, masked past the row's position
    scores = torch.cat([s_shared.view(kvh, c, g, n, BLOCK).permute(0, 3, 2, 1, 4).reshape(kvh, n, g, c * BLOCK),
                        s_rows.permute(0, 1, 3, 2, 4).reshape(kvh, n, g, 2 * BLOCK)], dim=-1) * scaling
    allowed = torch.cat([torch.ones(n, c * BLOCK, dtype=torch.bool, device=q.device), valid], dim=1)
    window = getattr(module, "sliding_window", None) or kwargs.get("sliding_window")
    if window:
        pos = torch.arange(allowed.shape[1], device=q.device)
        allowed = allowed & (pos[None] > (L + tree_layout.depths)[:, None] - window)
    scores = scores.masked_fill(~allowed[None, :, None], float("-inf"))
    p = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # (kvh, n, g, (c+2)B)

    # p @ V per block, bf16 partials, then a fixed-order fp32 sum over blocks
    p_shared = p[..., :c * BLOCK].reshape(kvh, n, g, c, BLOCK).permute(0, 3, 2, 1, 4).reshape(kvh, c, g * n, BLOCK)
    o_shared = torch.matmul(p_shared, vc).view(kvh, c, g, n, hd).permute(0, 3, 2, 1, 4)  # (kvh, n, g, c, hd)
    p_rows = p[..., c * BLOCK:].reshape(kvh, n, g, 2, BLOCK).permute(0, 1, 3, 2, 4)  # (kvh, n, 2, g, B)
    o_rows = torch.matmul(p_rows, vr).permute(0, 1, 3, 2, 4)  # (kvh, n, g, 2, hd)
    out = _pairwise_sum(torch.cat([o_shared, o_rows], dim=3).float(), dim=3).to(query.dtype)  # (kvh, n, g, hd)
    return out.permute(1, 0, 2, 3).reshape(1, n, nh, hd), None


K_CHUNK = 768  # largest inner size measured row-invariant for bf16 GEMMs on this CPU


class InvariantLinear(torch.nn.Linear):
    """nn.Linear whose reduction over in_features runs in fixed chunks (row-invariant)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., K) -> (..., out); chunk partials are added in fp32, left to right
        out = None
        for start in range(0, self.in_features, K_CHUNK):
            part = F.linear(x[..., start:start + K_CHUNK], self.weight[:, start:start + K_CHUNK]).float()
            out = part if out is None else out + part
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


def make_invariant(model: torch.nn.Module) -> int:
    """Swap every nn.Linear with in_features > K_CHUNK for InvariantLinear (in place, same
    weights) and select the exact attention; returns the number of layers swapped."""
    swapped = 0
    for module in model.modules():
        for name, child in module.named_children():
            if type(child) is torch.nn.Linear and child.in_features > K_CHUNK:
                child.__class__ = InvariantLinear  # same parameters, same state_dict keys
                swapped += 1
    model.set_attn_implementation(NAME)
    return swapped


def undo_invariant(model: torch.nn.Module, attention: str = "sdpa") -> None:
    for module in model.modules():
        if type(module) is InvariantLinear:
            module.__class__ = torch.nn.Linear
    model.set_attn_implementation(attention)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, exact_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


register()

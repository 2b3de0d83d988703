"""Batch-invariant kernels: a token's logits come out bit-identical alone or inside a draft tree.

Why: speculative decoding is lossless only if verifying a token inside a tree gives the
bit-identical logits that a plain one-token step would give. In bf16 on CPU, `nn.Linear`
is row-invariant (a row's reduction order does not depend on how many rows are in the
batch), but attention is not: the `p @ V` reduction runs over a key axis whose length and
layout change with the tree (masked siblings sit between a node's ancestors).

How (attention): where core.kernels.native's kernels run (AVX-512 bf16, x86-64 Linux), each row
attends to its keys 0..p in plain decoding's order with one fixed instruction sequence in C,
invariant by construction. Elsewhere, in torch: every query at absolute position p attends
to its keys laid out in plain decoding's order, positions 0..p, cut into fixed blocks of B
positions anchored at position 0:
  scores   one GEMM per block, (rows, hd) @ (hd, B)     -- same shape for every block
  softmax  over the concatenated blocks, fp32, masked tail = exact zeros
  p @ V    one GEMM per block, (rows, B) @ (B, hd)      -- a bf16 partial per block
  sum      partials added pairwise in fp32, in block order anchored at block 0
Blocks that hold only committed context are shared by all rows (one batched GEMM; bf16
GEMMs are row-invariant); the one or two blocks holding a row's own ancestors are gathered
per row. A plain step is the same code with a one-node tree, so both compute each row the
same way by construction; `core.decoding.probe` checks this on the loaded model at start-up.

Linear layers: `InvariantLinear` (swapped in at load, same parameters and state_dict keys)
runs core.kernels.native's AVX-512 bf16 kernel, row-invariant by construction and about twice as fast as
oneDNN on decoding's few rows. Where that kernel is unavailable it falls back to oneDNN, whose
bf16 GEMMs here are row-invariant for inner sizes up to 768 but not beyond (SmolLM2's
down_proj, K = 1536, changes rows for some batch sizes): it then reduces K in fixed chunks of
at most 768 and adds the chunk results in fp32, in order.

The attention function is registered with transformers' AttentionInterface as "eagle_exact"
and receives the tree layout as a keyword argument of the model's forward; without a layout
(the prefill) it falls back to sdpa, which both decoding modes share.
"""

from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.kernels import native

NAME = "eagle_exact"
BLOCK = 64  # positions per block; a tree deeper than this is refused


@dataclass(frozen=True)
class TreeLayout:
    """Which keys each of the n new rows sees, in plain decoding's layout; built once per
    forward and shared by every layer. Row i sits at position L + depths[i] and sees
    positions 0 .. L + depths[i]: the context, then its ancestors, then itself."""

    committed: int           # L: keys already in the cache before this call
    depths: torch.Tensor     # (n,) int64, root = 0
    shared_blocks: int       # c: blocks [0, c) hold only context, shared by every row
    row_blocks: int          # r: blocks [c, c + r) are gathered per row (1, or 2 if a row spills over)
    row_keys: torch.Tensor   # (n, r*B) int64: index into (cache + new keys) of each position there
    bias: torch.Tensor       # (n, (c + r)*B) float32: 0 where the row attends, -inf elsewhere
    ancestors: torch.Tensor  # (n, D + 1) int64: the node at each depth on row i's path, root first

    @classmethod
    def from_tree(cls, parents: torch.Tensor, depths: torch.Tensor, committed: int) -> "TreeLayout":
        # parents, depths: (n,) int64, parents in topological order (root first, parents[0] == -1)
        anc = tree_ancestors(parents, depths)
        max_depth = anc.shape[1] - 1
        assert max_depth < BLOCK, f"trees deeper than {BLOCK - 1} are not supported"
        return cls._build(committed, anc, depths, max_depth)

    @classmethod
    def single(cls, committed: int, device) -> "TreeLayout":
        """A plain decoding step: one new token at position `committed`."""
        zero = torch.zeros(1, dtype=torch.long, device=device)
        return cls._build(committed, zero[:, None], zero, 0)

    @classmethod
    def _build(cls, L: int, anc: torch.Tensor, depths: torch.Tensor, max_depth: int) -> "TreeLayout":
        c = L // BLOCK
        r = (L + max_depth) // BLOCK - c + 1
        n = depths.shape[0]
        pos = c * BLOCK + torch.arange(r * BLOCK, device=depths.device)  # (rB,) absolute positions
        own = (pos - L)[None].expand(n, -1)  # depth of the ancestor at that position (< 0: context)
        ancestor = anc.gather(1, own.clamp(0, anc.shape[1] - 1))  # (n, rB)
        valid = pos[None] <= (L + depths)[:, None]
        keys = torch.where(own >= 0, L + ancestor.clamp(min=0), pos[None].clamp(max=max(L - 1, 0)))
        bias = torch.zeros(n, (c + r) * BLOCK, device=depths.device)
        bias[:, c * BLOCK:].masked_fill_(~valid, float("-inf"))
        return cls(L, depths, c, r, torch.where(valid, keys, torch.zeros_like(keys)), bias, anc)


def tree_ancestors(parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """parents, depths (n,) int64 (topological order, parents[0] == -1) -> (n, D + 1) int64: row
    i's ancestor at each depth, root first, itself at its own depth, -1 past it."""
    return torch.tensor(ancestor_rows(parents.tolist(), depths.tolist()), device=depths.device)


def ancestor_rows(parents: list[int], depths: list[int]) -> list[list[int]]:
    """tree_ancestors on host lists: row i's ancestor at each depth, root first, itself at its own
    depth, -1 past it."""
    anc = [[-1] * (max(depths) + 1) for _ in parents]
    for i, row in enumerate(anc):  # a few dozen nodes: a walk up on lists beats a tensor ancestry mask
        node = i
        while node >= 0:
            row[depths[node]] = node
            node = parents[node]
    return anc


def _pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` in a fixed pairwise order anchored at index 0 (zero padding is exact)."""
    x = x.movedim(dim, 0)
    size = 1 << max(0, (x.shape[0] - 1).bit_length())
    if size > x.shape[0]:
        x = torch.cat([x, x.new_zeros((size - x.shape[0], *x.shape[1:]))])
    while x.shape[0] > 1:
        x = x[0::2] + x[1::2]
    return x[0]


def cached_then_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: int,
                       scaling: float) -> torch.Tensor | None:
    """A prefill chunk's attention after `past` cached rows: query (1, nh, n, hd), key/value (1, kvh, past + n,
    hd) -> (1, n, nh, hd), or None where it does not serve (not a CPU float type). Two flash calls, the
    cached keys unmasked and the chunk's own causally, merged by their log-sum-exp in fp32: the masked
    attention transformers would run instead costs 1.3-1.5x as much there, plus building the mask
    (docs/long-context.md, 2026-12-05). The same inputs give the same bits: a chunk's rows depend on
    its tokens and the cache's rows alone (core.decoding.forward.prefill's fixed chunks)."""
    if not (query.is_cpu and query.dtype in (torch.bfloat16, torch.float16, torch.float32) and query.shape[0] == 1):
        return None
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _, nh, n, hd = query.shape
    kvh = key.shape[1]
    g = nh // kvh
    # the cached keys, unmasked: the g query heads of a kv head as one (g n)-row query (row order does not
    # matter without a mask), so the cached keys are read as stored, not repeated per query head
    out_a, lse_a = flash(query.reshape(1, kvh, g * n, hd), key[:, :, :past].contiguous(), value[:, :, :past].contiguous(),
                         scale=scaling)
    out_a, lse_a = out_a.reshape(1, nh, n, hd), lse_a.reshape(1, nh, n)
    k, v = (t[:, :, past:].repeat_interleave(g, dim=1) if g > 1 else t[:, :, past:].contiguous() for t in (key, value))
    out_b, lse_b = flash(query, k, v, is_causal=True, scale=scaling)  # the chunk's own rows, causal: (1, nh, n, hd)
    top = torch.maximum(lse_a, lse_b)  # (1, nh, n) fp32
    w_a, w_b = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    out = (out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def exact_attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                    tree_layout: TreeLayout | None = None, prefill_past: int = 0, **kwargs):
    """AttentionInterface function. query (1, nh, n, hd); key/value (1, kvh, L + n, hd). prefill_past: a
    prefill chunk's cached rows (core.decoding.forward.prefill), attended by cached_then_causal."""
    if tree_layout is None:  # prefill: ordinary causal attention, shared by both modes
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        window = getattr(module, "sliding_window", None) or kwargs.get("sliding_window")
        if prefill_past and not window and not dropout:
            out = cached_then_causal(query, key, value, prefill_past, scaling)
            if out is not None:
                return out, None
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    _, nh, n, hd = query.shape
    lay = tree_layout
    window = getattr(module, "sliding_window", None) or kwargs.get("sliding_window")
    if not window and native.attention_usable(query, key):  # one fixed sequence per row, in C
        out = native.attention(query[0].transpose(0, 1), key[0], value[0], lay.committed, lay.ancestors,
                               lay.depths + 1, scaling)  # (n, nh, hd)
        return out[None], None
    kvh, L, c, r = key.shape[1], lay.committed, lay.shared_blocks, lay.row_blocks
    g = nh // kvh
    assert query.shape[0] == 1 and key.shape[2] == L + n and lay.depths.shape[0] == n
    q = query[0].view(kvh, g, n, hd)
    k, v = key[0], value[0]  # (kvh, L + n, hd)

    # shared context blocks: (kvh, c, g*n, hd) @ (kvh, c, hd, B) -> (kvh, c, g*n, B)
    # contiguous first: matmul cannot fold (kvh, c) of a cache slice into one batch dim, and its
    # own copy is slower than this one (the same values, so the same GEMMs and results)
    kc = k[:, :c * BLOCK].reshape(kvh, c, BLOCK, hd).contiguous()
    vc = v[:, :c * BLOCK].reshape(kvh, c, BLOCK, hd).contiguous()
    s_shared = torch.matmul(q.reshape(kvh, 1, g * n, hd).expand(kvh, c, g * n, hd), kc.transpose(-1, -2))
    # the row's own blocks (context tail + its ancestors + itself), gathered per row
    flat = lay.row_keys.flatten()
    kr = k.index_select(1, flat).view(kvh, n, r, BLOCK, hd)
    vr = v.index_select(1, flat).view(kvh, n, r, BLOCK, hd)
    q_rows = q.permute(0, 2, 1, 3)[:, :, None].expand(kvh, n, r, g, hd)
    s_rows = torch.matmul(q_rows, kr.transpose(-1, -2))  # (kvh, n, r, g, B)

    # canonical score rows: positions 0 .. (c+r)B - 1, -inf past the row's own position
    scores = torch.cat([s_shared.view(kvh, c, g, n, BLOCK).permute(0, 3, 2, 1, 4).reshape(kvh, n, g, c * BLOCK),
                        s_rows.permute(0, 1, 3, 2, 4).reshape(kvh, n, g, r * BLOCK)], dim=-1) * scaling
    bias = lay.bias
    if window:
        pos = torch.arange(bias.shape[1], device=bias.device)
        bias = bias.masked_fill(pos[None] <= (L + lay.depths)[:, None] - window, float("-inf"))
    p = F.softmax(scores.float() + bias[None, :, None], dim=-1).to(query.dtype)  # (kvh, n, g, (c+r)B)

    # p @ V per block, bf16 partials, then a fixed-order fp32 sum over blocks
    p_shared = p[..., :c * BLOCK].reshape(kvh, n, g, c, BLOCK).permute(0, 3, 2, 1, 4).reshape(kvh, c, g * n, BLOCK)
    o_shared = torch.matmul(p_shared, vc).view(kvh, c, g, n, hd).permute(0, 3, 2, 1, 4)  # (kvh, n, g, c, hd)
    p_rows = p[..., c * BLOCK:].reshape(kvh, n, g, r, BLOCK).permute(0, 1, 3, 2, 4)  # (kvh, n, r, g, B)
    o_rows = torch.matmul(p_rows, vr).permute(0, 1, 3, 2, 4)  # (kvh, n, g, r, hd)
    out = _pairwise_sum(torch.cat([o_shared, o_rows], dim=3).float(), dim=3).to(query.dtype)  # (kvh, n, g, hd)
    return out.permute(1, 0, 2, 3).reshape(1, n, nh, hd), None


K_CHUNK = 768  # largest inner size measured row-invariant for oneDNN's bf16 GEMMs on this CPU


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's F.linear made row-invariant: the inner size reduced in fixed chunks of K_CHUNK,
    partials added in fp32, left to right."""
    out = None
    for start in range(0, weight.shape[1], K_CHUNK):
        part = F.linear(x[..., start:start + K_CHUNK], weight[:, start:start + K_CHUNK]).float()
        out = part if out is None else out + part
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def prompt_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A call of more than native.MAX_ROWS rows (a prompt's prefill): the native GEMM where it runs on AMX
    tiles (native.prompt_usable), else oneDNN in fixed inner chunks."""
    if native.prompt_usable(x, weight):
        return native.linear(x, weight, bias)
    return chunked_linear(x, weight, bias)


class InvariantLinear(torch.nn.Linear):
    """nn.Linear computing each row independently of the others in the batch (row-invariant)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native.usable(x, self.weight):
            return native.linear(x, self.weight, self.bias)
        return prompt_linear(x, self.weight, self.bias)


_prefill = threading.local()

# In a prefill, a block layer's call of this many rows or more takes the prompt GEMM where that runs on AMX
# tiles: ~40 ms of dequantizing for SmolLM2's every layer, then ~0.55 ms a row against the 8-bit kernel's
# ~0.95 ms (integer work per row). Measured on the Intel AMX VM (2026-12-05, prefill of T tokens, one process
# alternating, medians; the tiles then read a dequantized copy, now they dequantize in cache at the same
# cost): 32 tokens 49 / 59 ms (8-bit / tiles), 64: 75 / 73, 128: 127 / 110, 256: 243 / 177, 512: 502 / 335.
# 96: past the crossover (64-80 rows).
PROMPT_TILE_ROWS = 96


@contextmanager
def reading_prompt(keep_weights: bool = False):
    """Inside the block (a prompt's prefill, core.decoding.forward.prefill): BlockLinear calls of at least
    PROMPT_TILE_ROWS rows take the prompt GEMM where it runs on tiles (decoding's calls never do: a row's
    numerics there must not depend on the rows beside it; a prefill chunk's rows follow from its position).
    keep_weights (a prompt of several chunks): where the tiles do not serve, each BlockLinear dequantizes its
    blocks once and keeps the bf16 copy for the later chunks, a whole model's copy while the prefill runs
    (270 MB for SmolLM2-135M), freed after it; without it every chunk dequantized every weight again."""
    outer = getattr(_prefill, "weights", None), getattr(_prefill, "active", False)
    _prefill.active = True
    _prefill.weights = outer[0] if outer[0] is not None else {} if keep_weights else None
    try:
        yield
    finally:
        _prefill.weights, _prefill.active = outer


class BlockLinear(InvariantLinear):
    """A linear layer whose weight lives only as GGUF blocks (core.kernels.quant; `weight` is empty):
    decoding-sized calls multiply the blocks in place (native.linear_w), longer ones (a prompt's prefill:
    more than native.MAX_ROWS rows, or PROMPT_TILE_ROWS inside reading_prompt where the tiles serve) run on
    AMX tiles, each 16 x 32 tile dequantized into cache (native.linear_tiles), or elsewhere dequantize the
    blocks to their bf16 values for oneDNN (prompt_linear). Made by core.kernels.step once the native step
    serves from the blocks; make_invariant and undo_invariant leave it as it is."""

    wmat: native.WMat
    blocks: object  # core.kernels.quant.Blocks that wmat points into

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = x.dtype is torch.bfloat16 and x.is_cpu and not (torch.is_grad_enabled() and x.requires_grad)
        if kernels and x.numel() <= native.MAX_ROWS * x.shape[-1] and not self._on_tiles(x):
            return native.linear_w(x, self.wmat, self.bias)
        if kernels and native.status().isa == "avx2":
            # AVX2 has no bf16 dot product: a dequantized prompt GEMM costs several times the blocks' own kernel
            # per row (a 1,000-token prompt: 53% of its time in the bf16 GEMM), so the blocks' kernel serves
            # every call, MAX_ROWS rows at a time; a row's bits do not depend on the rows beside it.
            rows = x.reshape(-1, x.shape[-1])
            step = native.MAX_ROWS
            out = torch.cat([native.linear_w(rows[i:i + step], self.wmat, self.bias) for i in range(0, rows.shape[0], step)])
            return out.view(*x.shape[:-1], out.shape[-1])
        if kernels and native.tiles_serve(self.wmat):
            return native.linear_tiles(x, self.wmat, self.bias)  # blocks dequantized tile by tile, no copy
        kept = getattr(_prefill, "weights", None)  # reading_prompt(keep_weights=True): dequantized once per prefill
        weight = kept.get(id(self)) if kept is not None else None
        if weight is None:
            weight = native.dequantize(self.wmat)  # (N, K) bf16, a few MB, gone after the call
            if kept is not None:
                kept[id(self)] = weight
        return prompt_linear(x, weight, self.bias) if x.dtype is torch.bfloat16 else F.linear(
            x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def _on_tiles(self, x: torch.Tensor) -> bool:
        """A prefill call of PROMPT_TILE_ROWS rows or more, where the tiles read these blocks."""
        return (getattr(_prefill, "active", False) and x.numel() >= PROMPT_TILE_ROWS * x.shape[-1]
                and native.tiles_serve(self.wmat))


# transformers' RMSNorm classes that compute weight * bf16(x / rms(x)), as native.rms_norm does
NATIVE_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")


@functools.cache
def _native_norm(base: type) -> type:
    """A subclass of transformers' `base` norm whose forward runs native.rms_norm where it can."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if native.norm_usable(hidden_states, self.weight):
            return native.rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return base.forward(self, hidden_states)

    return type(f"Native{base.__name__}", (base,), {"forward": forward, "__module__": __name__, "native_base": base})


def swap_norms(model: torch.nn.Module) -> int:
    """Turn transformers' Llama-style RMSNorms into their native subclass (same weights) where
    core.kernels.native runs; returns the number swapped."""
    if not native.status().available:
        return 0
    swapped = 0
    for module in model.modules():
        if type(module).__name__ in NATIVE_NORMS and hasattr(module, "variance_epsilon"):
            module.__class__ = _native_norm(type(module))
            swapped += 1
    return swapped


# transformers' MLP classes computing down(act(gate(x)) * up(x)); with SiLU, native.silu_mul
# computes act(gate) * up with one fixed vector sequence per element (csrc/silu_mul.c). torch's
# SiLU splits its elementwise loop by a grain size and runs a scalar tail with another exp, so a
# tree row's element could round differently from the plain step's.
NATIVE_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP")


@functools.cache
def _native_mlp(base: type) -> type:
    """A subclass of transformers' `base` MLP whose SiLU x up runs native.silu_mul where it can."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if native.silu_mul_usable(gate, up):
            return self.down_proj(native.silu_mul(gate, up))
        return self.down_proj(self.act_fn(gate) * up)

    return type(f"Native{base.__name__}", (base,), {"forward": forward, "__module__": __name__, "native_base": base})


def swap_mlps(model: torch.nn.Module) -> int:
    """Turn SiLU-gated MLPs (NATIVE_MLPS) into their native subclass where core.kernels.native runs."""
    if not native.status().available:
        return 0
    swapped = 0
    for module in model.modules():
        if type(module).__name__ in NATIVE_MLPS and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"):
            module.__class__ = _native_mlp(type(module))
            swapped += 1
    return swapped


def swap_linears(model: torch.nn.Module) -> int:
    """Turn the nn.Linear layers that need it into InvariantLinear (in place, same weights):
    all of them when core.kernels.native's kernel runs here (it is also the fast one), else those with
    in_features > K_CHUNK. Returns the number swapped."""
    every = native.status().available
    swapped = 0
    for module in model.modules():
        for child in module.children():
            if type(child) is torch.nn.Linear and (every or child.in_features > K_CHUNK):
                child.__class__ = InvariantLinear  # same parameters, same state_dict keys
                swapped += 1
    return swapped


class Int8DraftLinear(InvariantLinear):
    """A draft head's linear layer that runs decoding-sized calls on an int8 copy of its weight
    (core.kernels.native.linear_s8: half the bytes to stream, about 1% error); longer calls (a prompt's
    catch-up) and anything the int8 kernel does not serve keep the bf16 weight. The parameters
    and state_dict are the layer's own; the int8 copy is derived from them (`quantize_linears`)."""

    int8: native.Int8Weight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None and native.linear_s8_usable(x, self.int8):
            return native.linear_s8(x, self.int8, self.bias)
        return super().forward(x)


DRAFT_INT8_ENV = "EAGLE_CHAT_DRAFT_INT8"  # "0": draft with the bf16 weights


def draft_int8_enabled(weight: torch.Tensor) -> bool:
    """Whether a draft head with this (bf16, CPU) weight drafts from int8 copies: the int8 kernel
    runs here and EAGLE_CHAT_DRAFT_INT8 is not 0."""
    return (os.environ.get(DRAFT_INT8_ENV, "1") != "0" and weight.dtype is torch.bfloat16 and weight.is_cpu
            and native.int8_available())


def quantize_linears(module: torch.nn.Module, keep: tuple[str, ...] = ("fc",)) -> int:
    """Turn a draft head's linear layers into Int8DraftLinear, each with an int8 copy of its
    weight, except those named in `keep`; returns the number quantized (0 where the int8
    kernel does not run). The default keeps `fc` in bf16: its input is the target's features
    (with the token embedding), whose outlier channels make one int8 scale per row too coarse;
    quantizing it cost 2.3% of held-out tau against 0.4-0.7% for the rest together."""
    done = 0
    for parent in list(module.modules()):
        for name, child in parent.named_children():
            if name not in keep and type(child) in (torch.nn.Linear, InvariantLinear) and draft_int8_enabled(child.weight):
                child.__class__ = Int8DraftLinear
                child.int8 = native.quantize(child.weight)
                done += 1
    return done


def make_invariant(model: torch.nn.Module) -> int:
    """Swap in InvariantLinear (`swap_linears`) and select the exact attention; returns the
    number of layers swapped."""
    swapped = swap_linears(model)
    swap_norms(model)
    swap_mlps(model)
    model.set_attn_implementation(NAME)
    return swapped


def undo_invariant(model: torch.nn.Module, attention: str = "sdpa") -> None:
    for module in model.modules():
        if type(module) in (InvariantLinear, Int8DraftLinear):
            module.__class__ = torch.nn.Linear
        elif "native_base" in vars(type(module)):  # a _native_norm subclass
            module.__class__ = type(module).native_base
    model.set_attn_implementation(attention)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, exact_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


register()

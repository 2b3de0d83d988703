"""The EAGLE-1/2 head's forward as one native call (csrc/decode_step.c's head_step).

A drafting call on the head is a few rows through fc and one decoder layer: about 20 small
kernels, each behind a Python and torch dispatch that costs more than the kernel (a catch-up
of 2-3 rows took ~1 ms in Python, most of it dispatch). head_step runs fc and the layers in
one OpenMP team on the decode step's kernels, from the head's weights as Q4_1 blocks (the target
layers' format: 0.63 bytes a weight, 2.6 MB for the shipped head's layer and fc) times 8-bit
activations (csrc/gemm_x8.c). `EAGLE_CHAT_HEAD_BLOCKS=Q8_0` keeps them as Q8_0 (1.06 bytes a weight,
4.5 MB), the format until 2026-12-05: the head's weights stream from memory again after every target
forward, and on the Intel VM of 2026-12-05 the Q4_1 call took 0.30-0.41 ms against 0.32-0.57 (4.8%
of a speculative step against 6.4-7.0%) at the same acceptance (tau 2.01 against 2.00, 12
hand-written prompts; docs/native-step.md, tenth session).

Only which tokens the tree proposes can change with the draft numerics; the target verifies
every proposal, so the output is plain decoding's either way. The Python head with the same
blocks (invariant.BlockLinear) computes the same bits (tests/test_headstep.py).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from core.config import switched_off
from core.kernels import native, quant
from core.decoding.head import EagleHead, HeadCache, KeyLayout
from core.kernels.step import _PROJ, HeadCall, StepError, _Layer, _Model, rotary_table

NATIVE_HEAD_ENV = "EAGLE_CHAT_NATIVE_HEAD"  # "0" turns the native head off (the Python head drafts)
_TABLE = 4096  # rotary table rows at start (grown by doubling)


HEAD_BLOCKS_ENV = "EAGLE_CHAT_HEAD_BLOCKS"  # the native head's weight blocks: Q4_1 (default) or Q8_0
HEAD_BLOCKS = ("Q4_1", "Q8_0")


def head_block_kind() -> str:
    """The block type the native head's weights are quantized to (HEAD_BLOCKS_ENV, else Q4_1)."""
    kind = os.environ.get(HEAD_BLOCKS_ENV, "").strip().upper() or HEAD_BLOCKS[0]
    if kind not in HEAD_BLOCKS:
        raise StepError(f"{HEAD_BLOCKS_ENV}={kind!r}: the native head takes {' or '.join(HEAD_BLOCKS)} blocks")
    return kind


def weight_blocks(weight: torch.Tensor, kind: str) -> quant.Blocks:
    """A (N, K) weight as `kind` blocks (a gguf block type: Q4_1, Q8_0; gguf's quantizer) packed for csrc/gemm_x8.c."""
    from gguf import GGMLQuantizationType, quants

    t = GGMLQuantizationType[kind]
    w = weight.detach().float().cpu().numpy()
    raw = quants.quantize(w, t)
    return quant.pack_x8(quant.Blocks(int(t), torch.from_numpy(np.ascontiguousarray(raw)), *weight.shape))


def head_blocks(head: EagleHead, kind: str) -> dict[str, quant.Blocks]:
    """Every linear weight of the head (fc and its layers' projections) as `kind` blocks, by state_dict name, side
    by side in huge-page memory (core.kernels.hugepages: the head re-reads them after every target forward)."""
    from core.kernels.hugepages import Arena

    arena = Arena()
    return {f"{name}.weight": arena.place_blocks(weight_blocks(m.weight, kind)) for name, m in head.named_modules()
            if isinstance(m, torch.nn.Linear) and m.weight.numel()}


def unsupported(head) -> str | None:
    """Why the native head cannot run `head` here, or None."""
    if switched_off(NATIVE_HEAD_ENV):
        return f"{NATIVE_HEAD_ENV}=0"
    if not native.status().available:
        return f"native kernels unavailable ({native.status().reason})"
    if not isinstance(head, EagleHead):
        return "an EAGLE-3 head"
    c = head.config
    if head.fc.weight.dtype is not torch.bfloat16 or head.fc.weight.device.type != "cpu":
        return "a head that is not bf16 on the CPU"
    from core.kernels.invariant import draft_int8_enabled

    if not draft_int8_enabled(head.fc.weight):
        return "8-bit drafting is off (EAGLE_CHAT_DRAFT_INT8=0) or its kernel does not run here"
    if not head.rotary.static:
        return "a rotary scaling whose frequencies depend on the length"
    hd = c.dim_per_head
    if hd % 32 or hd > 256 or c.hidden_size % 32 or c.intermediate_size % 32 or c.hidden_act != "silu":
        return f"shapes the kernels do not take (hidden {c.hidden_size}, head_dim {hd}, ffn {c.intermediate_size})"
    if any(l.self_attn.q_proj.bias is not None for l in head.layers):
        return "projection biases"
    return None


class NativeHead:
    """The head's fc and decoder layers as one native call over Q4_1 (or Q8_0) copies of its weights.
    Holds the C structures and the blocks they point into; the head's KV cache stays the
    caller's HeadCache (bound per call: it grows by reallocation)."""

    def __init__(self, head: EagleHead, blocks: dict[str, quant.Blocks] | None = None):
        reason = unsupported(head)
        if reason:
            raise StepError(f"the native head cannot run this head: {reason}")
        c = head.config
        self.head = head
        if blocks is None:
            self.block_kind = head_block_kind()  # the setting read once: the blocks and their name agree
            blocks = head_blocks(head, self.block_kind)
        else:
            self.block_kind = "/".join(sorted({b.type_name for b in blocks.values()}))
        self.blocks = blocks
        w = lambda name: native.wmat(blocks=self.blocks[name])  # noqa: E731
        layers = (_Layer * len(head.layers))()
        for i, layer in enumerate(head.layers):
            for p in _PROJ:
                part = "self_attn" if p in ("q", "k", "v", "o") else "mlp"
                setattr(layers[i], p, w(f"layers.{i}.{part}.{p}_proj.weight"))
            layers[i].ln1 = None  # the published heads' layer has no input norm
            layers[i].ln2 = layer.post_attention_layernorm.weight.detach().data_ptr()
        self._layers = layers
        self._fc = w("fc.weight")
        self._fc_bias = None if head.fc.bias is None else head.fc.bias.detach().contiguous()
        hd = c.dim_per_head
        self._m = _Model(layers=len(head.layers), hidden=c.hidden_size, heads=c.num_attention_heads,
                         kv_heads=c.num_key_value_heads, head_dim=hd, ffn=c.intermediate_size, vocab=0,
                         eps=head.layers[0].post_attention_layernorm.eps, scale=hd ** -0.5, layer=layers)
        self._tables(_TABLE)
        self._logits: torch.Tensor | None = None  # catch_up_top's scratch: the draft LM head's row
        self._top_args: dict[tuple[int, int, int], tuple] = {}  # top_call's fixed arguments by (embedding, LM head, k)

    @property
    def weight_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks.values())

    def _tables(self, size: int) -> None:
        """cos / sin (size, head_dim) bf16: the head's rotary table (the values its Python path uses)."""
        self._cos, self._sin = rotary_table(self.head.rotary, self.head.fc.weight.new_empty(0), size)
        self._m.cos, self._m.sin, self._m.max_pos = self._cos.data_ptr(), self._sin.data_ptr(), size

    def _bind(self, top: int, cache: HeadCache, n: int) -> int:
        """Grow the rotary table to position `top`, make room for n rows in `cache` and point the
        layers at its buffers (it grows by reallocation); returns the slot the rows' keys go to."""
        if top >= self._m.max_pos:
            self._tables(max(2 * self._m.max_pos, top + 1))
        at = cache.length
        cache.reserve(at + n)
        for i in range(len(self.head.layers)):
            k, v = cache.layer_keys[i], cache.layer_values[i]  # (1, kvh, capacity, hd)
            self._layers[i].kc, self._layers[i].vc, self._layers[i].kv_head = k.data_ptr(), v.data_ptr(), k.stride(1)
        return at

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: KeyLayout,
                cache: HeadCache) -> torch.Tensor:
        """embeds, features (n, H) bf16; positions (n,); row i sees head-cache slots [0,
        mask.committed) and mask.committed + mask.ancestors[i, :mask.counts[i]] -> (n, H), the
        head's outputs; the rows' keys and values are appended to `cache`."""
        n, H = features.shape
        at = self._bind(int(positions.max()), cache, n)
        xin = torch.cat([embeds, features], dim=-1).to(torch.bfloat16).contiguous()  # (n, 2H)
        positions = positions.to(torch.int64).contiguous()
        anc, counts = mask.ancestors.to(torch.int64).contiguous(), mask.counts.to(torch.int64).contiguous()
        out = torch.empty(n, H, dtype=torch.bfloat16)
        code = native._library()[0].head_step(
            ctypes.byref(self._m), ctypes.byref(self._fc), None if self._fc_bias is None else self._fc_bias.data_ptr(),
            xin.data_ptr(), positions.data_ptr(), n, mask.committed, at, anc.data_ptr(), anc.stride(0),
            counts.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if code:
            raise StepError(f"the native head failed (code {code})")
        cache.length = at + n
        return out

    def catch_up_top(self, tokens: torch.Tensor, embed: torch.Tensor, features: torch.Tensor, cache: HeadCache,
                     lm: native.Int8Weight, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A catch-up and the next root's proposal in one call (csrc/decode_step.c's head_step_top):
        tokens (n,) int64 whose rows of `embed` (the target's input embedding (V, H) bf16) are the
        head's embeddings, features (n, H) bf16, causal after the cache -> (the last row's output (H,),
        the k best draft log-probabilities (k,) fp32 of the LM head `lm` on it, best first, and their
        draft ids (k,)); the same bits as `forward` on embed[tokens], native.linear_s8 and
        native.topk_log_probs in turn. The C gathers the embeddings and numbers the positions."""
        n, H = features.shape
        vocab = lm.q.shape[0]
        if not 1 <= k <= min(vocab, native.TOPK_MAX):
            raise ValueError(f"the proposal's k must be in 1..{min(vocab, native.TOPK_MAX)}, got {k}")
        if not (embed.dtype is torch.bfloat16 and embed.is_contiguous() and embed.shape[1] == H
                and features.dtype is torch.bfloat16 and tokens.shape == (n,)):
            raise StepError(f"catch_up_top needs bf16 embeddings (V, {H}) and features (n, {H}) and n token ids; got "
                            f"{embed.dtype} {tuple(embed.shape)}, {features.dtype} {tuple(features.shape)}, "
                            f"{tuple(tokens.shape)}")
        at = self._bind(cache.length + n - 1, cache, n)
        tokens, features = tokens.to(torch.int64).contiguous(), features.contiguous()
        if self._logits is None or self._logits.shape[0] != vocab:
            self._logits = torch.empty(vocab, dtype=torch.bfloat16)  # the call's scratch
        out = torch.empty(n, H, dtype=torch.bfloat16)
        vals, idx = torch.empty(k, dtype=torch.float32), torch.empty(k, dtype=torch.int64)
        code = native._library()[0].head_step_top(
            ctypes.byref(self._m), ctypes.byref(self._fc), None if self._fc_bias is None else self._fc_bias.data_ptr(),
            tokens.data_ptr(), embed.data_ptr(), embed.shape[0], features.data_ptr(), n, at, out.data_ptr(),
            lm.q.data_ptr(), lm.scale.data_ptr(), lm.sums.data_ptr(), vocab, self._logits.data_ptr(), vals.data_ptr(),
            idx.data_ptr(), k, torch.get_num_threads())
        if code:
            raise StepError(f"the native head failed (code {code}{': a token id outside the embedding' if code == -2 else ''})")
        cache.length = at + n
        return out[-1], vals, idx

    def top_call(self, embed: torch.Tensor, cache: HeadCache, lm: native.Int8Weight, k: int, n: int) -> HeadCall:
        """catch_up_top's call as the head's part of a fused greedy step (core.kernels.step.NativeStep.spec_step_greedy):
        `cache` bound with room for a catch-up of up to n rows, new output buffers, and the arguments in
        csrc/decode_step.c's order (catch_up_top's checks, made once per embedding, LM head and k)."""
        fixed = self._top_args.get((embed.data_ptr(), lm.q.data_ptr(), k))
        if fixed is None:
            H, vocab = self._m.hidden, lm.q.shape[0]
            if not 1 <= k <= min(vocab, native.TOPK_MAX):
                raise ValueError(f"the proposal's k must be in 1..{min(vocab, native.TOPK_MAX)}, got {k}")
            if not (embed.dtype is torch.bfloat16 and embed.is_contiguous() and embed.dim() == 2 and embed.shape[1] == H):
                raise StepError(f"a fused step's head needs bf16 embeddings (V, {H}); got {embed.dtype} {tuple(embed.shape)}")
            scratch = torch.empty(vocab, dtype=torch.bfloat16)  # the draft LM head's row
            fixed = self._top_args[(embed.data_ptr(), lm.q.data_ptr(), k)] = (
                (ctypes.byref(self._m), ctypes.byref(self._fc),
                 None if self._fc_bias is None else self._fc_bias.data_ptr(), embed.data_ptr(), embed.shape[0]),
                (lm.q.data_ptr(), lm.scale.data_ptr(), lm.sums.data_ptr(), vocab, scratch.data_ptr()), scratch)
        head, lm_args, _ = fixed
        at = self._bind(cache.length + n - 1, cache, n)
        out = torch.empty(n, self._m.hidden, dtype=torch.bfloat16)
        vals, idx = torch.empty(k, dtype=torch.float32), torch.empty(k, dtype=torch.int64)
        return HeadCall(at, (*head, out.data_ptr(), *lm_args, vals.data_ptr(), idx.data_ptr(), k), out, vals, idx)


def native_head(head) -> NativeHead | None:
    """The native head for `head` where it can run (else None: the Python head drafts)."""
    if unsupported(head):
        return None
    try:
        return NativeHead(head)
    except (StepError, quant.QuantWeightError, ValueError):
        return None

"""A GGUF file's weights as its own 4- and 8-bit blocks, for the native decode step (core.kernels.step).

The embedded model ships as a GGUF (Q4_1 layers, a Q8_0 embedding that is also the tied LM
head). transformers reads it only by dequantizing every weight to fp32, and the bf16 copy the
engine computes with holds exactly those values rounded to bf16. The native GEMMs read the
blocks themselves and dequantize them in registers to those same bf16 values
(csrc/dequant.c), so the logits are bit-identical to the bf16 path while the weights stay at
the file's size (92 MB for SmolLM2-135M instead of 270 MB in bf16).

Loading checks every tensor the step needs: its type must be one the kernels read
(SUPPORTED), its shape the model's, its bytes all present; anything else raises a
`QuantWeightError` that names the tensor, so the caller can keep serving the bf16 path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

# ggml type id -> (name, bytes per block of 32 weights); csrc/weights.h has the same ids
SUPPORTED = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34)}
BLOCK = 32
# our layouts for 8-bit activations (csrc/gemm_x8.c): type id -> (name, bytes per 16 rows x 32 columns)
SPLIT = 102  # split_q8's layout (csrc/weights.h WT_Q8_SPLIT)
X8 = {100: ("Q4x8", 320), 101: ("Q8x8", 544), SPLIT: ("Q8x8 split", 544), 103: ("Q5x8", 384), 104: ("Q6x8", 420),
      105: ("Q4Kx8", 296), 107: ("Q40x8", 288), 108: ("Q5Kx8", 360)}
# GGUF's Q5_1 (fp16 d, fp16 m, 32 fifth bits, 16 bytes of low nibbles): what Q5_0, Q5_1 and Q5_K tensors are read
# as for 8-bit activations (repacked; never on the bf16-exact q4 path)
Q5_1 = 7
# GGUF's Q6_K cut into blocks of 32 values (our own block, not a GGUF type; q6_halves): fp16 d, the two 16-value
# sub-blocks' int8 scales, 16 bytes of low nibbles (Q4's byte order), 8 bytes of the codes' two high bits
Q6_HALVES = 106
# GGUF's Q4_K and Q5_K as they are (144- and 176-byte super-blocks of 256 values: 18 and 22 bytes per 32), read only
# for 8-bit activations
Q4_K, Q5_K = 12, 13
K_SUPER = {Q4_K: 144, Q5_K: 176}  # bytes per 256 values
X8_OF = {2: 107, 3: 100, 8: 101, Q5_1: 103, Q6_HALVES: 104, Q4_K: 105, Q5_K: 108}  # the layout each type is packed in
X8_BITS = {100: 4, 107: 4, 105: 4, 103: 5, 108: 5, 104: 6, 101: 8, SPLIT: 8}  # each layout's weight code width
BLOCK_TYPES = {**SUPPORTED, Q5_1: ("Q5_1", 24), Q6_HALVES: ("Q6_K", 28), Q4_K: ("Q4_K", 18), Q5_K: ("Q5_K", 22)}

# transformers' parameter name (per layer) -> the GGUF tensor name
LAYER_TENSORS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                 "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def layer_tensor_names(layer: int) -> dict[str, str]:
    """Decoder layer `layer`'s linear weights: transformers' full parameter name -> the GGUF tensor name."""
    return {f"model.layers.{layer}.{'self_attn' if theirs.startswith('attn') else 'mlp'}.{ours}.weight":
            f"blk.{layer}.{theirs}.weight" for ours, theirs in LAYER_TENSORS.items()}


class QuantWeightError(ValueError):
    """A GGUF tensor the native step cannot read; the message names it and what is supported."""


@dataclass(frozen=True)
class Blocks:
    """One weight (N, K) as GGUF blocks: N rows of K / 32 blocks of `type`."""

    type: int             # ggml type id, a key of SUPPORTED
    data: torch.Tensor    # (N, K // 32 * block bytes) uint8, contiguous
    n: int
    k: int
    tiled: bool = False   # data in tile_blocks' order (the same bytes, another order)
    source: str = ""      # the file's type where these blocks were converted from it (repacked, requantized_q8)

    @property
    def type_name(self) -> str:
        return (BLOCK_TYPES.get(self.type) or X8[self.type])[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _supported_text() -> str:
    return ", ".join(name for name, _ in SUPPORTED.values())


def read_blocks(tensor: "GGUFTensor", n: int, k: int, requantize: bool = False) -> Blocks:
    """A GGUF tensor (open_gguf's) -> Blocks, checked against the expected (n, k). requantize: a type
    the kernels do not read (SUPPORTED) comes back in one they do instead of raising: Q4_K and Q5_K as they
    are, Q5_0 and Q5_1 as Q5_1, Q6_K as Q6_HALVES (repacked: the same codes), any other type gguf
    de-quantizes (F16, Q3_K, ...) as Q8_0 blocks of its values (requantized_q8)."""
    name, kind = tensor.name, tensor.type
    if kind not in SUPPORTED and not requantize:
        raise QuantWeightError(f"GGUF tensor {name} has type {tensor.type_name}; the native step reads "
                               f"{_supported_text()}: run the bf16 path (--weights bf16) or convert the file")
    shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    if shape != (n, k) or k % BLOCK:
        raise QuantWeightError(f"GGUF tensor {name} has shape {shape}, the model needs {(n, k)}")
    if kind not in SUPPORTED:
        return repacked(tensor, n, k) or requantized_q8(tensor, n, k)
    row = k // BLOCK * SUPPORTED[kind][1]
    data = np.asarray(tensor.data)
    if data.size != n * row:
        raise QuantWeightError(f"GGUF tensor {name} holds {data.size} bytes, {n} x {k} {SUPPORTED[kind][0]} "
                               f"needs {n * row}: the file is truncated or damaged; reinstall it")
    return Blocks(kind, torch.from_numpy(np.array(data, dtype=np.uint8).reshape(n, row)), n, k)


# how a tensor of another type reaches the kernels (read_blocks' requantize), as the step's text says it
REPACKED = {"Q4_K": "as 4-bit blocks with their own scales (exactly)", "Q5_0": "as Q5_1 (exactly)",
            "Q5_1": "as 5-bit blocks", "Q5_K": "as 5-bit blocks with their own scales (exactly)",
            "Q6_K": "as 6-bit blocks (exactly)"}


def k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks' 12 bytes of six-bit scales and minimums (..., 12) -> sc, mn (..., 8), uint8."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def nibble_bytes(codes: np.ndarray) -> np.ndarray:
    """Codes (..., 32) -> GGUF's 16 bytes of low 4 bits (Q4's order: code i in byte i's low nibble, 16 + i high)."""
    return (codes[..., :16] & 15) | ((codes[..., 16:] & 15) << 4)


def nibble_codes(qs: np.ndarray) -> np.ndarray:
    """GGUF's 16 bytes of 4-bit codes in Q4's order (..., 16) -> the codes (..., 32); nibble_bytes' inverse."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def q5_1_blocks(d: np.ndarray, m: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """fp16 d, m (B,) and 5-bit codes (B, 32) -> GGUF Q5_1 blocks (B, 24): d, m, the fifth bits (bit e of a
    little-endian uint32: code e's), then code i's low 4 bits in byte i's low nibble, code 16 + i's in its high."""
    out = np.empty((len(codes), 24), np.uint8)
    out[:, 0:2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = m.astype(np.float16).reshape(-1, 1).view(np.uint8)
    bits = ((codes >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    out[:, 4:8] = bits.sum(axis=1, dtype=np.uint32).astype("<u4").reshape(-1, 1).view(np.uint8)
    out[:, 8:24] = nibble_bytes(codes)
    return out


def fifth_bits(qh: np.ndarray) -> np.ndarray:
    """GGUF Q5 blocks' 4 bytes of fifth bits (..., 4) -> each code's fifth bit (..., 32) (bit e of a little-endian
    uint32: code e's)."""
    return ((qh.copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def q5_codes(raw: np.ndarray) -> np.ndarray:
    """GGUF Q5_0 / Q5_1 blocks' last 20 bytes (..., 20: the fifth bits, then the nibbles) -> codes (..., 32)."""
    qs = raw[..., 4:20]
    return nibble_codes(qs) | (fifth_bits(raw[..., 0:4]) << 4)


def q6_k_codes(b: np.ndarray) -> np.ndarray:
    """GGUF Q6_K super-blocks (B, 210: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d) ->
    the codes u in 0..63 (B, 256) of the values d * scale[e // 16] * (u - 32). Per half of 128 values, ql[l] holds
    values l (low nibble) and 64 + l (high), ql[32 + l] values 32 + l and 96 + l, qh[l] the high pairs of l, 32 + l,
    64 + l and 96 + l (bits 0-1, 2-3, 4-5, 6-7)."""
    ql, qh = b[:, 0:128].reshape(-1, 2, 2, 32), b[:, 128:192].reshape(-1, 2, 1, 32)   # (B, half, j, l)
    low = np.stack([ql & 15, ql >> 4], axis=2).reshape(-1, 2, 4, 32)                   # value 32 q + l: (ql j, nibble)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3           # (B, half, q, l)
    return (low | (high << 4)).reshape(-1, 256)


def q6_halves(d: np.ndarray, scales: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """fp16 d (B,), int8 scales (B, 2) and 6-bit codes (B, 32) -> Q6_HALVES blocks (B, 28): d, the two scales,
    code i's low 4 bits in byte i's low nibble and code 16 + i's in its high (Q4's order), then code e's high two
    bits at bits 2e, 2e + 1 of a little-endian uint64."""
    out = np.empty((len(codes), 28), np.uint8)
    out[:, 0:2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = scales.astype(np.int8).view(np.uint8)
    out[:, 4:20] = nibble_bytes(codes)
    pairs = (codes >> 4).astype(np.uint64) << (2 * np.arange(32, dtype=np.uint64))
    out[:, 20:28] = pairs.sum(axis=1, dtype=np.uint64).astype("<u8").reshape(-1, 1).view(np.uint8)
    return out


def q6_halves_codes(raw: np.ndarray) -> np.ndarray:
    """Q6_HALVES blocks (..., 28) -> their codes (..., 32)."""
    qs = raw[..., 4:20]
    pairs = (raw[..., 20:28].copy().view("<u8") >> (2 * np.arange(32, dtype=np.uint64))) & 3
    return nibble_codes(qs) | (pairs.astype(np.uint8) << 4)


def repacked(tensor: "GGUFTensor", n: int, k: int) -> Blocks | None:
    """A Q4_K, Q5_0, Q5_1, Q5_K or Q6_K tensor as blocks the kernels read, keeping its integer codes; None for
    other types, a damaged tensor, or scales that do not fit (requantized_q8 serves those).
    - Q4_K (256 values: fp16 d, dmin, 8 six-bit scales and mins, 4-bit codes: d sc q - dmin mn) and Q5_K (the
      same with a fifth bit per code): as they are, on csrc/gemm_x8.c's WT_Q4K_X8 / WT_Q5K_X8 (the file's values
      exactly, in its 4.5 / 5.5 bits a weight plus an eighth).
    - Q5_0 (fp16 d, 5-bit codes u: d (u - 16)): a Q5_1 block with m = -16 d, exactly (where -16 d fits fp16;
      else the same d and codes u - 16 as a Q8_0 block, exactly).
    - Q5_1: as it is.
    The 5-bit blocks take 24 bytes per 32 values (Q8_0: 34) and run on their own kernel (csrc/gemm_x8.c
    WT_Q5_X8).
    - Q6_K (256 values: fp16 d, 16 int8 scales, 6-bit codes u: d sc (u - 32)): each 32 values a Q6_HALVES block
      (the same d, codes and two scales: exactly), 28 bytes, packed back into super-blocks (Q6_K's 26.25 bytes
      per 32) for csrc/gemm_x8.c's WT_Q6_X8."""
    from gguf import GGMLQuantizationType as T

    data = np.asarray(tensor.data)
    if tensor.type == T.Q6_K and k % 256 == 0 and tensor.complete:
        b = data.reshape(-1, 210)                                          # (B, 210) super-blocks
        d = b[:, 208:210].copy().view(np.float16)[:, 0]                    # (B,)
        if not np.isfinite(d).all():
            return None
        scales = b[:, 192:208].view(np.int8).reshape(-1, 8, 2)             # (B, block, half)
        out = q6_halves(np.repeat(d, 8), scales.reshape(-1, 2), q6_k_codes(b).reshape(-1, 32))
        return Blocks(Q6_HALVES, torch.from_numpy(out.reshape(n, -1)), n, k, source="Q6_K")
    if tensor.type in (T.Q4_K, T.Q5_K) and k % 256 == 0 and tensor.complete:
        b = data.reshape(-1, K_SUPER[int(tensor.type)])                   # (B, 144 or 176) super-blocks
        if not np.isfinite(b[:, 0:4].copy().view(np.float16)).all():      # d, dmin
            return None
        return Blocks(int(tensor.type), torch.from_numpy(np.array(b, dtype=np.uint8).reshape(n, -1)), n, k,
                      source=T(tensor.type).name)
    if tensor.type == T.Q5_0 and tensor.complete:
        b = data.reshape(-1, 22)
        d = b[:, 0:2].copy().view(np.float16)[:, 0]                        # (B,)
        codes = q5_codes(b[:, 2:22])                                       # (B, 32): u, the value d (u - 16)
        if not np.isfinite(d).all():
            return None
        with np.errstate(over="ignore"):
            m = (d * np.float16(-16)).astype(np.float16)                   # exact: a power of two, short of overflow
        if np.isfinite(m).all():
            return Blocks(Q5_1, torch.from_numpy(q5_1_blocks(d, m, codes).reshape(n, -1)), n, k, source="Q5_0")
        out = np.empty((len(b), 34), np.uint8)                             # d too large: Q8_0 blocks, exactly
        out[:, 0:2] = b[:, 0:2]
        out[:, 2:] = (codes.astype(np.int16) - 16).astype(np.int8).view(np.uint8)
        return Blocks(8, torch.from_numpy(out.reshape(n, -1)), n, k, source="Q5_0")
    if tensor.type == T.Q5_1 and tensor.complete:
        b = data.reshape(-1, 24)
        if not np.isfinite(b[:, 0:4].copy().view(np.float16)).all():
            return None
        return Blocks(Q5_1, torch.from_numpy(np.array(b, dtype=np.uint8).reshape(n, -1)), n, k, source="Q5_1")
    return None


def requantized_q8(tensor: "GGUFTensor", n: int, k: int) -> Blocks:
    """A tensor of a type the kernels do not read, de-quantized to fp32 by gguf (llama.cpp's own
    formulas) and quantized again to Q8_0 blocks by gguf (llama.cpp's rounding: per 32 values d = max|w|
    / 127 stored in fp16, q = round(w / d)): each value moves by at most half a Q8_0 step plus the
    step's fp16 rounding (1.13 x max|w| / 254 in its block). These are the numerics the step then
    computes in, and its text says which tensors were requantized."""
    from gguf import GGMLQuantizationType, quants

    if not tensor.complete:
        raise QuantWeightError(f"GGUF tensor {tensor.name} ({tensor.type_name}) holds {tensor.data.size} bytes, not "
                               f"what {n} x {k} of its type needs: the file is truncated or damaged")
    try:  # F32, F16 and BF16 included
        w = quants.dequantize(np.asarray(tensor.data).reshape(n, -1), GGMLQuantizationType(tensor.type))
    except (NotImplementedError, ValueError, KeyError) as e:
        raise QuantWeightError(f"GGUF tensor {tensor.name} has type {tensor.type_name}, which neither the native "
                               f"step ({_supported_text()}) nor gguf's de-quantization reads: run the bf16 "
                               "path (--weights bf16) or convert the file") from e
    w = np.ascontiguousarray(w.reshape(n, k), dtype=np.float32)
    if not np.isfinite(w).all() or np.abs(w).max(initial=0) / 127 > 65504:
        raise QuantWeightError(f"GGUF tensor {tensor.name} holds values that are not finite or too large for "
                               "Q8_0's fp16 scales: run the bf16 path (--weights bf16)")
    q = quants.quantize(w, GGMLQuantizationType.Q8_0)  # (n, k / 32 * 34) uint8
    return Blocks(8, torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8).reshape(n, -1)), n, k,
                  source=tensor.type_name)


def rotary_row_order(n: int, heads: int) -> torch.Tensor:
    """llama.cpp's converter stores q and k with each head's rotary halves interleaved
    (row h*hd + 2i + j holds transformers' row h*hd + j*hd/2 + i): the file's row for each of
    transformers' rows (n,)."""
    hd = n // heads
    return torch.arange(n).view(heads, hd // 2, 2).transpose(1, 2).reshape(-1)


def unpermute_rows(blocks: Blocks, heads: int) -> Blocks:
    """q or k blocks put back in transformers' row order (rotary_row_order: whole rows of blocks move,
    the values do not change)."""
    return replace(blocks, data=blocks.data[rotary_row_order(blocks.n, heads)].contiguous())


def tile_blocks(blocks: Blocks) -> Blocks:
    """The blocks reordered so that, per 16 rows and block column, the 16 rows' blocks lie side
    by side (csrc/weights.h, `tiled`): an AMX tile's A operand is then one contiguous read and
    a GEMM streams the weight front to back instead of 16-64 rows at once. Needs N % 16 == 0."""
    if blocks.tiled or blocks.n % 16:
        return blocks
    rows, row = blocks.data.shape
    bs = SUPPORTED[blocks.type][1]
    data = blocks.data.view(rows // 16, 16, row // bs, bs).transpose(1, 2).contiguous().view(rows, row)
    return Blocks(blocks.type, data, blocks.n, blocks.k, tiled=True)


def x8_order(v: np.ndarray) -> np.ndarray:
    """Bytes per row and block column (g, 16, kb, B) -> per block column (g, kb, 16 B) in csrc/gemm_x8.c's order:
    vector t holds bytes 4t .. 4t + 3 of the 16 rows side by side (what one vpdpbusd multiplies)."""
    g, _, kb, nb = v.shape
    return v.reshape(g, 16, kb, nb // 4, 4).transpose(0, 2, 3, 1, 4).reshape(g, kb, 16 * nb)


def x8_scales(a: np.ndarray) -> np.ndarray:
    """fp16 per row and block column (g, 16, kb) -> per block column the 16 rows' values side by side (g, kb, 32
    bytes)."""
    g, _, kb = a.shape
    return a.transpose(0, 2, 1).copy().view(np.uint8).reshape(g, kb, 32)


def q8_unsigned(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 blocks (..., 34 bytes) -> their fp16 scales (...) and their codes as unsigned bytes
    u = q + 128 (..., 32), as the 8-bit-activation kernels read them."""
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]
    return d, (raw[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)


def pack_x8(blocks: Blocks) -> Blocks:
    """The blocks regrouped for csrc/gemm_x8.c (8-bit activations x these weights; layout in its
    header): per 16 rows and block column, the rows' codes interleaved 4 bytes at a time (what
    one VNNI vpdpbusd multiplies), then their fp16 scales (and Q4_1's minimums); Q5_1 adds a plane of the codes'
    fifth bits after the nibbles. The K-quants keep their super-blocks: per 16 rows and 256 columns their fp16 d
    (Q4_K, Q5_K: and dmin), then per block column the codes and the rows' scales: Q4_K, Q5_K six-bit scales and
    minimums (a byte each; Q5_K: a plane of fifth bits before them), Q6_K two planes (bits 4 and 5) and each
    half's int8 scale. The same information in the same bytes (Q4_0, Q4_1, Q5_1, Q6_K, Q8), or 4 bytes more per
    256 weights (Q4_K, Q5_K: their six-bit scales unpacked to bytes)."""
    if (blocks.type not in X8_OF or blocks.tiled or blocks.n % 16 or blocks.k % BLOCK
            or (blocks.type in (*K_SUPER, Q6_HALVES) and blocks.k % 256)):
        raise QuantWeightError(f"a {blocks.type_name} weight {blocks.n} x {blocks.k} cannot be packed for 8-bit "
                               f"activations (Q4_0, Q4_1, Q4_K, Q5_1, Q5_K, Q6_K, Q8_0 with rows a multiple of 16, "
                               f"in file order)")
    if blocks.type in K_SUPER:
        return _pack_k_quant(blocks)
    g, kb, bs = blocks.n // 16, blocks.k // BLOCK, BLOCK_TYPES[blocks.type][1]
    raw = blocks.data.numpy().reshape(g, 16, kb, bs)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]                     # (g, 16, kb)

    if blocks.type == Q5_1:  # Q4x8's nibbles, then the fifth bits
        m, qs = raw[..., 2:4].copy().view(np.float16)[..., 0], raw[..., 8:24]
        parts = [x8_order(qs), x8_plane(fifth_bits(raw[..., 4:8])), x8_scales(d), x8_scales(m)]
    elif blocks.type == Q6_HALVES:  # per super-block d, then per block column the nibbles, planes of bits 4 and 5
        sd = d.reshape(g, 16, kb // 8, 8)                                  # and each half's 16 scales
        if not (sd == sd[..., :1]).all():
            raise QuantWeightError("6-bit blocks whose d differs within 256 values (not from a Q6_K tensor) cannot "
                                   "be packed for 8-bit activations")
        high = q6_halves_codes(raw) >> 4                                   # (g, 16, kb, 32)
        sc = raw[..., 2:4].transpose(0, 2, 3, 1).reshape(g, kb, 32)        # (g, kb, half, row)
        cols = np.concatenate([x8_order(raw[..., 4:20]), x8_plane(high & 1), x8_plane(high >> 1), sc], axis=-1)
        parts = [x8_scales(sd[..., 0]), cols.reshape(g, kb // 8, 8 * 416)]  # (g, super-block, ...)
    elif blocks.type == 8:
        codes = q8_unsigned(raw)[1]  # (g, 16, kb, 32)
        parts = [x8_order(codes), x8_scales(d)]
    elif blocks.type == 3:
        m, qs = raw[..., 2:4].copy().view(np.float16)[..., 0], raw[..., 4:20]
        parts = [x8_order(qs), x8_scales(d), x8_scales(m)]
    else:  # Q4_0: d alone (the kernel computes its m = -8 d in fp32, exactly)
        parts = [x8_order(raw[..., 2:18]), x8_scales(d)]
    data = np.concatenate(parts, axis=-1).reshape(g, kb * X8[X8_OF[blocks.type]][1])  # (Q6: super-blocks in order)
    return Blocks(X8_OF[blocks.type], torch.from_numpy(np.ascontiguousarray(data)), blocks.n, blocks.k,
                  source=blocks.source)


def x8_plane(bit: np.ndarray) -> np.ndarray:
    """One bit per code (g, 16, kb, 32) -> per block column a 64-byte plane (g, kb, 64): byte 4 j + b, bit t holds
    row j's code 4 t + b (csrc/gemm_x8.c's or_plane)."""
    g, _, kb, _ = bit.shape
    bits = bit.reshape(g, 16, kb, 8, 4)                                    # (g, 16, kb, t, b)
    packed = (bits << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=3, dtype=np.uint8)  # (g, 16, kb, b)
    return packed.transpose(0, 2, 1, 3).reshape(g, kb, 64)


def k_quant_codes(raw: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K super-blocks (..., 144 or 176) -> their codes (..., 8, 32): sub-block 2c is chunk c's low nibbles,
    2c + 1 its high ones; Q5_K's fifth bit of sub-block s, value l is bit s of qh[l]."""
    qs = raw[..., -128:].reshape(*raw.shape[:-1], 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*raw.shape[:-1], 8, 32)
    if raw.shape[-1] == 176:
        qh = raw[..., 16:48]
        codes = codes | (((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
    return codes


def _pack_k_quant(blocks: Blocks) -> Blocks:
    """pack_x8 for Q4_K / Q5_K blocks: per 16 rows g and super-block column s (256 columns) the 16 rows' fp16 d,
    then their fp16 dmin (64 bytes), then per block column c of the 8: the low 4 bits of the codes in x8_order
    (256 bytes), Q5_K's plane of fifth bits (64), the rows' six-bit scales sc (16 bytes) and minimums mn (16):
    2,368 / 2,880 bytes (csrc/gemm_x8.c WT_Q4K_X8, WT_Q5K_X8)."""
    g, sb, size = blocks.n // 16, blocks.k // 256, K_SUPER[blocks.type]
    raw = blocks.data.numpy().reshape(g, 16, sb, size)
    d, dmin = (raw[..., o:o + 2].copy().view(np.float16)[..., 0] for o in (0, 2))  # (g, 16, sb)
    sc, mn = k_scales_mins(raw[..., 4:16])                                # (g, 16, sb, 8)
    codes = k_quant_codes(raw).reshape(g, 16, sb * 8, 32)
    parts = [x8_order(nibble_bytes(codes))]                               # (g, sb * 8, 256)
    if blocks.type == Q5_K:
        parts.append(x8_plane(codes >> 4))
    rows = lambda v: v.reshape(g, 16, sb * 8).transpose(0, 2, 1)         # (g, sb * 8, 16): per block column, row order
    cols = np.concatenate(parts + [rows(sc), rows(mn)], axis=-1).reshape(g, sb, -1)
    data = np.concatenate([x8_scales(d), x8_scales(dmin), cols], axis=-1).reshape(g, -1)
    return Blocks(X8_OF[blocks.type], torch.from_numpy(np.ascontiguousarray(data)), blocks.n, blocks.k,
                  source=blocks.source)


def split_q8(blocks: Blocks) -> Blocks:
    """A Q8_0 weight (file order) in csrc/gemm_x8.c's WT_Q8_SPLIT layout: each code u = q + 128 as
    u = 16 h + l, h (with the block scales) in one array and l in a second, both nibble-packed in
    Q4x8's order, so a pass over h alone can bound every row's logit (core.kernels.screen). The same
    bytes as pack_x8's Q8x8, and the same logits bit for bit (u is rebuilt exactly)."""
    if blocks.type != 8 or blocks.tiled or blocks.n % 16 or blocks.k % BLOCK:
        raise QuantWeightError(f"a {blocks.type_name} weight {blocks.n} x {blocks.k} cannot be split (Q8_0 with "
                               f"rows a multiple of 16, in file order)")
    g, kb = blocks.n // 16, blocks.k // BLOCK
    d, u = q8_unsigned(blocks.data.numpy().reshape(g, 16, kb, 34))                    # (g, 16, kb), (g, 16, kb, 32)
    hi = np.concatenate([x8_order(nibble_bytes(u >> 4)), x8_scales(d)], axis=-1).reshape(-1)
    data = np.concatenate([hi, x8_order(nibble_bytes(u & 15)).reshape(-1)])
    return Blocks(SPLIT, torch.from_numpy(np.ascontiguousarray(data)).view(1, -1), blocks.n, blocks.k)


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of a GGUF file's tensor directory, as far as the native step reads it."""

    name: str
    type: int                 # ggml type id
    shape: tuple[int, ...]    # GGUF's order: innermost dimension first
    data: np.ndarray          # its bytes (uint8, a view of the mapped file; short where the file is cut)

    @property
    def type_name(self) -> str:
        from gguf.constants import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.type).name
        except ValueError:
            return f"ggml type {self.type}"

    @property
    def nbytes(self) -> int:
        """The bytes its shape and type need (0 for a type gguf does not know)."""
        return tensor_bytes(self.type, self.shape)

    @property
    def complete(self) -> bool:
        """Whether the file holds all of its bytes (a known type only)."""
        return 0 < self.nbytes == self.data.size


def tensor_bytes(kind: int, shape: tuple[int, ...]) -> int:
    """The bytes a GGUF tensor of ggml type `kind` and `shape` takes (0 for a type gguf does not know)."""
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES.get(kind, (1, 0))
    return int(np.prod(shape, dtype=np.int64)) // block * size


# GGUF metadata value types (the spec's gguf_metadata_value_type): fixed sizes; 8 = string, 9 = array
_GGUF_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_MAGIC = 0x46554747  # "GGUF" read as a little-endian uint32


def open_gguf(path: Path) -> list[GGUFTensor]:
    """A GGUF file's tensor directory: gguf_info's tensors."""
    return gguf_info(path)[1]


def gguf_info(path: Path) -> tuple[str, list[GGUFTensor]]:
    """A GGUF file's general.architecture ("" where it names none) and its tensor directory (name,
    type, shape, bytes), reading its header alone: the
    metadata (a 49,152-token vocabulary and its merges for the embedded model) is skipped, not
    decoded. gguf's GGUFReader decodes every field into numpy views first, 4.8 s for the embedded
    model on the Intel VM of 2026-12-05, at every start of the app, a command or a test's process;
    this takes 0.13 s. A short, foreign or damaged header raises QuantWeightError naming the file."""
    import mmap
    import struct

    def bad(why: str) -> QuantWeightError:
        return QuantWeightError(f"{path} is not a readable GGUF file ({why}); reinstall it or run the bf16 path")

    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # missing, unreadable or empty
        raise bad(str(e)) from e
    size = len(buf)
    at = 0

    def take(fmt: str):
        nonlocal at
        out = struct.unpack_from(fmt, buf, at)
        at += struct.calcsize(fmt)
        return out

    def text() -> str:
        nonlocal at
        (n,) = take("<Q")
        if n > size - at:
            raise bad("a string runs past the end of the file")
        at += n
        return bytes(buf[at - n:at]).decode("utf-8")

    def skip(kind: int, count: int = 1) -> None:
        nonlocal at
        if kind in _GGUF_FIXED:
            at += _GGUF_FIXED[kind] * count
        elif kind == 8:
            for _ in range(count):
                (n,) = take("<Q")
                at += n
        elif kind == 9:
            for _ in range(count):
                inner, n = take("<IQ")
                if n > size - at:
                    raise bad("an array longer than the file")
                skip(inner, n)
        else:
            raise bad(f"unknown metadata value type {kind}")
        if at > size:
            raise bad("the metadata runs past the end of the file")

    try:
        magic, version = take("<II")
        if magic != _GGUF_MAGIC:
            raise bad("no GGUF magic at its start")
        if version not in (2, 3):
            raise bad(f"GGUF version {version}; versions 2 and 3 are read")
        n_tensors, n_kv = take("<QQ")
        if n_tensors > size or n_kv > size:
            raise bad("impossible counts in its header")
        alignment, arch = 32, ""
        for _ in range(n_kv):
            key = text()
            (kind,) = take("<I")
            if key == "general.alignment" and kind == 4:
                (alignment,) = take("<I")
            elif key == "general.architecture" and kind == 8:
                arch = text()
            else:
                skip(kind)
        entries = []
        for _ in range(n_tensors):
            name = text()
            (dims,) = take("<I")
            if dims > 8:
                raise bad(f"tensor {name} has {dims} dimensions")
            shape = take(f"<{dims}Q")
            kind, offset = take("<IQ")
            entries.append((name, kind, tuple(int(d) for d in shape), offset))
    except (struct.error, UnicodeDecodeError) as e:
        raise bad(f"its header ends early or is damaged: {e}") from e
    if alignment < 1:
        raise bad(f"alignment {alignment}")
    start = (at + alignment - 1) // alignment * alignment
    whole = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, kind, shape, offset in entries:
        first = min(start + offset, size)
        tensors.append(GGUFTensor(name, kind, shape, whole[first:min(first + tensor_bytes(kind, shape), size)]))
    return arch, tensors


def load_llama_blocks(path: Path, config, requantize: bool = False, prepare=None) -> dict[str, Blocks]:
    """The decoder's weights from a Llama GGUF, keyed by transformers' parameter names
    (`model.layers.0.self_attn.q_proj.weight`, ..., `model.embed_tokens.weight`, `lm_head.weight`
    when the file has its own output layer). requantize: read_blocks' (tqdm shows the progress; each
    such Blocks names its file's type in `source`). prepare(name, blocks) -> Blocks, where given, turns each
    tensor into what is kept as soon as it is read (pack_x8: one tensor's file-order copy at a time, not the
    whole file's next to its packed copy: 4 GB less at the peak for a 7B file)."""
    from tqdm import tqdm

    tensors = {t.name: t for t in open_gguf(path)}
    H, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or H // config.num_attention_heads
    q_rows, kv_rows = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes = {"q_proj": (q_rows, H), "k_proj": (kv_rows, H), "v_proj": (kv_rows, H), "o_proj": (H, q_rows),
              "gate_proj": (F, H), "up_proj": (F, H), "down_proj": (H, F)}
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}

    def get(name: str) -> object:
        if name not in tensors:
            raise QuantWeightError(f"GGUF tensor {name} is missing from {path.name}; the file does not match the model")
        return tensors[name]

    wanted = [("model.embed_tokens.weight", "token_embd.weight", (V, H))]  # (ours, the file's, shape), read in order
    if "output.weight" in tensors:
        wanted.append(("lm_head.weight", "output.weight", (V, H)))
    for layer in range(config.num_hidden_layers):
        wanted += [(key, name, shapes[key.split(".")[-2]]) for key, name in layer_tensor_names(layer).items()]
    slow = sum(1 for _, name, _ in wanted if name in tensors and tensors[name].type not in SUPPORTED)
    out = {}
    with tqdm(total=slow, desc=f"Repacking {path.name}'s other tensors", unit="tensor",
              disable=not (requantize and slow)) as bar:
        for key, name, (n, k) in wanted:
            tensor = get(name)
            b = read_blocks(tensor, n, k, requantize)
            if tensor.type not in SUPPORTED:
                bar.update()
            if key.endswith(("q_proj.weight", "k_proj.weight")):
                b = unpermute_rows(b, heads[key.split(".")[-2]])
            out[key] = prepare(key, b) if prepare else b
    return out

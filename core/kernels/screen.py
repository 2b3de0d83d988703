"""The screened LM head: greedy decoding reads about half of the LM head's bytes per token.

A plain step of the embedded model streams ~96 MB of weights, 30 MB of them the Q8_0 LM head
(49,152 x 576), though greedy decoding needs only each row's argmax. core.kernels.quant.split_q8
stores each code u = q + 128 as u = 16 h + l in two arrays, and csrc/gemm_x8.c's lm_screen_team
reads h alone (16 MB with the scales) to bound every logit from above, then computes the exact
logits (the same bits as the unsplit head) only for the groups of 16 rows whose bound reaches the
row's maximum; the rest are -inf. So the argmax is exact by construction, not by luck.

The bound (csrc/weights.h, lm_screen): with A the weight that h gives alone (u ~ 16 h + 7.5),
D = W - A (|D| <= 7.5 d per weight), U (r x K) the main directions of the final hidden states,
z = U x, y = x - U^T z, C = D U^T stored as bf16 C':
    W x = A x + C' z + (C - C') z + D (I - U^T U) y + C (U y)
so |W x - (A x + C' z)| <= e1 |y| + e2 |z| + e3 |U y| with e1 = |D_n (I - U^T U)|, e2 =
|C_n - C'_n|, e3 = |C_n| per vocabulary row (float64 here, rounded up), an identity for any U:
U only decides how tight the bound is. The final hidden states concentrate in a few directions
(rank 32 leaves |y| ~ 0.6 |x| on natural prompts), so most groups fall many logits below the
best one. U comes from the model's own answers to a few prompts (CALIBRATION), once per GGUF file
(cached in cache_home()/screen; the answers come from core.decoding.batched).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.kernels.quant import Blocks, q8_unsigned

RANK = 32
VERSION = 3  # of the cached file's contents (bump when build() or CALIBRATION change)
TOKENS = 80  # greedy tokens the model writes per CALIBRATION prompt
CALIBRATION = [  # kinds of request people make: U is fitted to the final hidden states of the model's answers
    "Can you explain how photosynthesis works, in simple terms?",
    "Write a Python function that returns the largest number in a list, and explain it.",
    "What should I pack for a three-day hiking trip?",
    "Summarise the causes of the First World War in a short paragraph.",
    "If a train travels 120 km in 1.5 hours, what is its average speed? Show your steps.",
    "Pretend you are a pirate captain and greet your new crew.",
    "Extract the names and dates from this text: Marie Curie won the Nobel Prize in 1903 and Albert Einstein in 1921.",
    "Write a short, friendly email asking my landlord to fix the heating.",
    "What are the pros and cons of working from home?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "My code says 'IndexError: list index out of range' when I loop over a list. What does it mean?",
    "Give me a recipe for a quick vegetarian dinner.",
    "Explain the difference between a virus and a bacterium.",
    "Write a four-line poem about the sea at night.",
    "How do I convert a string to an integer in JavaScript?",
    "What is 15% of 240, and how do you work it out?",
    "I feel nervous before job interviews. Any advice?",
    "Rewrite this sentence to sound more formal: we gotta finish the report by friday.",
    "List five facts about the planet Mars.",
    "Describe a day in the life of a medieval blacksmith.",
]


class ScreenStruct(ctypes.Structure):  # csrc/weights.h's lm_screen
    _fields_ = [("rank", ctypes.c_int32), ("pad", ctypes.c_int32), ("basis", ctypes.c_void_p),
                ("proj", ctypes.c_void_p), ("coef", ctypes.c_void_p)]


@dataclass(frozen=True)
class Screen:
    """What lm_screen_team reads besides the split head (the C structure points into these)."""

    basis: torch.Tensor   # (r, K) fp32: U
    proj: torch.Tensor    # (N / 16, r, 16) bf16: C' per group of 16 vocabulary rows
    coef: torch.Tensor    # (N / 16, 4, 16) fp32: e1, e2, e3, s per vocabulary row

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.basis, self.proj, self.coef))

    def struct(self) -> ScreenStruct:
        return ScreenStruct(self.basis.shape[0], 0, self.basis.data_ptr(), self.proj.data_ptr(), self.coef.data_ptr())


def quantized_rows(x: np.ndarray) -> np.ndarray:
    """(T, K) -> the values csrc/gemm_x8.c's 8-bit activations hold (per 32: d = max|x| / 127)."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(b).max(-1, keepdims=True)
    d = amax / np.float32(127)
    q = np.clip(np.rint(b * np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)), -127, 127)
    return (q * d).reshape(x.shape).astype(np.float64)


def directions(hidden: np.ndarray, rank: int = RANK) -> np.ndarray:
    """(T, K) final hidden states -> U (rank, K) fp32: the main directions of their quantized values."""
    xq = quantized_rows(hidden)
    _, _, vt = np.linalg.svd(xq, full_matrices=False)
    return np.ascontiguousarray(vt[:rank], dtype=np.float32)


def _up(a: np.ndarray) -> np.ndarray:
    """float64 norms -> fp32, rounded up (and a little more for float64's own rounding)."""
    f = (a * (1 + 1e-6)).astype(np.float32)
    return np.nextafter(f, np.float32(np.inf))


def build(q8: Blocks, basis: np.ndarray, chunk: int = 4096) -> Screen:
    """The screen of a Q8_0 LM head (file order) for directions `basis` (r, K) fp32."""
    assert q8.type == 8 and not q8.tiled and q8.n % 16 == 0 and q8.k % 32 == 0
    n, k, r = q8.n, q8.k, basis.shape[0]
    d, u = q8_unsigned(q8.data.numpy().reshape(n, k // 32, 34))                          # (N, KB), (N, KB, 32)
    d, u = d.astype(np.float64), u.astype(np.int64)
    U = basis.astype(np.float64)
    proj = np.empty((n, r), dtype=np.float32)
    coef = np.empty((n, 4), dtype=np.float32)
    for s in range(0, n, chunk):
        e = slice(s, min(n, s + chunk))
        dd = d[e][..., None]
        W = (dd * (u[e] - 128)).reshape(-1, k)
        A = (dd * (16 * (u[e] >> 4) + 7.5 - 128)).reshape(-1, k)
        D = (dd * ((u[e] & 15) - 7.5)).reshape(-1, k)
        C = D @ U.T                                                                         # (n, r)
        Cb = torch.from_numpy(C).to(torch.bfloat16).to(torch.float64).numpy()
        proj[e] = Cb
        coef[e, 0] = _up(np.linalg.norm(D - C @ U, axis=1))
        coef[e, 1] = _up(np.linalg.norm(C - Cb, axis=1))
        coef[e, 2] = _up(np.linalg.norm(C, axis=1))
        coef[e, 3] = _up(np.linalg.norm(W, axis=1) + np.linalg.norm(A, axis=1) + np.linalg.norm(Cb, axis=1))
    g = n // 16
    return Screen(torch.from_numpy(basis.copy()),
                  torch.from_numpy(proj).view(g, 16, r).transpose(1, 2).contiguous().to(torch.bfloat16),
                  torch.from_numpy(coef).view(g, 16, 4).transpose(1, 2).contiguous())


def load_or_build(q8: Blocks, source: Path, calibrate: Callable[[], np.ndarray]) -> Screen:
    """The screen for this model's Q8_0 LM head: from cache_home()/screen when this GGUF's was built
    before (name, size and time of the file key it), else built and kept there: `calibrate()` gives the
    final hidden states of the model's answers to CALIBRATION (up to TOKENS rows each:
    core.decoding.batched.calibration_hidden, up to 1,600 rows), then ~1.5 s of float64 norms."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    from core.models import cache_home

    st = source.stat()
    key = hashlib.sha256(f"{source.name}|{st.st_size}|{st.st_mtime_ns}|{RANK}|{VERSION}".encode()).hexdigest()[:16]
    path = cache_home() / "screen" / f"{source.stem}-{key}.safetensors"
    g = q8.n // 16
    shapes = {"basis": ((RANK, q8.k), torch.float32), "proj": ((g, RANK, 16), torch.bfloat16),
              "coef": ((g, 4, 16), torch.float32)}
    if path.exists():
        try:
            t = load_file(path)
            if all(k in t and tuple(t[k].shape) == s and t[k].dtype == dt for k, (s, dt) in shapes.items()):
                return Screen(t["basis"], t["proj"], t["coef"])
        except (OSError, ValueError, RuntimeError, SafetensorError):
            pass  # a damaged file: built again below
    screen = build(q8, directions(calibrate(), RANK))
    try:  # kept for the next load; where the cache cannot be written, built again then
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({"basis": screen.basis, "proj": screen.proj, "coef": screen.coef}, tmp)
        tmp.replace(path)
    except OSError:
        pass
    return screen


def screened_logits(x: torch.Tensor, head, screen: Screen) -> torch.Tensor:
    """x (M, K) bf16 (M <= 16) through a split LM head (core.kernels.quant.Blocks of split_q8) as a
    greedy step computes it: (M, N) bf16, exact where a logit can be its row's maximum, -inf elsewhere."""
    from core.kernels import native

    k = native._library()[0]
    assert k is not None, "needs the kernels"
    w, sc = native.wmat(blocks=head), screen.struct()
    x = x.contiguous()
    y = torch.empty(x.shape[0], head.n, dtype=torch.bfloat16)
    if k.lm_screen_w(x.data_ptr(), x.stride(0), ctypes.byref(w), ctypes.byref(sc), y.data_ptr(), head.n, x.shape[0],
                   torch.get_num_threads()):
        raise ValueError(f"the screen cannot serve {x.shape[0]} rows through a {head.type_name} head")
    return y

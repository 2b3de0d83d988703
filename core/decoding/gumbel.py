"""Sampling as a function of the answer's seed and the token's position: the Gumbel-max trick
with noise keyed by (seed, position, token id).

Plain sampling picks the token at position t as

    argmax_x  shaped(x) + g(seed, t, x)        shaped = logits / temperature, top-k / top-p dropped (-inf)

with g independent standard Gumbel noise per (t, x); that is an exact draw from softmax(shaped)
(the Gumbel-max trick), and each position reads fresh noise, so the answer has exactly the
target's distribution. Because the noise depends on the position and the token alone, never on
how many numbers were drawn before, tree verification can compute plain sampling's choice at every
node (a node at depth d chooses the token at position committed + d + 1) and then walk the tree as
greedy verification does: a child is accepted iff its token is that choice. A sampled answer is
then token-identical to plain sampling's with the same seed, whatever the tree, the lookup chain,
the mode a step ran in (adaptive speculation) or the side of a side-by-side comparison.

The head drafts on the same noise (`DraftNoise`): its children are the top-k of its own
temperature-scaled log-probabilities plus the position's noise, renormalised, so its first guess
is its own Gumbel-max draw, coupled to the target's: where the head's distribution is close to
the target's the two draws agree (for q = p always), and at temperature -> 0 this is greedy drafting.

Noise: h = mix64(key + (id + 1) * golden) with key = position_key(seed, position) (splitmix64's
finaliser), u = (2 * (h >> 41) + 1) / 2^24, g = -log(-log u): native (csrc/gumbel.c, ~20 us per
49,152 ids) or `noise_reference` in torch (the same hash; logs within float rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.config import SamplingConfig
from core.kernels import native

M64 = 2**64 - 1
GOLDEN = 0x9E3779B97F4A7C15
POSITION_STEP = 0xD1B54A32D192ED03  # decorrelates the positions of one seed


def mix64(z: int) -> int:
    """splitmix64's finaliser on a Python int (mod 2^64)."""
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def position_key(seed: int, position: int) -> int:
    """The 64-bit key of the noise that chooses the token at `position` of an answer seeded `seed`."""
    return mix64(mix64(seed) + (position + 1) * POSITION_STEP)


def noise_reference(key: int, ids: torch.Tensor | None, n: int, device=None) -> torch.Tensor:
    """The noise in torch int64 arithmetic (products wrap mod 2^64): ids (n,) or None -> (n,) fp32."""
    x = torch.arange(n, device=device) if ids is None else ids.to(torch.int64)

    def srl(z: torch.Tensor, s: int) -> torch.Tensor:  # logical right shift
        return (z >> s) & ((1 << (64 - s)) - 1)

    z = (x + 1) * native.as_int64(GOLDEN) + native.as_int64(key)
    z = (z ^ srl(z, 30)) * native.as_int64(0xBF58476D1CE4E5B9)
    z = (z ^ srl(z, 27)) * native.as_int64(0x94D049BB133111EB)
    z = z ^ srl(z, 31)
    u = (2 * srl(z, 41) + 1).to(torch.float32) / 2**24  # exact: < 2^24
    return -torch.log(-torch.log(u))


def noise(key: int, ids: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """Gumbel noise for ids (n,) (None = 0 .. n - 1) under `key` -> (n,) fp32 on `device`."""
    if native.gumbel_usable(device):
        return native.gumbel_noise(key, None if ids is None else ids.cpu(), n)
    return noise_reference(key, ids, n, device)


def shaped_logits(logits: torch.Tensor, s: SamplingConfig) -> torch.Tensor:
    """(n, V) logits -> (n, V) fp32: temperature, then top-k, then top-p; dropped tokens -inf.
    softmax of it is the distribution plain sampling draws from (`target_probs`)."""
    assert not s.greedy, "greedy decoding uses argmax, not a distribution"
    x = logits.float() / s.temperature
    if 0 < s.top_k < x.shape[-1]:
        kth = x.topk(s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:  # keep the most likely tokens until their mass reaches top_p
        p = x.softmax(-1)  # (n, V)
        k = min(64, p.shape[-1])
        while True:  # the nucleus lies in the top k once their mass reaches top_p (a sort of all: 2.4 ms)
            top, order = p.topk(k, dim=-1)  # (n, k) descending
            cum = top.cumsum(-1)
            if k == p.shape[-1] or bool((cum[..., -1] >= s.top_p).all()):
                break
            k = min(4 * k, p.shape[-1])
        keep = (cum - top) < s.top_p  # the mass before a token is short of top_p (the first always)
        x = torch.full_like(x, float("-inf")).scatter(-1, order, x.gather(-1, order).masked_fill(~keep, float("-inf")))
    return x


# The noise lies in [-2.82, 16.64] (u is at least 2^-24 from 0 and 1), so a token more than REACH
# below its row's best shaped logit never wins the Gumbel-max: only the others need noise. Exact,
# and at temperature 0.7 a row's candidates are a few hundred of 49,152.
REACH = 20.0


def sample_at(logits: torch.Tensor, positions: list[int], s: SamplingConfig, seed: int) -> list[int]:
    """(n, V) logits and the position each row chooses a token for -> n token ids, each plain
    sampling's draw at that position: the Gumbel-max over `shaped_logits` plus its noise. A row
    computes the same alone or beside others (rows at one position share the noise)."""
    if (native.gumbel_usable(logits.device) and logits.dtype is torch.bfloat16 and s.top_k == 0 and s.top_p >= 1.0
            and not s.greedy):  # temperature alone: the division in the same call, on the LM head's bf16 row
        return [native.gumbel_argmax_bf16(row, position_key(seed, t), s.temperature, REACH)
                for row, t in zip(logits, positions)]
    x = shaped_logits(logits, s)  # (n, V)
    if native.gumbel_usable(x.device):  # the candidates' noise in registers, 16 at a time: 0.1 ms a row on AVX2
        return [native.gumbel_argmax(row, position_key(seed, t), REACH) for row, t in zip(x, positions)]
    best = x.max(-1).values.tolist()  # (n,)
    out = []
    for row, t, top in zip(x, positions, best):
        cand = torch.nonzero(row >= top - REACH)[:, 0]  # (c,) the tokens that can win
        g = noise(position_key(seed, t), cand, cand.shape[0], row.device)  # (c,)
        out.append(int(cand[(row[cand] + g).argmax()]))
    return out


@dataclass(frozen=True)
class DraftNoise:
    """What a sampled step's head drafts with: the answer's temperature, seed, and the position of
    the root's children. A fed node at depth d proposes the token at `position + d`."""

    temperature: float
    seed: int
    position: int

    def log_probs(self, drafter, hidden: torch.Tensor, depth: int) -> torch.Tensor:
        """hidden (m, H) of nodes at `depth` -> (m, Vd) fp32: log-softmax of the head's
        log-probabilities / temperature plus the noise of their children's position (clamped at 0,
        as tree.log_probs)."""
        lp = drafter.log_probs(hidden) / self.temperature  # (m, Vd)
        ids = drafter.to_target_ids(torch.arange(lp.shape[-1], device=lp.device))  # noise is keyed by target id
        g = noise(position_key(self.seed, self.position + depth), ids, lp.shape[-1], lp.device)  # (Vd,)
        return torch.log_softmax(lp + g, dim=-1).clamp(max=0.0)

    def top_log_probs(self, drafter, hidden: torch.Tensor, depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The min(k, Vd) best of `log_probs` (m, k), best first, and their draft ids."""
        lp = self.log_probs(drafter, hidden, depth)
        return lp.topk(min(k, lp.shape[-1]), dim=-1)


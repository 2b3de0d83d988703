"""Tokens/s projected from a measured cost curve, with autotune's model (core.autotune):

    tokens/s(d, n) = E[tokens per step | depth d, tree size n] / (t_draft(d) + t_verify(n) + t_other)

The costs are measured (core.gpucheck); the acceptance is SYNTHETIC, for heads we cannot
measure here (a random head accepts almost nothing): a calibrated head whose rank-r
candidate is the target's token with probability p (1 - p)^r at every level, independently.
p is solved so that the reference tree (EAGLE-2-like: depth 6, top-k 8, 60 nodes) yields
tau tokens per step; autotune's `choose` then picks the fastest tree for the curve.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from core.autotune import DEPTHS, Profile, choose, expected_tokens, interpolate
from core.config import TreeConfig

REFERENCE_TREE = TreeConfig(depth=6, top_k=8, total_tokens=60)  # tau is defined on this tree
CHOICE_SIZES = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # tree sizes `choose` may pick
SYNTHETIC_STEPS = 64  # replayed steps per acceptance level; every choice replays them all


@dataclass(frozen=True)
class CostCurve:
    context: int                    # committed tokens before the call
    verify_s: dict[int, float]      # new tokens in one target call -> seconds
    head_step_s: float              # one head call on top_k frontier nodes (tree mask)
    draft_lm_head_s: float          # draft log-probs of those top_k rows over the draft vocabulary
    draft_s: dict[int, float]       # depth -> catch-up (3 tokens) + drafting an EAGLE-2 tree


@dataclass(frozen=True)
class Projection:
    tau: float                      # tokens per step of REFERENCE_TREE
    context: int
    acceptance_p: float             # the synthetic head's top-1 acceptance per level
    tree: TreeConfig                # what `choose` picks for this curve and acceptance
    expected_tokens: float          # tokens per step of that tree
    tokens_per_s: float
    plain_tokens_per_s: float
    speedup: float
    reference_tokens_per_s: float   # at REFERENCE_TREE
    reference_speedup: float
    other_gpu_tokens_per_s: float | None  # tokens_per_s / bandwidth ratio: a memory-bound projection


@functools.lru_cache(maxsize=None)
def synthetic_steps(p: float, top_k: int, depth: int = max(DEPTHS), n: int = SYNTHETIC_STEPS, seed: int = 0):
    """n steps in autotune's replay format, (depths, scores, accepted path), for acceptance p.

    Candidates grow as EAGLE-2 drafts them: the root's top_k children, then top_k children
    of each of the top_k best nodes of the last level; a node's score is the sum of log q_r
    along its path, q_r = p (1 - p)^r, so the head is calibrated.
    """
    assert 0 < p <= 1
    log_q = [math.log(p) + r * math.log1p(-p) if p < 1 else (0.0 if r == 0 else -1e9) for r in range(top_k)]
    depths, scores, child = [0], [0.0], {}
    frontier = [0]
    for d in range(1, depth + 1):
        level = []
        for node in frontier:
            for r in range(top_k):
                child[node, r] = len(depths)
                level.append(len(depths))
                depths.append(d)
                scores.append(scores[node] + log_q[r])
        frontier = sorted(level, key=lambda i: -scores[i])[:top_k]
    rng, steps = random.Random(seed), []
    for _ in range(n):
        path, node = [0], 0
        while True:  # the target's token at this level is the head's rank-r candidate
            rank = 0 if p == 1 else int(math.log(1.0 - rng.random()) / math.log1p(-p))  # P(r) = q_r
            if (node, rank) not in child:
                break
            node = child[node, rank]
            path.append(node)
        steps.append((tuple(depths), tuple(scores), tuple(path)))
    return tuple(steps)


@functools.lru_cache(maxsize=None)
def solve_acceptance(tau: float, top_k: int, tree: TreeConfig = REFERENCE_TREE) -> float | None:
    """p at which `tree` yields tau tokens per step (bisection); None when out of reach."""
    tokens = lambda p: expected_tokens(synthetic_steps(p, top_k), tree.depth, tree.total_tokens)
    lo, hi = 1e-3, 1.0
    if not tokens(lo) <= tau <= tokens(hi):
        return None
    for _ in range(24):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens(mid) < tau else (lo, mid)
    return hi


def plain_rate(curve: CostCurve, plain_other_s: float) -> float:
    """Plain decoding: one token per one-token target call."""
    return 1.0 / (curve.verify_s[1] + plain_other_s)


def project(curve: CostCurve, tau: float, top_k: int, other_s: float, plain_other_s: float,
            bandwidth_ratio: float | None = None) -> Projection | None:
    """Autotune's choice and rate on the measured curve, at synthetic acceptance `tau`."""
    p = solve_acceptance(tau, top_k)
    if p is None:
        return None
    steps = synthetic_steps(p, top_k)
    profile = Profile(verify_s=curve.verify_s, draft_s=curve.draft_s, other_s=other_s, steps=steps, top_k=top_k)
    tree, rate = choose(profile, depths=DEPTHS, sizes=CHOICE_SIZES)
    _, ref_rate = choose(profile, depths=(REFERENCE_TREE.depth,), sizes=(REFERENCE_TREE.total_tokens,))
    plain = plain_rate(curve, plain_other_s)
    return Projection(tau=tau, context=curve.context, acceptance_p=round(p, 4), tree=tree,
                      expected_tokens=expected_tokens(steps, tree.depth, tree.total_tokens), tokens_per_s=rate,
                      plain_tokens_per_s=plain, speedup=rate / plain, reference_tokens_per_s=ref_rate,
                      reference_speedup=ref_rate / plain,
                      other_gpu_tokens_per_s=rate / bandwidth_ratio if bandwidth_ratio else None)


def step_overheads(curve: CostCurve, spec_step_s: float, tree_size: int, depth: int,
                   plain_step_s: float) -> tuple[float, float]:
    """(speculative, plain) time per step outside the modelled costs: a measured step's wall
    time minus the curve's drafting and target time for that step, never below 0."""
    spec = spec_step_s - curve.draft_s[min(depth, max(curve.draft_s))] - interpolate(curve.verify_s, tree_size)
    return max(0.0, spec), max(0.0, plain_step_s - curve.verify_s[1])

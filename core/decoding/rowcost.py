"""What one more verified row costs, measured while answering, and the draft probability a row must
reach to pay for itself (`TreeConfig.row_floor`).

A greedy step verifies the root (the token it writes anyway) and the head's draft nodes. A draft
node accepted with probability p pays for its row where (1 + p) tokens in h + T2 seconds beat
1 token in h + T1:

    p > (T2 - T1) / (h + T1)

T1 / T2 the target forward of 1 / 2 rows, h the step's head work (catch-up and drafting, spent
either way: the head must run to give p). The head's first-level draft probabilities are
calibrated (accepted 0.09 ... 0.97 of the time by decile of p: docs/native-step.md, fifteenth
session), so p is the node's own cumulative draft probability. On a CPU with 8-bit activations the
floor moves with the machine by the minute (a row costs ~40% of a one-row forward in the Intel VM's
fast phase, ~6% in its slow one), so it is measured, as exponential means of the 1- and 2-row
forwards the answers run anyway. MIN_FLOOR keeps the rarest drafts dropped, so 1-row forwards keep
coming and T1 stays measured in every phase.

Which rows are verified never changes an answer: greedy verification accepts exactly plain
decoding's tokens whatever the tree (core.decoding.verify).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.decoding.tree import DraftTree

MIN_FLOOR = 0.1  # accepted ~9% of the time: never worth a row here, and the steps it leaves measure T1
MAX_FLOOR = 0.6  # a bound on a bad minute's estimate
START_FLOOR = 0.3  # until both forwards are measured (about the Intel VM's fast phase)
WEIGHT = 0.125  # of the newest forward in the means: the last ~8 of each kind


@dataclass(frozen=True)
class RowCosts:
    """Exponential means, in seconds: a verify forward of 1 row, of 2 rows, and a step's head work."""

    one: float | None = None
    two: float | None = None
    head: float | None = None


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)


def record(costs: RowCosts, rows: int, forward_s: float, head_s: float | None) -> RowCosts:
    """`costs` with one greedy step's forward (`rows` rows, `forward_s`) and head work (`head_s`;
    None: a plain step, which drafts nothing) taken in; forwards of other sizes (a lookup chain's)
    leave the forward means as they are."""
    if forward_s <= 0 or (head_s is not None and head_s < 0):
        return costs
    head = costs.head if head_s is None else _mean(costs.head, head_s)
    if rows == 1:
        return RowCosts(_mean(costs.one, forward_s), costs.two, head)
    if rows == 2:
        return RowCosts(costs.one, _mean(costs.two, forward_s), head)
    return RowCosts(costs.one, costs.two, head)


def floor(costs: RowCosts) -> float:
    """The draft probability a node needs for its row to pay, from the measured costs."""
    if costs.one is None or costs.two is None:
        return START_FLOOR
    p = (costs.two - costs.one) / (costs.one + (costs.head or 0.0))
    return min(MAX_FLOOR, max(MIN_FLOOR, p))


def prune(tree: DraftTree, p: float) -> DraftTree:
    """`tree` without the draft nodes whose cumulative draft probability is below `p` (and their
    descendants, whose scores are no higher); `tree` itself where every node stays or the tree
    has no scores."""
    scores = tree.host_scores
    if scores is None or p <= 0:
        return tree
    bar = math.log(p)
    tokens, parents, depths = tree.host
    new = {0: 0}  # kept node -> its index in the pruned tree (parents come before children)
    for i in range(1, len(scores)):
        if scores[i] >= bar and parents[i] in new:
            new[i] = len(new)
    if len(new) == len(scores):
        return tree
    keep = list(new)
    return DraftTree.from_lists([tokens[i] for i in keep], [-1] + [new[parents[i]] for i in keep[1:]],
                                [depths[i] for i in keep], [scores[i] for i in keep], tree.score_dtype, tree.device)

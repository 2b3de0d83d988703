"""Context lookup: a draft chain copied from earlier text, grafted onto the head's tree.

After prompt-lookup decoding (Saxena 2023; `prompt_lookup_num_tokens` in transformers): when
the last n tokens of the context (prompt + answer so far, ending with the root) occurred
earlier, the tokens that followed them then are a cheap guess of what follows now. Small
greedy models repeat themselves and chat answers quote their prompt (code, names, lists),
so the guess is often right for many tokens in a row, more than a depth-limited head tree
can accept in one step.

The chain is verified with the head's tree in the same target forward: it hangs under the
root, shares the nodes the tree already holds and appends the rest. Verification does not
care where a proposal came from (greedy: argmax match; sampling: each child is a point-mass
proposal that depends only on the context), so the output stays exactly plain decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.tree import DraftTree

# Measured on SmolLM2's greedy answers to the benchmark prompts (16-token chains, the n-gram
# tried longest first): a 4-token match was followed by 11.1 correct tokens on average (0.92
# had at least 1 right), a 3-token match by 2.7, a 2-token match by 1.5 (0.47 at least 1 right).
# The head's tree already covers the first two or three tokens, so 2-token matches do not pay
# for their verification rows, and 3-token matches get half the chain.
MIN_NGRAM = 3
MAX_NGRAM = 4
# The chain length core.autotune puts in the trees it chooses. On 6 benchmark prompts x 128
# tokens (depth 4, 10 nodes, the shipped head) tau went 2.22 (off) -> 2.62 (8) -> 2.74 (16)
# -> 2.80 (32); past 16 only long loops gain, while every failed chain costs its rows.
DEFAULT_TOKENS = 16


def lookup_chain(context: Sequence[int], max_tokens: int, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = MIN_NGRAM) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the context's last n tokens
    (n = max_ngram down to min_ngram), continued round the loop where they run into the
    present: `max_tokens` of them after a max_ngram match, half as many after a shorter one;
    [] when none occurred."""
    ctx = list(context)
    if max_tokens < 1:
        return []
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(ctx) <= n:
            continue
        suffix = ctx[-n:]
        last = suffix[-1]
        # latest start s < len - n with ctx[s:s+n] == suffix; scan candidate ends backwards
        for end in range(len(ctx) - 2, n - 2, -1):
            if ctx[end] == last and ctx[end - n + 1:end + 1] == suffix:
                return _continue(ctx, end, max_tokens if n == max_ngram else max_tokens // 2)
    return []


def _continue(ctx: list[int], end: int, max_tokens: int) -> list[int]:
    """What followed ctx[end]; where that runs into the present, the text is a loop of period
    len(ctx) - 1 - end, and the chain keeps going round it."""
    period = len(ctx) - 1 - end
    out: list[int] = []
    for i in range(max_tokens):
        out.append(ctx[end + 1 + i] if end + 1 + i < len(ctx) else out[i - period])
    return out


def graft(tree: DraftTree, chain: Sequence[int]) -> DraftTree:
    """`tree` with `chain` as a path under the root: where the tree already holds the chain's
    next token as a child the path follows it, the rest is appended (topological order kept,
    siblings stay distinct). Appended nodes score -inf: no draft probability backs them."""
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    n0 = len(tokens)
    node = 0
    for tok in chain:
        child = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == tok), None)
        if child is None:
            tokens.append(int(tok))
            parents.append(node)
            depths.append(depths[node] + 1)
            child = len(tokens) - 1
        node = child
    if len(tokens) == n0:
        return tree
    device = tree.tokens.device
    scores = None
    if tree.scores is not None:
        extra = torch.full((len(tokens) - n0,), float("-inf"), dtype=tree.scores.dtype, device=device)
        scores = torch.cat([tree.scores, extra])
    return DraftTree(tokens=torch.tensor(tokens, device=device), parents=torch.tensor(parents, device=device),
                     depths=torch.tensor(depths, device=device), scores=scores)

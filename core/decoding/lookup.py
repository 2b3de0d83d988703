"""Context lookup: a draft chain copied from earlier text, grafted onto the head's tree.

After prompt-lookup decoding (Saxena 2023; `prompt_lookup_num_tokens` in transformers): when
the last n tokens of the context (prompt + answer so far, ending with the root) occurred
earlier, the tokens that followed them then are a cheap guess of what follows now. Small
greedy models repeat themselves and chat answers quote their prompt (code, names, lists),
so the guess is often right for many tokens in a row, more than a depth-limited head tree
can accept in one step.

The chain is verified with the head's tree in the same target forward: it hangs under the
root, shares the nodes the tree already holds and appends the rest. Verification does not
care where a proposal came from (a child is accepted iff it is the target's own choice, greedy
or sampled: core.decoding.verify), so the output stays exactly plain decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from core.config import TreeConfig
from core.decoding.tree import DraftTree

# The chain follows the latest earlier occurrence of the longest suffix that occurred before
# (2 to MAX_NGRAM tokens), and its length grows with that match: `max_tokens` after 5 or more
# tokens, 60% of it after 4, 40% after 3, 30% after 2 (at least 2 tokens). A short match is
# followed by fewer right tokens than a long one (on 150 self-written prompts: the first copied
# token is right 49% of the time after a 2-token match, 66% after 3, 76% after 4, 88% after 5+),
# and every row costs verification time: on the 4-bit x 8-bit step a row costs 0.4-0.5 ms against
# a 3.4-3.8 ms one-token forward, so the w4a8 trees use 10 tokens (docs/context-lookup.md,
# 2026-12-04); where rows are nearly free (bf16 tiles), 24.
MIN_NGRAM = 2
MAX_NGRAM = 8
# The chain length core.autotune puts in the trees it chooses without measuring it (`default_tokens`).
DEFAULT_TOKENS = 24
DEFAULT_TOKENS_INT8 = 10  # where the step multiplies 8-bit activations: every row costs integer work
# and where it does so without VNNI (the AVX2 build: csrc/avx2.h's vpmaddubsw pairs), a row costs 20-25% of a
# forward, twice VNNI's share: 6 (docs/context-lookup.md, 2026-12-08)
DEFAULT_TOKENS_AVX2 = 6
# The head's tree on steps that verify a chain (TreeConfig.lookup_total_tokens), as autotune
# sets it: on a CPU a target forward costs about the same for 1 to 12 rows and about 0.85 ms
# (4% of a one-row forward) for each row past that, so with a chain of up to 24 rows the head's
# tree keeps only its 5 best nodes. `scripts/lookup_replay.py` (98 held-out, 16 benchmark and 40
# training prompts; depth 4, top-k 6, 10 tokens otherwise): these rules are 3.0% / 2.5% / 2.6%
# faster than the previous ones (no 2-token matches, 16 tokens, the full tree beside a chain),
# about 1 point of it from the smaller tree.
CHAIN_TREE_TOKENS = 6


def chain_tree(tree: TreeConfig) -> TreeConfig:
    """`tree` with `lookup_total_tokens` set for its chains (unchanged without lookup)."""
    if not tree.lookup or tree.is_static:
        return tree
    return replace(tree, lookup_total_tokens=min(tree.total_tokens, CHAIN_TREE_TOKENS))


def default_tokens(int8_activations: bool, gemm: str | None = None) -> int:
    """The chain length for a target whose step does (or does not) multiply 8-bit activations, on the decoding
    GEMM `gemm` (core.kernels.native.gemm_kind: "amx", "avx512", "avx2" or None)."""
    if not int8_activations:
        return DEFAULT_TOKENS
    return DEFAULT_TOKENS_AVX2 if gemm == "avx2" else DEFAULT_TOKENS_INT8


def chain_length(match: int, max_tokens: int) -> int:
    """Tokens to copy after a `match`-token suffix match (at most max_tokens)."""
    if match < 2 or max_tokens < 1:
        return 0
    if match >= 5:
        return max_tokens
    tenths = 6 if match == 4 else 4 if match == 3 else 3
    return min(max_tokens, max(2, (tenths * max_tokens + 5) // 10))


def longest_repeat(context: Sequence[int], max_ngram: int = MAX_NGRAM) -> tuple[int, int]:
    """(n, end): the longest suffix of `context` (at most max_ngram tokens) that occurred earlier,
    and where its latest earlier occurrence ends (ties keep the later one); (0, -1) if the last
    token never occurred before."""
    ctx = context if isinstance(context, list) else list(context)
    if len(ctx) < 2:
        return 0, -1
    last = ctx[-1]
    return _best_match(ctx, (end for end in range(len(ctx) - 2, -1, -1) if ctx[end] == last), max_ngram)


def _best_match(ctx: list[int], ends, max_ngram: int) -> tuple[int, int]:
    """longest_repeat's answer from `ends`: the earlier positions of ctx's last token, latest first."""
    n_ctx = len(ctx)
    best, best_end = 0, -1
    for end in ends:
        n = 1
        while n < max_ngram and end - n >= 0 and ctx[end - n] == ctx[n_ctx - 1 - n]:
            n += 1
        if n > best:
            best, best_end = n, end
            if n == max_ngram:
                break
    return best, best_end


def _chain(ctx: list[int], match: tuple[int, int], max_tokens: int, min_ngram: int) -> list[int]:
    """lookup_chain's tokens once the longest repeat (n, end) is known."""
    n, end = match
    k = chain_length(n, max_tokens) if n >= min_ngram else 0
    return copy_after(ctx, end, k) if k else []


class ContextIndex:
    """The context (prompt + answer so far) with, per token id, the positions it holds: what
    `longest_repeat` scans for, kept as tokens arrive, so a step's lookup visits the earlier
    occurrences of the last token instead of the whole context (a 4,000-token chat: ~40 positions
    against 4,000 a step). `chain(max_tokens)` is `lookup_chain(tokens, max_tokens)`, the same list."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: list[int] = []
        self._at: dict[int, list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        self._at.setdefault(token, []).append(len(self.tokens))
        self.tokens.append(token)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(int(t))

    def longest_repeat(self, max_ngram: int = MAX_NGRAM) -> tuple[int, int]:
        """longest_repeat(self.tokens, max_ngram), from the last token's earlier positions."""
        ctx = self.tokens
        if len(ctx) < 2:
            return 0, -1
        ends = self._at[ctx[-1]]
        return _best_match(ctx, (ends[i] for i in range(len(ends) - 2, -1, -1)), max_ngram)  # earlier ones, latest first

    def chain(self, max_tokens: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
        """lookup_chain(self.tokens, max_tokens, max_ngram, min_ngram)."""
        return _chain(self.tokens, self.longest_repeat(max_ngram), max_tokens, min_ngram) if max_tokens >= 1 else []


def lookup_chain(context: Sequence[int], max_tokens: int, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = MIN_NGRAM) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the context's longest
    repeated suffix (min_ngram..max_ngram tokens), continued round the loop where they run
    into the present; `chain_length` of them; [] when no suffix of min_ngram tokens occurred."""
    if max_tokens < 1:
        return []
    ctx = list(context)
    return _chain(ctx, longest_repeat(ctx, max_ngram), max_tokens, min_ngram)


def copy_after(ctx: list[int], end: int, max_tokens: int) -> list[int]:
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
    tokens, parents, depths = (list(x) for x in tree.host)
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
    scores = tree.host_scores
    if scores is not None:
        scores = scores + [float("-inf")] * (len(tokens) - n0)
    return DraftTree.from_lists(tokens, parents, depths, scores, tree.score_dtype, tree.device)

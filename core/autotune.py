"""Fit the draft tree to the hardware (after Sequoia, arXiv 2402.12374).

    tokens/s(d, n) = E[tokens per step | depth d, tree size n] / (t_draft(d, n) + t_verify(n) + t_other)

t_verify(n): measured cost of one target forward over n new tokens; t_draft(d, n): measured
cost of the head's catch-up and first level plus each further level's round, weighted by how
often drafting runs that round for an n-node tree (core.decoding.tree.draft_dynamic skips rounds whose
nodes cannot make the cut; `round_fractions` replays that); E[tokens per step]: from one
calibration run with a large tree, replaying which smaller trees would have held the
accepted path (a smaller EAGLE-2 tree keeps the best n - 1 candidates of depth <= d, a
subset of the large tree's candidates, and greedy acceptance of a node depends only on
its ancestors). Results are cached per model, head, device, dtype and thread count.
"""

from __future__ import annotations

import functools
import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import core.threads  # noqa: I001

if __name__ == "__main__":  # run as a command: choose the OpenMP policy before torch loads (core.threads)
    core.threads.start()

import torch
from tqdm import tqdm

from core.decoding import cache as kv
from core.clock import median_time
from core.config import WEIGHTS, WEIGHTS_HELP, GenerationConfig, SamplingConfig, TreeConfig
from core.decoding.engine import Engine
from core.decoding.forward import forward_tree, prefill
from core.decoding.head import HeadCache
from core.decoding.lookup import chain_tree, default_tokens
from core.decoding.tree import catch_up, draft_dynamic, tree_from_parents
from core.kernels import native
from core.decoding.treestore import (TREE_FILE, engine_gemm, save_tuned, shipped_tree, shipped_tree_path,  # noqa: F401
                            tuned_path, tuned_tree)  # (re-exported)

LOOKUP_CHOICES = (0, 6, 10, 16, 24)  # chain lengths autotune compares end to end (--lookup auto)
# Sampled speed, speculative vs plain, measured at these (hot_sampling) up to the first where plain decoding wins.
# From 0.1: on AVX2 (a verified row ~20% of a forward, and a sampled step computes every row's full LM head where a
# greedy one screens it) plain decoding was faster at every sampled temperature measured, 0.1 included (0.96x).
HOT_TEMPERATURES = (0.1, 0.3, 0.7, 1.0, 1.3)
CALIBRATION_PROMPTS = (
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about autumn leaves.",
    "What are three differences between Python lists and tuples?",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
    "Summarise the causes of the French Revolution in a few sentences.",
    "Write a Python function that checks whether a number is prime.",
)
SIZES = (2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
DEPTHS = tuple(range(1, 9))


@dataclass(frozen=True)
class Profile:
    verify_s: dict[int, float]   # tokens in one target call -> seconds (at `context` tokens of context)
    draft_s: dict[int, float]    # tree depth -> seconds to draft it (catch-up included)
    other_s: float               # per-step bookkeeping (acceptance, cache commit)
    steps: tuple[tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]], ...]  # (depths, scores, path)
    top_k: int
    context: int = 256           # context length the costs were measured at
    attend_s: float = 0.0        # extra seconds per call, per token in the call, per context token beyond
    steps_at: dict = field(default_factory=dict)  # context length -> `steps` calibrated on prompts that long


def steps_for(profile: Profile, context: int | None):
    """The calibration steps for a context: from the longest calibrated prompt not longer."""
    fits = [c for c in profile.steps_at if context is not None and c <= context]
    return profile.steps_at[max(fits)] if fits else profile.steps


def expected_tokens(steps, depth: int, size: int) -> float:
    """Mean tokens per step (accepted drafts + bonus) had the tree been (depth, size)."""
    total = 0
    for depths, scores, path in steps:
        d = torch.tensor(depths[1:])
        s = torch.tensor(scores[1:])
        eligible = (d <= depth).nonzero().flatten()
        order = torch.sort(-s[eligible], stable=True).indices[: size - 1]
        kept = set((eligible[order] + 1).tolist())
        accepted = 0
        for node in path[1:]:
            if node not in kept:
                break
            accepted += 1
        total += accepted + 1
    return total / max(1, len(steps))


def round_fractions(steps, depths, sizes) -> dict[tuple[int, int], float]:
    """(r, n) -> the fraction of steps in which drafting an n-node tree runs round r (feeds the
    depth-r frontier for depth r + 1 candidates). core.decoding.tree.draft_dynamic runs it only when the
    best depth-r candidate scores above the (n - 1)-th best candidate of depth <= r; replayed
    on the calibration trees (where those hold too few shallow nodes, the round counts as run)."""
    rounds = range(1, max(depths, default=1))
    ran = {(r, n): 0 for r in rounds for n in sizes}
    for depths_, scores, _ in steps:
        d = torch.tensor(depths_[1:])
        s = torch.tensor(scores[1:], dtype=torch.float64)
        for r in rounds:
            shallow = s[d <= r].sort(descending=True).values
            at_r = s[d == r]
            best = float(at_r.max()) if at_r.numel() else float("-inf")
            for n in sizes:
                keep = n - 1
                ran[(r, n)] += 1 if keep < 1 or shallow.numel() < keep else int(best > float(shallow[keep - 1]))
    return {key: count / max(1, len(steps)) for key, count in ran.items()}


def draft_cost(profile: "Profile", fractions: dict, depth: int, size: int) -> float:
    """Seconds to draft a (depth, size) tree: catch-up and the first level, then each further
    level's round (`draft_s[r + 1] - draft_s[r]`, measured running every round) as often as it runs."""
    cost = profile.draft_s[1]
    for r in range(1, depth):
        cost += fractions.get((r, size), 1.0) * max(0.0, profile.draft_s[r + 1] - profile.draft_s[r])
    return cost


def interpolate(table: dict[int, float], n: int) -> float:
    xs = sorted(table)
    if n <= xs[0]:
        return table[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if a <= n <= b:
            return table[a] + (table[b] - table[a]) * (n - a) / (b - a)
    return table[xs[-1]] * n / xs[-1]


# Costs are measured to about +-5% on a shared machine: trees predicted within this fraction
# of the fastest count as tied, and the one accepting the most tokens per step wins (fewer
# target forwards; it also keeps its lead as the context, and with it every forward, grows).
# Measured here (SmolLM2, native kernels, 10 tuning prompts x 128 tokens, end to end): from one
# noisy profile the raw argmax picked depth 1 / 3 nodes, 62.0 tok/s, where this rule picks
# depth 2 / 8 nodes, 71.6; from a quieter one it picks depth 3 / 10 nodes, 64.4 (2 runs)
# against 66.6 for depth 2 / 8 nodes.
TIE = 0.05


# Context lengths core.autotune fits long_context caps for (TreeConfig.at).
LONG_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


def rank(profile: Profile, depths=DEPTHS, sizes=SIZES, context: int | None = None) -> list[tuple[float, float, TreeConfig]]:
    """Every feasible (depth, size) as (predicted tokens/s, expected tokens per step, tree),
    fastest first, at `context` tokens of context (None: the profile's); pure."""
    extra = profile.attend_s * max(0, (context or profile.context) - profile.context)  # per token in the call
    steps = steps_for(profile, context)
    depths = [d for d in depths if all(e in profile.draft_s for e in range(1, d + 1))]
    fractions = round_fractions(steps, depths, sizes)
    candidates = []  # (rate, expected tokens per step, tree)
    for d in depths:
        for n in sizes:
            if n < 2 or n - 1 > profile.top_k + (d - 1) * profile.top_k ** 2:
                continue  # more nodes than the tree can have
            step = draft_cost(profile, fractions, d, n) + interpolate(profile.verify_s, n) + extra * n + profile.other_s
            tokens = expected_tokens(steps, d, n)
            candidates.append((tokens / step, tokens, TreeConfig(depth=d, top_k=profile.top_k, total_tokens=n)))
    return sorted(candidates, key=lambda c: -c[0])


def choose(profile: Profile, depths=DEPTHS, sizes=SIZES, context: int | None = None) -> tuple[TreeConfig, float]:
    """The (depth, size) with the highest predicted tokens/s at `context` tokens of context
    (None: the profile's), ties (within TIE) going to the tree that accepts more tokens per
    step; pure, for literal tests."""
    return pick(rank(profile, depths, sizes, context))


def pick(candidates: list[tuple[float, float, TreeConfig]]) -> tuple[TreeConfig, float]:
    """`choose` on ranked candidates: the fastest, a near tie (within TIE) going to the tree
    that accepts more tokens per step."""
    best_rate = candidates[0][0]
    rate, _, tree = max((c for c in candidates if c[0] >= (1 - TIE) * best_rate), key=lambda c: (c[1], c[0]))
    return tree, rate


def confirm(engine: Engine, trees: list[TreeConfig], prompts=CALIBRATION_PROMPTS, max_new_tokens: int = 128,
            reps: int = 2) -> tuple[TreeConfig, dict[TreeConfig, float]]:
    """End to end: every tree answers every prompt `reps` times, interleaved (each prompt starts
    the rotation at another tree; odd repetitions run it backwards), so a slow phase of the
    machine falls on all trees alike. The fastest in total tokens/s wins. On a noisy machine
    the cost model's ranking can swap trees within a few percent of each other; this is what
    the user's answers would see."""
    totals = {t: [0, 0.0] for t in trees}
    with tqdm(total=reps * len(prompts) * len(trees), desc="end-to-end check", leave=False) as bar:
        for rep in range(reps):
            for i, prompt in enumerate(prompts):
                order = trees[i % len(trees):] + trees[:i % len(trees)]
                for tree in order[::-1] if rep % 2 else order:
                    events = list(engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, tree=tree,
                                                                           reuse_prompt=False)))
                    totals[tree][0] += sum(ev.accepted_length for ev in events)
                    totals[tree][1] += events[-1].elapsed_s
                    bar.update()
    rates = {t: n / max(s, 1e-9) for t, (n, s) in totals.items()}
    return max(trees, key=lambda t: rates[t]), rates


def hot_sampling(engine: Engine, tree: TreeConfig, temperatures=HOT_TEMPERATURES, prompts=CALIBRATION_PROMPTS,
                 max_new_tokens: int = 128, reps: int = 2) -> tuple[float, dict[str, dict[str, float]]]:
    """TreeConfig.plain_from_temperature for `tree`, measured: at each temperature, coolest first, the
    calibration prompts are sampled with the tree and plain, interleaved, the same seed for both
    modes; the first temperature at which plain decoding is faster in tokens/s (the hotter ones are
    not measured: hotter sampling accepts fewer drafts), else 0 (speculate at every temperature). Hot
    sampling accepts fewer drafted tokens, and on a CPU whose verified rows are not free (8-bit
    activations) the tree then costs more than it saves. -> (that temperature, {temperature:
    {"eagle": tok/s, "plain": tok/s}} for the temperatures measured)."""
    tree = replace(tree, plain_from_temperature=0.0)
    rates: dict[str, dict[str, float]] = {}
    with tqdm(total=len(temperatures) * reps * len(prompts) * 2, desc="sampled, eagle vs plain", leave=False) as bar:
        for t in sorted(temperatures):
            totals = {True: [0, 0.0], False: [0, 0.0]}
            for rep in range(reps):
                for i, prompt in enumerate(prompts):
                    for spec in ((True, False) if (rep + i) % 2 == 0 else (False, True)):
                        cfg = GenerationConfig(max_new_tokens=max_new_tokens, speculative=spec, tree=tree,
                                               sampling=SamplingConfig(temperature=t), seed=1000 * rep + i,
                                               reuse_prompt=False)
                        events = list(engine.generate(prompt, cfg))
                        totals[spec][0] += events[-1].total_tokens
                        totals[spec][1] += events[-1].elapsed_s
                        bar.update()
            rate = rates[f"{t:g}"] = {"eagle": totals[True][0] / max(totals[True][1], 1e-9),
                                      "plain": totals[False][0] / max(totals[False][1], 1e-9)}
            if rate["plain"] >= rate["eagle"]:
                return float(t), rates
    return 0.0, rates


def long_context_caps(profile: Profile, tree: TreeConfig, max_context: int,
                      depths=DEPTHS, sizes=SIZES) -> tuple[tuple[int, int, int], ...]:
    """TreeConfig.long_context for `tree`: at each of LONG_CONTEXTS up to max_context, the tree
    `choose` picks there, kept where it is smaller than the one before, or plain decoding
    ([c, 0, 0], then to the end) where it beats the best tree; pure."""
    caps, last = [], (tree.depth, tree.total_tokens)
    for c in LONG_CONTEXTS:
        if c >= max_context or c <= profile.context:
            continue
        t, rate = choose(profile, depths, sizes, context=c)
        plain = 1.0 / (interpolate(profile.verify_s, 1) + profile.attend_s * (c - profile.context))
        if rate < (1 - TIE) * plain:  # clearly slower than plain decoding (a tie keeps speculating)
            caps.append((c, 0, 0))
            break
        shape = (min(t.depth, last[0]), min(t.total_tokens, last[1]))
        if shape != last:
            caps.append((c, *shape))
            last = shape
    return tuple(caps)


LONGER = 1024  # context tokens added to measure what a row's attention costs per context token


def monotone(costs: dict[int, float]) -> dict[int, float]:
    """Measured cost per call by rows -> the same, made non-decreasing in rows (a call with more
    rows never costs less; on a noisy machine one can measure less, e.g. 4 rows 33.6 ms after 3
    rows 27.4 here, and the chooser would then favour that size for nothing): each cost is lifted
    to the largest one measured at fewer rows; pure."""
    out, top = {}, 0.0
    for n in sorted(costs):
        top = max(top, costs[n])
        out[n] = top
    return out


def measure_costs(engine: Engine, top_k: int, context: int = 256, reps: int = 5) -> tuple[dict, dict, float]:
    """Target cost per call against tokens in the call, draft cost per depth, and the extra
    target cost per token in the call and per context token beyond `context`."""
    model, device = engine.forwarder, engine.target.device  # the native step where it serves
    ids = torch.arange(100, 100 + context, device=device) % model.config.vocab_size
    cache = kv.new_cache(model)
    # the fastest of several calls: machine noise only ever adds time
    _fastest = lambda fn, reps: min(median_time(fn, device, reps=1, warmup=0) for _ in range(reps))
    with torch.inference_mode():
        features, _ = prefill(model, ids, cache, engine.drafter.feature_layers)
        verify = {}
        for _ in range(2):  # warm-up: the first calls of each shape build kernels and buffers
            for n in (1,) + SIZES:
                forward_tree(model, tree_from_parents([int(t) for t in ids[:n]], [-1] + list(range(n - 1)), device),
                             cache, context)
                kv.keep(cache, context, [])
        chain = lambda n: tree_from_parents([int(t) for t in ids[:n]], [-1] + list(range(n - 1)), device)

        def cost(n: int, at: int) -> float:
            tree = chain(n)

            def call():
                forward_tree(model, tree, cache, at)
                kv.keep(cache, at, [])

            call()  # warm-up
            return _fastest(call, reps)

        for n in tqdm((1,) + SIZES, desc="target cost per call", leave=False):  # 1 = plain decoding
            verify[n] = cost(n, context)
        verify = monotone(verify)
        # every row attends to the whole context: the extra cost per row and context token,
        # from 16 rows against 1 at `context` and at `context + LONGER` tokens
        longer = min(LONGER, engine.max_context - context - 64)
        attend = 0.0
        if longer > 0:
            prefill(model, (ids.repeat(longer // context + 1)[:longer] + 7) % model.config.vocab_size, cache)
            wide = cost(16, context + longer) - cost(1, context + longer)
            attend = max(0.0, (wide - (verify[16] - verify[1])) / (15 * longer))
            kv.keep(cache, context, [])  # back to `context` tokens
        head_cache = HeadCache(engine.head.config, engine.target.dtype, device)
        root_hidden = catch_up(engine.drafter, head_cache, ids[1:], features[:-1])
        catch = _fastest(lambda: (catch_up(engine.drafter, head_cache, ids[:3], features[:3]),
                                      head_cache.truncate(context - 1)), reps)
        drafts = {}  # every round run (no pruning): round_fractions says how often each one is
        for d in tqdm(DEPTHS, desc="draft cost per depth", leave=False):
            cfg = TreeConfig(depth=d, top_k=top_k, total_tokens=min(512, 1 + top_k + (d - 1) * top_k))
            drafts[d] = catch + _fastest(lambda: draft_dynamic(engine.drafter, head_cache, int(ids[-1]),
                                                                   root_hidden, cfg, prune=False), reps)
    return verify, drafts, attend


def calibrate(engine: Engine, top_k: int, max_new_tokens: int = 48, prompts=CALIBRATION_PROMPTS):
    """Greedy answers with a large tree; record every step's candidates and accepted path."""
    steps, other = [], []
    big = TreeConfig(depth=max(DEPTHS), top_k=top_k, total_tokens=max(SIZES) + 16)
    record = lambda tree, result: steps.append((tuple(tree.depths.tolist()), tuple(tree.scores.tolist()),
                                                result.path))
    for prompt in tqdm(prompts, desc="acceptance calibration", leave=False):  # strings or chat messages
        for ev in engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, tree=big),
                                  on_step=record):
            if ev.tree_size:
                other.append(ev.other_s)
    return tuple(steps), statistics.median(other) if other else 0.0


LONG_CALIBRATION = (2048, 4096)  # context lengths whose acceptance is calibrated on prompts that long


def long_document() -> str:
    """A fixed long text for long-context prompts: the Python language reference topics that ship
    with the interpreter (`pydoc_data.topics`, from "assignment" on)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics) if k >= "assignment")


@functools.cache
def _document_ids(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer(long_document(), add_special_tokens=False)["input_ids"])  # ~100k tokens, 0.3 s


def long_prompt(engine: Engine, tokens: int, skip: int = 0) -> list[dict]:
    """A chat asking for a summary of `tokens` tokens of `long_document()`, after the first `skip`."""
    tok = engine.target.tokenizer
    doc = tok.decode(list(_document_ids(tok)[skip:skip + tokens]))
    return [{"role": "user", "content": f"Here is a document:\n{doc}\nSummarise it in three sentences."}]


def calibrate_long(engine: Engine, top_k: int, max_new_tokens: int = 48) -> dict:
    """Acceptance on long prompts (the head accepts less deep in long contexts than after short
    prompts): context length -> calibration steps, for the LONG_CALIBRATION lengths that fit."""
    out = {}
    for c in LONG_CALIBRATION:
        if c + max_new_tokens + max(SIZES) + 64 >= engine.max_context:
            continue
        prompts = (long_prompt(engine, c - 64), long_prompt(engine, c - 64, skip=c))  # two documents
        steps, _ = calibrate(engine, top_k, max_new_tokens, prompts=prompts)
        if steps:
            out[c] = steps
    return out


def cached_tree(engine: Engine) -> TreeConfig | None:
    """The tree chosen earlier for this model/head/device/numerics/threads, if any."""
    choice = tuned_tree(engine)
    return choice.tree if choice else None


def choose_tree(engine: Engine, top_k: int = 8, refresh: bool = False, lookup: int | None = None,
                confirm_top: int = 0, hot: bool = True) -> TreeConfig:
    """Measure (or reuse) the cost and acceptance profile and return the fastest tree, with
    `lookup` context-lookup tokens (core.decoding.lookup; the head's tree is chosen without them).
    confirm_top > 1: the model's choice and the best-predicted trees of the next sizes, that
    many in all, answer the calibration prompts end to end (`confirm`) and the fastest wins.
    lookup None (with confirm_top > 1): the chain length is measured too: the chosen tree with
    each of LOOKUP_CHOICES answers end to end and the fastest wins (a chain's rows cost what
    the machine's GEMM makes them cost: nearly nothing up to 16 rows on AMX tiles, ~10% of a
    one-row call each with 8-bit activations on AVX-512).
    hot (with confirm_top > 1): sampled answers measure from which temperature plain decoding is
    faster (`hot_sampling`, the tree's plain_from_temperature).
    On 8-bit activations, where each verified row costs integer work, the tree drops the drafts
    too unlikely to pay for their rows at the costs measured while answering (`row_floor`,
    core.decoding.rowcost)."""
    if not engine.has_head:
        raise ValueError("choosing a tree needs a draft head")
    if not refresh and (tree := cached_tree(engine)) is not None:
        return tree
    verify, drafts, attend = measure_costs(engine, top_k)
    steps, other = calibrate(engine, top_k)
    profile = Profile(verify_s=verify, draft_s=drafts, other_s=other, steps=steps, top_k=top_k, attend_s=attend,
                      steps_at=calibrate_long(engine, top_k))
    candidates = rank(profile)
    tree, rate = pick(candidates)
    dear_rows = engine.step is not None and engine.step.info.activations == "int8"  # a row costs integer work
    default_lookup = default_tokens(dear_rows, native.gemm_kind())
    confirmed = {}
    if confirm_top > 1:
        trees = [tree]  # then the best depth of each next-best size: size is what costs
        for _, _, t in candidates:
            if len(trees) < confirm_top and all(t.total_tokens != u.total_tokens for u in trees):
                trees.append(t)
        with_lookup = [chain_tree(replace(t, lookup=default_lookup if lookup is None else lookup)) for t in trees]
        best, rates = confirm(engine, with_lookup)
        tree = trees[with_lookup.index(best)]
        rate = next(r for r, _, t in candidates if t == tree)  # the model's prediction for the tree kept
        confirmed = {f"{t.depth},{t.total_tokens}": r for t, r in zip(trees, (rates[w] for w in with_lookup))}
    by_lookup = {}
    if lookup is None:
        lookup = default_lookup
        if confirm_top > 1:
            chains = [chain_tree(replace(tree, lookup=n)) for n in LOOKUP_CHOICES]
            best, rates = confirm(engine, chains)
            lookup = best.lookup
            by_lookup = {str(t.lookup): r for t, r in rates.items()}
    plain_from, by_temperature = 0.0, {}
    if hot and confirm_top > 1:
        plain_from, by_temperature = hot_sampling(engine, chain_tree(replace(tree, lookup=lookup)))
    tree = chain_tree(replace(tree, lookup=lookup, long_context=long_context_caps(profile, tree, engine.max_context),
                              plain_from_temperature=plain_from, row_floor=dear_rows))
    save_tuned(engine, tree, {"predicted_tokens_per_s": rate, "verify_s": verify, "draft_s": drafts,
                              "other_s": other, "attend_s_per_row_and_context_token": attend,
                              "numerics": engine.numerics.describe(),
                              "end_to_end_tokens_per_s": confirmed,
                              "end_to_end_tokens_per_s_by_lookup": by_lookup,
                              "sampled_tokens_per_s_by_temperature": by_temperature,
                              "expected_tokens": {f"{d},{n}": expected_tokens(steps, d, n)
                                                  for d in DEPTHS for n in SIZES}})
    engine.tree_choice = tuned_tree(engine) or engine.tree_choice
    return tree


def _lookup_arg(text: str) -> int | None:
    """--lookup: "auto" (None) or a chain length in 0..32."""
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 32:
        import argparse
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer in 0..32, got {text!r}")
    return n


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m core.autotune",
                                description="Measure this machine and choose the fastest draft tree.")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--head", default="default")
    p.add_argument("--dtype", default="auto", help="auto: bf16 with exact kernels on CPU where the probe passes")
    p.add_argument("--attention", default="auto", help="auto, exact, sdpa or eager")
    p.add_argument("--weights", default="auto", choices=WEIGHTS, help=WEIGHTS_HELP)
    p.add_argument("--device", default="cpu")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--lookup", type=_lookup_arg, default=None, metavar="N|auto",
                   help=f"context-lookup tokens in the chosen tree (0 = off; default auto: each of "
                        f"{', '.join(map(str, LOOKUP_CHOICES))} answers end to end and the fastest wins; "
                        f"where --confirm is 0 or 1: {default_tokens(True)} on the 8-bit-activation step "
                        f"({default_tokens(True, 'avx2')} on AVX2), else {default_tokens(False)})")
    p.add_argument("--confirm", type=int, default=4, metavar="N",
                   help="answer the calibration prompts end to end with the model's N best trees and keep "
                        "the fastest (0 = trust the cost model; default 4)")
    p.add_argument("--ship", action="store_true",
                   help=f"also write the choice beside the head: to tree.<gemm>.json where the head has one for "
                        f"this machine's GEMM (amx, avx512, avx2, amx-w4a8, avx512-w4a8, avx2-w4a8), else to {TREE_FILE}")
    a = p.parse_args(argv)
    core.threads.start()  # no-op where the command line already did
    core.threads.set_threads(a.threads)
    engine = Engine.load(a.model, a.head, dtype=a.dtype, attention=a.attention, device=a.device, weights=a.weights)
    print(f"numerics: {engine.numerics.describe()}")
    tree = choose_tree(engine, top_k=a.top_k, refresh=True, lookup=a.lookup, confirm_top=a.confirm)
    report = json.loads(tuned_path(engine).read_text())
    if report.get("end_to_end_tokens_per_s"):
        print("end to end, tokens/s by depth,size:", {k: round(v, 1) for k, v in report["end_to_end_tokens_per_s"].items()})
    if report.get("end_to_end_tokens_per_s_by_lookup"):
        print("end to end, tokens/s by lookup tokens:",
              {k: round(v, 1) for k, v in report["end_to_end_tokens_per_s_by_lookup"].items()})
    if report.get("sampled_tokens_per_s_by_temperature"):
        print("sampled, tokens/s by temperature:", {t: {m: round(v, 1) for m, v in r.items()}
                                                    for t, r in report["sampled_tokens_per_s_by_temperature"].items()})
    print(f"chosen: depth={tree.depth} top_k={tree.top_k} total_tokens={tree.total_tokens} lookup={tree.lookup} "
          f"plain_from_temperature={tree.plain_from_temperature:g} "
          f"(predicted {report['predicted_tokens_per_s']:.1f} tokens/s for the head's tree alone)")
    plain = 1.0 / (report["verify_s"]["1"] + report["other_s"])
    print(f"plain decoding: predicted {plain:.1f} tokens/s"
          + ("  -> speculation does not pay with this head on this machine" if plain > report["predicted_tokens_per_s"] else ""))
    print("target ms per call:", {n: round(1000 * s, 1) for n, s in report["verify_s"].items()})
    print("draft ms per depth:", {d: round(1000 * s, 1) for d, s in report["draft_s"].items()})
    print(f"attention: +{1e6 * report['attend_s_per_row_and_context_token'] * 1000:.0f} us per tree row per "
          f"1,000 context tokens; long-context caps [min_context, depth, total_tokens]: {list(tree.long_context)}")
    if a.ship:
        from core.decoding.engine import default_head

        folder = Path(a.head if a.head != "default" else default_head(a.model))
        path = shipped_tree_path(folder, engine_gemm(engine))  # the file machines like this one read
        path.write_text(json.dumps(asdict(tree)) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Context-lookup rules, compared offline by replaying recorded answers (docs/context-lookup.md).

    python scripts/lookup_replay.py record PROMPTS.jsonl OUT.jsonl [--exclude FILE.jsonl] [--limit N] [--threads 1]
    python scripts/lookup_replay.py replay OUT.jsonl [OUT2.jsonl ...]

`record` answers each prompt's first turn with plain greedy decoding (what every speculative
run outputs too), then, at every answer position, drafts the head's full dynamic tree there
(depth 5, top-k 6, nothing pruned) and stores its candidates with their scores. From these,
the tree a step would verify at that position is known for any depth <= 5 and any size
(the best `total_tokens - 1` candidates), so `replay` can walk each answer step by step under a
lookup rule and a tree shape without running the target again: a step accepts the longest
path of its tree or of its lookup chain that matches the answer, then moves on by that plus
the bonus token. Tau is exact for the recorded answers (up to the tiny feature differences
between a prefill and a tree forward); time comes from a cost model measured on a machine
(`--cost`, COSTS): a target forward of r rows costs `VERIFY_MS + ROW_MS * (r - 1)` up to KNEE
rows and `PAST_KNEE_MS` for each row past that; drafting costs `ROUND_MS` per head round run.
Speed-ups are relative to plain decoding in the same model, so the absolute level cancels.
The served w4a8 tree (depth 1, 3 tokens) is `replay FILE --depth 1 --size 3`.
Run `record` with --threads 1 if another job shares the machine: nothing in it is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core.decoding.lookup import (CHAIN_TREE_TOKENS, DEFAULT_TOKENS, DEFAULT_TOKENS_INT8, MAX_NGRAM, chain_length,
                                  copy_after, longest_repeat)

# Cost models, 2 threads: (VERIFY_MS, ROW_MS, KNEE, PAST_KNEE_MS, ROUND_MS, STEP_MS, PLAIN_OTHER_MS):
# a one-row forward; each further row up to KNEE rows; each row past it; a head round; a step's
# catch-up + bookkeeping; a plain step's own bookkeeping.
COSTS = {
    # the 4-bit x 8-bit native step, AMD EPYC Zen 5 (2026-12-04: forwards by rows in the engine,
    # 3 rows 3.5 ms, 8 rows 6.1 ms, 26 rows 16.1 ms; draft + bookkeeping 1.0 ms a step)
    "w4a8-avx512": (3.4, 0.5, 512, 0.5, 0.35, 1.0, 0.18),
    # the bf16 transformers forward on AMX tiles, Intel Xeon (2026-12-01; a chain-shaped tree after
    # a 50-token prompt, min of 12 runs): rows nearly free up to 12
    "bf16-amx": (22.6, 0.3, 12, 0.85, 0.87, 1.8, 0.3),
}
VERIFY_MS, ROW_MS, KNEE, PAST_KNEE_MS, ROUND_MS, STEP_MS, PLAIN_OTHER_MS = COSTS["w4a8-avx512"]
RECORD_DEPTH, RECORD_TOP_K = 5, 6


@dataclass(frozen=True)
class Rule:
    """A lookup rule: the chain's length after a match of n tokens with `room` tokens left to
    write (`lengths`), the longest match looked for, and the head tree's size beside a chain."""

    name: str
    lengths: Callable[[int, int], int]
    max_ngram: int
    chain_tree: int = 0  # 0: the full tree

    def chain(self, ctx: list[int], room: int) -> list[int]:
        n, end = longest_repeat(ctx, self.max_ngram)
        k = self.lengths(n, room) if room > 0 else 0
        return copy_after(ctx, end, k) if k else []


def table(*pairs: tuple[int, int]) -> Callable[[int, int], int]:
    """((min n, tokens), ...), longest first -> a `lengths` function."""
    return lambda n, room: min(next((t for m, t in pairs if n >= m), 0), room)


def previous(n: int, room: int) -> int:
    """The rule before 2026-12-01 (16 tokens after a 4-token match, half after 3), as it ran."""
    k = min(16, room)
    return k if n >= 4 else k // 2 if n == 3 else 0


def until_dec4(max_tokens: int) -> Callable[[int, int], int]:
    """The rule of 2026-12-01 to 12-03: max_tokens after 4+ matching tokens, a third after 3, a quarter after 2."""
    def lengths(n: int, room: int) -> int:
        k = min(max_tokens, room)
        return k if n >= 4 else k // 3 if n == 3 else k // 4 if n == 2 else 0
    return lengths


def shipped_at(max_tokens: int) -> Callable[[int, int], int]:
    """core.decoding.lookup's rule with a tree's `lookup` setting, as the engine runs it
    (lookup_chain with the room-capped setting)."""
    return lambda n, room: chain_length(n, min(max_tokens, room))


shipped = shipped_at(DEFAULT_TOKENS)

RULES = (
    Rule("previous: 4 -> 16, 3 -> 8 tokens, full tree", previous, 4),
    Rule(f"12-01 rule: 4+ -> 24, 3 -> 8, 2 -> 6, a {CHAIN_TREE_TOKENS}-token tree beside a chain", until_dec4(24),
         MAX_NGRAM, CHAIN_TREE_TOKENS),
    Rule("12-01 rule at 8 tokens", until_dec4(8), MAX_NGRAM, CHAIN_TREE_TOKENS),
    Rule(f"shipped rule (5+ -> all, 4 -> 60%, 3 -> 40%, 2 -> 30%) at {DEFAULT_TOKENS} tokens", shipped, MAX_NGRAM,
         CHAIN_TREE_TOKENS),
    Rule(f"shipped rule at {DEFAULT_TOKENS_INT8} tokens (the w4a8 trees)", shipped_at(DEFAULT_TOKENS_INT8), MAX_NGRAM,
         CHAIN_TREE_TOKENS),
    Rule("shipped rule at 16 tokens", shipped_at(16), MAX_NGRAM, CHAIN_TREE_TOKENS),
)


def record(a) -> None:
    from core import threads

    threads.start()  # the OpenMP policy, before torch loads
    threads.set_threads(a.threads)
    import torch
    from tqdm import tqdm

    from core.decoding import cache as kv
    from core.config import GenerationConfig, TreeConfig
    from core.decoding.engine import Engine
    from core.decoding.forward import prefill
    from core.decoding.head import HeadCache
    from core.decoding.tree import catch_up, draft_dynamic

    engine = Engine.load()
    skip = {json.loads(line)["id"] for line in open(a.exclude)} if a.exclude else set()
    rows = [r for r in map(json.loads, open(a.prompts)) if r["id"] not in skip][: a.limit]
    done = {json.loads(line)["id"] for line in open(a.out)} if Path(a.out).is_file() else set()
    full = TreeConfig(depth=RECORD_DEPTH, top_k=RECORD_TOP_K, total_tokens=512)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as f:
        for r in tqdm([r for r in rows if r["id"] not in done], desc="record", unit="prompt"):
            ids = engine.encode(r["turns"][0])
            out = [t for ev in engine.generate(ids, GenerationConfig(max_new_tokens=a.max_new_tokens,
                                                                     speculative=False)) for t in ev.token_ids]
            trees = []
            with torch.inference_mode():
                seq = torch.tensor(ids + out)
                feats, _ = prefill(engine.target.model, seq, kv.new_cache(engine.target.model))  # (T + n, H)
                cache = HeadCache(engine.head.config, engine.target.dtype, engine.target.device)
                t0 = len(ids)
                hidden = catch_up(engine.drafter, cache, seq[1:t0 + 1], feats[:t0])  # root: out[0]
                for i in range(len(out) - 1):  # root out[i]; its tree drafts out[i + 1], ...
                    tree = draft_dynamic(engine.drafter, cache, out[i], hidden, full, prune=False)
                    trees.append({"tokens": tree.tokens[1:].tolist(), "parents": (tree.parents[1:] - 1).tolist(),
                                  "depths": tree.depths[1:].tolist(),
                                  "scores": [round(x, 5) for x in tree.scores[1:].tolist()]})
                    hidden = catch_up(engine.drafter, cache, seq[t0 + i + 1:t0 + i + 2], feats[t0 + i:t0 + i + 1])
            f.write(json.dumps({"id": r["id"], "prompt": ids, "answer": out, "trees": trees}) + "\n")
            f.flush()


def verify_ms(rows: int) -> float:
    return VERIFY_MS + ROW_MS * (min(rows, KNEE) - 1) + PAST_KNEE_MS * max(0, rows - KNEE)


def head_tree(tree: dict, depth: int, size: int) -> list[int]:
    """Candidates (indices) of the dynamic tree of this depth and size, in drafting order."""
    cands = [j for j, d in enumerate(tree["depths"]) if d <= depth]
    return sorted(sorted(cands, key=lambda j: -tree["scores"][j])[:size - 1])


def head_rounds(tree: dict, depth: int, size: int, top_k: int) -> int:
    """Head calls after the root's, with draft_dynamic's pruning (rounds that cannot change the tree)."""
    rounds = 0
    for r in range(1, depth):
        so_far = sorted((s for s, d in zip(tree["scores"], tree["depths"]) if d <= r), reverse=True)
        frontier = sorted((s for s, d in zip(tree["scores"], tree["depths"]) if d == r), reverse=True)[:top_k]
        if len(so_far) >= size - 1 and not any(s > so_far[size - 2] for s in frontier):
            break
        rounds += 1
    return rounds


def replay_answer(rec: dict, rule: Rule | None, depth: int, size: int, top_k: int, budget: int) -> tuple[int, int, float]:
    """-> (tokens, target forwards incl. the prefill, modelled ms after the prefill)."""
    out, trees, i, steps, ms = rec["answer"], rec["trees"], 0, 0, 0.0
    while i < len(out) - 1:
        tree = trees[i]
        chain = rule.chain(rec["prompt"] + out[:i + 1], budget - i - 2) if rule else []
        nodes = head_tree(tree, depth, min(size, rule.chain_tree) if chain and rule.chain_tree else size)
        accepted, kids = 0, {}
        for j in nodes:  # topological: a node matches if its parent did and it is the answer's token
            p = tree["parents"][j]
            if (p < 0 or p in kids) and i + tree["depths"][j] < len(out) and tree["tokens"][j] == out[i + tree["depths"][j]]:
                kids[j] = True
                accepted = max(accepted, tree["depths"][j])
        by_parent = {(tree["parents"][j], tree["tokens"][j]): j for j in nodes}
        node, extra, chained = -1, 0, 0
        for k, tok in enumerate(chain):
            node = by_parent.get((node, tok)) if node is not None else None
            extra += node is None
            if chained == k and i + 1 + k < len(out) and out[i + 1 + k] == tok:
                chained += 1
        accepted = max(accepted, chained)
        ms += verify_ms(1 + len(nodes) + extra) + ROUND_MS * head_rounds(tree, depth, size, top_k) + STEP_MS
        i += accepted + 1
        steps += 1
    return len(out), steps + 1, ms


def replay(a) -> None:
    global VERIFY_MS, ROW_MS, KNEE, PAST_KNEE_MS, ROUND_MS, STEP_MS, PLAIN_OTHER_MS
    VERIFY_MS, ROW_MS, KNEE, PAST_KNEE_MS, ROUND_MS, STEP_MS, PLAIN_OTHER_MS = COSTS[a.cost]
    for path in a.records:
        recs = [json.loads(line) for line in open(path)]
        plain_ms = sum((len(r["answer"]) - 1) * (verify_ms(1) + PLAIN_OTHER_MS) for r in recs)
        print(f"{path}: {len(recs)} answers, {sum(len(r['answer']) for r in recs)} tokens "
              f"(tree depth {a.depth}, top-k {RECORD_TOP_K}, {a.size} tokens; cost model {a.cost})")
        results = {}
        for rule in (None,) + RULES:
            tokens = forwards = 0
            ms = 0.0
            for r in recs:
                n, f, t = replay_answer(r, rule, a.depth, a.size, RECORD_TOP_K, a.max_new_tokens)
                tokens, forwards, ms = tokens + n, forwards + f, ms + t
            results[rule] = (tokens / forwards, plain_ms / ms)
        base = results[RULES[1]][1]  # the rule this one replaced
        for rule, (tau, speedup) in results.items():
            rel = f", {speedup / base:.4f}x the 12-01 rule" if rule not in (None, RULES[1]) else ""
            print(f"  {rule.name if rule else 'no lookup'}: tau {tau:.3f}, modelled speed-up over plain {speedup:.3f}x{rel}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="answer prompts and record every position's full head tree")
    r.add_argument("prompts", help="JSONL with id and turns")
    r.add_argument("out")
    r.add_argument("--exclude", help="JSONL whose ids are skipped (e.g. the held-out benchmark prompts)")
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--max-new-tokens", type=int, default=128)
    q = sub.add_parser("replay", help="compare the lookup rules on recorded answers")
    q.add_argument("records", nargs="+")
    q.add_argument("--depth", type=int, default=4)
    q.add_argument("--size", type=int, default=10)
    q.add_argument("--max-new-tokens", type=int, default=128)
    q.add_argument("--cost", choices=sorted(COSTS), default="w4a8-avx512",
                   help="the measured cost model (COSTS): which machine and step the speed-ups model")
    a = p.parse_args(argv)
    if a.cmd == "replay" and not (1 <= a.depth <= RECORD_DEPTH and a.size >= 2):
        p.error(f"--depth must be in 1..{RECORD_DEPTH} (the recorded depth) and --size at least 2")
    (record if a.cmd == "record" else replay)(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())

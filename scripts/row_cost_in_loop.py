"""What a verified row costs inside the decode loop, not alone: one speculative run where every other
step verifies the root alone (the head still catches up, context lookup off), then plain decoding.

    python scripts/row_cost_in_loop.py [PROMPTS.jsonl] [--limit 12] [--threads 2]

Prints the median target forward of the one-row and the two-row steps of the same run, and of plain
decoding's steps: the difference of the first two is what the head's draft token costs in target time;
the one-row step against plain decoding's shows what the head's work between forwards costs the
target's own forward (docs/native-step.md, eighth session). Run it on a quiet machine.
"""

import argparse
import json
import statistics
import time
from collections import defaultdict
from dataclasses import replace

from core import threads  # noqa: I001

if __name__ == "__main__":  # the OpenMP policy, before torch loads (core.threads)
    threads.start()

import torch

from core.config import GenerationConfig
from core.decoding import engine as loop
from core.decoding.tree import DraftTree


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompts", nargs="?", default="assets/heldout_handwritten.jsonl")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = loop.Engine.load()
    tree = replace(engine.default_tree, lookup=0)
    seconds: dict[str, list[float]] = defaultdict(list)
    drafted, forward, plain = loop.draft, loop.forward_tree_greedy, loop.plain_forward_greedy
    turn = [0]

    def every_other_root_alone(*a, **k) -> DraftTree:
        t = drafted(*a, **k)
        turn[0] ^= 1
        if not turn[0]:
            return t
        return DraftTree(tokens=t.tokens[:1], parents=t.parents[:1], depths=t.depths[:1],
                         scores=None if t.scores is None else t.scores[:1])

    def timed(label, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            seconds[label(a)].append(time.perf_counter() - t0)
            return out
        return call

    loop.draft = every_other_root_alone
    loop.forward_tree_greedy = timed(lambda a: f"speculative run, {a[1].size} row(s)", forward)
    loop.plain_forward_greedy = timed(lambda a: "plain decoding, 1 row", plain)
    try:
        rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8")][:args.limit]
        for row in rows:
            messages = [{"role": "user", "content": row["turns"][0]}]
            for speculative in (True, False):
                for _ in engine.generate(messages, GenerationConfig(max_new_tokens=128, speculative=speculative,
                                                                    tree=tree)):
                    pass
    finally:
        loop.draft, loop.forward_tree_greedy, loop.plain_forward_greedy = drafted, forward, plain
    for label, values in sorted(seconds.items()):
        print(f"{label:32s} {len(values):5d} forwards, median {1000 * statistics.median(values):.3f} ms")


if __name__ == "__main__":
    main()

"""The target forward's cost by rows in the call and context length (a verified tree's rows).

    python scripts/forward_cost.py [--contexts 256,1024,2048,4000] [--rows 1,2,4,8,12] [--weights auto] [--threads 2]

Prefills a context of the given length, then times one forward of a chain of n rows on top of it
(the cache is set back after each), best of --reps calls. Prints milliseconds per call. Run it on
an otherwise idle machine: the figures are what `core.autotune` models trees with.
"""

import argparse
import time

from core import threads  # noqa: I001

if __name__ == "__main__":  # the OpenMP policy, before torch loads (core.threads)
    threads.start()

import torch

from core.config import WEIGHTS
from core.decoding import cache as kv
from core.decoding.engine import Engine
from core.decoding.forward import forward_tree, prefill
from core.decoding.tree import tree_from_parents


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def context_cache(model, ctx: int):
    """A synthetic context of `ctx` tokens prefilled into a fresh cache -> (its ids (ctx,), the cache)."""
    ids = (torch.arange(100, 100 + ctx) * 7) % model.config.vocab_size
    cache = kv.new_cache(model)
    prefill(model, ids, cache)
    return ids, cache


def row_chain(ids: torch.Tensor, n: int):
    """A chain of n rows (the context's first n tokens) to verify on top of the context."""
    return tree_from_parents([int(t) for t in ids[:n]], [-1] + list(range(n - 1)), "cpu")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=ints, default=[256, 1024, 2048, 4000])
    p.add_argument("--rows", type=ints, default=[1, 2, 4, 8, 12])
    p.add_argument("--weights", default="auto", choices=WEIGHTS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=12)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.load(weights=args.weights)
    model = engine.forwarder
    if max(args.contexts) + max(args.rows) >= engine.max_context:
        p.error(f"context + rows must stay under the model's {engine.max_context} tokens")
    print("context " + " ".join(f"{n:>7}" for n in args.rows) + "   (ms per forward, rows in the call)")
    with torch.inference_mode():
        for ctx in args.contexts:
            ids, cache = context_cache(model, ctx)
            best = []
            for n in args.rows:
                tree = row_chain(ids, n)
                fastest = float("inf")
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    forward_tree(model, tree, cache, ctx)
                    fastest = min(fastest, time.perf_counter() - t0)
                    kv.keep(cache, ctx, [])
                best.append(fastest)
            print(f"{ctx:7d} " + " ".join(f"{1000 * b:7.2f}" for b in best), flush=True)


if __name__ == "__main__":
    main()

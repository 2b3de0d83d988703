"""Another build's decode step against this one's, forward by forward: the only kernel A/B this VM's noise allows.

    python scripts/step_ab.py OTHER.so [--contexts 300,4000] [--rows 1,2] [--reps 300] [--features] [--greedy]

Loads the engine, prefills a context of each length, then times one target forward of n rows on top of it
(the cache set back after each), the two libraries' `decode_step` alternating forward by forward, and prints
each one's median and their ratio (this / other). OTHER.so: a copy of an earlier build's library
(`core.kernels.native._build(isa)` names it; copy it before changing csrc/). `--features` asks for the draft
head's features as an eagle step does; `--greedy` reads each row's argmax only, as a greedy step does (the screened
LM head). Run it once against a copy of this build first: that A/A ratio is the
noise (on the AVX2 VM of 2026-12-06: 0.996-1.009x at 300 keys). Kernels timed alone, with their data warm in
cache, misled there: the p @ V passes that measured 0.87x per layer alone took 1.06x per forward at 4,000 keys,
where the keys and values come from memory (docs/native-step.md, twentieth session).
"""

import argparse
import ctypes
import time

from core import threads  # noqa: I001

if __name__ == "__main__":  # the OpenMP policy, before torch loads (core.threads)
    threads.start()

import torch

from core.decoding import cache as kv
from core.decoding.engine import Engine
from core.decoding.forward import forward_tree
from core.kernels import native
from forward_cost import context_cache, ints, row_chain  # scripts/: this script's folder


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("other", help="the other build's library (.so)")
    p.add_argument("--contexts", type=ints, default=[300, 4000])
    p.add_argument("--rows", type=ints, default=[1, 2])
    p.add_argument("--reps", type=int, default=300, help="forwards per build and setting")
    p.add_argument("--features", action="store_true", help="ask for the draft head's features (an eagle step)")
    p.add_argument("--greedy", action="store_true", help="read each row's argmax only (the screened LM head)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    threads.set_threads(args.threads)
    torch.set_num_threads(args.threads)
    engine = Engine.load()
    kernels = native._library()[0]
    if kernels is None:
        p.error(f"the native kernels do not serve here: {native.status().describe()}")
    other = ctypes.CDLL(args.other).decode_step
    sig = native.signatures()["decode_step"]
    other.argtypes, other.restype = sig.argtypes, sig.restype
    steps = (other, kernels.decode_step)
    model = engine.forwarder
    layers = engine.drafter.feature_layers if args.features else None
    try:
        with torch.inference_mode():
            for ctx in args.contexts:
                ids, cache = context_cache(model, ctx)
                for n in args.rows:
                    tree = row_chain(ids, n)
                    choices = torch.empty(n, dtype=torch.int64) if args.greedy else None
                    times: tuple[list[float], list[float]] = ([], [])
                    for rep in range(args.reps):
                        for v in ((0, 1) if rep % 2 else (1, 0)):
                            kernels.decode_step = steps[v]
                            t0 = time.perf_counter()
                            forward_tree(model, tree, cache, ctx, layers, args.greedy, choices)
                            times[v].append(time.perf_counter() - t0)
                            kv.keep(cache, ctx, [])
                    a, b = (1e3 * sorted(t)[len(t) // 2] for t in times)
                    print(f"context {ctx:5d}, rows {n:2d}: other {a:.2f} ms, this {b:.2f} ms ({b / a:.3f}x)", flush=True)
    finally:
        kernels.decode_step = steps[1]


if __name__ == "__main__":
    main()

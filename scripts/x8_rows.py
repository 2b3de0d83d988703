"""The target forward by rows in the call on the 8-bit-activation step, AMX-INT8 against VNNI.

    python scripts/x8_rows.py [--rows 2,4,6,8,9,12,16] [--context 256] [--rounds 6] [--threads 2]

Prefills a random context, then times one forward of a chain of n rows on top of it with AMX-INT8 on and
off (`core.kernels.native.set_x8_amx`; the same bits either way), best of 5 calls, the median over rounds
that alternate the two. Decides `AMX_X8_MIN_ROWS` in csrc/gemm_x8.c (docs/native-step.md, tenth session).
Run it on an otherwise idle machine.
"""

import argparse
import time

from core import threads  # noqa: I001

if __name__ == "__main__":  # the OpenMP policy, before torch loads (core.threads)
    threads.start()

import torch

from core.decoding import cache as kv
from core.decoding.engine import Engine
from core.decoding.forward import forward_tree, prefill
from core.decoding.tree import tree_from_parents
from core.kernels import native


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="2,4,6,8,9,12,16")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows_list = [int(x) for x in a.rows.split(",")]
    engine = Engine.load(head=None)
    model = engine.forwarder
    cache = kv.new_cache(model)
    times: dict[tuple[int, bool], list[float]] = {}
    with torch.inference_mode():
        prefill(model, torch.randint(100, 20000, (a.context,), generator=torch.Generator().manual_seed(0)), cache)
        try:
            for _ in range(a.rounds):
                for rows in rows_list:
                    tree = tree_from_parents(list(range(1000, 1000 + rows)), list(range(-1, rows - 1)))
                    for amx in (True, False):
                        native.set_x8_amx(amx)
                        best = float("inf")
                        for _ in range(5):
                            t0 = time.perf_counter()
                            forward_tree(model, tree, cache, a.context, only_max=True)
                            best = min(best, time.perf_counter() - t0)
                            kv.keep(cache, a.context, [])
                        times.setdefault((rows, amx), []).append(best)
        finally:
            native.set_x8_amx(True)
    print(f"context {a.context}, ms per forward (median of {a.rounds} rounds of best-of-5)")
    for rows in rows_list:
        med = {amx: sorted(times[(rows, amx)])[len(times[(rows, amx)]) // 2] * 1000 for amx in (True, False)}
        print(f"rows {rows:3d}: AMX-INT8 {med[True]:7.2f}  VNNI {med[False]:7.2f}")


if __name__ == "__main__":
    main()

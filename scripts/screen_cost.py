"""The screened LM head against the full one (core.kernels.screen): target forwards of real chains.

    python scripts/screen_cost.py [--prompts 6] [--rows 1,2,3,8] [--threads 2]

For natural held-out prompts never trained on (assets/heldout_natural.jsonl, from the 21st), writes
80 greedy tokens, then at every 6th position times one forward of the next n tokens as a chain with
only_max on (screened) and off (full), interleaved, the cache set back after each. Prints the median
ms of each, their ratio, the share of the head computed exactly, and the rows whose argmax differs
(must be 0). Run it on an otherwise idle machine.
"""

import argparse
import json
import time
from pathlib import Path

from core import threads  # noqa: I001

if __name__ == "__main__":  # the OpenMP policy, before torch loads (core.threads)
    threads.start()

import numpy as np
import torch

from core.decoding import cache as kv
from core.decoding.engine import Engine
from core.decoding.forward import plain_forward, prefill
from core.decoding.verify import greedy_tokens

PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "heldout_natural.jsonl"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--rows", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 3, 8])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.load()
    step = engine.step
    if step is None or step.screen is None:
        p.error(f"no screened LM head serves here: {engine.numerics.describe()}")
    prompts = [json.loads(line)["turns"][0] for line in PROMPTS.read_text().splitlines()][20:20 + args.prompts]
    times, shares, wrong = {}, {}, 0
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor(engine.encode(prompt))
            cache = kv.new_cache(step.hf)
            _, last = prefill(step, ids, cache)
            start, seq = len(ids), [int(last.float().argmax())]
            for i in range(80):
                seq.append(int(greedy_tokens(plain_forward(step, seq[-1], cache, start + i)[1])))
            kv.keep(cache, start, [])  # back to the prompt: the answer is committed again 6 tokens at a time
            for at in range(0, 60, 6):
                ctx = start + at
                for n in args.rows:
                    call = (torch.tensor(seq[at:at + n]), torch.arange(ctx, ctx + n), ctx, torch.arange(n).repeat(n, 1),
                            torch.arange(1, n + 1), cache)
                    out = {}
                    for rep in range(4):
                        for screened in ((True, False) if rep % 2 == 0 else (False, True)):
                            t0 = time.perf_counter()
                            out[screened] = step.forward(*call, only_max=screened)[1]
                            times.setdefault((n, screened), []).append(time.perf_counter() - t0)
                            kv.keep(cache, ctx, [])
                    wrong += int((greedy_tokens(out[True]) != greedy_tokens(out[False])).sum())
                    shares.setdefault(n, []).append(torch.isfinite(out[True].float()).float().mean().item())
                for i in range(6):  # commit the next 6 tokens
                    plain_forward(step, seq[at + i], cache, ctx + i)
    print(engine.numerics.describe())
    print("rows  screened ms  full ms  ratio  head computed")
    for n in args.rows:
        s, f = np.median(times[(n, True)]), np.median(times[(n, False)])
        print(f"{n:4d}  {1e3 * s:11.3f}  {1e3 * f:7.3f}  {s / f:5.3f}  {np.mean(shares[n]):13.3f}")
    print(f"rows whose argmax differs: {wrong}")


if __name__ == "__main__":
    main()

"""An experiment: speculation by context lookup alone (no head: each step verifies the root and the
lookup chain, where one is found, and the head neither drafts nor catches up) against the shipped
head's tree and plain decoding, interleaved prompt by prompt in one process; first turns, greedy,
128 new tokens, 2 threads. The engine's draft and catch-up are replaced in this process only; every
answer must stay identical, and the script says how many are.

    python scripts/lookup_only_ab.py assets/heldout_natural.jsonl 60
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import core.threads  # noqa: E402,F401  (the thread settings the engine runs with)
from core.config import GenerationConfig  # noqa: E402
from core.decoding import engine as E  # noqa: E402
from core.decoding.tree import DraftTree  # noqa: E402

MODES = ("shipped", "lookup", "plain")
REAL = (E.draft, E._Run.catch_up)


def root_only(drafter, cache, token, hidden, shape, noise, root_top=None) -> DraftTree:
    """A 'draft' of the root alone: the lookup chain, if any, is grafted under it."""
    return DraftTree(tokens=torch.tensor([token]), parents=torch.tensor([-1]), depths=torch.tensor([0]))


def use(mode: str) -> None:
    E.draft, E._Run.catch_up = (root_only, lambda run, tokens, features: None) if mode == "lookup" else REAL


def answer(engine, prompt: str, mode: str) -> tuple[list[int], float, int]:
    """(tokens after the first, decode seconds, steps) of one greedy answer in `mode`."""
    use(mode)
    cfg = GenerationConfig(max_new_tokens=128, tree=engine.default_tree, speculative=mode != "plain")
    tokens, t0, steps = [], None, 0
    for event in engine.generate([{"role": "user", "content": prompt}], cfg):
        if t0 is None:  # the first event is the prefill's token: decode time starts after it
            t0 = time.perf_counter()
            continue
        tokens += event.token_ids
        steps += 1
    return tokens, time.perf_counter() - t0, steps


def main(path: str, limit: int) -> None:
    torch.set_num_threads(2)
    engine = E.Engine.load()
    prompts = [json.loads(line)["turns"][0] for line in open(path, encoding="utf-8")][:limit]
    totals = {m: [0, 0.0, 0] for m in MODES}
    identical = 0
    for i, prompt in enumerate(prompts):
        texts = set()
        for mode in MODES if i % 2 == 0 else MODES[::-1]:  # each mode first on half the prompts
            tokens, seconds, steps = answer(engine, prompt, mode)
            totals[mode][0] += len(tokens)
            totals[mode][1] += seconds
            totals[mode][2] += steps
            texts.add(tuple(tokens))
        identical += len(texts) == 1
    use("shipped")
    for mode, (n, seconds, steps) in totals.items():
        print(f"{mode:8s} {n / seconds:7.1f} tok/s  tau {n / steps:.3f}  ({n} tokens, {steps} steps)")
    print(f"identical: {identical} / {len(prompts)}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 60)

"""Share of speculative step time spent outside the two model forwards (target, head).

    python scripts/profile_step.py [--max-new-tokens 128] [--dtype float32]

Times every EagleHead.forward call by wrapping it; the target forward is the engine's own
verify_s. Everything else (tree building, masks, top-k, acceptance, cache commit,
detokenisation) is the overhead reported.
"""

import argparse
import time

import torch

from core.config import GenerationConfig
from core.engine import Engine
from core.head import EagleHead

PROMPTS = ["Explain how a refrigerator keeps food cold.", "Write a Python function that merges two sorted lists.",
           "Give three tips for a job interview.", "What causes the seasons on Earth?"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--head", default="default")
    a = p.parse_args()
    engine = Engine.load(head=a.head, dtype=a.dtype)
    head_time = [0.0]
    inner = EagleHead.forward

    def timed(self, *args, **kw):
        t = time.perf_counter()
        out = inner(self, *args, **kw)
        head_time[0] += time.perf_counter() - t
        return out

    EagleHead.forward = timed
    cfg = GenerationConfig(max_new_tokens=a.max_new_tokens, tree=engine.default_tree)
    list(engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=8, tree=engine.default_tree)))  # warm-up
    head_time[0] = 0.0
    total = verify = tokens = forwards = 0.0
    for prompt in PROMPTS:
        events = list(engine.generate(prompt, cfg))
        steps = events[1:]  # the prefill step has no draft
        total += sum(e.draft_s + e.verify_s + e.other_s for e in steps)
        verify += sum(e.verify_s for e in steps)
        tokens += sum(e.accepted_length for e in steps)
        forwards += len(steps)
    outside = total - verify - head_time[0]
    print(f"tree={engine.default_tree} threads={torch.get_num_threads()} dtype={a.dtype}")
    print(f"steps={forwards:.0f} tau={tokens / forwards:.2f} step_ms={1000 * total / forwards:.1f} "
          f"target={verify / total:.1%} head={head_time[0] / total:.1%} outside_forwards={outside / total:.1%}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()

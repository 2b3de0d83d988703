"""How much of a decoding step runs outside the native calls: greedy answers, plain or speculative,
timers around the C calls alone (decode_step, head_step, head_step_top), the rest is Python and torch.

    python scripts/python_share.py [PROMPTS.jsonl] [--mode plain|eagle] [--limit 8] [--threads 2]

Prints ms per step, tau, tok/s, each C call's ms per step and what is left outside them, twice (the
second pass is the one to read). The prompt's prefill and first token are not counted. Run it on a
quiet machine (docs/native-step.md, ninth session).
"""

import argparse
import json
import time

from core import threads  # noqa: I001

if __name__ == "__main__":  # the OpenMP policy, before torch loads (core.threads)
    threads.start()

import torch

from core.config import GenerationConfig
from core.decoding.engine import Engine
from core.kernels import native

CALLS = ("decode_step", "spec_step_greedy", "head_step", "head_step_top")


def timed_calls(spent: dict[str, float]) -> None:
    """Wrap the library's native calls so each adds its seconds to spent[name]."""
    lib = native._library()[0]
    assert lib is not None, f"the native kernels do not run here: {native.status().reason}"
    for name in CALLS:
        fn = getattr(lib, name)

        def timed(*args, fn=fn, name=name):
            t0 = time.perf_counter()
            out = fn(*args)
            spent[name] += time.perf_counter() - t0
            return out
        setattr(lib, name, timed)


def parser(doc: str) -> argparse.ArgumentParser:
    """The command line of this script and of scripts/step_stages.py: prompts, mode, how many, how long."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("prompts", nargs="?", default="assets/heldout_handwritten.jsonl")
    p.add_argument("--mode", choices=("plain", "eagle"), default="eagle")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    return p


def main() -> None:
    a = parser(__doc__).parse_args()
    torch.set_num_threads(a.threads)
    engine = Engine.load()
    spent = dict.fromkeys(CALLS, 0.0)
    timed_calls(spent)
    prompts = [json.loads(line) for line in open(a.prompts, encoding="utf-8")][:a.limit]
    cfg = GenerationConfig(max_new_tokens=a.max_new_tokens, tree=engine.default_tree, speculative=a.mode == "eagle")
    for rep in range(2):
        steps = tokens = 0
        seconds, inside = 0.0, dict.fromkeys(CALLS, 0.0)
        for prompt in prompts:
            events = engine.generate([{"role": "user", "content": prompt["turns"][0]}], cfg)
            next(events)  # prefill and the first token
            before, t0 = dict(spent), time.perf_counter()
            for event in events:
                steps += 1
                tokens += len(event.token_ids)
            seconds += time.perf_counter() - t0
            for name in CALLS:
                inside[name] += spent[name] - before[name]
        per = {name: 1000 * s / steps for name, s in inside.items() if s}
        outside = 1000 * (seconds - sum(inside.values())) / steps
        print(f"{a.mode} pass {rep + 1}: {1000 * seconds / steps:.3f} ms/step, tau {tokens / steps:.2f}, "
              f"{tokens / seconds:.1f} tok/s; " + ", ".join(f"{n} {v:.3f}" for n, v in per.items())
              + f"; outside the C calls {outside:.3f} ms/step")


if __name__ == "__main__":
    main()

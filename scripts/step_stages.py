"""Where a decoding step's time goes, stage by stage: greedy answers through the engine on kernels built
with per-stage clocks (EAGLE_CHAT_PROFILE=1, a library of its own; every number they compute is the same).

    python scripts/step_stages.py [PROMPTS.jsonl] [--mode plain|eagle] [--limit 8] [--max-new-tokens 128]

Prints ms per step for each stage of the target's forwards and of the draft head's (a stage's time runs to
its closing barrier, so it includes waiting for the slower thread), their sums, and what is left outside the
C calls (Python, torch). The prompt's prefill and first token are not counted. The screen's rows (quantized
and projected by every thread) count as "lm head"; its passes as "screen one" (the bound of every group),
"screen centre" (each row's best group, exactly) and "screen two" (the groups that can hold a maximum).
Two passes over the prompts; the second is printed. Run it on a quiet machine (docs/native-step.md).
"""

import json
import os
import time

os.environ["EAGLE_CHAT_PROFILE"] = "1"  # before the kernels load

from core import threads  # noqa: E402, I001

if __name__ == "__main__":  # the OpenMP policy, before torch loads (core.threads)
    threads.start()

import torch  # noqa: E402

from core.config import GenerationConfig  # noqa: E402
from core.decoding.engine import Engine  # noqa: E402
from core.kernels import native  # noqa: E402
from python_share import parser  # noqa: E402  (scripts/: this script's folder)


def main() -> None:
    p = parser(__doc__)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    engine = Engine.load()
    if native.stage_times() is None:
        p.error(f"the native kernels do not serve here: {native.status().describe()}")
    prompts = [json.loads(line) for line in open(a.prompts, encoding="utf-8")][:a.limit]
    cfg = GenerationConfig(max_new_tokens=a.max_new_tokens, tree=engine.default_tree, speculative=a.mode == "eagle")
    for _ in range(2):
        steps = tokens = 0
        seconds = 0.0
        spent = {part: dict.fromkeys(native.STAGES, 0.0) for part in ("target", "head")}
        for prompt in prompts:
            events = engine.generate([{"role": "user", "content": prompt["turns"][0]}], cfg)
            next(events)  # prefill and the first token
            native.stage_times()  # from here
            t0 = time.perf_counter()
            for event in events:
                steps += 1
                tokens += len(event.token_ids)
            seconds += time.perf_counter() - t0
            for part, times in native.stage_times().items():
                for name, s in times.items():
                    spent[part][name] += s
    ms = 1000 / steps
    print(f"{a.mode}: {seconds * ms:.3f} ms/step, tau {tokens / steps:.2f}, {tokens / seconds:.1f} tok/s "
          f"({steps} steps; {engine.numerics.describe()})")
    inside = 0.0
    for part, times in spent.items():
        total = sum(times.values())
        inside += total
        if total:
            print(f"  {part}: {total * ms:.3f} ms/step: " + ", ".join(
                f"{name} {s * ms:.3f}" for name, s in times.items() if s * ms >= 0.0005))
    print(f"  outside the stages (Python, torch, the draft's LM head and top-k): {(seconds - inside) * ms:.3f} ms/step")


if __name__ == "__main__":
    main()

"""Speculation in a long chat (docs/long-context.md): plain against eagle at several context lengths.

    python scripts/long_context.py [--contexts 1024,2048,2800,4096] [--tokens 64] [--reps 2] [--task summary|edit] [--temperature T]

Each prompt asks for a summary of the first N tokens of a fixed document (`core.autotune.long_prompt`:
the Python language reference topics that ship with the interpreter), which the answer may quote
from, as long chats do. For each length it answers with plain decoding, with the shipped tree (its
long_context caps applied: `tree.at(context)`, plain decoding past a plain cap) and with the same
tree without caps and adaptively (GenerationConfig.adaptive: the mode measured faster, the app's
default), interleaved and repeated, and prints tokens/s and tau after the prefill. `--task edit`
asks instead for work on a text the prompt holds, as long chats often do: a module of this
repository rewritten with one name changed, and a part of README.md summarised (the answers copy
from the chat, so context lookup accepts long runs). `--temperature T` samples instead, seed 0 in
every mode (the tree without caps then speculates at any temperature: its hot pause is off too).
The output is checked to be the same in every mode. Run it on an otherwise idle machine.
"""

import argparse
import time
from dataclasses import replace
from pathlib import Path

from core import threads  # noqa: I001

if __name__ == "__main__":  # the OpenMP policy, before torch loads (core.threads)
    threads.start()

import torch

from core.autotune import long_prompt
from core.config import GenerationConfig, SamplingConfig
from core.decoding.engine import Engine


def answer(engine: Engine, messages, config: GenerationConfig) -> tuple[float, int, int, list[int]]:
    """-> (seconds after the prefill, tokens after the prefill, steps after the prefill, all tokens)."""
    out, steps, n, start = [], 0, 0, None
    for i, ev in enumerate(engine.generate(messages, config)):
        out += ev.token_ids
        if i == 0:
            start = time.perf_counter()
            continue
        n += len(ev.token_ids)
        steps += 1
    return time.perf_counter() - start, n, steps, out


def edit_prompt(engine: Engine, tokens: int) -> list[dict]:
    """About `tokens` tokens of this repository's text with a request to rework it: a module with
    a name changed (even lengths' ordinal), else README.md summarised."""
    root = Path(__file__).resolve().parent.parent
    code = tokens // 1000 % 2 == 1
    text = (root / ("core/decoding/verify.py" if code else "README.md")).read_text()
    ids = engine.target.tokenizer(text)["input_ids"][:tokens]
    part = engine.target.tokenizer.decode(ids)
    ask = ("Rewrite this module exactly, but rename the function `target_probs` to `target_distribution` "
           "everywhere." if code else "Summarise this text in five bullet points, quoting its key sentences.")
    fence = "```python\n" if code else ""
    return [{"role": "user", "content": f"{fence}{part}{chr(10) + '```' if code else ''}\n\n{ask}"}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1024,2048,2800,4096", help="document tokens (the chat template adds about 45)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--task", choices=("summary", "edit"), default="summary")
    p.add_argument("--temperature", type=float, default=0.0, help="sampled (seed 0 for every mode) instead of greedy")
    a = p.parse_args()
    threads.set_threads(a.threads)
    engine = Engine.load()
    tree = engine.default_tree
    same = dict(max_new_tokens=a.tokens, sampling=SamplingConfig(temperature=a.temperature), seed=0)
    modes = {"plain": GenerationConfig(speculative=False, **same),
             "eagle (caps)": GenerationConfig(tree=tree, **same),
             "eagle (no caps)": GenerationConfig(tree=replace(tree, long_context=(), plain_from_temperature=0.0), **same),
             "eagle (adaptive)": GenerationConfig(tree=tree, adaptive=True, **same)}
    print(f"tree: {tree}")
    with torch.inference_mode():
        for length in (int(c) for c in a.contexts.split(",")):
            messages = long_prompt(engine, length) if a.task == "summary" else edit_prompt(engine, length)
            context = engine.count_tokens(messages)
            totals = {m: [0.0, 0, 0] for m in modes}
            outputs = set()
            for r in range(a.reps):
                for m in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                    s, n, steps, out = answer(engine, messages, modes[m])
                    totals[m][0] += s
                    totals[m][1] += n
                    totals[m][2] += steps
                    outputs.add(tuple(out))
            row = "  ".join(f"{m} {t[1] / t[0]:.1f} tok/s tau {t[1] / max(t[2], 1):.2f}" for m, t in totals.items())
            there = (f"depth {tree.at(context).depth}, {tree.at(context).total_tokens} tokens"
                     if tree.speculates_at(context) else "plain decoding")
            print(f"context {context:5d} (tree there: {there}): {row}; identical: {len(outputs) == 1}")


if __name__ == "__main__":
    main()

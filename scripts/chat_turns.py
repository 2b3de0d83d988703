"""First-token time of each turn of a growing chat, continuing the last prompt's kept rows (core.decoding.prefix)
and reading it all, and whether the answers agree.

    python scripts/chat_turns.py [--turns 4] [--document-tokens 1500] [--max-new-tokens 64] [--threads 2]

The chat opens with a long pasted text (the Python reference topics that ship with the interpreter, as
core.autotune's long prompts) and a request about it; each later turn asks a short follow-up. Every turn is
answered twice, greedy, speculative: reading the whole conversation (reuse_prompt=False) and continuing the
rows the engine kept from the turn before (what the app and core.serve do), in alternating order. Prints per
turn the prompt's tokens, the rows continued from, both first-token times and whether the two answers are the
same tokens (by construction they are). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core import threads  # noqa: E402,I001

if __name__ == "__main__":  # the OpenMP policy, before torch loads (core.threads)
    threads.start()

FOLLOW_UPS = ("Which of these points matters most, and why?", "Give an example for the second point.",
              "Now say it in two sentences.", "What would you add for a beginner?", "Summarise our chat so far.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--document-tokens", type=int, default=1500)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    import torch

    from core.autotune import long_document
    from core.config import GenerationConfig
    from core.decoding import prefix
    from core.decoding.engine import Engine

    torch.set_num_threads(a.threads)
    engine = Engine.load()
    tok = engine.target.tokenizer
    doc = tok.decode(tok(long_document(), add_special_tokens=False)["input_ids"][:a.document_tokens])
    chat = [{"role": "user", "content": f"Here is a text:\n\n{doc}\n\nList its three main points."}]

    def answer(reuse: bool) -> tuple[float, list[int]]:
        start, first, out = time.perf_counter(), None, []
        for ev in engine.generate(chat, GenerationConfig(max_new_tokens=a.max_new_tokens, tree=engine.default_tree,
                                                         reuse_prompt=reuse)):
            first = first if first is not None else time.perf_counter() - start
            out += ev.token_ids
        return first, out

    print("turn  prompt tokens  continued from  first token: read all / continued  same answer")
    for turn in range(a.turns):
        ids = engine.encode(chat)
        n, saved = len(ids), engine.prefix
        rows = prefix.reusable(saved, ids, engine.drafter.feature_layers)
        if turn % 2:  # alternate which runs first
            cold, cold_ids = answer(False)
            engine.prefix = saved  # what the turn before kept, as the chat would find it
            warm, warm_ids = answer(True)
        else:
            warm, warm_ids = answer(True)
            cold, cold_ids = answer(False)
        print(f"{turn + 1:4d}  {n:13d}  {rows:14d}  {cold:10.3f} s / {warm:.3f} s  {warm_ids == cold_ids}")
        chat += [{"role": "assistant", "content": tok.decode(warm_ids, skip_special_tokens=True)},
                 {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]


if __name__ == "__main__":
    main()

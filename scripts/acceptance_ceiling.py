"""Where the head's first draft token fails, by how sure the target itself is (issue 31).

    python scripts/acceptance_ceiling.py [PROMPTS] [--limit 60] [--tokens 128] [--head FOLDER] [--threads 1] [--probe]

Answers each prompt's first turn with plain greedy decoding (the engine on bf16 weights), then, teacher-forced
over prompt + answer in bf16 (transformers, as the head trains): the target's probability of its own greedy
token at each answer position, and whether the head's top-1 (from the target's features of the position
before and the token there, as a catch-up gives it) is that token. Prints the head's top-1 agreement per bucket
of the target's top-1 probability, and per category: how much of the missed acceptance lies where the target
itself is unsure (a draft head can only match a coin-flip choice by learning the target's near-tie rule).
`--probe` also gives the agreement with the head's inputs spoiled (each token replaced by another position's,
the features zeroed: does it use both?) and the draft vocabulary's ceiling (its LM-head rows applied to the
target's own next feature, what a head that predicted the feature exactly would draft).
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

from core import threads  # noqa: I001

if __name__ == "__main__":
    threads.start()

import torch
import torch.nn.functional as F

from core.config import GenerationConfig
from core.decoding.engine import Engine
from core.decoding.head import load_head
from core.models import DEFAULT_HEAD_DIR
from core.train.trainer import Frozen

BUCKETS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("prompts", nargs="?", default="assets/heldout_natural.jsonl")
    p.add_argument("--limit", type=int, default=60)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--head", default=None, help="head folder [default: the shipped one]")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--probe", action="store_true", help="also spoil the head's inputs, and the vocabulary's ceiling")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    engine = Engine.load(head=None, weights="bf16")  # plain answers; bf16 throughout, as the head trains
    model = engine.target.model
    head_dir = a.head or str(DEFAULT_HEAD_DIR)
    head, vocab = load_head(head_dir, model.config, dtype=torch.float32)
    fz = Frozen.from_target(model, vocab if vocab is not None else torch.arange(model.config.vocab_size))

    def drafted(x: torch.Tensor) -> torch.Tensor:  # (n, H) predicted features -> (n,) target ids of their top-1
        return fz.draft_vocab[(x @ fz.lm_rows.T).argmax(-1)]

    records = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()][:a.limit]
    hits, count, outside = defaultdict(int), defaultdict(int), defaultdict(int)
    in_vocab = torch.zeros(fz.embed.shape[0], dtype=torch.bool)
    in_vocab[fz.draft_vocab] = True
    cat_hits, cat_count, cat_sure = defaultdict(int), defaultdict(int), defaultdict(float)
    cfg = GenerationConfig(max_new_tokens=a.tokens, speculative=False)
    probes, shuffle = defaultdict(int), torch.Generator().manual_seed(0)
    for r in records:
        msgs = [{"role": "user", "content": r["turns"][0]}]
        with torch.inference_mode():
            answer = [t for ev in engine.generate(msgs, cfg) for t in ev.token_ids]
        prompt = engine.encode(msgs)
        ids = torch.tensor(list(prompt) + answer)
        n0 = len(prompt)
        with torch.inference_mode():
            out = model.model(input_ids=ids[None], use_cache=False)
            h = out.last_hidden_state[0].float()  # (n, H)
            probs = torch.softmax(model.lm_head(out.last_hidden_state)[0].float(), -1)  # (n, V)
            n, emb = len(ids) - 1, F.embedding(ids[1:][None], fz.embed)  # (1, n-1, H)
            draft = drafted(head(emb, h[:-1][None], torch.arange(n))[0])  # row j: the token after ids[j+1]
            if a.probe:
                spoiled = {"tokens shuffled": head(F.embedding(ids[1:][torch.randperm(n, generator=shuffle)][None],
                                                               fz.embed), h[:-1][None], torch.arange(n))[0],
                           "features zeroed": head(emb, torch.zeros_like(h[:-1][None]), torch.arange(n))[0],
                           "the target's own next feature (the vocabulary's ceiling)": h[1:]}
        p_top, want = probs.max(-1)  # the target's greedy token after each position, and its probability
        if a.probe:
            for name, x in spoiled.items():
                probes[name] += int((drafted(x)[n0 - 1:-1] == want[n0:-1]).sum())
        for j in range(n0 - 1, len(ids) - 2):  # the head at row j drafts the token after ids[j+1] (an answer token)
            q = float(p_top[j + 1])
            b = next(i for i in range(len(BUCKETS) - 1) if q < BUCKETS[i + 1])
            ok = int(draft[j]) == int(want[j + 1])
            hits[b] += ok
            count[b] += 1
            outside[b] += not bool(in_vocab[int(want[j + 1])])
            c = r.get("category", "?")
            cat_hits[c] += ok
            cat_count[c] += 1
            cat_sure[c] += q >= 0.5
    total = sum(count.values())
    print(f"{len(records)} prompts, {total} answer positions (head {head_dir})")
    print("| target's top-1 probability | share of positions | head top-1 = target's token | target's token outside "
          "the draft vocabulary |")
    print("|---|---|---|---|")
    for b in range(len(BUCKETS) - 1):
        if count[b]:
            print(f"| {BUCKETS[b]:.1f}-{min(BUCKETS[b + 1], 1.0):.1f} | {count[b] / total:.3f} | {hits[b] / count[b]:.3f} | "
                  f"{outside[b] / count[b]:.3f} |")
    print(f"| all | 1.000 | {sum(hits.values()) / total:.3f} | {sum(outside.values()) / total:.3f} |")
    for name, hit in probes.items():
        print(f"| {name} | | {hit / total:.3f} | |")
    print("\n| category | positions | head top-1 agreement | target's top-1 >= 0.5 |\n|---|---|---|---|")
    for c in sorted(cat_count):
        print(f"| {c} | {cat_count[c]} | {cat_hits[c] / cat_count[c]:.3f} | {cat_sure[c] / cat_count[c]:.3f} |")


if __name__ == "__main__":
    main()

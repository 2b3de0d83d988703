"""Would a sharper (or flatter) draft distribution agree more often with the target's sampled token? (issue 31)

    python scripts/draft_temperature_lab.py [--limit 20] [--temps 0.7,1.0] [--scales 0.5,0.7,1.0] [--draws 64]

A sampled speculative step drafts the head's Gumbel-max draw on the noise the target's draw uses
(core.decoding.gumbel.DraftNoise: argmax log q / T + g against argmax log p / T + g). Offline, over plain sampled
answers to natural held-out prompts (bf16, teacher-forced as the head trains): the probability, over the noise
(`--draws` samples a position), that the head's draw at temperature s * T is the target's draw at T, for each
scale s. s = 1 is what the engine drafts with. docs/sampling.md (2026-12-07, thirty-first session) has the figures.
"""

import argparse
import json
from pathlib import Path

from core import threads  # noqa: I001

if __name__ == "__main__":
    threads.start()

import torch
import torch.nn.functional as F

from core.config import GenerationConfig, SamplingConfig
from core.decoding.engine import Engine
from core.decoding.head import load_head
from core.models import DEFAULT_HEAD_DIR
from core.train.trainer import Frozen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("prompts", nargs="?", default="assets/heldout_natural.jsonl")
    p.add_argument("--skip", type=int, default=100, help="prompts skipped first (scripts/ab.py runs take the first)")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--temps", default="0.7,1.0")
    p.add_argument("--scales", default="0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.2")
    p.add_argument("--draws", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    engine = Engine.load(head=None, weights="bf16")
    model = engine.target.model
    head, vocab = load_head(str(DEFAULT_HEAD_DIR), model.config, dtype=torch.float32)
    fz = Frozen.from_target(model, vocab)
    records = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    records = records[a.skip:a.skip + a.limit]
    scales = [float(x) for x in a.scales.split(",")]
    noise = torch.Generator().manual_seed(0)
    for temperature in [float(x) for x in a.temps.split(",")]:
        agree, positions = torch.zeros(len(scales)), 0
        for i, r in enumerate(records):
            msgs = [{"role": "user", "content": r["turns"][0]}]
            cfg = GenerationConfig(max_new_tokens=a.tokens, speculative=False,
                                   sampling=SamplingConfig(temperature=temperature), seed=1000 + i)
            with torch.inference_mode():
                answer = [t for ev in engine.generate(msgs, cfg) for t in ev.token_ids]
                prompt = engine.encode(msgs)
                ids = torch.tensor(list(prompt) + answer)
                out = model.model(input_ids=ids[None], use_cache=False)
                hidden = out.last_hidden_state[0].float()  # (n, H)
                logits = model.lm_head(out.last_hidden_state)[0].float()  # (n, V)
                n = len(ids) - 1
                drafted = head(F.embedding(ids[1:][None], fz.embed), hidden[:-1][None], torch.arange(n))[0]
                log_q = torch.log_softmax(drafted @ fz.lm_rows.T, -1)  # (n, Vd): row j drafts the token after ids[j+1]
            for j in range(len(prompt) - 1, len(ids) - 2):
                shaped = logits[j + 1] / temperature  # (V,) the target's, for the token the head's row j drafts
                u = torch.rand(a.draws, shaped.shape[0], generator=noise).clamp(1e-7, 1 - 1e-7)
                g = -torch.log(-torch.log(u))  # (K, V) standard Gumbel
                target = (shaped[None] + g).argmax(-1)  # (K,)
                g_draft = g[:, fz.draft_vocab]  # (K, Vd) the same noise, keyed by target id
                for k, s in enumerate(scales):
                    draft = fz.draft_vocab[(log_q[j][None] / (temperature * s) + g_draft).argmax(-1)]
                    agree[k] += (draft == target).float().mean()
                positions += 1
        print(f"T={temperature}, {len(records)} prompts, {positions} positions: "
              + " ".join(f"s={s}: {float(agree[k] / positions):.4f}" for k, s in enumerate(scales)), flush=True)


if __name__ == "__main__":
    main()

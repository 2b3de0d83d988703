"""Would the EAGLE-1 head draft better if it also read lower target layers? A warm-started measurement.

The shipped head computes fc(cat(embed(t_{j+1}), f_j)) -> its decoder layer. This lab adds
fc_extra(rms(l_a), rms(l_b), rms(l_c)) to fc's output: the target's hidden states entering layers a, b, c
(EAGLE-3's low / middle / high choice), each RMS-normalised (no weight: their scales differ by 10x and a
few positions reach 25,000), through a linear map that starts at zero, so training starts from exactly
today's head. Arms: `extra` trains fc_extra alone (the head frozen: any gain is the extra layers'
information), `both` trains fc_extra and the head, `control` trains the head alone on the same batches (no
extra layers). `--use` picks which stored layers fc_extra reads and `--shift 1` reads them at the embedded
token's own position instead of the feature's (what running the target's first layers on the token being
drafted from would give a head). Reported: depth-1 top-1 (the head's best draft-vocabulary token == the target's greedy token,
teacher-forced, the agreement a one-token draft is accepted at) on held-out conversations, before, every
`--eval-every` seconds and at the end. Nothing is saved into the shipped head.

Features come from the trainer's EAGLE-3 feature pass (bf16 numerics), one `--work` per set:

    python -m core.train features --work runs/lab/va --data VAL.jsonl --head-kind eagle3 --layer-ids 2,15,27
    python -m core.train features --work runs/lab/tr --data TRAIN.jsonl --head-kind eagle3 --layer-ids 2,15,27
    PYTHONPATH=. python scripts/extra_layers_lab.py --train runs/lab/tr --val runs/lab/va --arm extra --epochs 3

(docs/training.md, fourteenth session: the run and its figures.)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from core.decoding.head import load_head
from core.models import DEFAULT_HEAD_DIR, load_target
from core.train.features import Sequence, load_sequences
from core.train import trainer
from core.train.trainer import Batch, Frozen, eagle_loss, loss_rows, token_hits

def sequences(work: Path) -> list[Sequence]:
    """Every EAGLE-3 feature sequence under work/features_eagle3/*/ (hidden (n, 3H), final (n, H))."""
    folders = sorted(p.parent for p in (work / "features_eagle3").glob("*/manifest.json"))
    if not folders:
        raise SystemExit(f"no EAGLE-3 features under {work}: run `python -m core.train features --work {work} "
                         "--head-kind eagle3 ...` first")
    return [s for f in folders for s in load_sequences(f)]


def collate(seqs: list[Sequence], H: int) -> tuple[Batch, torch.Tensor]:
    """-> the trainer's batch of the last hidden states (ids, final features, assistant mask, greedy next
    tokens; right-padded) and the normalised extra layers (B, n, 3H), padded alike."""
    batch = trainer.collate([replace(s, hidden=s.final) for s in seqs])
    extra = torch.zeros(*batch.ids.shape, 3 * H)
    for i, s in enumerate(seqs):
        layers = s.hidden.float().view(len(s.input_ids), -1, H)  # (k, 3, H)
        extra[i, :len(s.input_ids)] = (layers * torch.rsqrt(layers.pow(2).mean(-1, keepdim=True) + 1e-6)).flatten(1)
    return batch, extra


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=Path, required=True, help="--work folder of the training features")
    p.add_argument("--val", type=Path, required=True, help="--work folder of the held-out features")
    p.add_argument("--arm", choices=["extra", "both", "control"], required=True)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--minutes", type=float, default=60.0, help="stop after this long whatever the epochs")
    p.add_argument("--lr-head", type=float, default=1e-4)
    p.add_argument("--lr-extra", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--noise", type=float, default=0.1, help="U(-noise, noise) on the last-layer input, as the trainer")
    p.add_argument("--eval-every", type=float, default=150.0, help="seconds between held-out checks")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--use", default="0,1,2", help="which of the stored layers to read (0, 1, 2: the feature pass's --layer-ids)")
    p.add_argument("--shift", type=int, choices=[0, 1], default=0,
                   help="1: read the layers at the embedded token's own position (what the target's first layers "
                        "compute for the token being drafted from), 0: at the feature's position, as EAGLE-3")
    p.add_argument("--out", type=Path, default=None, help="write the log (and the weights) here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    target = load_target("smollm2")
    head, vocab = load_head(DEFAULT_HEAD_DIR, target.model.config)
    fz = Frozen.from_target(target.model, vocab)
    H = head.config.hidden_size
    use = [int(i) for i in args.use.split(",")]
    fc_extra = nn.Linear(len(use) * H, H, bias=False)
    nn.init.zeros_(fc_extra.weight)
    head.float().train().requires_grad_(args.arm != "extra")
    uses_extra = args.arm != "control"

    def predict(batch: Batch, extra: torch.Tensor, noise: float) -> torch.Tensor:
        """A batch and its extra layers -> the head's predicted next features (B, n - 1, H), as
        trainer.unrolled_forward at depth 1 (plus fc_extra's term)."""
        ids, m = batch.ids, batch.ids.shape[1] - 1
        feat = batch.hidden[:, :m]
        if noise:
            feat = feat + (torch.rand_like(feat) * 2 - 1) * noise
        x = head.fc(torch.cat([F.embedding(ids[:, 1:], fz.embed), feat], -1))  # (B, m, H)
        if uses_extra:
            ex = extra[:, args.shift:m + args.shift].unflatten(-1, (3, H))[:, :, use].flatten(2)
            x = x + fc_extra(ex)
        cos, sin = head.rotary(x, torch.arange(m)[None])
        for layer in head.layers:
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype), None, None)
        return x

    def loss_and_hits(batch: tuple[Batch, torch.Tensor], noise: float) -> tuple[torch.Tensor, int, int]:
        b, extra = batch
        pred = predict(b, extra, noise)
        rows = loss_rows(b.amask, 1)  # (B, m)
        loss = eagle_loss(pred, b.hidden[:, 1:], fz.lm_rows, rows, ce_weight=0.1)
        hits, _ = token_hits(pred[rows].detach(), fz, b.argmax[:, 1:][rows])
        return loss, hits, int(rows.sum())

    train, val = sequences(args.train), sequences(args.val)

    @torch.no_grad()
    def held_out() -> float:
        head.eval()
        hits = rows = 0
        for i in range(0, len(val), args.batch_size):
            _, h, r = loss_and_hits(collate(val[i:i + args.batch_size], H), 0.0)
            hits, rows = hits + h, rows + r
        head.train()
        return hits / rows

    groups = [{"params": [fc_extra.weight], "base": args.lr_extra}] if uses_extra else []
    if args.arm != "extra":
        groups.append({"params": list(head.parameters()), "base": args.lr_head})
    opt = torch.optim.AdamW([dict(g, lr=g["base"]) for g in groups], betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    order = torch.cat([torch.randperm(len(train), generator=g) for _ in range(math.ceil(args.epochs))]).tolist()
    total = int(args.epochs * len(train)) // args.batch_size
    evals = [{"step": 0, "minutes": 0.0, "top1": held_out()}]
    print(f"{len(train)} training / {len(val)} held-out conversations; step 0: held-out top-1 {evals[0]['top1']:.4f}",
          flush=True)
    t0 = last = time.time()
    step = hits = rows = 0
    while step < total and time.time() - t0 < args.minutes * 60:
        progress = max(step / total, (time.time() - t0) / (args.minutes * 60))
        scale = min(1.0, (step + 1) / 50) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = group["base"] * scale
        batch = collate([train[i] for i in order[step * args.batch_size:(step + 1) * args.batch_size]], H)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, h, r = loss_and_hits(batch, args.noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([q for group in opt.param_groups for q in group["params"]], 0.5)
        opt.step()
        step, hits, rows = step + 1, hits + h, rows + r
        if time.time() - last > args.eval_every or step == total:
            evals.append({"step": step, "minutes": (time.time() - t0) / 60, "top1": held_out(),
                          "train_top1": hits / max(rows, 1)})
            print(f"step {step}/{total}: held-out top-1 {evals[-1]['top1']:.4f}, training batches since the last "
                  f"check {hits / max(rows, 1):.4f}", flush=True)
            last, hits, rows = time.time(), 0, 0
    if evals[-1]["step"] != step:  # stopped by --minutes between checks
        evals.append({"step": step, "minutes": (time.time() - t0) / 60, "top1": held_out(),
                      "train_top1": hits / max(rows, 1)})
        print(f"step {step}/{total} (time's up): held-out top-1 {evals[-1]['top1']:.4f}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "log.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "evals": evals}, indent=1))
        torch.save({"head": head.state_dict(), "fc_extra": fc_extra.weight.detach()}, args.out / "weights.pt")


if __name__ == "__main__":
    main()

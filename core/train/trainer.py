"""EAGLE-1 head training on cached target features, with optional training-time unroll.

Glossary (one sequence t_0..t_{n-1}, target features f_0..f_{n-1}, m = n - 1 rows)
- row p of depth 1: input (embed(t_{p+1}), f_p + noise) -> f^_{p+1}; its token
  distribution lm_head(f^_{p+1}) drafts t_{p+2}. This is the EAGLE-1 recipe.
- row p of depth d > 1: input (embed(t_{p+1}), depth-(d-1) output of row p-1), i.e. the
  head consumes its own predicted feature, as it does when drafting d tokens ahead of the
  last target feature (anchor a = p - d + 1). Its attention sees the true rows <= a and
  its own chain (depth e row a + e - 1, e = 2..d) -- exactly the head's KV cache while
  drafting (EAGLE-3's "training-time test"). Tokens are teacher-forced, so depth-d
  accuracy is conditioned on the draft path so far being right, as acceptance is.
- loss (per depth, weight decay^(d-1)):
  reg_weight * SmoothL1(f^, f) + ce_weight * CE(softmax(target logits), head logits), both logits
  over the draft vocabulary (the tokens the engine drafts from), on rows where t_{a+1}..
  t_{p+2} are all assistant tokens.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from core.decoding.head import EagleHead, additive, load_head, save_head
from core.train.data import DataError
from core.train.features import Sequence

STATE_FILE = "trainer_state.pt"


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    warmup_steps: int = 100
    min_lr_ratio: float = 0.05
    epochs: float = 10.0
    minutes: float | None = None  # wall-clock budget; the cosine schedule follows whichever ends first
    batch_size: int = 8  # sequences per step
    noise: float = 0.1  # U(-noise, noise) added to the true input features
    ce_weight: float = 0.1
    reg_weight: float = 1.0  # feature regression's weight (0: token loss only, as EAGLE-3 trains)
    unroll: int = 1  # depths trained (1 = plain EAGLE-1)
    unroll_decay: float = 0.8
    ckpt_every_s: float = 300.0
    log_every: int = 20
    seed: int = 0
    autocast_bf16: bool = False  # bf16 matmuls (fp32 weights and optimizer); ~1.5x faster on avx512_bf16 CPUs
    max_steps: int | None = None  # stop after this step (tests; simulating an interruption)
    soft_targets: bool = True  # EAGLE-3: CE against the target's distribution (False: its greedy token)
    frozen: tuple[str, ...] = ()  # parameter-name prefixes kept fixed (e.g. ("fc.", "layers.0.")), not trained
    # with held-out sequences: stop after this many checks (one per checkpoint) in a row without a better
    # held-out depth-1 top-1 (0: never stop early); either way the head returned is the best one checked
    patience: int = 0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.batch_size < 1 or self.unroll < 1 or self.epochs <= 0:
            raise ValueError("lr, batch_size, unroll and epochs must be positive")


@dataclass(frozen=True)
class Frozen:
    """The target pieces the head borrows, frozen: embedding and LM head rows of the draft vocab."""

    embed: torch.Tensor  # (V_target, H)
    lm_rows: torch.Tensor  # (V_draft, H) = lm_head.weight[draft_vocab]
    draft_vocab: torch.Tensor  # (V_draft,) target ids

    @classmethod
    def from_target(cls, model, draft_vocab: torch.Tensor) -> "Frozen":
        w = model.get_output_embeddings().weight.detach().float()
        return cls(model.get_input_embeddings().weight.detach().float(), w[draft_vocab].contiguous(),
                   draft_vocab)


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # (B, n) long, right-padded
    hidden: torch.Tensor  # (B, n, H) float32
    amask: torch.Tensor  # (B, n) bool assistant tokens (False on padding)
    argmax: torch.Tensor  # (B, n) long target greedy next token


@dataclass(frozen=True)
class StepMetrics:
    loss: float
    top1: tuple[float, ...]  # per depth: head top-1 == target greedy token
    top3: tuple[float, ...]
    count: tuple[int, ...]  # rows scored per depth


def frequent_tokens(seqs: list[Sequence], size: int, vocab_size: int) -> torch.Tensor:
    """The draft vocabulary: the `size` tokens most frequent in the training answers
    (ties to the lower id), as ascending target ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.input_ids[s.loss_mask], minlength=vocab_size)
    size = min(size, int((counts > 0).sum()))
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def collate(seqs: list[Sequence]) -> Batch:
    n = max(len(s.input_ids) for s in seqs)
    b, h = len(seqs), seqs[0].hidden.shape[1]
    ids = torch.zeros(b, n, dtype=torch.long)
    hid = torch.zeros(b, n, h)
    am = torch.zeros(b, n, dtype=torch.bool)
    top = torch.zeros(b, n, dtype=torch.long)
    for i, s in enumerate(seqs):
        k = len(s.input_ids)
        ids[i, :k], hid[i, :k], am[i, :k], top[i, :k] = s.input_ids, s.hidden.float(), s.loss_mask, s.argmax
    return Batch(ids, hid, am, top)


def unroll_mask(m: int, depth: int) -> torch.Tensor:
    """bool (depth*m, depth*m): which keys row (d, p) sees (see the module glossary)."""
    p = torch.arange(m)[:, None]
    q = torch.arange(m)[None, :]
    rows = []
    for d in range(1, depth + 1):
        blocks = []
        for e in range(1, depth + 1):
            if e == 1:
                blocks.append(q <= p - d + 1)
            elif e <= d:
                blocks.append(q == p - (d - e))
            else:
                blocks.append(torch.zeros(m, m, dtype=torch.bool))
        rows.append(torch.cat(blocks, dim=1))
    allowed = torch.cat(rows, dim=0)
    return allowed | torch.eye(depth * m, dtype=torch.bool)  # a row always sees itself (no NaN rows)


def loss_rows(amask: torch.Tensor, d: int) -> torch.Tensor:
    """(B, n) -> (B, m) rows of depth d scored: t_{p-d+2} .. t_{p+2} all assistant tokens."""
    b, n = amask.shape
    ok = torch.zeros(b, n - 1, dtype=torch.bool)
    ok[:, :n - 2] = True
    for k in range(-d + 2, 3):  # token offsets p+k relative to row p
        shifted = torch.zeros(b, n - 1, dtype=torch.bool)
        lo, hi = max(0, -k), min(n - 1, n - k)
        shifted[:, lo:hi] = amask[:, lo + k:hi + k]
        ok &= shifted
    return ok


def unrolled_forward(head: EagleHead, fz: Frozen, batch: Batch, depth: int, noise: float) -> list[torch.Tensor]:
    """Predicted features per depth, each (B, m, H); depth-1 uses true (noised) features."""
    b, n, h = batch.hidden.shape
    m = n - 1
    emb = F.embedding(batch.ids[:, 1:], fz.embed)  # (B, m, H): embed(t_{p+1})
    feat = batch.hidden[:, :m]  # f_p
    if noise:
        feat = feat + (torch.rand_like(feat) * 2 - 1) * noise
    pos = torch.arange(m)
    if depth == 1:
        return [head(emb, feat, pos)]
    outs = [head(emb, feat, pos)]
    mask = additive(unroll_mask(m, depth), emb.dtype)
    # one forward over all depths at once is exact only with all chains known, so depths
    # are computed sequentially: depth d's inputs are depth d-1's outputs shifted by one row
    feats = [feat]
    for d in range(2, depth + 1):
        prev = outs[-1]
        feats.append(torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1))
        k = len(feats)
        x = head(emb.repeat(1, k, 1), torch.cat(feats, dim=1), pos.repeat(k),
                 mask=mask[:, :, :k * m, :k * m])
        outs.append(x[:, (k - 1) * m:])
    return outs


def eagle_loss(pred: torch.Tensor, target: torch.Tensor, lm_rows: torch.Tensor,
               rows: torch.Tensor, ce_weight: float, reg_weight: float = 1.0) -> torch.Tensor:
    """reg_weight * SmoothL1(f^, f) + ce_weight * CE(softmax(f W^T), f^ W^T) over the scored rows.

    pred, target: (B, m, H); lm_rows: (V, H); rows: (B, m) bool."""
    p, t = pred[rows], target[rows]  # (R, H)
    if p.shape[0] == 0:
        return pred.sum() * 0.0
    reg = F.smooth_l1_loss(p, t)
    with torch.no_grad():
        target_p = torch.softmax(t @ lm_rows.T, dim=-1)  # (R, V)
    ce = -(target_p * torch.log_softmax(p @ lm_rows.T, dim=-1)).sum(-1).mean()
    return reg_weight * reg + ce_weight * ce


def token_hits(pred: torch.Tensor, fz: Frozen, want: torch.Tensor, k: int = 3) -> tuple[int, int]:
    """(top-1 hits, top-k hits): head's best draft-vocab tokens vs the target's greedy token.
    pred: (R, H); want: (R,) target ids."""
    top = fz.draft_vocab[(pred @ fz.lm_rows.T).topk(k, dim=-1).indices]  # (R, k)
    return int((top[:, 0] == want).sum()), int((top == want[:, None]).any(-1).sum())


def step_loss(head, fz: Frozen, batch: Batch, cfg: TrainConfig, noise: float) -> tuple[torch.Tensor, StepMetrics]:
    outs = unrolled_forward(head, fz, batch, cfg.unroll, noise)
    target = batch.hidden[:, 1:]  # f_{p+1}
    want = batch.argmax[:, 1:]  # target's greedy token after f_{p+1}
    total, top1, top3, count = 0.0, [], [], []
    for d, pred in enumerate(outs, start=1):
        rows = loss_rows(batch.amask, d)
        loss = eagle_loss(pred, target, fz.lm_rows, rows, cfg.ce_weight, cfg.reg_weight)
        total = total + cfg.unroll_decay ** (d - 1) * loss
        with torch.no_grad():
            h1, h3 = token_hits(pred[rows], fz, want[rows])
        r = int(rows.sum())
        top1.append(h1 / max(r, 1))
        top3.append(h3 / max(r, 1))
        count.append(r)
    return total, StepMetrics(float(total.detach()), tuple(top1), tuple(top3), tuple(count))


def schedule(order_seed: int, n: int, batch_size: int, lengths: list[int]) -> list[list[int]]:
    """One epoch of batches: a seeded shuffle, then length-sorted windows (less padding)."""
    g = torch.Generator().manual_seed(order_seed)
    perm = torch.randperm(n, generator=g).tolist()
    window = batch_size * 16
    batches = []
    for w in range(0, n, window):
        chunk = sorted(perm[w:w + window], key=lambda i: lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    order = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in order]


def lr_factor(cfg: TrainConfig, step: int, total_steps: int, elapsed: float) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    if cfg.minutes:
        progress = max(progress, elapsed / (cfg.minutes * 60))
    progress = min(1.0, progress)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class TrainResult:
    step: int
    elapsed_s: float
    history: tuple[StepMetrics, ...]  # this run's logged metrics (averaged over log_every steps)
    batches: tuple[tuple[int, ...], ...]  # sample indices trained on in this run, in order
    finished: bool
    best: "Best | None" = None  # with held-out sequences: the checked head that was returned
    stopped_early: bool = False  # `patience` checks in a row without a better held-out score


BEST_DIR = "best"  # in the checkpoint folder: the best head checked so far, in the published layout
BEST_FILE = "best.json"


@dataclass(frozen=True)
class Best:
    """The held-out check that chose the head: its step, score (depth-1 top-1) and how many checks since."""

    step: int
    score: float
    checks_since: int = 0
    top1: tuple[float, ...] = ()

    def to_json(self) -> dict:
        return asdict(self)

    def exhausted(self, patience: int) -> bool:
        """`patience` checks in a row without a better score (patience 0: never)."""
        return bool(patience) and self.checks_since >= patience


def held_out_score(m: StepMetrics) -> float:
    """What a held-out check maximises: depth-1 top-1, the acceptance of a tree's first draft token."""
    return m.top1[0]


def read_best(ckpt: Path) -> Best | None:
    path = ckpt / BEST_FILE
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    return Best(**{**d, "top1": tuple(d["top1"])})


def write_best(ckpt: Path, best: Best, head=None, draft_vocab=None, recipe: "Recipe | None" = None) -> None:
    """best.json, and (when `head` is given) the head itself under best/: written before the json, so a
    crash leaves a json that names a head at least that good."""
    if head is not None:
        (recipe or EAGLE1).save(head, ckpt / BEST_DIR, draft_vocab)
    tmp = ckpt / (BEST_FILE + ".partial")
    tmp.write_text(json.dumps(best.to_json(), indent=1))
    tmp.rename(ckpt / BEST_FILE)


@dataclass(frozen=True)
class Recipe:
    """What differs between head kinds; train() runs the same loop, checkpoints and resume for all."""

    loss: Callable  # (head, fz, list[Sequence], cfg, noise) -> (loss tensor, StepMetrics)
    save: Callable  # (head, folder, draft_vocab) -> None, the published layout
    load: Callable  # (folder, target_config) -> head, strictly
    evaluate: Callable  # (head, fz, list[Sequence], depth) -> StepMetrics, held-out per depth


def save_checkpoint(folder: Path, head: EagleHead, draft_vocab: torch.Tensor, opt, step: int,
                    elapsed: float, cfg: TrainConfig, samples: int, recipe: Recipe | None = None) -> None:
    """Head in the published layout + trainer state; the state file is replaced atomically
    last, so a crash mid-save leaves the previous (head, state) pair or a newer head."""
    (recipe or EAGLE1).save(head, folder, draft_vocab)
    tmp = folder / (STATE_FILE + ".partial")
    torch.save({"step": step, "elapsed": elapsed, "samples": samples, "optimizer": opt.state_dict(),
                "rng": torch.get_rng_state(), "config": {k: str(v) for k, v in asdict(cfg).items()}}, tmp)
    tmp.rename(folder / STATE_FILE)


def resume(folder: Path, head: EagleHead, opt, target_config, samples: int,
           recipe: Recipe | None = None) -> tuple[int, float]:
    """Load (head weights, optimizer, RNG) from `folder` if it holds a checkpoint -> (step, elapsed)."""
    if not (folder / STATE_FILE).is_file():
        return 0, 0.0
    state = torch.load(folder / STATE_FILE, weights_only=True)
    if int(state.get("samples", -1)) != samples:
        raise DataError(f"the checkpoint in {folder} was trained on {state.get('samples')} sequences, "
                        f"this data has {samples}: resuming would repeat or skip samples. "
                        "Delete the checkpoint folder to start afresh")
    loaded = (recipe or EAGLE1).load(folder, target_config)
    head.load_state_dict(loaded.state_dict(), strict=True)
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    print(f"train: resuming from {folder} at step {state['step']}", flush=True)
    return int(state["step"]), float(state["elapsed"])


class EpochOrder:
    """Batch k of epoch e is a pure function of (seed, e, k): a resumed run trains on exactly
    the batches an uninterrupted one would have, from the step it stopped at."""

    def __init__(self, seqs: list[Sequence], batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = len(seqs), batch_size, seed
        self.lengths = [len(s.input_ids) for s in seqs]
        self.per_epoch = len(self._epoch(0))
        self._cache: tuple[int, list[list[int]]] = (0, self._epoch(0))

    def _epoch(self, epoch: int) -> list[list[int]]:
        return schedule(self.seed + epoch, self.n, self.batch_size, self.lengths)

    def batch(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.per_epoch)
        if self._cache[0] != epoch:
            self._cache = (epoch, self._epoch(epoch))
        return self._cache[1][k]


def optimizer_step(head: EagleHead, opt, loss: torch.Tensor, lr: float, clip: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), clip)
    opt.step()


def train(head: EagleHead, fz: Frozen, seqs: list[Sequence], cfg: TrainConfig, ckpt: Path,
          target_config, val: list[Sequence] | None = None, recipe: Recipe | None = None) -> TrainResult:
    """Train `head` in place on `seqs`, checkpointing to `ckpt` (resumed from there if present).
    `recipe`: the head kind's loss and checkpoint format (default EAGLE-1)."""
    recipe = recipe or EAGLE1
    head.train().requires_grad_(True)
    names = [n for n, _ in head.named_parameters()]
    for prefix in cfg.frozen:
        if not any(n.startswith(prefix) for n in names):
            raise DataError(f"frozen prefix {prefix!r} names no parameter of this head (its parameters: "
                            f"{', '.join(sorted({n.rsplit('.', 2)[0] for n in names}))})")
    for name, p in head.named_parameters():
        p.requires_grad_(not name.startswith(cfg.frozen))
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, betas=cfg.betas,
                            weight_decay=cfg.weight_decay)
    step, elapsed0 = resume(ckpt, head, opt, target_config, len(seqs), recipe)
    order = EpochOrder(seqs, cfg.batch_size, cfg.seed)
    total = math.ceil(cfg.epochs * order.per_epoch)
    stop_at = total if cfg.max_steps is None else min(total, cfg.max_steps)
    ckpt.mkdir(parents=True, exist_ok=True)
    # the starting head (a warm start's) is the first candidate; a resumed run's head was checked when saved
    best = (read_best(ckpt) or check(head, fz, val, cfg, recipe, step, None, ckpt)) if val else None
    checked = step  # the step last checked held out
    t0, last_ckpt = time.time() - elapsed0, time.time()
    history, seen, window = [], [], []
    bar = tqdm(total=stop_at, initial=step, unit="step", desc="train")
    while step < stop_at and not (cfg.minutes and time.time() - t0 > cfg.minutes * 60) \
            and not (best and best.exhausted(cfg.patience)):
        idx = order.batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            loss, metrics = recipe.loss(head, fz, [seqs[i] for i in idx], cfg, cfg.noise)
        optimizer_step(head, opt, loss, cfg.lr * lr_factor(cfg, step, total, time.time() - t0), cfg.grad_clip)
        step += 1
        seen.append(tuple(idx))
        window.append(metrics)
        bar.update(1)
        if len(window) == cfg.log_every or step == stop_at:
            history.append(_average(window))
            bar.set_postfix(loss=f"{history[-1].loss:.3f}", top1=f"{history[-1].top1[0]:.3f}",
                            lr=f"{opt.param_groups[0]['lr']:.1e}")
            window = []
        if time.time() - last_ckpt > cfg.ckpt_every_s:
            if val:
                best, checked = check(head, fz, val, cfg, recipe, step, best, ckpt), step
            save_checkpoint(ckpt, head, fz.draft_vocab, opt, step, time.time() - t0, cfg, len(seqs), recipe)
            last_ckpt = time.time()
    bar.close()
    stopped_early = bool(best and best.exhausted(cfg.patience))
    if val and checked != step:
        best = check(head, fz, val, cfg, recipe, step, best, ckpt)
    save_checkpoint(ckpt, head, fz.draft_vocab, opt, step, time.time() - t0, cfg, len(seqs), recipe)
    if val and best.step != step:  # an earlier head scored better on the held-out sequences: return that one
        print(f"train: the head of step {best.step} scored best held out (depth-1 top-1 {best.score:.4f}); "
              "returning it", flush=True)
        head.load_state_dict(recipe.load(ckpt / BEST_DIR, target_config).state_dict(), strict=True)
    head.eval().requires_grad_(False)
    return TrainResult(step, time.time() - t0, tuple(history), tuple(seen), step >= total, best, stopped_early)


def check(head, fz: "Frozen", val: list[Sequence], cfg: TrainConfig, recipe: Recipe, step: int,
          best: Best | None, ckpt: Path) -> Best:
    """One held-out check (accuracy one depth beyond the trained ones): a better depth-1 top-1 than
    `best` becomes the best, its head kept under ckpt/best/; -> the best so far."""
    m = recipe.evaluate(head, fz, val, cfg.unroll + 1)
    score = held_out_score(m)
    better = best is None or score > best.score
    mark = "best so far" if better else f"best {best.score:.4f} at step {best.step}"
    print(f"\nstep {step}: held-out {format_accuracy(m)} ({mark})", flush=True)
    head.train()
    if better:
        best = Best(step, score, 0, tuple(m.top1))
        write_best(ckpt, best, head, fz.draft_vocab, recipe)
    else:
        best = Best(best.step, best.score, best.checks_since + 1, best.top1)
        write_best(ckpt, best)
    return best


def _average(ms: list[StepMetrics]) -> StepMetrics:
    depth = len(ms[0].top1)
    cnt = [sum(m.count[d] for m in ms) for d in range(depth)]
    top1 = tuple(sum(m.top1[d] * m.count[d] for m in ms) / max(cnt[d], 1) for d in range(depth))
    top3 = tuple(sum(m.top3[d] * m.count[d] for m in ms) / max(cnt[d], 1) for d in range(depth))
    return StepMetrics(sum(m.loss for m in ms) / len(ms), top1, top3, tuple(cnt))


@torch.no_grad()
def evaluate_features(head: EagleHead, fz: Frozen, seqs: list[Sequence], depth: int,
                      batch_size: int = 8) -> StepMetrics:
    """Held-out draft accuracy per depth (teacher-forced tokens, the head's own features)."""
    head.eval()
    cfg = TrainConfig(unroll=depth, batch_size=batch_size)
    ms = [step_loss(head, fz, collate(seqs[i:i + batch_size]), cfg, noise=0.0)[1]
          for i in range(0, len(seqs), batch_size)]
    return _average(ms)


def format_accuracy(m: StepMetrics) -> str:
    parts = [f"depth {d + 1}: top-1 {m.top1[d]:.3f} top-3 {m.top3[d]:.3f} (n={m.count[d]})"
             for d in range(len(m.top1))]
    return f"loss {m.loss:.3f}; " + "; ".join(parts)


EAGLE1 = Recipe(loss=lambda head, fz, seqs, cfg, noise: step_loss(head, fz, collate(seqs), cfg, noise),
                save=lambda head, folder, vocab: save_head(head, folder, draft_vocab=vocab),
                load=lambda folder, target_config: load_head(folder, target_config)[0],
                evaluate=evaluate_features)

"""EAGLE-3 head training with training-time test (TTT): the head is unrolled on its own states.

Glossary (one sequence t_0..t_{n-1}; fused target features g_j; p_j = the target's next-token
distribution at position j, restricted to the draft vocabulary and renormalised; m = n - 1 rows)
- step 0, row i: input (embed(t_{i+1}), fc(g_i)) at position i -> head state s^0_i, whose
  draft distribution predicts t_{i+2} (target p_{i+1}). Anchor i is the last position with
  target features, as after a catch-up in drafting.
- step k > 0, row i: input (embed(t_{i+1+k}), s^{k-1}_i) at position i + k -> s^k_i,
  predicting t_{i+2+k} (target p_{i+1+k}): the head drafting k + 1 tokens past anchor i.
  Its attention sees the step-0 keys of rows <= i and its own keys of steps 1..k, exactly
  the head's KV cache while drafting a chain. Tokens are teacher-forced, so step-k accuracy
  is conditioned on the chain so far being right, as acceptance is.
- loss: sum_k decay^k * CE(p_{i+1+k}, draft distribution of s^k_i) averaged over scored rows
  (token-level only, no feature regression; `soft_targets=False`: CE against the target's
  greedy token). Row i of step k is scored when t_{i+1}..t_{i+2+k} are all assistant tokens
  (the root and the chain are answer tokens, as when drafting an answer); the loss also
  needs the target's greedy token at i+1+k in the draft vocabulary (as the reference
  masks), while accuracy counts every scored row, so it compares with EAGLE-1's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.decoding.head import additive
from core.decoding.head3 import Eagle3Head, load_head3, save_head3
from core.train.data import DataError
from core.train.features import Sequence
from core.train.trainer import Frozen, Recipe, StepMetrics, TrainConfig, _average


@dataclass(frozen=True)
class Batch3:
    ids: torch.Tensor  # (B, n) long, right-padded
    fused: torch.Tensor  # (B, n, 3H) float32 fused target features
    final: torch.Tensor | None  # (B, n, H) float32 last hidden states (soft targets), or None
    amask: torch.Tensor  # (B, n) bool assistant tokens (False on padding)
    argmax: torch.Tensor  # (B, n) long target greedy next token


def collate3(seqs: list[Sequence], need_final: bool) -> Batch3:
    if need_final and any(s.final is None for s in seqs):
        raise DataError("these features lack the last hidden state that soft targets need: "
                        "build them with `--head-kind eagle3`")
    n, b, w = max(len(s.input_ids) for s in seqs), len(seqs), seqs[0].hidden.shape[1]
    ids, am, top = (torch.zeros(b, n, dtype=t) for t in (torch.long, torch.bool, torch.long))
    fused = torch.zeros(b, n, w)
    final = torch.zeros(b, n, seqs[0].final.shape[1]) if need_final else None
    for i, s in enumerate(seqs):
        k = len(s.input_ids)
        ids[i, :k], fused[i, :k], am[i, :k], top[i, :k] = s.input_ids, s.hidden.float(), s.loss_mask, s.argmax
        if need_final:
            final[i, :k] = s.final.float()
    return Batch3(ids, fused, final, am, top)


def shift(x: torch.Tensor, j: int, fill=0) -> torch.Tensor:
    """(B, n) -> (B, n - 1): row i holds x[:, i + j] (fill past the end)."""
    b, n = x.shape
    out = torch.full((b, n - 1), fill, dtype=x.dtype)
    if j < n:
        out[:, :n - j] = x[:, j:]
    return out


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  causal: torch.Tensor) -> torch.Tensor:
    """Row i of step k attends to step-0 keys <= i and its own keys of steps 1..k.

    q: (B, nh, m, hd); keys/values: k + 1 tensors (B, kvh, m, hd); causal: additive (1, 1, m, m)
    -> (B, nh, m, hd)."""
    g = q.shape[1] // keys[0].shape[1]
    rep = lambda t: t.repeat_interleave(g, dim=1) if g > 1 else t  # noqa: E731 (GQA: head h reads kv h // g)
    scale = q.shape[-1] ** -0.5
    scores = [q @ rep(keys[0]).transpose(-1, -2) * scale + causal]  # (B, nh, m, m)
    scores += [(q * rep(k)).sum(-1, keepdim=True) * scale for k in keys[1:]]  # own row: (B, nh, m, 1)
    scores = torch.cat(scores, dim=-1)
    w = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    m = q.shape[2]
    out = w[..., :m] @ rep(values[0])
    for j, v in enumerate(values[1:]):
        out = out + w[..., m + j:m + j + 1] * rep(v)
    return out


def ttt_states(head: Eagle3Head, embed: torch.Tensor, batch: Batch3, steps: int,
               noise: float = 0.0) -> list[torch.Tensor]:
    """Head states per unroll step, each (B, m, H) (see the module glossary)."""
    if batch.fused.shape[-1] != head.fc.in_features:
        raise DataError(f"features of width {batch.fused.shape[-1]}, the head fuses {head.fc.in_features}: "
                        "build EAGLE-3 features (`--head-kind eagle3`) for this target")
    b, n, _ = batch.fused.shape
    m = n - 1
    g = batch.fused[:, :m]
    if noise:
        g = g + (torch.rand_like(g) * 2 - 1) * noise
    x = head.fc(g)  # (B, m, H)
    causal = additive(torch.ones(m, m, dtype=torch.bool).tril(), x.dtype)
    layer, attn = head.midlayer, head.midlayer.self_attn
    keys, values, states = [], [], []
    for k in range(steps):
        emb = F.embedding(shift(batch.ids, 1 + k), embed).to(x.dtype)  # (B, m, H): t_{i+1+k}
        cos, sin = head.rotary(x, (torch.arange(m) + k)[None])
        q, kk, v = attn.qkv(layer.attn_input(emb, x), cos.to(x.dtype), sin.to(x.dtype))
        keys.append(kk)
        values.append(v)
        a = ttt_attention(q, keys, values, causal)  # (B, nh, m, hd)
        x = layer.finish(x, attn.o_proj(a.transpose(1, 2).reshape(b, m, -1)))
        states.append(x)
    return states


def scored_rows(amask: torch.Tensor, k: int) -> torch.Tensor:
    """(B, n) assistant mask -> (B, m) bool: rows of step k scored (t_{i+1}..t_{i+2+k} answer tokens)."""
    ok = shift(amask, 1, fill=False)
    for j in range(2, k + 3):
        ok &= shift(amask, j, fill=False)
    return ok


def ttt_loss(head: Eagle3Head, fz: Frozen, batch: Batch3, cfg: TrainConfig,
             noise: float) -> tuple[torch.Tensor, StepMetrics]:
    v = fz.embed.shape[0]
    lookup = torch.full((v,), -1, dtype=torch.long)
    lookup[fz.draft_vocab] = torch.arange(fz.draft_vocab.shape[0])  # target id -> draft id
    in_draft = lookup >= 0
    states = ttt_states(head, fz.embed, batch, cfg.unroll, noise)
    if cfg.soft_targets:
        probs, index = target_probs(batch, fz, in_draft)
    total, top1, top3, count = 0.0, [], [], []
    for k, s in enumerate(states):
        rows = scored_rows(batch.amask, k)
        want = shift(batch.argmax, 1 + k)[rows]  # (R,) target greedy ids
        logp = F.log_softmax(head.logits(s[rows]).float(), dim=-1)  # (R, Vd)
        fit = in_draft[want]  # (R,) rows the loss uses: the target's token is draftable
        if cfg.soft_targets:
            ce = -(probs[shift(index, 1 + k)[rows][fit]] * logp[fit]).sum(-1)
        else:
            ce = F.nll_loss(logp[fit], lookup[want[fit]], reduction="none")
        total = total + cfg.unroll_decay ** k * (ce.mean() if ce.numel() else logp.sum() * 0.0)
        with torch.no_grad():
            top = fz.draft_vocab[logp.topk(min(3, logp.shape[1]), dim=-1).indices]  # (R, 3)
            r = max(int(rows.sum()), 1)
            top1.append(int((top[:, 0] == want).sum()) / r)
            top3.append(int((top == want[:, None]).any(-1).sum()) / r)
            count.append(int(rows.sum()))
    return total, StepMetrics(float(total.detach()), tuple(top1), tuple(top3), tuple(count))


@torch.no_grad()
def target_probs(batch: Batch3, fz: Frozen, in_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distributions over the draft vocabulary, once per batch for every step,
    at positions j some row predicts from (t_{j+1} an assistant token, greedy token in the
    draft vocabulary) -> (probs (N, Vd), index (B, n): row of position j in probs, else -1)."""
    need = in_draft[batch.argmax]
    need[:, :-1] &= batch.amask[:, 1:]
    need[:, -1] = False
    index = torch.full(need.shape, -1, dtype=torch.long)
    index[need] = torch.arange(int(need.sum()))
    return torch.softmax(batch.final[need] @ fz.lm_rows.T, dim=-1), index


@torch.no_grad()
def evaluate_features3(head: Eagle3Head, fz: Frozen, seqs: list[Sequence], depth: int,
                       batch_size: int = 8) -> StepMetrics:
    """Held-out draft accuracy per depth (teacher-forced tokens, the head's own states)."""
    head.eval()
    soft = all(s.final is not None for s in seqs)
    cfg = TrainConfig(unroll=depth, batch_size=batch_size, soft_targets=soft)
    ms = [ttt_loss(head, fz, collate3(seqs[i:i + batch_size], soft), cfg, noise=0.0)[1]
          for i in range(0, len(seqs), batch_size)]
    return _average(ms)


EAGLE3 = Recipe(loss=lambda head, fz, seqs, cfg, noise: ttt_loss(head, fz, collate3(seqs, cfg.soft_targets),
                                                                 cfg, noise),
                save=lambda head, folder, vocab: save_head3(head, folder),
                load=lambda folder, target_config: load_head3(folder, target_config),
                evaluate=evaluate_features3)


def frozen_for(model, head: Eagle3Head) -> Frozen:
    """The target's embedding and LM-head rows of the head's draft vocabulary (soft targets)."""
    return Frozen.from_target(model, head.target_ids().cpu())

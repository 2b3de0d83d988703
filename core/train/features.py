"""Feature cache: one target forward per conversation gives every last hidden state
(after the final norm, what the LM head consumes). Stored in safetensors shards.

Shard k (`shard_00000.safetensors`) holds a run of consecutive conversations:
  input_ids (N,) int32, loss_mask (N,) bool (assistant tokens), hidden (N, H) fp16,
  argmax (N,) int32, offsets (M + 1,) int64 (conversation i spans offsets[i]:offsets[i+1]).
EAGLE-3 features (`FeatureConfig.layer_ids`, see core.decoding.head3): hidden is (N, 3H), the
hidden states of those layers concatenated, and final (N, H) fp16 holds the last one.
`manifest.json` lists the shards in order with how many source conversations each
covers, and the layer ids; a rerun continues after the last complete shard (a shard is
written atomically).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from core.train.data import DataError, assistant_mask, conversation_digest

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class FeatureConfig:
    max_len: int = 768  # longer conversations are cut (the head trains on short windows anyway)
    shard_tokens: int = 50_000
    batch_tokens: int = 0  # > 0: consecutive conversations run together, right-padded (0: one at a
    # time, which measured fastest on a CPU: 415 vs 345 tok/s of CPU time in bf16, batch 1 vs 4)
    layer_ids: tuple[int, ...] | None = None  # EAGLE-3: fuse these `output_hidden_states` entries
    weights: str = "bf16"  # the numerics of the answers' features: "bf16" (transformers) or "w4a8" (native_features)


@dataclass(frozen=True)
class Sequence:
    input_ids: torch.Tensor  # (n,) long
    loss_mask: torch.Tensor  # (n,) bool: token is written by the assistant
    hidden: torch.Tensor  # (n, H) fp16 target features; EAGLE-3: (n, 3H) fused layers
    argmax: torch.Tensor  # (n,) long: the target's greedy next token at each position
    final: torch.Tensor | None = None  # EAGLE-3 only: (n, H) fp16 last hidden state


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {"shards": [], "conversations": 0,
                                                                "skipped_no_assistant": 0}


@torch.inference_mode()
def target_features(model, seqs: list[torch.Tensor], layer_ids: tuple[int, ...] | None = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Features, greedy next tokens and (EAGLE-3) last hidden states per id sequence (one
    batched forward, right padding) -> [(hidden (n_i, H or 3H) fp16, (n_i,) long, final)]."""
    from core.decoding.head3 import target_features as pick

    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    att = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], att[i, :len(s)] = s, 1
    out = model.model(input_ids=ids, attention_mask=att, use_cache=False,  # the final norm is applied
                      output_hidden_states=layer_ids is not None)
    last = out.last_hidden_state  # (B, n, H)
    h = pick(out, layer_ids)  # (B, n, H) or (B, n, 3H)
    top = model.lm_head(last).argmax(-1)  # (B, n)
    return [(h[i, :len(s)].to(torch.float16), top[i, :len(s)],
             None if layer_ids is None else last[i, :len(s)].to(torch.float16)) for i, s in enumerate(seqs)]


@torch.inference_mode()
def native_features(step, seq: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One conversation's EAGLE-1 features in the numerics a served answer has: the text before its
    last answer prefilled through transformers (as the engine prefills a chat), the answer's tokens
    through the native decode step (`step`, core.kernels.step.NativeStep, e.g. 4-bit weights x
    8-bit activations) as one chain; its rows are row-invariant, so each is bit for bit the decode
    step that verified that token. seq, mask (n,) -> (hidden (n, H) fp16, (n,) greedy next tokens)."""
    from core.decoding import cache as kv
    from core.decoding.forward import forward_tree
    from core.decoding.tree import DraftTree

    answer = torch.nonzero(mask).flatten()
    start = int(answer[-1]) if len(answer) else len(seq)
    while start > 0 and bool(mask[start - 1]):  # back to where the last answer's run starts
        start -= 1
    start = max(start, 1)  # a prefill needs a token
    cache = kv.new_cache(step)
    before = step.hf.model(input_ids=seq[None, :start], cache=cache, use_cache=True).last_hidden_state[0]  # (start, H)
    top = [step.hf.lm_head(before).argmax(-1)]
    hidden = [before]
    n = len(seq) - start
    if n:
        chain = DraftTree(tokens=seq[start:], parents=torch.arange(-1, n - 1), depths=torch.arange(n))
        feats, logits = forward_tree(step, chain, cache, start)  # (n, H), (n, V)
        hidden.append(feats)
        top.append(logits.argmax(-1))
    return torch.cat(hidden).to(torch.float16), torch.cat(top)


def tokenize_all(tokenizer, convs: list[list[dict]], max_len: int) -> tuple[list, int]:
    """(ids, mask) per conversation (None where it has no assistant token) and that count."""
    out, empty = [], 0
    for conv in convs:
        ids, mask = assistant_mask(tokenizer, conv)
        ids, mask = ids[:max_len], mask[:max_len]
        if not mask.any():
            empty += 1
            out.append(None)
        else:
            out.append((ids, mask))
    return out, empty


def build_features(target, convs: list[list[dict]], folder: Path, cfg: FeatureConfig, step=None) -> dict:
    """Write shards for every conversation not yet covered by the manifest; returns the manifest.
    `step` (cfg.weights "w4a8"): the native decode step the answers' features come from (native_features)."""
    if (step is None) != (cfg.weights == "bf16"):
        raise ValueError(f"features in {cfg.weights} numerics need {'no' if step is None else 'the'} native step")
    if step is not None and cfg.layer_ids is not None:
        raise DataError("native-step features are EAGLE-1's (the last hidden state); build EAGLE-3 features "
                        "with --feature-weights bf16")
    folder.mkdir(parents=True, exist_ok=True)
    man = read_manifest(folder)
    start = man["conversations"]
    if start > len(convs) or man.get("digest", conversation_digest([])) != conversation_digest(convs[:start]):
        raise DataError(f"{folder} caches features of other conversations than these (the first {start} "
                        "differ); delete the folder or point --work elsewhere to start afresh")
    layers = list(cfg.layer_ids) if cfg.layer_ids is not None else None
    if man["shards"] and man.get("layer_ids") != layers:
        raise DataError(f"{folder} caches features of layers {man.get('layer_ids')}, not {layers} (another head "
                        "kind); use another folder")
    man["layer_ids"] = layers
    if man["shards"] and man.get("weights", "bf16") != cfg.weights:
        raise DataError(f"{folder} caches features in {man.get('weights', 'bf16')} numerics, not {cfg.weights}; "
                        "use another --work folder")
    man["weights"] = cfg.weights
    todo = convs[start:]
    if not todo:
        print(f"features: all {start} conversations already cached in {folder}")
        return man
    tokenized, empty = tokenize_all(target.tokenizer, todo, cfg.max_len)
    if empty == len(todo) and not man["shards"]:
        raise DataError("the dataset has no assistant tokens: nothing to train the head on "
                        "(every conversation lacks an assistant turn)")
    pending: list[Sequence] = []
    covered = 0
    bar = tqdm(total=sum(len(t[0]) for t in tokenized if t), unit="tok", desc="features")
    order = _length_batches(tokenized, cfg.batch_tokens)
    for batch in order:
        if step is None:
            feats = target_features(target.model, [tokenized[i][0] for i in batch], cfg.layer_ids)
        else:
            feats = [(*native_features(step, *tokenized[i]), None) for i in batch]
        for i, (h, top, final) in zip(batch, feats):
            pending.append((i, Sequence(tokenized[i][0], tokenized[i][1], h, top, final)))
        bar.update(sum(len(tokenized[i][0]) for i in batch))
        # flush a shard once enough tokens of a *contiguous* prefix of conversations are done
        done = {i for i, _ in pending}
        prefix = covered
        while prefix < len(tokenized) and (prefix in done or tokenized[prefix] is None):
            prefix += 1
        ready = [(i, s) for i, s in pending if i < prefix]
        if sum(len(s.input_ids) for _, s in ready) >= cfg.shard_tokens or prefix == len(tokenized):
            _write_shard(folder, man, [s for _, s in sorted(ready, key=lambda x: x[0])], prefix - covered,
                         conversation_digest(convs[:start + prefix]))
            man["skipped_no_assistant"] += sum(1 for i in range(covered, prefix) if tokenized[i] is None)
            pending = [(i, s) for i, s in pending if i >= prefix]
            covered = prefix
    bar.close()
    if covered < len(tokenized):  # conversations with no assistant tokens at the very end
        _write_shard(folder, man, [], len(tokenized) - covered, conversation_digest(convs))
        man["skipped_no_assistant"] += len(tokenized) - covered
    return man


def _length_batches(tokenized, batch_tokens: int) -> list[list[int]]:
    """Indices in source order, grouped greedily so batch size x longest <= batch_tokens.

    Source order (not length order) keeps shards contiguous, so resume stays simple."""
    batches, cur, longest = [], [], 0
    for i, t in enumerate(tokenized):
        if t is None:
            continue
        n = len(t[0])
        if cur and (batch_tokens <= 0 or max(longest, n) * (len(cur) + 1) > batch_tokens):
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def _write_shard(folder: Path, man: dict, seqs: list[Sequence], n_convs: int, digest: str) -> None:
    from safetensors.torch import save_file

    name = f"shard_{len(man['shards']):05d}.safetensors"
    if seqs:
        lens = torch.tensor([0] + [len(s.input_ids) for s in seqs])
        tensors = {"input_ids": torch.cat([s.input_ids for s in seqs]).to(torch.int32),
                   "loss_mask": torch.cat([s.loss_mask for s in seqs]),
                   "hidden": torch.cat([s.hidden for s in seqs]).contiguous(),
                   "argmax": torch.cat([s.argmax for s in seqs]).to(torch.int32),
                   "offsets": lens.cumsum(0)}
        if seqs[0].final is not None:
            tensors["final"] = torch.cat([s.final for s in seqs]).contiguous()
        tmp = folder / (name + ".partial")
        save_file(tensors, str(tmp))
        tmp.rename(folder / name)
    man["shards"].append({"file": name if seqs else None, "conversations": n_convs,
                          "sequences": len(seqs), "tokens": int(sum(len(s.input_ids) for s in seqs)),
                          "assistant_tokens": int(sum(int(s.loss_mask.sum()) for s in seqs))})
    man["conversations"] += n_convs
    man["digest"] = digest
    tmp = folder / (MANIFEST + ".partial")
    tmp.write_text(json.dumps(man, indent=1))
    tmp.rename(folder / MANIFEST)


def load_sequences(folder: Path, last_only: bool = False) -> list[Sequence]:
    """Every cached sequence, in source order. last_only: EAGLE-3 shards read as EAGLE-1
    features (hidden = the stored last hidden state; the fused layers are not kept)."""
    from safetensors.torch import load_file

    man = read_manifest(folder)
    if not man["shards"]:
        raise DataError(f"no feature shards in {folder}: run `python -m core.train features` first")
    out = []
    for shard in man["shards"]:
        if shard["file"] is None:
            continue
        t = load_file(str(folder / shard["file"]))
        if last_only:
            if "final" not in t:
                raise DataError(f"{folder / shard['file']} holds no last hidden state ('final'): "
                                "not EAGLE-3 features")
            t["hidden"] = t.pop("final")
        off = t["offsets"].tolist()
        for a, b in zip(off[:-1], off[1:]):
            out.append(Sequence(t["input_ids"][a:b].long(), t["loss_mask"][a:b], t["hidden"][a:b],
                                t["argmax"][a:b].long(), t["final"][a:b] if "final" in t else None))
    return out

"""Self-distillation: the target answers the training prompts (batched generation, left
padding) and each answer becomes a training conversation.

Answers are greedy, or for a `sampled_fraction` of the prompts (chosen by a hash of the id,
so a resumed run makes the same choice) sampled at `temperature` with no top-k or top-p, the
distribution the engine's sampled decoding reproduces. Output is JSONL, one line per prompt,
appended (and flushed) after every batch: {"id", "category", "messages": [...], "new_tokens",
"truncated"}, plus "temperature" for a sampled answer. A rerun skips the ids already in the
file, so an interrupted run resumes without duplicates.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from core.config import SamplingConfig
from core.train.data import Prompt
from core.decoding.verify import greedy_tokens, target_probs


@dataclass(frozen=True)
class DistillConfig:
    batch_size: int = 24
    max_new_tokens: int = 256
    sort_window: int = 96  # prompts sorted by length within windows of this many (less padding)
    deadline: datetime | None = None  # stop starting new batches after this time (UTC)
    max_prompts: int | None = None
    sampled_fraction: float = 0.0  # this share of the prompts is answered by sampling, the rest greedily
    temperature: float = 0.7  # of the sampled answers
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError("batch_size and max_new_tokens must be >= 1")
        if not 0.0 <= self.sampled_fraction <= 1.0 or self.temperature <= 0:
            raise ValueError("sampled_fraction must be in [0, 1] and temperature > 0")

    def temperature_for(self, prompt_id: str) -> float:
        """0.0 (greedy) or the sampling temperature: a fixed choice per prompt id."""
        h = int(hashlib.sha256(f"{self.seed}:{prompt_id}".encode()).hexdigest()[:8], 16)
        return self.temperature if h / 0xFFFFFFFF < self.sampled_fraction else 0.0


def read_records(path: Path) -> list[dict]:
    """The answer records in `path` (none if it does not exist); a torn last line (killed
    mid-write) or any other unparsable line is ignored."""
    out = []
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return out


def done_ids(path: Path) -> set[str]:
    """Prompt ids already answered in `path`."""
    return {r["id"] for r in read_records(path) if isinstance(r, dict) and "id" in r}


def batches(prompts: list[Prompt], tokenizer, cfg: DistillConfig):
    """Batches of prompts; within each window the prompts are sorted by templated length."""
    for w in range(0, len(prompts), cfg.sort_window):
        window = prompts[w:w + cfg.sort_window]
        window.sort(key=lambda p: sum(len(m["content"]) for m in p.messages()))
        for b in range(0, len(window), cfg.batch_size):
            yield window[b:b + cfg.batch_size]


def prepare_tokenizer(tok) -> None:
    """Left padding (every row's continuation starts at the same column) and a pad token."""
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token


@torch.inference_mode()
def generate_ids(model, tokenizer, texts: list[str], stop_ids, max_new_tokens: int,
                 sampling: SamplingConfig = SamplingConfig(), generator: torch.Generator | None = None,
                 ) -> list[tuple[list[int], int | None]]:
    """Continue each already-templated text, batched (left padding) -> per text (the new
    token ids before the first stop id, that stop id or None when cut at max_new_tokens).

    Greedy (argmax) or sampled from core.decoding.verify.target_probs, the engine's own temperature /
    top-k / top-p. A row that stops leaves the batch (its cache rows are dropped): a batch
    then costs about what its rows generate, where transformers' generate() runs every row
    until the longest ends (user turns of 10 to 250 tokens: most of that work wasted).
    """
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    mask = enc["attention_mask"]  # (b, T), 0 on the left padding
    step = enc["input_ids"]  # (b, T) at the prefill, then (b, 1)
    stops = torch.tensor(sorted(set(stop_ids)))
    rows = torch.arange(len(texts))  # which text each live batch row continues
    new: list[list[int]] = [[] for _ in texts]
    ended: list[int | None] = [None] * len(texts)
    cache = DynamicCache()
    for _ in range(max_new_tokens):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step.shape[1]:]  # positions skip the padding
        logits = model(input_ids=step, attention_mask=mask, position_ids=pos, cache=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]  # (b, V)
        tok = greedy_tokens(logits) if sampling.greedy else \
            torch.multinomial(target_probs(logits, sampling), 1, generator=generator)[:, 0]
        done = torch.isin(tok, stops)
        for r, t, d in zip(rows.tolist(), tok.tolist(), done.tolist()):
            if d:
                ended[r] = t
            else:
                new[r].append(t)
        if done.all():
            break
        if done.any():
            keep = (~done).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            rows, mask, tok = rows[keep], mask[keep], tok[keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        step = tok[:, None]
    return list(zip(new, ended))


def generate_batch(model, tokenizer, prompts: list[Prompt], eos_ids, max_new_tokens: int,
                   temperature: float = 0.0, generator: torch.Generator | None = None):
    """Answers to each prompt's conversation (history + first turn), greedy or sampled at
    `temperature` (no top-k, no top-p) -> list of (answer text, n tokens, truncated)."""
    texts = [tokenizer.apply_chat_template(p.messages(), tokenize=False, add_generation_prompt=True)
             for p in prompts]
    outs = generate_ids(model, tokenizer, texts, eos_ids, max_new_tokens, SamplingConfig(temperature), generator)
    return [(tokenizer.decode(toks, skip_special_tokens=True), len(toks), stop is None) for toks, stop in outs]


def batch_seed(seed: int, ids: list[str]) -> int:
    """A sampled batch's generator seed, from its prompts (so a rerun of it samples the same)."""
    return int(hashlib.sha256(f"{seed}:{ids[0]}:{len(ids)}".encode()).hexdigest()[:12], 16)


def distill(target, prompts: list[Prompt], out_path: Path, cfg: DistillConfig) -> int:
    """Answer every prompt not yet in `out_path` with the transformers model `target.model`,
    batched; returns the number of new tokens written."""
    tok = target.tokenizer
    prepare_tokenizer(tok)

    def answer(batch: list[Prompt], temperature: float) -> list[tuple[str, int, bool]]:
        gen = torch.Generator().manual_seed(batch_seed(cfg.seed, [p.id for p in batch]))
        return generate_batch(target.model, tok, batch, target.eos_ids, cfg.max_new_tokens, temperature, gen)

    return _answer_all(prompts, out_path, cfg, answer, tok, {})


def engine_answer(engine, prompt: Prompt, max_new_tokens: int, temperature: float, seed: int,
                  ) -> tuple[str, int, bool]:
    """One answer through the app's own engine (core.decoding.engine): the served numerics, and
    speculative decoding where the engine has a head, whose output is the target's own (greedy:
    token-identical to plain decoding; sampled: the target's distribution) -> (text, n tokens
    before the stop token, cut at max_new_tokens)."""
    from core.config import GenerationConfig, SamplingConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, speculative=engine.has_head, tree=engine.default_tree,
                              sampling=SamplingConfig(temperature), seed=seed)
    ids, reason = [], None
    for event in engine.generate(prompt.messages(), config):
        ids.extend(event.token_ids)
        reason = event.finish_reason
    return answer_text(engine.target.tokenizer, ids, reason)


def answer_text(tokenizer, ids, reason: str) -> tuple[str, int, bool]:
    """An answer's ids and finish reason -> (its text, the tokens before the stop token, cut at the budget)."""
    ids = list(ids[:-1] if reason == "eos" else ids)
    return tokenizer.decode(ids, skip_special_tokens=True), len(ids), reason in ("length", "context")


def distill_engine(engine, prompts: list[Prompt], out_path: Path, cfg: DistillConfig) -> int:
    """`distill` through the app's engine: the answers the app itself would give, in the numerics it
    serves (on a CPU the native 4-bit step: what the head must predict there). Where the native step
    serves, cfg.batch_size answers are written at once as branches of one cache (_answer_branches:
    the same tokens, several times the answers per hour); elsewhere one prompt at a time (batch_size
    then only groups the writes). Each record names the numerics."""
    served = engine.numerics.step or f"{engine.numerics.dtype} / {engine.numerics.attention}"
    if engine.step is not None:
        return _answer_branches(engine, prompts, out_path, cfg, {"numerics": served})

    def answer(batch: list[Prompt], temperature: float) -> list[tuple[str, int, bool]]:
        return [engine_answer(engine, p, cfg.max_new_tokens, temperature, batch_seed(cfg.seed, [p.id]))
                for p in batch]

    return _answer_all(prompts, out_path, cfg, answer, engine.target.tokenizer, {"numerics": served})


def _plan(prompts: list[Prompt], out_path: Path, cfg: DistillConfig, tok) -> list[tuple[list[Prompt], float]]:
    """The batches still to answer and their temperatures: answered ids skipped, greedy and sampled
    interleaved (printed: how many are done and to go)."""
    done = done_ids(out_path)
    todo = [p for p in prompts if p.id not in done]
    if cfg.max_prompts is not None:
        todo = todo[:max(0, cfg.max_prompts - len(done))]
    greedy = [p for p in todo if not cfg.temperature_for(p.id)]
    sampled = [p for p in todo if cfg.temperature_for(p.id)]
    print(f"distill: {len(done)} prompts already answered, {len(todo)} to go ({len(sampled)} sampled at "
          f"T {cfg.temperature}) -> {out_path}", flush=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    return interleave([(b, 0.0) for b in batches(greedy, tok, cfg)],
                      [(b, cfg.temperature) for b in batches(sampled, tok, cfg)])


def _record(p: Prompt, text: str, n: int, truncated: bool, temperature: float, extra: dict) -> str:
    """One answer's JSONL line."""
    row = {"id": p.id, "category": p.category, "messages": p.messages() + [{"role": "assistant", "content": text}],
           "new_tokens": n, "truncated": truncated}
    return json.dumps(row | ({"temperature": temperature} if temperature else {}) | extra, ensure_ascii=False) + "\n"


def _past(deadline: datetime | None) -> bool:
    if deadline and datetime.now(timezone.utc) >= deadline:
        print(f"distill: deadline {deadline:%H:%M} UTC reached, stopping", flush=True)
        return True
    return False


def _answer_all(prompts: list[Prompt], out_path: Path, cfg: DistillConfig, answer, tok, extra: dict) -> int:
    """The distill loop: skip answered ids, greedy and sampled batches interleaved, one JSONL
    line per answer (flushed per batch), a deadline, progress; `answer(batch, temperature)`
    gives (text, n tokens, truncated) per prompt. Returns the new tokens written."""
    runs = _plan(prompts, out_path, cfg, tok)
    total, t0 = 0, time.time()
    bar = tqdm(total=sum(len(b) for b, _ in runs), unit="prompt", desc="distill")
    with open(out_path, "a", encoding="utf-8") as f:
        for batch, temperature in runs:
            if _past(cfg.deadline):
                break
            for p, (text, n, truncated) in zip(batch, answer(batch, temperature)):
                f.write(_record(p, text, n, truncated, temperature, extra))
                total += n
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(tok=total, tok_s=f"{total / (time.time() - t0):.1f}")
    bar.close()
    return total


def _answer_branches(engine, prompts: list[Prompt], out_path: Path, cfg: DistillConfig, extra: dict) -> int:
    """_answer_all's loop with the answers written as branches of one cache (core.decoding.batched),
    cfg.batch_size of them in flight: the same answers as the engine one at a time, each line
    written (and flushed) as its answer finishes; no new answer starts after the deadline."""
    from core.decoding import batched

    tok = engine.target.tokenizer
    order = [(p, t) for batch, t in _plan(prompts, out_path, cfg, tok) for p in batch]

    def requests():
        for p, t in order:
            if _past(cfg.deadline):
                return
            yield batched.Request(tuple(engine.encode(p.messages())), cfg.max_new_tokens, SamplingConfig(t),
                                  batch_seed(cfg.seed, [p.id]))

    total, t0 = 0, time.time()
    bar = tqdm(total=len(order), unit="prompt", desc="distill")
    with open(out_path, "a", encoding="utf-8") as f, torch.inference_mode():
        for a in batched.answers(engine, requests(), rows=cfg.batch_size):
            p, t = order[a.index]
            text, n, truncated = answer_text(tok, a.tokens, a.finish_reason)
            f.write(_record(p, text, n, truncated, t, extra))
            f.flush()
            total += n
            bar.update(1)
            bar.set_postfix(tok=total, tok_s=f"{total / (time.time() - t0):.1f}")
    bar.close()
    return total


def interleave(greedy: list, sampled: list) -> list:
    """Greedy and sampled batches alternated in proportion, so a run stopped early (--until)
    has answered both kinds in their share."""
    at = lambda i, n: (i + 0.5) / n  # noqa: E731  (a batch's position within its kind, 0..1)
    tagged = [(at(i, len(greedy)), 0, r) for i, r in enumerate(greedy)]
    tagged += [(at(i, len(sampled)), 1, r) for i, r in enumerate(sampled)]
    return [r for _, _, r in sorted(tagged, key=lambda t: t[:2])]

"""Self-distillation: the target answers the training prompts (batched greedy generation,
left padding) and each answer becomes a training conversation.

Output is JSONL, one line per prompt, appended (and flushed) after every batch:
{"id", "category", "messages": [...], "new_tokens", "truncated"}. A rerun skips the ids
already in the file, so an interrupted run resumes without duplicates.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from core.train.data import Prompt


@dataclass(frozen=True)
class DistillConfig:
    batch_size: int = 24
    max_new_tokens: int = 256
    sort_window: int = 96  # prompts sorted by length within windows of this many (less padding)
    deadline: datetime | None = None  # stop starting new batches after this time (UTC)
    max_prompts: int | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError("batch_size and max_new_tokens must be >= 1")


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


@torch.inference_mode()
def generate_batch(model, tokenizer, prompts: list[Prompt], eos_ids, max_new_tokens: int):
    """Greedy answers to each prompt's conversation (history + first turn) -> list of
    (answer text, n tokens, truncated)."""
    texts = [tokenizer.apply_chat_template(p.messages(), tokenize=False, add_generation_prompt=True)
             for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids),
                         pad_token_id=tokenizer.pad_token_id)
    new = out[:, enc["input_ids"].shape[1]:]  # (B, <= max_new_tokens)
    results = []
    for row in new.tolist():
        stop = next((i for i, t in enumerate(row) if t in eos_ids), None)
        toks = row if stop is None else row[:stop]
        results.append((tokenizer.decode(toks, skip_special_tokens=True), len(toks), stop is None))
    return results


def distill(target, prompts: list[Prompt], out_path: Path, cfg: DistillConfig) -> int:
    """Answer every prompt not yet in `out_path`; returns the number of new tokens written."""
    tok = target.tokenizer
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    done = done_ids(out_path)
    todo = [p for p in prompts if p.id not in done]
    if cfg.max_prompts is not None:
        todo = todo[:max(0, cfg.max_prompts - len(done))]
    print(f"distill: {len(done)} prompts already answered, {len(todo)} to go -> {out_path}", flush=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    total, t0 = 0, time.time()
    bar = tqdm(total=len(todo), unit="prompt", desc="distill")
    with open(out_path, "a", encoding="utf-8") as f:
        for batch in batches(todo, tok, cfg):
            if cfg.deadline and datetime.now(timezone.utc) >= cfg.deadline:
                print(f"distill: deadline {cfg.deadline:%H:%M} UTC reached, stopping", flush=True)
                break
            for p, (answer, n, truncated) in zip(batch, generate_batch(target.model, tok, batch, target.eos_ids,
                                                                        cfg.max_new_tokens)):
                msgs = p.messages() + [{"role": "assistant", "content": answer}]
                f.write(json.dumps({"id": p.id, "category": p.category, "messages": msgs,
                                    "new_tokens": n, "truncated": truncated}, ensure_ascii=False) + "\n")
                total += n
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(tok=total, tok_s=f"{total / (time.time() - t0):.1f}")
    bar.close()
    return total

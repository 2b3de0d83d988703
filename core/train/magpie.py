"""User prompts written by the target itself (Magpie, Xu et al. 2024, arXiv 2406.08464).

An instruct model given its chat template up to the start of a user turn (for SmolLM2's
ChatML: the default system prompt the template adds, then `<|im_start|>user\\n`) writes what
a user would say there, because it was trained on such turns. Sampled at temperature 1.0,
top-p 0.99 and stopped at the end of the turn, it yields prompts in the style people type,
which the template generator (core/train/templates.py) does not.

Glossary
- shape: how a row's user turn starts. "free" is pure Magpie (nothing); "lead", "puzzle"
  and "long" put a few words in the user's mouth (an opening verb, "A train", "My
  requirements:") to spread the requests over kinds a small model rarely starts by itself
  (math and reasoning above all). Paste shapes
  ("summarise", "extract", "fix", "reformat") start the user turn with real text
  (core.train.pastes: the model writes instructions well and pasted text badly) and an
  opener under it, and the model finishes the instruction line, having read the text;
  "ask-code" pastes code and lets the model write the rest of the turn.
- line batch / turn batch: a batch is all line shapes (generation stops at the end of the
  instruction line, <= 48 tokens) or all turn shapes (stops at the end of the user turn),
  and either all pasted or none.
- written: the part of a prompt the model wrote, with its opener; the filters and the
  duplicate check look at it (pasted text is allowed to recur under a new instruction).

Output: <work>/magpie.jsonl, one prompt record per kept prompt (core.train.data's format, so
`distill --prompt-file` answers it): {"id", "category", "turns", "shape", "written",
"source", "batch", "new_tokens"}; dropped ones go to magpie_rejected.jsonl with their reason.
Batch b samples with seed hash(seed, b); a rerun reads both files, continues at the next
batch and refuses what duplicates a kept prompt, so it never writes a prompt twice.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from core.config import SamplingConfig
from core.train.distill import generate_ids, prepare_tokenizer, read_records
from core.train.prompt_filter import CATEGORIES, DedupIndex, FilterConfig, categorize, reject_reason

SENTINEL = "\u2063MAGPIE\u2063"  # stands for the user's words while the template is rendered


@dataclass(frozen=True)
class Shape:
    name: str
    weight: float
    openers: tuple[str, ...] = ("",)
    paste: str = ""  # kind of text pasted at the start of the turn (core.train.pastes); "" for none
    line: bool = False  # the model writes one line (an instruction under the paste), not a whole turn
    category: str = ""  # forced category ("" = by keyword)


LEAD = ("Write", "Explain", "Can you", "How do I", "What is", "Why", "Give me", "Help me", "Create", "Compare",
        "I'm trying to", "Please", "Describe", "Tell me", "Suggest", "List", "What are", "Should I", "Translate",
        "Solve", "Calculate", "Imagine", "Pretend you are", "Act as", "Is it true that", "What would happen if",
        "Write a Python function", "Plan", "I'm learning", "Who was", "In what year", "What caused",
        "What was the role of")
PUZZLE = ("Solve for x:", "What is", "A train", "If a", "How many", "Riddle:", "Logic puzzle:", "Which is heavier",
          "Prove that", "What comes next in the sequence", "Calculate", "A farmer has", "Sarah is older than")
LONG = ("I need your help with a project.", "My situation:", "I have a few questions.",
        "I'd like you to do several things:", "My requirements:", "Context:", "I'm writing a",
        "My teacher gave us this assignment:", "I have a detailed task for you.")
SHAPES = (
    Shape("free", 0.50),
    Shape("lead", 0.15, LEAD),
    Shape("puzzle", 0.05, PUZZLE),  # math and reasoning: 2.8% and 0.2% of the first 528 prompts without it
    Shape("long", 0.05, LONG),
    Shape("ask-code", 0.04, ("Can you", "Why does", "What does", "How can I", "Explain", "Is there", "I get"),
          paste="code", category="coding"),
    Shape("summarise", 0.07, ("Summarize", "Can you summarize", "Give me a summary of", "Explain in simple words",
                              "What is the main point of", "Simplify"), paste="prose", line=True,
          category="extraction"),
    Shape("extract", 0.05, ("Extract", "List all", "Find", "Pull out", "Make a list of", "Identify"),
          paste="prose", line=True, category="extraction"),
    Shape("fix", 0.05, ("Fix", "Find the bug in", "This code doesn't work", "Debug", "Why does",
                        "What's wrong with", "Can you fix"), paste="code", line=True, category="coding"),
    Shape("reformat", 0.04, ("Reformat", "Sort", "Turn", "Convert", "Rewrite", "Organize", "Group"),
          paste="list", line=True, category="extraction"),
)


@dataclass(frozen=True)
class MagpieConfig:
    count: int = 20_000  # kept first-turn prompts wanted in the file, counting those already there
    batch_size: int = 64
    max_new_tokens: int = 192  # per user turn (~140 words; a turn still going there is mostly a loop)
    line_tokens: int = 48  # per instruction line (paste shapes)
    temperature: float = 1.0
    top_p: float = 0.99
    # an instruction under a paste; read by eye, at 1.0 about a third of 45 kept ones made no
    # sense of the text, at 0.7 about one in ten of 51
    line_temperature: float = 0.7
    seed: int = 0
    deadline: datetime | None = None  # stop starting new batches after this time (UTC)
    filters: FilterConfig = FilterConfig()
    shapes: tuple[Shape, ...] = SHAPES
    heldout_after: int = 2000  # carve the natural held-out set once this many prompts are kept
    heldout_count: int = 240

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.count < 0:
            raise ValueError("batch_size and max_new_tokens must be >= 1, count >= 0")

    def sampling(self, line: bool = False) -> SamplingConfig:
        return SamplingConfig(temperature=self.line_temperature if line else self.temperature, top_p=self.top_p)


def seeded(seed: int, key) -> torch.Generator:
    """The generator of one batch: its own seed from (run seed, batch key), so a rerun of the
    batch draws the same."""
    return torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:12], 16))


@dataclass(frozen=True)
class Row:
    """One generation slot of a batch: its shape, opener and paste, and the text fed after the prefix."""
    shape: Shape
    opener: str
    paste: object = None  # a core.train.pastes.Paste, or None

    def lead_in(self) -> str:
        return f"{self.paste.text}\n\n{self.opener}" if self.paste else self.opener


@dataclass
class Progress:
    """What the output files already hold: the next batch, kept prompts and the duplicate check."""
    next_batch: int = 0
    kept: list[dict] = field(default_factory=list)
    dedup: dict[str, DedupIndex] = field(default_factory=dict)  # per paste source ("" = no paste)


def user_turn_prefix(tokenizer, history: list[dict] | tuple = ()) -> str:
    """The templated conversation up to where the next user message's text begins
    (history, then the template's own system prompt if it adds one, then the user header)."""
    text = tokenizer.apply_chat_template(list(history) + [{"role": "user", "content": SENTINEL}], tokenize=False)
    if SENTINEL not in text:
        raise ValueError("the chat template does not render a user message's text verbatim")
    return text[:text.index(SENTINEL)]


def stop_ids(tokenizer, eos_ids, line: bool) -> set[int]:
    """End of turn (the eos ids and every special token, e.g. a new <|im_start|>); for an
    instruction line also every token holding a newline."""
    ids = set(eos_ids) | set(tokenizer.all_special_ids)
    if line:
        ids |= {i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])}
    return ids


def batch_rows(cfg: MagpieConfig, batch: int, pool: dict) -> list[Row]:
    """The rows of batch `batch`, drawn by weight from one group of shapes: line shapes, other
    pasted shapes, or unpasted ones (a batch stops at one kind of end, and a paste among
    unpasted rows would pad all of them to its length at the prefill)."""
    rng = random.Random(f"{cfg.seed}:{batch}")
    groups: dict[tuple[bool, bool], list[Shape]] = {}
    for s in cfg.shapes:
        if not s.paste or pool.get(s.paste):
            groups.setdefault((s.line, bool(s.paste)), []).append(s)
    keys = sorted(groups)
    kinds = groups[rng.choices(keys, weights=[sum(s.weight for s in groups[k]) for k in keys])[0]]
    rows = []
    for shape in rng.choices(kinds, weights=[s.weight for s in kinds], k=cfg.batch_size):
        paste = rng.choice(pool[shape.paste]) if shape.paste else None
        rows.append(Row(shape, rng.choice(shape.openers), paste))
    return rows


def written_text(tokenizer, row: Row, toks: list[int], stop: int | None) -> str:
    """The opener and what the model wrote after it; an instruction line ends at its newline."""
    if row.shape.line:
        text = row.opener + tokenizer.decode(toks + ([stop] if stop is not None else []), skip_special_tokens=True)
        return text.split("\n")[0].strip()
    return (row.opener + tokenizer.decode(toks, skip_special_tokens=True)).strip()


def prompt_text(row: Row, written: str) -> str:
    return f"{row.paste.text}\n\n{written}" if row.paste else written


def judge(row: Row, written: str, truncated: bool, progress: Progress, filters: FilterConfig) -> str | None:
    """Why this row's prompt is dropped, or None: the filters, then the duplicate check
    against kept prompts on the same paste (recording it as kept). Under a paste, one word
    ("Summarize:", "Debug:") is a whole instruction."""
    if row.paste:
        filters = replace(filters, min_words=1, min_chars=4)
    reason = reject_reason(written, truncated, filters)
    if reason:
        return reason
    index = progress.dedup.setdefault(row.paste.source if row.paste else "", DedupIndex(filters.near_jaccard))
    reason = index.reason(written)
    if reason is None:
        index.add(written)
    return reason


def read_progress(out_path: Path, rejected_path: Path, filters: FilterConfig) -> Progress:
    kept = [r for r in read_records(out_path) if "batch" in r]
    batches = [r["batch"] for r in kept + read_records(rejected_path) if "batch" in r]
    progress = Progress(next_batch=max(batches, default=-1) + 1, kept=kept)
    for r in kept:
        index = progress.dedup.setdefault(r.get("source", ""), DedupIndex(filters.near_jaccard))
        index.add(r["written"])
    return progress


def run_batch(target, cfg: MagpieConfig, rows: list[Row], batch: int, progress: Progress,
              stops: dict[bool, set[int]]) -> tuple[list, list]:
    """Generate one batch -> (kept records, rejected records). `stops`: stop ids for turn
    batches (False) and line batches (True)."""
    tok = target.tokenizer
    line = rows[0].shape.line
    prefix = user_turn_prefix(tok)
    outs = generate_ids(target.model, tok, [prefix + r.lead_in() for r in rows], stops[line],
                        cfg.line_tokens if line else cfg.max_new_tokens, cfg.sampling(line), seeded(cfg.seed, batch))
    kept, rejected = [], []
    for i, (row, (toks, stop)) in enumerate(zip(rows, outs)):
        written = written_text(tok, row, toks, stop)
        reason = judge(row, written, stop is None, progress, cfg.filters)
        rid = f"magpie-{cfg.seed}-{batch}-{i}"
        if reason:
            rejected.append({"id": rid, "batch": batch, "shape": row.shape.name, "reason": reason, "text": written})
            continue
        text = prompt_text(row, written)
        kept.append({"id": rid, "category": row.shape.category or categorize(text), "turns": [text],
                     "shape": row.shape.name, "written": written, "source": row.paste.source if row.paste else "",
                     "batch": batch, "new_tokens": len(toks)})
    return kept, rejected


def magpie(target, out_path: Path, cfg: MagpieConfig, heldout_path: Path | None = None,
           distilled_ids: set[str] = frozenset()) -> int:
    """Generate until `out_path` holds cfg.count prompts (or the deadline); returns how many
    were added. Once cfg.heldout_after are kept, carves the natural held-out set into
    `heldout_path` (if given and not yet there), leaving out prompts already distilled."""
    from core.train.pastes import paste_pool

    prepare_tokenizer(target.tokenizer)
    rejected_path = out_path.with_name(out_path.stem + "_rejected.jsonl")
    progress = read_progress(out_path, rejected_path, cfg.filters)
    start = len(progress.kept)
    print(f"magpie: {start} prompts kept so far, {max(0, cfg.count - start)} to go, from batch "
          f"{progress.next_batch} -> {out_path}", flush=True)
    pool = paste_pool(cfg.seed) if any(s.paste for s in cfg.shapes) else {}
    stops = {line: stop_ids(target.tokenizer, target.eos_ids, line) for line in (False, True)}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=cfg.count, initial=min(start, cfg.count), unit="prompt", desc="magpie")
    t0, reasons = time.time(), Counter()
    with open_append(out_path) as out, open_append(rejected_path) as rej:
        while len(progress.kept) < cfg.count:
            if cfg.deadline and datetime.now(timezone.utc) >= cfg.deadline:
                print(f"magpie: deadline {cfg.deadline:%H:%M} UTC reached, stopping", flush=True)
                break
            b = progress.next_batch
            kept, rejected = run_batch(target, cfg, batch_rows(cfg, b, pool), b, progress, stops)
            append(out, kept)
            append(rej, rejected)
            progress.kept += kept
            progress.next_batch += 1
            reasons.update(r["reason"] for r in rejected)
            bar.update(len(kept))
            added = len(progress.kept) - start
            bar.set_postfix(per_h=f"{added * 3600 / (time.time() - t0):.0f}", rejected=sum(reasons.values()))
            maybe_carve(progress.kept, cfg, heldout_path, distilled_ids)
    bar.close()
    maybe_carve(progress.kept, cfg, heldout_path, distilled_ids)
    print(f"magpie: kept {len(progress.kept) - start} new prompts; dropped {dict(reasons.most_common())}", flush=True)
    return len(progress.kept) - start


def open_append(path: Path):
    """`path` opened for appending records, after ending a torn last line (a run killed
    mid-write) so the next record starts on a line of its own."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, 2)
            torn = f.read(1) != b"\n"
        if torn:
            with open(path, "a", encoding="utf-8") as f:
                f.write("\n")
    return open(path, "a", encoding="utf-8")


def append(f, records: list[dict]) -> None:
    for r in records:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
    f.flush()


def maybe_carve(kept: list[dict], cfg: MagpieConfig, path: Path | None, distilled_ids) -> None:
    if path is not None and len(kept) >= cfg.heldout_after and not path.exists():
        carve_heldout(kept, path, cfg.heldout_count, cfg.seed, distilled_ids)


def carve_heldout(kept: list[dict], path: Path, n: int, seed: int, distilled_ids=frozenset()) -> list[dict]:
    """`n` prompts, taken round-robin over the categories (so each has a usable share) from
    those not yet distilled, written to `path` as prompt records; training leaves them out."""
    from core.train.data import write_jsonl

    rng = random.Random(seed)
    by_cat: dict[str, list[dict]] = {}
    for r in kept:
        if r["id"] not in distilled_ids:
            by_cat.setdefault(r["category"], []).append(r)
    for rows in by_cat.values():
        rng.shuffle(rows)
    picked = []
    while len(picked) < n and any(by_cat.values()):
        for cat in sorted(by_cat):
            if by_cat[cat] and len(picked) < n:
                picked.append(by_cat[cat].pop())
    write_jsonl(path, [{k: r[k] for k in ("id", "category", "turns", "shape")} for r in picked])
    print(f"magpie: {len(picked)} natural held-out prompts -> {path} "
          f"({dict(Counter(r['category'] for r in picked))})", flush=True)
    return picked


# ----------------------------------------------------------------------------- follow-ups

def followups(target, distilled: list[dict], out_path: Path, cfg: MagpieConfig, fraction: float) -> int:
    """Second user turns written by the target after its own answers: for `fraction` of the
    finished, distilled magpie conversations (chosen by id hash), a free user turn after the
    answer, filtered like first turns (no duplicate check: "Can you give an example?" is a
    fine follow-up to many answers). Written as prompt records with the history, answered by
    `distill --prompt-file <out_path>`. Returns how many were added."""
    tok = target.tokenizer
    prepare_tokenizer(tok)
    rejected_path = out_path.with_name(out_path.stem + "_rejected.jsonl")
    done = {r["id"] for r in read_records(out_path) + read_records(rejected_path) if "id" in r}
    todo = [r for r in distilled if wants_followup(r, fraction, cfg.seed) and f"{r['id']}-fu" not in done]
    stops = stop_ids(tok, target.eos_ids, line=False)
    print(f"magpie followups: {len(todo)} conversations to continue -> {out_path}", flush=True)
    added, bar = 0, tqdm(total=len(todo), unit="conv", desc="followups")
    with open_append(out_path) as out, open_append(rejected_path) as rej:
        for b in range(0, len(todo), cfg.batch_size):
            if cfg.deadline and datetime.now(timezone.utc) >= cfg.deadline:
                break
            batch = todo[b:b + cfg.batch_size]
            texts = [user_turn_prefix(tok, r["messages"]) for r in batch]
            outs = generate_ids(target.model, tok, texts, stops, cfg.max_new_tokens, cfg.sampling(),
                                seeded(cfg.seed, batch[0]["id"]))
            kept, rejected = [], []
            for r, (toks, stop) in zip(batch, outs):
                text = tok.decode(toks, skip_special_tokens=True).strip()
                reason = reject_reason(text, stop is None, cfg.filters)
                rid = f"{r['id']}-fu"
                if reason:
                    rejected.append({"id": rid, "shape": "followup", "reason": reason, "text": text})
                else:
                    kept.append({"id": rid, "category": r.get("category", "general"), "turns": [text],
                                 "history": r["messages"], "shape": "followup", "new_tokens": len(toks)})
            append(out, kept)
            append(rej, rejected)
            added += len(kept)
            bar.update(len(batch))
    bar.close()
    return added


def wants_followup(record: dict, fraction: float, seed: int) -> bool:
    rid = str(record.get("id", ""))
    if not rid.startswith("magpie-") or rid.endswith("-fu") or record.get("truncated"):
        return False
    if len(record.get("messages") or []) != 2:
        return False
    return int(hashlib.sha256(f"{seed}:fu:{rid}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction


# ----------------------------------------------------------------------------- stats

def stats_table(kept: list[dict], rejected: list[dict]) -> str:
    """Markdown tables: prompts per category (share, mean words, shapes), and drop reasons."""
    n = max(1, len(kept))
    lines = ["| category | prompts | share | mean words | shapes |", "|---|---|---|---|---|"]
    by_cat = Counter(r["category"] for r in kept)
    for cat in [c for c in CATEGORIES if c in by_cat] + sorted(set(by_cat) - set(CATEGORIES)):
        rows = [r for r in kept if r["category"] == cat]
        words = sum(len(r["turns"][0].split()) for r in rows) / len(rows)
        shapes = ", ".join(f"{s} {k}" for s, k in Counter(r.get("shape", "?") for r in rows).most_common())
        lines.append(f"| {cat} | {len(rows)} | {len(rows) / n:.1%} | {words:.0f} | {shapes} |")
    lines.append(f"| all | {len(kept)} | 100% | | |")
    total = len(kept) + len(rejected)
    lines += ["", f"dropped {len(rejected)} of {total} generated ({len(rejected) / max(1, total):.0%}):",
              "| reason | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in Counter(r.get("reason", "?") for r in rejected).most_common()]
    return "\n".join(lines)

"""Evaluation of a trained head with the real engine on held-out prompts.

tau = accepted tokens per target forward in speculative steps (the bonus token included),
so plain decoding has tau = 1. Engine acceptance at depth d = the fraction of steps whose
accepted draft path reached depth d; conditional acceptance at depth d (the EAGLE paper's
"d-alpha" in the engine, the tree's alternatives counted) = the fraction of steps that reached
depth d among those that reached depth d - 1. Draft top-1/top-3 per depth on held-out *features*
(teacher-forced tokens, the head's own features) comes from trainer.evaluate_features.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from core.config import GenerationConfig
from core.train.data import Prompt


@dataclass(frozen=True)
class PromptResult:
    id: str
    category: str
    tokens: int  # tokens produced in speculative steps (the prefill's first token excluded)
    forwards: int  # target forwards in speculative steps
    accepted_draft: tuple[int, ...]  # draft tokens accepted per step
    seconds: float

    @property
    def tau(self) -> float:
        return self.tokens / max(self.forwards, 1)


@dataclass(frozen=True)
class CategoryReport:
    category: str
    prompts: int
    tau: float  # pooled over the category's steps
    accept_at_depth: tuple[float, ...]  # P(accepted draft path length >= d), d = 1..
    tokens_per_s: float

    @property
    def conditional_acceptance(self) -> tuple[float, ...]:
        """P(path reaches depth d | it reached depth d - 1), d = 2.. (0 where none reached d - 1)."""
        a = self.accept_at_depth
        return tuple(a[d] / a[d - 1] if a[d - 1] else 0.0 for d in range(1, len(a)))


def run_prompt(engine, prompt: Prompt, config: GenerationConfig) -> PromptResult:
    """One held-out prompt's first turn through the engine; counts speculative steps only."""
    tokens = forwards = 0
    accepted: list[int] = []
    t0 = time.perf_counter()
    for ev in engine.generate([{"role": "user", "content": prompt.turns[0]}], config):
        if ev.tree_size > 0:
            tokens += len(ev.token_ids)
            forwards += 1
            accepted.append(ev.draft_tokens)
    return PromptResult(prompt.id, prompt.category, tokens, forwards, tuple(accepted),
                        time.perf_counter() - t0)


def summarize(results: list[PromptResult], max_depth: int) -> list[CategoryReport]:
    """Per category, plus an 'all' row pooling every step."""
    groups: dict[str, list[PromptResult]] = {}
    for r in results:
        groups.setdefault(r.category, []).append(r)
    groups["all"] = results
    out = []
    for cat, rs in groups.items():
        steps = [a for r in rs for a in r.accepted_draft]
        tokens, fwd = sum(r.tokens for r in rs), sum(r.forwards for r in rs)
        depth = tuple(sum(a >= d for a in steps) / max(len(steps), 1) for d in range(1, max_depth + 1))
        secs = sum(r.seconds for r in rs)
        out.append(CategoryReport(cat, len(rs), tokens / max(fwd, 1), depth, tokens / max(secs, 1e-9)))
    return out


def evaluate_engine(engine, prompts: list[Prompt], config: GenerationConfig,
                    log: Path | None = None) -> list[PromptResult]:
    """Run every prompt; with `log`, each result is appended as a JSON line as it finishes
    and prompts already in the log are not rerun (a rerun resumes)."""
    done = _read_log(log) if log else {}
    results = [done[p.id] for p in prompts if p.id in done]
    bar = tqdm(prompts, unit="prompt", desc="eval", initial=len(results))
    for p in (p for p in prompts if p.id not in done):
        r = run_prompt(engine, p, config)
        results.append(r)
        if log:
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(r)) + "\n")
        pooled = sum(x.tokens for x in results) / max(sum(x.forwards for x in results), 1)
        bar.update(1)
        bar.set_postfix(tau=f"{pooled:.2f}")
    bar.close()
    return results


def _read_log(log: Path) -> dict[str, PromptResult]:
    out = {}
    if log.is_file():
        for line in log.read_text(encoding="utf-8").splitlines():
            try:
                d = json.loads(line)
                out[d["id"]] = PromptResult(**{**d, "accepted_draft": tuple(d["accepted_draft"])})
            except (ValueError, KeyError, TypeError):
                continue
    return out


def pick_prompts(prompts: list[Prompt], per_category: int) -> list[Prompt]:
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        if seen.get(p.category, 0) < per_category:
            seen[p.category] = seen.get(p.category, 0) + 1
            out.append(p)
    return out


def format_table(reports: list[CategoryReport]) -> str:
    depth = len(reports[0].accept_at_depth) if reports else 0
    head = ("| category | prompts | tau | tok/s | " + " | ".join(f"acc@{d + 1}" for d in range(depth))
            + "".join(f" | acc@{d + 1} given {d}" for d in range(1, depth)) + " |")
    sep = "|" + "---|" * (4 + depth + max(depth - 1, 0))
    rows = [f"| {r.category} | {r.prompts} | {r.tau:.2f} | {r.tokens_per_s:.1f} | "
            + " | ".join(f"{a:.2f}" for a in r.accept_at_depth)
            + "".join(f" | {a:.2f}" for a in r.conditional_acceptance) + " |" for r in reports]
    return "\n".join([head, sep, *rows])

"""Many answers at once: every answer a branch of one KV cache, one native forward a step for all.

Answering training prompts one at a time (the distiller), each step streams the whole model's
weights for a single row. Here every live answer is a branch of one cache: its prompt's rows (read
by the engine's own prefill, alone, then copied in) and then one row per generated token. A step
feeds one row of every live branch to the native step (core.kernels.step) with no shared prefix
(committed 0) and the branch's own slots as that row's ancestors, so each row sees exactly its own
answer's keys, in its own order. The kernels are batch-invariant (a row computes the same bits
alone, in a draft tree, or beside other branches), so every answer is token for token the engine's
plain decoding of the same prompt, greedy or sampled with the same seed (a sampled token is a
function of the seed and its position: core.decoding.gumbel). tests/test_batched.py checks both.

A finished branch leaves its slots behind; when the cache would pass `max_slots`, the live
branches' rows move to its front (cache.keep), so memory stays bounded however many prompts run
(by max_slots, or by what the live answers themselves hold where that is more).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from core.config import SamplingConfig
from core.decoding import cache as kv
from core.decoding.forward import prefill
from core.decoding.verify import plain_choice


@dataclass(frozen=True)
class Request:
    """One answer to write: its prompt (chat template applied) and how to choose its tokens."""

    ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.ids or self.max_new_tokens < 1:
            raise ValueError("a request needs at least one prompt token and max_new_tokens >= 1")


@dataclass(frozen=True)
class Answer:
    index: int                # the request's position in the input
    tokens: tuple[int, ...]   # the generated ids, the stop token included where it stopped on one
    finish_reason: str        # "eos", "length" (max_new_tokens) or "context" (the model's window)


@dataclass
class _Branch:  # a live answer: where its rows are in the cache and what it wrote so far
    index: int
    request: Request
    slots: list[int]
    tokens: list[int]
    budget: int
    cut: str  # the finish reason when the budget runs out

    @property
    def position(self) -> int:  # of the last token written, the one the next row feeds
        return len(self.request.ids) + len(self.tokens) - 1


def answer_budget(max_new_tokens: int, room: int) -> tuple[int, str]:
    """(the tokens an answer may write, the finish reason when it writes them all): max_new_tokens, or the
    `room` the context leaves after the prompt where that is less (the engine's rule too)."""
    return min(max_new_tokens, room), "length" if max_new_tokens <= room else "context"


def answers(engine, requests: Iterable[Request], rows: int = 32, max_slots: int = 16384,
            on_step: Callable[[list[int], torch.Tensor], None] | None = None) -> Iterator[Answer]:
    """Answer `requests` (read as room frees up, so a generator may stop supplying them, e.g. at a
    deadline), up to `rows` at a time; yields each Answer as it finishes, not in order. on_step: called
    after every forward with the requests' indices and their rows' final hidden states (n, H), the LM
    head's inputs (core.kernels.screen fits on them). ValueError where the engine has no native step or
    a request cannot fit in max_slots."""
    if engine.step is None:
        raise ValueError("batched answers need the native decode step (a Llama-family target on a CPU with "
                         "AVX-512); use the engine one answer at a time instead")
    return branches(engine.step, set(engine.target.eos_ids), engine.max_context, requests, rows, max_slots, on_step)


def branches(step, eos: set[int], max_context: int, requests: Iterable[Request], rows: int = 32,
             max_slots: int = 16384, on_step: Callable[[list[int], torch.Tensor], None] | None = None
             ) -> Iterator[Answer]:
    """answers() on a native step (core.kernels.step.NativeStep) alone: its stop tokens and context."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    cache, live, waiting = None, [], enumerate(requests)
    while True:
        while len(live) < rows and (item := next(waiting, None)) is not None:
            index, request = item
            n = len(request.ids)
            if n >= max_context:
                raise ValueError(f"request {index}: its {n} prompt tokens leave no room in the model's context of "
                                 f"{max_context} tokens; shorten the prompt")
            if n + answer_budget(request.max_new_tokens, max_context - n)[0] > max_slots:
                raise ValueError(f"request {index}: {n} prompt tokens plus its answer do not fit in "
                                 f"max_slots={max_slots}; raise max_slots")
            if cache is not None and kv.cache_length(cache) + n > max_slots:
                compact(cache, live)
            cache, branch = admit(step, max_context, cache, index, request)
            live.append(branch)
        if not live:
            return
        for b in [b for b in live if _finish(b, eos)]:
            live.remove(b)
            yield Answer(b.index, tuple(b.tokens), "eos" if b.tokens[-1] in eos else b.cut)
        if live:
            if kv.cache_length(cache) + len(live) > max_slots:
                compact(cache, live)
            hidden = step_branches(step, cache, live)
            if on_step is not None:
                on_step([b.index for b in live], hidden)


def admit(step, max_context: int, cache, index: int, request: Request):
    """A request's prompt read by the engine's prefill alone (the engine's bits), its rows appended to
    `cache` (None: its own cache becomes the batch's) -> (the cache, the request's branch, holding its
    first token, chosen from the prefill's logits as the engine's first step chooses it)."""
    own = kv.new_cache(step)
    n = len(request.ids)
    _, logits = prefill(step, torch.tensor(request.ids), own)  # (V,) after the prompt's last token
    at = 0 if cache is None else kv.cache_length(cache)
    if cache is None:
        cache = own
    else:
        kv.append_rows(cache, own, n)
    budget, cut = answer_budget(request.max_new_tokens, max_context - n)
    first = plain_choice(logits, n, request.sampling, request.seed)
    return cache, _Branch(index, request, list(range(at, at + n)), [first], budget, cut)


def step_branches(step, cache, live: list[_Branch]) -> torch.Tensor:
    """One native forward: the last token of every live branch, each row seeing its own branch;
    appends each branch's next token and its new slot. Returns the rows' final hidden states (n, H)."""
    at, n = kv.cache_length(cache), len(live)
    width = max(len(b.slots) for b in live) + 1
    anc = torch.zeros(n, width, dtype=torch.int64)  # (n, width): row i's keys, its branch's slots then itself
    for i, b in enumerate(live):
        anc[i, :len(b.slots)] = torch.tensor(b.slots)
        anc[i, len(b.slots)] = at + i
    counts = torch.tensor([len(b.slots) + 1 for b in live])  # (n,)
    tokens = torch.tensor([b.tokens[-1] for b in live])  # (n,)
    positions = torch.tensor([b.position for b in live])  # (n,)
    greedy = all(b.request.sampling.greedy for b in live)
    choices = torch.empty(n, dtype=torch.int64)
    hidden, logits = step.forward(tokens, positions, 0, anc, counts, cache, only_max=greedy, choices=choices, at=at)
    picked = choices.tolist() if greedy else None
    for i, b in enumerate(live):
        b.slots.append(at + i)
        b.tokens.append(picked[i] if greedy else plain_choice(logits[i], b.position + 1, b.request.sampling,
                                                               b.request.seed))
    return hidden


def compact(cache, live: list[_Branch]) -> None:
    """Move the live branches' rows to the front of the cache, in order, and renumber their slots."""
    kept = [s for b in live for s in b.slots]
    kv.keep(cache, 0, kept)
    at = 0
    for b in live:
        b.slots = list(range(at, at + len(b.slots)))
        at += len(b.slots)


def _finish(b: _Branch, eos: set[int]) -> bool:
    return b.tokens[-1] in eos or len(b.tokens) >= b.budget


@torch.inference_mode()
def calibration_hidden(step, target) -> np.ndarray:
    """The final hidden states (the LM head's input) of the model's own greedy answers to the LM-head screen's
    CALIBRATION prompts (up to TOKENS rows each; core.kernels.screen), through the native step: (rows, K), prompt
    by prompt. target: the loaded model (core.models.LoadedModel: its chat template, stop tokens and context). The
    answers are written side by side, so a large model's weights stream TOKENS times, not once a token of every
    answer (an 8B-shaped file's first load spent 3.7 minutes on them one at a time)."""
    from tqdm import tqdm

    from core.kernels import screen

    requests = [Request(tuple(target.chat_ids([{"role": "user", "content": prompt}])), screen.TOKENS + 1)
                for prompt in screen.CALIBRATION]  # each answer's first token, then TOKENS rows
    rows: list[list[np.ndarray]] = [[] for _ in requests]
    with tqdm(total=screen.TOKENS, desc="Fitting the LM-head screen (once per model file)", unit="step",
              leave=False) as bar:
        def keep(indices: list[int], hidden: torch.Tensor) -> None:  # hidden: valid until the next forward
            for i, h in zip(indices, hidden.float().numpy()):
                rows[i].append(h.copy())
            bar.update(1)

        for _ in branches(step, set(target.eos_ids), target.max_context, requests, rows=len(requests), on_step=keep):
            pass
    return np.stack([h for answer in rows for h in answer])

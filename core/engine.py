"""The decode loop: prefill, then steps of (draft -> verify -> commit), yielding StepEvents.

One step in speculative mode:
  draft    the head extends the root (last accepted token) into a DraftTree   (core.tree)
  verify   the target runs root + tree in ONE forward with a 4D tree mask      (forward_tree)
  accept   greedy or sampled acceptance picks a path + bonus token             (core.verify)
  commit   the target cache keeps only the path; the head catches up on the
           path's true target features, giving the next root's proposal        (core.cache, catch_up)
Plain mode is the same loop with no draft: each step verifies just the root.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from core import cache as kv
from core.config import GenerationConfig, TreeConfig
from core.head import EagleHead, HeadCache, HeadLoadError, additive, load_head
from core.models import DEFAULT_HEAD_DIR, EMBEDDED, LoadedModel, catalogue_entry, load_target, resolve
from core.tree import DraftTree, Drafter, catch_up, draft
from core.verify import Verification, sample, target_probs, verify_greedy, verify_sampled


class EngineError(ValueError):
    """Bad input to the engine (empty prompt, too long for the context, ...)."""


@dataclass(frozen=True)
class StepEvent:
    token_ids: tuple[int, ...]     # tokens accepted this step, in order
    draft_tokens: int              # the first `draft_tokens` came from the draft; the rest is the bonus
    text: str                      # text delta to append to the answer
    token_texts: tuple[str, ...]   # per-token pieces of `text`, aligned with token_ids
    tree_size: int                 # nodes verified this step incl. root (0: plain or prefill)
    draft_s: float
    verify_s: float
    other_s: float
    finished: bool
    finish_reason: str | None      # "eos" | "stop" | "length" | "context" | None
    total_tokens: int              # running totals over this answer
    target_forwards: int
    elapsed_s: float

    @property
    def accepted_length(self) -> int:
        return len(self.token_ids)


def forward_tree(model, tree: DraftTree, cache, committed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the tree's n nodes -> (features (n, H), logits (n, V)).

    Each node sees the committed context and its own ancestors; its position is the
    context length plus its depth. The forward appends n entries to `cache`.
    """
    device = tree.tokens.device
    allowed = torch.cat([torch.ones(tree.size, committed, dtype=torch.bool, device=device), tree.mask], 1)
    dtype = model.get_input_embeddings().weight.dtype
    out = model.model(input_ids=tree.tokens[None], attention_mask=additive(allowed, dtype),
                      position_ids=tree.positions(committed)[None], cache=cache, use_cache=True)
    features = out.last_hidden_state[0]  # (n, H)
    return features, model.lm_head(features)


def prefill(model, ids: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids (T,) -> (features (T, H), logits of the last position (V,))."""
    out = model.model(input_ids=ids[None], cache=cache, use_cache=True)
    features = out.last_hidden_state[0]
    return features, model.lm_head(features[-1:])[0]


def default_head(model: str) -> str | None:
    if model == EMBEDDED:
        return str(DEFAULT_HEAD_DIR) if DEFAULT_HEAD_DIR.is_dir() else None
    entry = catalogue_entry(model)
    return entry.head if entry else None


class _Detokenizer:
    """Incremental, UTF-8 safe text from token ids; a piece is held back while incomplete."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return ""
        piece, self.text = full[len(self.text):], full
        return piece


class Engine:
    def __init__(self, target: LoadedModel, head: EagleHead | None = None,
                 draft_vocab: torch.Tensor | None = None):
        self.target = target
        self.head = head
        self.default_tree = TreeConfig()  # Engine.load replaces it with the tuned tree, if cached
        model = target.model
        self.drafter = None
        if head is not None:
            weight = model.lm_head.weight
            lm_weight = weight if draft_vocab is None else weight[draft_vocab].clone()
            self.drafter = Drafter(head=head, embed=model.get_input_embeddings(),
                                   lm_weight=lm_weight.to(target.dtype), vocab=draft_vocab)

    @classmethod
    def load(cls, model: str = EMBEDDED, head: str | None = "default", *, dtype="float32",
             device: str = "cpu", load_in_4bit: bool = False) -> "Engine":
        """Load a target and its head. head="default": the shipped head for the embedded
        model, the catalogue's head for a catalogue target, else none (plain decoding only)."""
        target = load_target(model, dtype=dtype, device=device, load_in_4bit=load_in_4bit)
        if head == "default":
            head = default_head(model)
        if head is None:
            return cls(target)
        folder = Path(head).expanduser() if Path(head).expanduser().exists() else resolve(
            head, allow_patterns=["config.json", "*.safetensors", "pytorch_model.bin"])
        module, vocab = load_head(folder, target.model.config, dtype=target.dtype, device=device)
        engine = cls(target, module, vocab)
        from core.autotune import cached_tree, shipped_tree  # autotune builds on the engine

        engine.default_tree = cached_tree(engine) or shipped_tree(folder) or engine.default_tree
        return engine

    @property
    def has_head(self) -> bool:
        return self.drafter is not None

    @property
    def max_context(self) -> int:
        return self.target.max_context

    def encode(self, prompt: str | Sequence[dict] | Sequence[int]) -> list[int]:
        """Chat messages (tokenizer's chat template), a user message string, or token ids."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise EngineError("the prompt is empty: type a message first")
            prompt = [{"role": "user", "content": prompt}]
        if len(prompt) == 0:
            raise EngineError("the prompt is empty: type a message first")
        if isinstance(prompt[0], dict):
            if not any(str(m.get("content", "")).strip() for m in prompt):
                raise EngineError("the prompt is empty: type a message first")
            enc = self.target.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
            ids = enc["input_ids"] if hasattr(enc, "keys") else enc
            return list(ids)
        return [int(t) for t in prompt]

    def count_tokens(self, messages: Sequence[dict]) -> int:
        return len(self.encode(messages))

    def generate(self, prompt, config: GenerationConfig, on_step=None) -> Iterator[StepEvent]:
        """Stream the answer as StepEvents; closing the generator stops within one step.

        `on_step(tree, verification)`, if given, sees every speculative step (statistics).
        """
        ids = self.encode(prompt)
        if len(ids) >= self.max_context:
            raise EngineError(f"the prompt is {len(ids)} tokens but the model's context is "
                              f"{self.max_context}; shorten it or start a new chat")
        vocab = self.target.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise EngineError(f"token ids must be in 0..{vocab - 1}")
        if config.speculative and not self.has_head:
            raise EngineError("speculation needs a draft head: load one (--head) or turn speculation off")
        with torch.inference_mode():
            yield from _Run(self, ids, config, on_step).events()


class _Run:
    """State of one answer: caches, counters and the stop rules."""

    def __init__(self, engine: Engine, ids: list[int], config: GenerationConfig, on_step=None):
        self.e, self.cfg, self.on_step = engine, config, on_step
        self.model, self.device = engine.target.model, engine.target.device
        self.ids = torch.tensor(ids, device=self.device)
        self.cache = kv.new_cache(self.model)
        self.head_cache = (HeadCache(engine.head.config, engine.target.dtype, self.device)
                           if config.speculative else None)
        seed = config.seed if config.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.budget = min(config.max_new_tokens, engine.max_context - len(ids))
        self.budget_reason = "length" if config.max_new_tokens <= engine.max_context - len(ids) else "context"
        self.detok = _Detokenizer(engine.target.tokenizer)
        self.eos = set(engine.target.eos_ids)
        self.n_out = self.forwards = 0
        self._draft_carry = 0.0  # head catch-up time, reported with the next step's draft
        self.start = time.perf_counter()

    def choose(self, logits: torch.Tensor) -> int:
        """Plain decoding's choice from (V,) logits."""
        s = self.cfg.sampling
        return int(logits.argmax()) if s.greedy else sample(target_probs(logits[None], s)[0], self.gen)

    def events(self) -> Iterator[StepEvent]:
        t0 = time.perf_counter()
        features, logits = prefill(self.model, self.ids, self.cache)
        token = self.choose(logits)
        self.forwards += 1
        t1 = time.perf_counter()
        event = self.emit([token], 0, 0, 0.0, t1 - t0, t0)
        yield event
        root_hidden = None
        if self.cfg.speculative and not event.finished:
            t = time.perf_counter()
            root_hidden = catch_up(self.e.drafter, self.head_cache,
                                   torch.cat([self.ids[1:], torch.tensor([token], device=self.device)]), features)
            self._draft_carry = time.perf_counter() - t
        while not event.finished:
            if self.cfg.speculative and self.fits_tree():
                event, token, root_hidden = self.spec_step(token, root_hidden)
            else:
                event, token = self.plain_step(token)
                if self.cfg.speculative and not event.finished:  # near the context end: stay plain
                    self.cfg = replace(self.cfg, speculative=False)
            yield event

    def fits_tree(self) -> bool:
        return kv.cache_length(self.cache) + self.cfg.tree.depth + 1 < self.e.max_context

    def plain_step(self, token: int) -> tuple[StepEvent, int]:
        t0 = time.perf_counter()
        committed = kv.cache_length(self.cache)
        out = self.model.model(input_ids=torch.tensor([[token]], device=self.device),
                               position_ids=torch.tensor([[committed]], device=self.device),
                               cache=self.cache, use_cache=True)
        logits = self.model.lm_head(out.last_hidden_state[0, -1])
        t1 = time.perf_counter()
        new = self.choose(logits)
        self.forwards += 1
        return self.emit([new], 0, 0, 0.0, t1 - t0, t0), new

    def spec_step(self, root: int, root_hidden: torch.Tensor) -> tuple[StepEvent, int, torch.Tensor | None]:
        t0 = time.perf_counter()
        tree = draft(self.e.drafter, self.head_cache, root, root_hidden, self.cfg.tree)
        t1 = time.perf_counter()
        committed = kv.cache_length(self.cache)
        features, logits = forward_tree(self.model, tree, self.cache, committed)
        t2 = time.perf_counter()
        s = self.cfg.sampling
        result: Verification = (verify_greedy(tree, logits) if s.greedy
                                else verify_sampled(tree, target_probs(logits, s), self.gen))
        if self.on_step is not None:
            self.on_step(tree, result)
        path = torch.tensor(result.path, device=self.device)
        kv.keep(self.cache, committed, path)
        self.forwards += 1
        carry = self._draft_carry  # spent before t0, so the step starts that much earlier
        event = self.emit(list(result.tokens), result.accepted, tree.size, (t1 - t0) + carry, t2 - t1, t0 - carry)
        next_hidden = None
        if not event.finished:  # the head catches up only when another step follows
            t3 = time.perf_counter()
            next_hidden = catch_up(self.e.drafter, self.head_cache,
                                   torch.tensor(result.tokens, device=self.device), features[path])
            self._draft_carry = time.perf_counter() - t3  # reported with the next step's draft
        return event, result.bonus, next_hidden

    def emit(self, tokens: list[int], n_draft: int, tree_size: int, draft_s: float, verify_s: float,
             t_start: float) -> StepEvent:
        """Apply the stop rules to this step's tokens and build its event."""
        kept, pieces, reason = [], [], None
        for tok in tokens:
            kept.append(tok)
            pieces.append(self.detok.push(tok))
            self.n_out += 1
            if tok in self.eos:
                reason = "eos"
            elif self.stop_hit():
                reason = "stop"
            elif self.n_out >= self.budget:
                reason = self.budget_reason
            if reason:
                break
        if reason == "stop":
            pieces = self.cut_stop(pieces)
        now = time.perf_counter()
        return StepEvent(token_ids=tuple(kept), draft_tokens=min(n_draft, len(kept)), text="".join(pieces),
                         token_texts=tuple(pieces), tree_size=tree_size, draft_s=draft_s, verify_s=verify_s,
                         other_s=max(0.0, now - t_start - draft_s - verify_s), finished=reason is not None,
                         finish_reason=reason, total_tokens=self.n_out, target_forwards=self.forwards,
                         elapsed_s=now - self.start)

    def stop_hit(self) -> bool:
        tail = self.detok.text[-(max((len(s) for s in self.cfg.stop_strings), default=0) + 64):]
        return any(s in tail for s in self.cfg.stop_strings)

    def cut_stop(self, pieces: list[str]) -> list[str]:
        """Drop the stop string (and anything after it) from this step's text pieces."""
        text = self.detok.text
        cut = min(i for i in (text.find(s) for s in self.cfg.stop_strings) if i >= 0)
        shown_before = len(text) - sum(len(p) for p in pieces)
        out, pos = [], shown_before
        for p in pieces:
            keep_len = max(0, min(len(p), cut - pos))
            out.append(p[:keep_len])
            pos += len(p)
        return out

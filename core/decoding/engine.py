"""The engine: a target and its drafter behind one facade (Engine), and the decode loop: prefill,
then steps of (draft -> verify -> commit), yielding StepEvents.

One step in speculative mode:
  draft    the head extends the root (last accepted token) into a DraftTree   (core.decoding.tree)
  verify   the target runs root + tree in ONE forward                         (core.decoding.forward)
  accept   greedy or sampled acceptance picks a path + bonus token             (core.decoding.verify)
  commit   the target cache keeps only the path; the head catches up on the
           path's true target features, giving the next root's proposal        (core.decoding.cache, catch_up)
Plain mode is the same loop with no draft: each step verifies just the root.

Numerics: with the batch-invariant kernels (core.kernels.invariant, bf16 on CPU) a tree row computes
bit for bit what a plain step computes, so greedy output equals plain decoding by
construction, and sampled output equals plain sampling with the same seed (its draws are a
function of the seed and the position: core.decoding.gumbel); `Engine.numerics` says which numerics run and what the probe found (core.decoding.numerics).
The drafter is any core.decoding.drafter.DraftModel: the loop asks nothing else of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from core.decoding import adaptive, cache as kv, prefix, rowcost
from core.decoding.batched import answer_budget
from core import threads
from core.clock import now
from core.config import EngineError, GenerationConfig, TreeConfig, new_seed
from core.decoding.drafter import DraftModel
from core.decoding.forward import (StopReading, forward_tree, forward_tree_greedy, plain_forward,
                                   plain_forward_greedy, prefill, spec_step_greedy, uses_exact_kernels)
from core.decoding.head import HeadCache, HeadLoadError
from core.decoding.head3 import drafter_for, load_any_head
from core.decoding.lookup import ContextIndex, default_tokens, graft
from core.models import DEFAULT_HEAD_DIR, EMBEDDED, LoadedModel, catalogue_entry, names_gguf, resolve
from core.decoding.numerics import Numerics, load_numerics
from core.kernels import native
from core.kernels.step import NativeStep
from core.decoding.text import TextStream
from core.decoding.gumbel import DraftNoise
from core.decoding.tree import DraftTree, catch_up, catch_up_top, draft
from core.decoding.treestore import BUILT_IN, TreeChoice, default_tree
from core.decoding.verify import Verification, accept_greedy, plain_choice, verify_sampled


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


LOOKUP_ALONE = "context lookup alone: this model has no EAGLE head"


def lookup_alone(step: NativeStep | None) -> TreeChoice:
    """The tree of an engine without a head: no head tree, a lookup chain as long as rows of this step pay for."""
    int8 = step is not None and step.info.activations == "int8"
    return TreeChoice(TreeConfig(lookup=default_tokens(int8, native.gemm_kind())), LOOKUP_ALONE)


def default_head(model: str) -> str | None:
    if model == EMBEDDED:
        return str(DEFAULT_HEAD_DIR) if DEFAULT_HEAD_DIR.is_dir() else None
    entry = catalogue_entry(model)
    return entry.head if entry else None


class Engine:
    def __init__(self, target: LoadedModel, head=None, draft_vocab: torch.Tensor | None = None,
                 numerics: Numerics | None = None, drafter: DraftModel | None = None,
                 step: NativeStep | None = None):
        """`drafter`: one already built for `head` (Engine.load), else it is built here. `step`:
        the native decode step for the target (core.kernels.step), else transformers' forward serves."""
        self.target = target
        self.step = step
        self.head = head
        if drafter is None and head is not None:
            drafter = drafter_for(head, target.model, draft_vocab)
        assert drafter is None or drafter.head is head, "the drafter must drive the engine's head"
        self.drafter = drafter
        self.numerics = numerics or Numerics(str(target.dtype).removeprefix("torch."),
                                             "exact" if uses_exact_kernels(target.model) else
                                             target.model.config._attn_implementation, None)
        # Engine.load: tuned / shipped; without a head, speculation copies from the context alone
        self.tree_choice = TreeChoice(TreeConfig(), BUILT_IN) if drafter is not None else lookup_alone(step)
        self.prefix: prefix.Prefix | None = None  # the last prompt's rows (read_prompt)
        self.row_costs = rowcost.RowCosts()  # measured by greedy steps of trees with row_floor

    @classmethod
    def load(cls, model: str = EMBEDDED, head: str | None = "default", *, dtype: str = "auto",
             attention: str = "auto", device: str = "cpu", load_in_4bit: bool = False,
             weights: str = "auto") -> "Engine":
        """Load a target and its head. head="default": the shipped head for the embedded
        model, the catalogue's head for a catalogue target, else none (plain decoding only).
        weights: what the native step reads (core.kernels.step.WEIGHTS). The probe runs with or without a
        head (once per machine, cached): a plain run must pick the numerics a speculative run
        picks, or `--plain` and the default could answer in different numerics (the clean-clone
        CI saw two texts when a failed probe had sent only the speculative run to fp32)."""
        if head == "default":
            head = default_head(model)
        if head is not None and names_gguf(head):  # refused before the target loads
            raise HeadLoadError(f"{head} names a GGUF model file; an EAGLE head is a folder or a hub repo (its "
                                "config.json and weights), given with --head or the Models tab's head field")
        target, numerics, step = load_numerics(model, dtype=dtype, attention=attention, device=device,
                                               load_in_4bit=load_in_4bit, check=True, weights=weights)
        if head is None:
            return cls(target, numerics=numerics, step=step)
        folder = Path(head).expanduser() if Path(head).expanduser().exists() else resolve(
            head, allow_patterns=["config.json", "*.safetensors", "pytorch_model.bin"])
        drafter = load_any_head(folder, target.model, dtype=target.dtype, device=device)
        engine = cls(target, drafter.head, drafter.vocab, numerics, drafter=drafter, step=step)
        engine.tree_choice = default_tree(engine, folder)
        return engine

    def read_prompt(self, ids: torch.Tensor, cache, feature_layers=None, reuse: bool = True,
                    should_stop=None) -> tuple[torch.Tensor, torch.Tensor]:
        """prefill, from the rows of the last prompt read where this one begins with its tokens
        (core.decoding.prefix: the same bits as reading it all; `reuse` False: from its start), and its
        rows kept for the next (not where `should_stop` ended the reading: StopReading)."""
        listed = ids.tolist()
        kept = self.prefix
        rows = prefix.reusable(kept, listed, feature_layers) if reuse else 0
        before = prefix.restore(kept, rows, cache) if rows else None
        features, logits = prefill(self.forwarder, ids[rows:], cache, feature_layers, should_stop)
        if before is not None:
            features = torch.cat([before, features])
        self.prefix = prefix.keep(listed, cache, features, feature_layers, kept)
        return features, logits

    @property
    def forwarder(self):
        """What runs the target's forwards: the native step, else the transformers model."""
        return self.step or self.target.model

    @property
    def default_tree(self) -> TreeConfig:
        return self.tree_choice.tree

    @property
    def tree_origin(self) -> str:
        return self.tree_choice.origin

    @property
    def has_head(self) -> bool:
        return self.drafter is not None

    @property
    def max_context(self) -> int:
        return self.target.max_context

    def encode(self, prompt: str | Sequence[dict] | Sequence[int], *, continue_final: bool = False) -> list[int]:
        """Chat messages (tokenizer's chat template), a user message string, or token ids.
        `continue_final`: the messages end with a partial assistant message, which the answer
        continues (the template's end of that turn left out) instead of starting a new turn."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise EngineError("the prompt is empty: type a message first")
            prompt = [{"role": "user", "content": prompt}]
        if len(prompt) == 0:
            raise EngineError("the prompt is empty: type a message first")
        if isinstance(prompt[0], dict):
            if not any(str(m.get("content", "")).strip() for m in prompt):
                raise EngineError("the prompt is empty: type a message first")
            if continue_final and prompt[-1].get("role") != "assistant":
                raise EngineError("only an assistant message can be continued: the messages end with a "
                                  f"{prompt[-1].get('role')!r} message")
            return self.target.chat_ids(prompt, continue_final=continue_final)
        return [int(t) for t in prompt]

    def count_tokens(self, messages: Sequence[dict], *, continue_final: bool = False) -> int:
        return len(self.encode(messages, continue_final=continue_final))

    def generate(self, prompt, config: GenerationConfig, on_step=None, should_stop=None, *,
                 continue_final: bool = False) -> Iterator[StepEvent]:
        """Stream the answer as StepEvents; closing the generator stops within one step.

        Each step runs in its own `torch.inference_mode()` block, so the generator may be
        advanced from any thread (Gradio moves it between workers). `on_step(tree,
        verification)`, if given, sees every speculative step (statistics). `should_stop()`, if
        given, is asked before each chunk of the prompt is read (core.decoding.forward.prefill):
        True ends the answer before its first token, and the generator yields nothing.
        `continue_final`: the prompt (chat messages, or token ids) ends with a partial answer, which
        this one continues (its text is what follows that answer's, leading space included).
        """
        ids = self.encode(prompt, continue_final=continue_final)
        if len(ids) >= self.max_context:
            raise EngineError(f"the prompt is {len(ids)} tokens but the model's context is "
                              f"{self.max_context}; shorten it or start a new chat")
        vocab = self.target.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise EngineError(f"token ids must be in 0..{vocab - 1}")
        if config.speculative and not (self.has_head and config.head) and not config.tree.lookup:
            raise EngineError("without a draft head speculation copies from the context, and this tree's lookup "
                              "is 0: set lookup (--lookup N), load a head (--head), or turn speculation off")
        return _stream(self, ids, config, on_step, should_stop, text_context=tuple(ids[-1:]) if continue_final else ())


POLICY = adaptive.Policy()  # GenerationConfig.adaptive's probing schedule
# An adaptive answer to a prompt past the tree's plain cap: the head catches up on the prompt's
# last HEAD_WINDOW tokens when a probe first speculates (its rotary positions are relative, and
# context lookup copies from the whole chat), not on all of it
HEAD_WINDOW = 256
COPY_PROBE = 6  # a lookup chain this long (a repeat of 4+ tokens, core.decoding.lookup.chain_length) probes speculation


def _stream(engine: Engine, ids: list[int], config: GenerationConfig, on_step,
            should_stop=None, text_context: tuple[int, ...] = ()) -> Iterator[StepEvent]:
    threads.refit()  # no-op unless the launcher turned the thread governor on
    threads.apply()
    with torch.inference_mode():
        run = _Run(engine, ids, config, on_step, text_context)
        try:
            event = run.first_step(should_stop)
        except StopReading:
            return
    yield event
    while not event.finished:
        threads.refit_during()  # no-op unless the governor is on
        threads.apply()  # this step may run in another thread than the last (Gradio)
        with torch.inference_mode():
            event = run.next_step()
        yield event


class _Run:
    """State of one answer: caches, counters, the text stream and the stop rules."""

    def __init__(self, engine: Engine, ids: list[int], config: GenerationConfig, on_step=None,
                 text_context: tuple[int, ...] = ()):
        if config.paused_hot and not config.adaptive:
            config = replace(config, speculative=False)  # measured: plain decoding is faster this hot
        self.e, self.cfg, self.on_step = engine, config, on_step
        self.model, self.device = engine.forwarder, engine.target.device
        # speculation without the head: each step verifies the root and a lookup chain, where the context repeats
        self.lookup_only = config.speculative and not (engine.has_head and config.head)
        head = config.speculative and not self.lookup_only
        self.layers = engine.drafter.feature_layers if head else None
        self.ids = torch.tensor(ids, device=self.device)
        self.context = ContextIndex(ids)  # prompt + every emitted token: where context lookup searches
        self.cache = kv.new_cache(self.model)
        self.head_cache = HeadCache(engine.head.config, engine.target.dtype, self.device) if head else None
        # sampled tokens are a function of the seed and their position (core.decoding.gumbel)
        self.seed = config.seed if config.seed is not None else new_seed()
        self.budget, self.budget_reason = answer_budget(config.max_new_tokens, engine.max_context - len(ids))
        self.text = TextStream(engine.target.tokenizer, config.stop_strings, text_context)
        self.eos = set(engine.target.eos_ids)
        self.n_out = self.forwards = 0
        self.token, self.root_hidden = None, None
        self.root_top: tuple[torch.Tensor, torch.Tensor] | None = None  # the root's best children (catch_up)
        self._draft_carry = 0.0  # head catch-up time, reported with the next step's draft
        # GenerationConfig.adaptive: the measured speeds (core.decoding.adaptive), the
        # (tokens, features) the head has not caught up on (the prompt past a plain cap, plain
        # steps), and the seconds this step spent catching up on them (a switch's cost, not the mode's)
        self.speeds: adaptive.Speeds | None = None
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._switch_s = 0.0
        self.start = self.now()

    def now(self) -> float:
        return now(self.device)

    def choose(self, logits: torch.Tensor, position: int) -> int:
        """Plain decoding's choice from (V,) logits for the token at `position`."""
        return plain_choice(logits, position, self.cfg.sampling, self.seed)

    def first_step(self, should_stop=None) -> StepEvent:
        t0 = self.now()
        features, logits = self.e.read_prompt(self.ids, self.cache, self.layers, self.cfg.reuse_prompt, should_stop)
        self.token = self.choose(logits, len(self.ids))
        self.forwards += 1
        t1 = self.now()
        event = self.emit([self.token], 0, 0, 0.0, t1 - t0, t0)
        # past a plain cap (a long prompt; adaptive: also sampling at or past the hot pause) the answer
        # starts plain; an adaptive one probes speculation, which may pay for this answer after all
        capped = not self.cfg.tree.speculates_at(len(self.ids)) or self.cfg.paused_hot
        follow = torch.cat([self.ids[1:], torch.tensor([self.token], device=self.device)])  # (T,) the next tokens
        if self.cfg.speculative and self.cfg.adaptive:
            self.speeds = adaptive.start(not capped, POLICY, patient=self.cfg.paused_hot)
            if capped:  # the head catches up on the prompt when a probe first speculates, if one does
                if not self.lookup_only:
                    self.pending.append((follow, features))
                return event
        elif self.cfg.speculative and capped:
            self.cfg = replace(self.cfg, speculative=False)  # a plain cap: no head catch-up on a long prompt
        if self.cfg.speculative and not self.lookup_only and not event.finished:
            self.root_hidden = self.catch_up(follow, features)
        return event

    def catch_up(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The head catches up on the accepted tokens; returns its output at the new root. A greedy
        dynamic tree's first level (the root's best children) comes out of the same call
        (self.root_top, read by the next draft)."""
        t = self.now()
        tree = self.cfg.tree
        if self.cfg.sampling.greedy and not tree.is_static:
            hidden, self.root_top = catch_up_top(self.e.drafter, self.head_cache, tokens, features, tree.top_k)
        else:
            hidden, self.root_top = catch_up(self.e.drafter, self.head_cache, tokens, features), None
        self._draft_carry = self.now() - t  # reported with the next step's draft
        return hidden

    def next_step(self) -> StepEvent:
        if self.speeds is not None:
            return self.adaptive_step()
        if self.cfg.speculative and self.fits_tree() and self.cfg.tree.speculates_at(kv.cache_length(self.cache)):
            return self.spec_step()
        event = self.plain_step()
        if self.cfg.speculative and not event.finished:  # near the context end, or a plain cap: stay plain
            self.cfg = replace(self.cfg, speculative=False)
        return event

    def adaptive_step(self) -> StepEvent:
        """The mode the measured speeds choose (plain near the context's end), then its time recorded.
        With a head, the mode beside speculation copies where it can (`copies`): the head's own work is what the
        two modes' speeds weigh. Else a plain stretch probes speculation at once where the context repeats (a lookup
        chain of COPY_PROBE tokens or more: the answer copies from the chat, where speculation pays most)."""
        copies = self.copies()
        if not self.speeds.speculative and not copies and self.cfg.tree.lookup and self.fits_tree():
            chain = self.context.chain(self.lookup_room(kv.cache_length(self.cache)))
            if len(chain) >= COPY_PROBE:
                self.speeds = adaptive.probe_now(self.speeds, POLICY)
        speculate = self.speeds.speculative and self.fits_tree()
        t0, self._switch_s = self.now(), 0.0
        event = self.spec_step() if speculate else self.lookup_step() if copies else self.plain_step()
        seconds = self.now() - t0 - self._switch_s
        self.speeds = adaptive.record(self.speeds, POLICY, speculate, len(event.token_ids), seconds)
        return event

    def copies(self) -> bool:
        """Whether an adaptive answer with a head copies in its other mode: context lookup alone (a plain step where
        nothing repeats), where the tree copies and speculates at this context's length. Where a verified row costs
        most (AVX2), copying alone measured as fast as the head with it, or faster (docs/context-lookup.md,
        2026-12-08): the answer then runs the faster of the two instead of the head or nothing."""
        committed = kv.cache_length(self.cache)
        return (not self.lookup_only and self.cfg.tree.lookup > 0 and self.cfg.tree.speculates_at(committed)
                and self.fits_tree())

    def fits_tree(self) -> bool:
        return kv.cache_length(self.cache) + self.cfg.tree.depth + 1 < self.e.max_context

    def lookup_room(self, committed: int) -> int:
        """How many context-lookup tokens this step may verify: the setting, capped by the
        tokens still to write and by the context window (the root and its chain must fit)."""
        left = self.budget - self.n_out - 1  # the step's bonus token writes one more
        return max(0, min(self.cfg.tree.lookup, left, self.e.max_context - committed - 2))

    def plain_step(self) -> StepEvent:
        t0 = self.now()
        committed = kv.cache_length(self.cache)
        layers = self.layers if self.speeds is not None else None
        if self.cfg.sampling.greedy:  # the argmax comes out of the forward's own call
            features, self.token = plain_forward_greedy(self.model, self.token, self.cache, committed, layers)
            t1 = self.now()
        else:
            features, logits = plain_forward(self.model, self.token, self.cache, committed, layers)
            t1 = self.now()
            self.token = self.choose(logits, committed + 1)
        if self.speeds is not None and not self.lookup_only:  # for the head, should a later step speculate
            self.pending.append((torch.tensor([self.token], device=self.device), features))
            if self.cfg.sampling.greedy and self.cfg.tree.row_floor:  # a 1-row forward: the floor's T1
                self.e.row_costs = rowcost.record(self.e.row_costs, 1, t1 - t0, None)
        self.forwards += 1
        return self.emit([self.token], 0, 0, 0.0, t1 - t0, t0)

    def spec_step(self) -> StepEvent:
        if self.lookup_only:
            return self.lookup_step()
        if self.pending:  # an adaptive answer's first speculative step after plain ones
            t = self.now()
            tokens, features = (torch.cat(x) for x in zip(*self.pending))  # (n,), (n, F)
            self.pending = []
            if self.head_cache.length == 0:  # a long prompt: the head reads its end (103 ms for 4,000 tokens)
                tokens, features = tokens[-HEAD_WINDOW:], features[-HEAD_WINDOW:]
            self.root_hidden = self.catch_up(tokens, features)
            self._switch_s = self.now() - t
        t0 = self.now()
        committed = kv.cache_length(self.cache)
        shape = self.cfg.tree.at(committed)  # smaller trees for long contexts (TreeConfig.long_context)
        chain = self.context.chain(self.lookup_room(committed)) if shape.lookup else []
        shape = shape.with_chain() if chain else shape
        s = self.cfg.sampling
        noise = None if s.greedy else DraftNoise(s.temperature, self.seed, committed + 1)
        tree = draft(self.e.drafter, self.head_cache, self.token, self.root_hidden, shape, noise, self.root_top)
        self.root_top = None
        floor = s.greedy and shape.row_floor
        if floor:  # only the drafts likely enough to pay for their rows at what a row costs now
            tree = rowcost.prune(tree, rowcost.floor(self.e.row_costs))
        if chain:
            tree = graft(tree, chain)
        t1 = self.now()
        # greedy, a dynamic tree: forward, walk and the head's catch-up in one native call where it serves
        fused = (spec_step_greedy(self.model, tree, self.cache, committed, self.e.drafter, self.head_cache,
                                  self.cfg.tree.top_k) if s.greedy and not self.cfg.tree.is_static else None)
        if fused is not None:  # the forward's time as the separate calls measure it: all but the head's part
            t2 = self.now() - fused.head_s
            result: Verification = Verification(fused.path, fused.tokens)
        else:
            features, result, t2 = self.verify(tree, committed)
        self.keep(tree, result, committed)
        carry = self._draft_carry  # the last catch-up, spent before t0: the step starts that much earlier
        head_s = (t1 - t0) + carry + (fused.head_s if fused is not None else 0.0)  # a fused step catches up in it
        if floor:
            self.e.row_costs = rowcost.record(self.e.row_costs, tree.size, t2 - t1, head_s)
        event = self.emit(list(result.tokens), result.accepted, tree.size, head_s, t2 - t1, t0 - carry)
        self._draft_carry = 0.0
        self.token = result.bonus
        if fused is not None:
            self.root_hidden, self.root_top = fused.head_hidden, fused.top
        elif not event.finished:  # the head catches up only when another step follows
            path = result.path
            kept = features[:len(path)] if path == tuple(range(len(path))) else features[list(path)]  # (m, F)
            self.root_hidden = self.catch_up(torch.tensor(result.tokens, device=self.device), kept)
        return event

    def verify(self, tree: DraftTree, committed: int) -> tuple[torch.Tensor | None, Verification, float]:
        """The tree's rows in one target forward, then its walk: greedy, each row's argmax out of the forward's own
        call; sampled, plain sampling's token for the seed at every node. -> (features for the head, the
        verification, the time the forward ended)."""
        s = self.cfg.sampling
        if s.greedy:
            features, choices = forward_tree_greedy(self.model, tree, self.cache, committed, self.layers)
            t2 = self.now()
            return features, accept_greedy(tree, choices), t2
        features, logits = forward_tree(self.model, tree, self.cache, committed, self.layers)
        t2 = self.now()
        return features, verify_sampled(tree, logits, s, self.seed, committed), t2

    def keep(self, tree: DraftTree, result: Verification, committed: int) -> None:
        """The cache keeps the accepted path's rows; the step is counted (and shown to `on_step`)."""
        if self.on_step is not None:
            self.on_step(tree, result)
        kv.keep(self.cache, committed, result.path)
        self.forwards += 1

    def lookup_step(self) -> StepEvent:
        """Speculation without the head: the root and the context's lookup chain verified in one forward, with the
        rules of any tree (greedy: plain decoding's tokens; sampled: its tokens for the seed); a plain step where the
        context holds no repeat to copy. Where a head is loaded (an adaptive answer's copying mode, `copies`) the
        accepted rows' features wait for its catch-up, as a plain step's do."""
        committed = kv.cache_length(self.cache)
        chain = self.context.chain(self.lookup_room(committed))  # (none where the tree's lookup is 0)
        if not chain:
            return self.plain_step()
        t0 = self.now()
        # a path of 1 + n; the copied nodes score -inf, as beside a head's tree (what the app counts as copied)
        tree = graft(DraftTree.from_lists([self.token], [-1], [0], [0.0], device=self.device), chain)
        t1 = self.now()
        features, result, t2 = self.verify(tree, committed)
        self.keep(tree, result, committed)
        if not self.lookup_only:  # (m, F): a chain's path is its first m rows
            self.pending.append((torch.tensor(result.tokens, device=self.device), features[:len(result.path)]))
        event = self.emit(list(result.tokens), result.accepted, tree.size, t1 - t0, t2 - t1, t0)
        self.token = result.bonus
        return event

    def emit(self, tokens: list[int], n_draft: int, tree_size: int, draft_s: float, verify_s: float,
             t_start: float) -> StepEvent:
        """Apply the stop rules to this step's tokens and build its event."""
        kept, pieces, reason = [], [], None
        for tok in tokens:
            kept.append(tok)
            self.context.append(tok)
            self.n_out += 1
            pieces.append(self.text.push(tok))
            if tok in self.eos:
                reason = "eos"
            elif self.text.stopped:
                reason = "stop"
            elif self.n_out >= self.budget:
                reason = self.budget_reason
            if reason:
                break
        if reason and reason != "stop":
            pieces[-1] += self.text.finish()
        t = self.now()
        return StepEvent(token_ids=tuple(kept), draft_tokens=min(n_draft, len(kept)), text="".join(pieces),
                         token_texts=tuple(pieces), tree_size=tree_size, draft_s=draft_s, verify_s=verify_s,
                         other_s=max(0.0, t - t_start - draft_s - verify_s), finished=reason is not None,
                         finish_reason=reason, total_tokens=self.n_out, target_forwards=self.forwards,
                         elapsed_s=t - self.start)

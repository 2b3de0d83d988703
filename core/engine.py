"""The decode loop: prefill, then steps of (draft -> verify -> commit), yielding StepEvents.

One step in speculative mode:
  draft    the head extends the root (last accepted token) into a DraftTree   (core.tree)
  verify   the target runs root + tree in ONE forward                         (forward_tree)
  accept   greedy or sampled acceptance picks a path + bonus token             (core.verify)
  commit   the target cache keeps only the path; the head catches up on the
           path's true target features, giving the next root's proposal        (core.cache, catch_up)
Plain mode is the same loop with no draft: each step verifies just the root.

Numerics: with the batch-invariant kernels (core.invariant, bf16 on CPU) a tree row computes
bit for bit what a plain step computes, so greedy output equals plain decoding by
construction; `Engine.numerics` says which numerics run and what the probe found.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from core import cache as kv
from core import invariant, native, threads
from core.clock import now
from core.config import ATTENTIONS, GenerationConfig, TreeConfig
from core.head import HeadCache, additive
from core.head3 import drafter_for, load_any_head, target_features
from core.lookup import graft, lookup_chain
from core.models import DEFAULT_HEAD_DIR, EMBEDDED, LoadedModel, catalogue_entry, load_target, resolve
from core.probe import ProbeResult, probe
from core.quant import QuantWeightError
from core.step import WEIGHTS, NativeStep, StepError, load_step
from core.text import TextStream
from core.tree import DraftTree, catch_up, draft
from core.treestore import BUILT_IN, TreeChoice, default_tree
from core.verify import Verification, greedy_tokens, sample, target_probs, verify_greedy, verify_sampled



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


@dataclass(frozen=True)
class Numerics:
    """How the target computes, and whether tree rows are verified bit-identical to plain steps."""

    dtype: str                  # "bfloat16", "float32", ...
    attention: str              # "exact" (batch-invariant kernels), "sdpa" or "eager"
    probe: ProbeResult | None   # None: not probed (e.g. no head, nothing to compare)
    note: str = ""              # why these numerics were chosen (e.g. a failed probe's fallback)
    step: str = ""              # what runs decoding steps: the native step and its weights, or why not

    @property
    def exact(self) -> bool:
        return self.probe is not None and self.probe.exact

    def describe(self) -> str:
        dt = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "float64": "fp64"}.get(self.dtype, self.dtype)
        kernels = (f"batch-invariant kernels, {native.status().describe()}" if self.attention == "exact"
                   else f"{self.attention} attention")
        if self.probe is None:
            verdict = "exactness not checked"
        elif self.probe.exact:
            verdict = f"exact: verified on this machine ({self.probe.checked_at})"
        else:
            verdict = f"exact: not guaranteed ({self.probe.reason})"
        return (f"{dt}, {kernels}; {verdict}" + (f"; {self.step}" if self.step else "")
                + (f"; {self.note}" if self.note else ""))


# ---- target forwards (the model's public forward only: 4D mask / tree layout, positions, cache) ----

def uses_exact_kernels(model) -> bool:
    return model.config._attn_implementation == invariant.NAME


def _window_masks(model, allowed: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor,
                  dtype: torch.dtype):
    """The 4D mask(s) for a tree forward, with the model's sliding window built in."""
    cfg = model.config
    full = additive(allowed, dtype)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or []
    if not window or (types and "sliding_attention" not in types):
        return full
    near = key_positions[None, :] > positions[:, None] - window  # (n, L + n)
    sliding = additive(allowed & near, dtype)
    return {"full_attention": full, "sliding_attention": sliding} if types else sliding


def forward_tree(model, tree: DraftTree, cache, committed: int,
                 feature_layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the tree's n nodes -> (features (n, F), logits (n, V)).

    Each node sees the committed context and its own ancestors; its position is the
    context length plus its depth. The forward appends n entries to `cache`. Features are
    the last hidden state, or the fused layers an EAGLE-3 head reads.
    """
    device = tree.tokens.device
    positions = tree.positions(committed)  # (n,)
    if isinstance(model, NativeStep):
        ancestors = invariant.tree_ancestors(tree.parents, tree.depths)
        return model.forward(tree.tokens, positions, committed, ancestors, tree.depths + 1, cache, feature_layers)
    kwargs = {}
    if uses_exact_kernels(model):
        kwargs["tree_layout"] = invariant.TreeLayout.from_tree(tree.parents, tree.depths, committed)
    else:
        allowed = torch.cat([torch.ones(tree.size, committed, dtype=torch.bool, device=device), tree.mask], 1)
        key_pos = torch.cat([torch.arange(committed, device=device), positions])
        kwargs["attention_mask"] = _window_masks(model, allowed, positions, key_pos,
                                                 model.get_input_embeddings().weight.dtype)
    out = model.model(input_ids=tree.tokens[None], position_ids=positions[None], cache=cache, use_cache=True,
                      output_hidden_states=feature_layers is not None, **kwargs)
    return target_features(out, feature_layers)[0], model.lm_head(out.last_hidden_state[0])


def plain_forward(model, token: int, cache, position: int, feature_layers=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain decoding step -> (features (1, F), logits (V,)); the same kernels as a tree row."""
    if isinstance(model, NativeStep):
        one = torch.ones(1, dtype=torch.long)
        features, logits = model.forward(torch.tensor([token]), torch.tensor([position]), position, one[:, None] - 1,
                                         one, cache, feature_layers)
        return features, logits[0]
    device = model.get_input_embeddings().weight.device
    kwargs = {"tree_layout": invariant.TreeLayout.single(position, device)} if uses_exact_kernels(model) else {}
    out = model.model(input_ids=torch.tensor([[token]], device=device),
                      position_ids=torch.tensor([[position]], device=device), cache=cache, use_cache=True,
                      output_hidden_states=feature_layers is not None, **kwargs)
    return target_features(out, feature_layers)[0], model.lm_head(out.last_hidden_state[0, -1])


def plain_logits(model, token: int, cache, position: int) -> torch.Tensor:
    return plain_forward(model, token, cache, position)[1]


def prefill(model, ids: torch.Tensor, cache, feature_layers=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids (T,) -> (features (T, F), logits of the last position (V,)). Through
    transformers also where the native step serves the decoding steps (oneDNN's compute-bound
    GEMMs for a long prompt; both decoding modes share it)."""
    if isinstance(model, NativeStep):
        model = model.hf
    out = model.model(input_ids=ids[None], cache=cache, use_cache=True,
                      output_hidden_states=feature_layers is not None)
    return target_features(out, feature_layers)[0], model.lm_head(out.last_hidden_state[0, -1:])[0]


def default_head(model: str) -> str | None:
    if model == EMBEDDED:
        return str(DEFAULT_HEAD_DIR) if DEFAULT_HEAD_DIR.is_dir() else None
    entry = catalogue_entry(model)
    return entry.head if entry else None


# ---- numerics at load ----

def _auto_numerics(device: str, load_in_4bit: bool, dtype: str, attention: str) -> tuple[str, str]:
    if dtype == "auto":
        dtype = "bfloat16" if torch.device(device).type == "cpu" and not load_in_4bit else (
            "float16" if torch.device(device).type == "cuda" else "float32")
    if attention == "auto":
        attention = "exact" if dtype in ("bfloat16", "bf16") and torch.device(device).type == "cpu" else "sdpa"
    return dtype, attention


def set_numerics(target: LoadedModel, attention: str) -> None:
    if attention == "exact":
        invariant.make_invariant(target.model)
    else:
        invariant.undo_invariant(target.model, attention)


def load_numerics(model: str, *, dtype: str, attention: str, device: str, load_in_4bit: bool,
                  check: bool, weights: str = "auto") -> tuple[LoadedModel, Numerics, NativeStep | None]:
    """Load the target in the requested numerics ("auto": bf16 + exact kernels on CPU when the
    probe passes, else fp32 + sdpa with the probe's reason kept), and the native step that runs
    its decoding forwards where it can (core.step; `weights`: one of core.config.WEIGHTS)."""
    if attention not in ATTENTIONS:
        raise EngineError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
    if weights not in WEIGHTS:
        raise EngineError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
    auto = dtype == "auto" and attention == "auto"
    dtype, attention = _auto_numerics(device, load_in_4bit, dtype, attention)
    target = load_target(model, dtype=dtype, device=device, load_in_4bit=load_in_4bit)
    set_numerics(target, attention)
    try:
        step, step_text = load_step(target, weights)
    except (StepError, QuantWeightError) as e:  # only where q4 was asked for by name
        raise EngineError(str(e)) from e
    result = probe(step or target.model, target.dtype, attention, device) if check else None
    if auto and result is not None and not result.exact and attention == "exact":
        target.model.float()
        target = replace(target, dtype=torch.float32)
        set_numerics(target, "sdpa")
        fallback = probe(target.model, target.dtype, "sdpa", device)
        return target, Numerics("float32", "sdpa", fallback,
                                note=f"bf16 exact kernels failed the probe here ({result.reason}), so fp32 runs"), None
    if step is not None:
        step.drop_bf16_layers()  # q4: the layers' bf16 copies go (nothing to drop for bf16 weights)
    return target, Numerics(str(target.dtype).removeprefix("torch."), attention, result, step=step_text), step


class Engine:
    def __init__(self, target: LoadedModel, head=None, draft_vocab: torch.Tensor | None = None,
                 numerics: Numerics | None = None, drafter=None, step: NativeStep | None = None):
        """`drafter`: one already built for `head` (Engine.load), else it is built here. `step`:
        the native decode step for the target (core.step), else transformers' forward serves."""
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
        self.tree_choice = TreeChoice(TreeConfig(), BUILT_IN)  # Engine.load: tuned / shipped

    @classmethod
    def load(cls, model: str = EMBEDDED, head: str | None = "default", *, dtype: str = "auto",
             attention: str = "auto", device: str = "cpu", load_in_4bit: bool = False,
             weights: str = "auto") -> "Engine":
        """Load a target and its head. head="default": the shipped head for the embedded
        model, the catalogue's head for a catalogue target, else none (plain decoding only).
        weights: what the native step reads (core.step.WEIGHTS). The probe runs with or without a
        head (once per machine, cached): a plain run must pick the numerics a speculative run
        picks, or `--plain` and the default could answer in different numerics (the clean-clone
        CI saw two texts when a failed probe had sent only the speculative run to fp32)."""
        if head == "default":
            head = default_head(model)
        target, numerics, step = load_numerics(model, dtype=dtype, attention=attention, device=device,
                                               load_in_4bit=load_in_4bit, check=True, weights=weights)
        if head is None:
            return cls(target, numerics=numerics, step=step)
        folder = Path(head).expanduser() if Path(head).expanduser().exists() else resolve(
            head, allow_patterns=["config.json", "*.safetensors", "pytorch_model.bin"])
        drafter = load_any_head(folder, target.model, dtype=target.dtype, device=device)
        engine = cls(target, drafter.head, getattr(drafter, "vocab", None), numerics, drafter=drafter, step=step)
        engine.tree_choice = default_tree(engine, folder)
        return engine

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

        Each step runs in its own `torch.inference_mode()` block, so the generator may be
        advanced from any thread (Gradio moves it between workers). `on_step(tree,
        verification)`, if given, sees every speculative step (statistics).
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
        return _stream(self, ids, config, on_step)


def _stream(engine: Engine, ids: list[int], config: GenerationConfig, on_step) -> Iterator[StepEvent]:
    threads.refit()  # no-op unless the launcher turned the thread governor on
    threads.apply()
    with torch.inference_mode():
        run = _Run(engine, ids, config, on_step)
        event = run.first_step()
    yield event
    while not event.finished:
        threads.apply()  # this step may run in another thread than the last (Gradio)
        with torch.inference_mode():
            event = run.next_step()
        yield event


class _Run:
    """State of one answer: caches, counters, the text stream and the stop rules."""

    def __init__(self, engine: Engine, ids: list[int], config: GenerationConfig, on_step=None):
        self.e, self.cfg, self.on_step = engine, config, on_step
        self.model, self.device = engine.forwarder, engine.target.device
        self.layers = engine.drafter.feature_layers if config.speculative else None
        self.ids = torch.tensor(ids, device=self.device)
        self.context = list(ids)  # prompt + every emitted token: where context lookup searches
        self.cache = kv.new_cache(self.model)
        self.head_cache = (HeadCache(engine.head.config, engine.target.dtype, self.device)
                           if config.speculative else None)
        seed = config.seed if config.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.budget = min(config.max_new_tokens, engine.max_context - len(ids))
        self.budget_reason = "length" if config.max_new_tokens <= engine.max_context - len(ids) else "context"
        self.text = TextStream(engine.target.tokenizer, config.stop_strings)
        self.eos = set(engine.target.eos_ids)
        self.n_out = self.forwards = 0
        self.token, self.root_hidden = None, None
        self._draft_carry = 0.0  # head catch-up time, reported with the next step's draft
        self.start = self.now()

    def now(self) -> float:
        return now(self.device)

    def choose(self, logits: torch.Tensor) -> int:
        """Plain decoding's choice from (V,) logits."""
        s = self.cfg.sampling
        return int(greedy_tokens(logits)) if s.greedy else sample(target_probs(logits[None], s)[0], self.gen)

    def first_step(self) -> StepEvent:
        t0 = self.now()
        features, logits = prefill(self.model, self.ids, self.cache, self.layers)
        self.token = self.choose(logits)
        self.forwards += 1
        t1 = self.now()
        event = self.emit([self.token], 0, 0, 0.0, t1 - t0, t0)
        if self.cfg.speculative and not self.cfg.tree.speculates_at(len(self.ids)):
            self.cfg = replace(self.cfg, speculative=False)  # a plain cap: no head catch-up on a long prompt
        if self.cfg.speculative and not event.finished:
            self.root_hidden = self.catch_up(torch.cat([self.ids[1:], torch.tensor([self.token], device=self.device)]),
                                             features)
        return event

    def catch_up(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        t = self.now()
        hidden = catch_up(self.e.drafter, self.head_cache, tokens, features)
        self._draft_carry = self.now() - t  # reported with the next step's draft
        return hidden

    def next_step(self) -> StepEvent:
        if self.cfg.speculative and self.fits_tree() and self.cfg.tree.speculates_at(kv.cache_length(self.cache)):
            return self.spec_step()
        event = self.plain_step()
        if self.cfg.speculative and not event.finished:  # near the context end, or a plain cap: stay plain
            self.cfg = replace(self.cfg, speculative=False)
        return event

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
        _, logits = plain_forward(self.model, self.token, self.cache, committed)
        t1 = self.now()
        self.token = self.choose(logits)
        self.forwards += 1
        return self.emit([self.token], 0, 0, 0.0, t1 - t0, t0)

    def spec_step(self) -> StepEvent:
        t0 = self.now()
        committed = kv.cache_length(self.cache)
        shape = self.cfg.tree.at(committed)  # smaller trees for long contexts (TreeConfig.long_context)
        chain = lookup_chain(self.context, self.lookup_room(committed)) if shape.lookup else []
        tree = draft(self.e.drafter, self.head_cache, self.token, self.root_hidden,
                     shape.with_chain() if chain else shape)
        if chain:
            tree = graft(tree, chain)
        t1 = self.now()
        features, logits = forward_tree(self.model, tree, self.cache, committed, self.layers)
        t2 = self.now()
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
        self._draft_carry = 0.0
        self.token = result.bonus
        if not event.finished:  # the head catches up only when another step follows
            self.root_hidden = self.catch_up(torch.tensor(result.tokens, device=self.device), features[path])
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

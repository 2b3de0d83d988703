"""Settings, one frozen dataclass per concern, validated once on construction.

The UI and the CLIs only parse user input into these; every range check lives here so a
bad value is refused with the same message wherever it comes from.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field, fields, replace


ATTENTIONS = ("auto", "exact", "sdpa", "eager")  # "exact" = core.kernels.invariant's batch-invariant kernels
DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64")
WEIGHTS = ("auto", "w4a8", "q4", "bf16")  # what the native step reads (core.kernels.step.WEIGHTS), torch-free for the CLIs
WEIGHTS_HELP = ("what the native decode step reads and how it multiplies: w4a8 = the GGUF's 4-bit blocks times 8-bit "
                "activations (integer dot products, as llama.cpp; the fastest), q4 = the same blocks rebuilt to bf16 "
                "(answers bit-identical to bf16), bf16 = the model's bf16 tensors, auto = w4a8 where the target came "
                "from a GGUF, else bf16")


def add_runtime_args(p, dtype_help: str = "") -> None:
    """The options that say how the target computes, shared by the CLIs (torch-free: the
    arguments are checked before a model loads): --dtype, --attention, --weights, --threads,
    --device, --load-in-4bit."""
    p.add_argument("--dtype", default="auto", help="auto (CPU: bf16 with exact kernels where the probe "
                   "passes, else fp32), float32, bfloat16, float16" + dtype_help)
    p.add_argument("--attention", default="auto", choices=ATTENTIONS,
                   help="exact = batch-invariant kernels (bit-identical verification); sdpa; eager")
    p.add_argument("--weights", default="auto", choices=WEIGHTS, help=WEIGHTS_HELP)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every core on a "
                   "quiet machine, the idle ones on a busy one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--load-in-4bit", action="store_true")


TREE_ARGS = ("depth", "top_k", "total_tokens", "lookup", "plain_from_temperature")  # what a command line may set


def add_tree_args(p) -> None:
    """--depth, --top-k, --total-tokens, --lookup: a user's settings over the default tree
    (TreeConfig.override), shared by the CLIs; each left out keeps the default tree's."""
    p.add_argument("--depth", type=int, default=None, help="tree depth (default: the tuned tree's)")
    p.add_argument("--top-k", type=int, default=None, help="draft tree branching (default: the tuned tree's)")
    p.add_argument("--total-tokens", type=int, default=None, help="tree size incl. root (default: the tuned "
                   "tree's)")
    p.add_argument("--lookup", type=int, default=None, help="tokens copied from earlier text into the tree "
                   "when it repeats (0 = off; default: the tuned tree's)")
    p.add_argument("--plain-from-temperature", type=float, default=None, metavar="T",
                   help="sampling at temperature T or hotter decodes plain, where autotune measured plain decoding "
                        "faster (0 = speculate at every temperature; default: the tuned tree's)")


def tree_changes(a) -> dict[str, int | float]:
    """The tree settings given on the command line, for TreeConfig.override; checked here, so a
    bad value is refused before the model loads (ConfigError)."""
    changes = {k: getattr(a, k) for k in TREE_ARGS if getattr(a, k) is not None}
    TreeConfig().override(**changes)
    return changes


OFF_WORDS = ("0", "off", "false", "no")  # what turns an EAGLE_CHAT_* feature switch off


def switched_off(env: str) -> bool:
    """Whether the environment variable `env` (a feature switch, on by default) is set to turn it off."""
    return os.environ.get(env, "").lower() in OFF_WORDS


class ConfigError(ValueError):
    """A setting is out of range; the message names the setting and the allowed range."""


class EngineError(ValueError):
    """Bad input to the engine (empty prompt, too long for the context, numerics or weights it
    cannot load, ...). Defined here, below both, so the engine (core.decoding.engine) and its load-time
    numerics (core.decoding.numerics) raise one type without importing each other."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree.

    dynamic (EAGLE-2): each round the `top_k` best frontier nodes each propose `top_k`
    children, for `depth` levels; the best `total_tokens - 1` nodes (by cumulative draft
    log-probability) plus the root are verified.
    static: a fixed tree of child ranks, `static_paths`, e.g. ((0,), (1,), (0, 0)) means
    the root's best and second-best child and the best child of the best child.
    lookup: up to this many tokens copied from earlier context (`core.decoding.lookup`) are grafted
    under the root as one more path, beyond `total_tokens` and `depth`; 0 = off.
    lookup_total_tokens: the head's tree on steps that graft a lookup chain (0 = `total_tokens`).
    The chain's rows cost verification time (past about 12 rows a target forward is
    compute-bound on a CPU), so those steps may give the head's tree fewer tokens.
    long_context: caps for long contexts, ((min_context, depth, total_tokens), ...) with
    min_context ascending: once the context holds min_context tokens the tree keeps at most
    that depth and that many tokens (`at`); (min_context, 0, 0) means plain decoding from
    there on (`speculates_at`). Every tree row attends to the whole context, so a row's cost
    grows with it; core.autotune measures by how much and fits these caps.
    plain_from_temperature: sampled answers at this temperature or hotter decode plain (0 = never).
    The hotter the sampling, the less often a drafted token is accepted; where the rows and the
    drafting then cost more than they save, plain decoding is faster and follows the same
    distribution. core.autotune measures both modes at a few temperatures and sets it.
    row_floor: greedy steps verify only the draft nodes whose cumulative draft probability pays for
    their row at the row costs measured while answering (core.decoding.rowcost); where a verified
    row is not nearly free (8-bit activations on a CPU) dropping the unlikely drafts is faster, and
    verification keeps every answer as it was.
    """

    depth: int = 6
    top_k: int = 8
    total_tokens: int = 24
    static_paths: tuple[tuple[int, ...], ...] | None = None
    lookup: int = 0
    lookup_total_tokens: int = 0
    long_context: tuple[tuple[int, int, int], ...] = ()
    plain_from_temperature: float = 0.0
    row_floor: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.long_context, tuple) or any(not isinstance(c, tuple) for c in self.long_context):
            try:  # from JSON: lists of lists
                object.__setattr__(self, "long_context", tuple(tuple(int(v) for v in c) for c in self.long_context))
            except (TypeError, ValueError) as e:
                raise ConfigError(f"tree long_context must be a list of [min_context, depth, total_tokens], "
                                  f"got {self.long_context!r}") from e
        starts = [c[0] for c in self.long_context]
        _check(all(len(c) == 3 and c[0] >= 1 and (1 <= c[1] <= 32 and 2 <= c[2] <= 512 or c[1:] == (0, 0))
                   for c in self.long_context) and starts == sorted(set(starts)),
               f"tree long_context must hold [min_context >= 1, depth 1..32, total_tokens 2..512] entries "
               f"(or [min_context, 0, 0]: plain decoding) with ascending distinct min_context, got {self.long_context!r}")
        _check(isinstance(self.depth, int) and 1 <= self.depth <= 32,
               f"tree depth must be an integer in 1..32, got {self.depth!r}")
        _check(isinstance(self.top_k, int) and 1 <= self.top_k <= 64,
               f"tree top_k must be an integer in 1..64, got {self.top_k!r}")
        _check(isinstance(self.total_tokens, int) and 2 <= self.total_tokens <= 512,
               f"tree total_tokens must be an integer in 2..512 (root + at least one draft), "
               f"got {self.total_tokens!r}")
        _check(isinstance(self.lookup, int) and 0 <= self.lookup <= 32,
               f"tree lookup must be an integer in 0..32 (tokens copied from the context, 0 = off), "
               f"got {self.lookup!r}")
        _check(isinstance(self.lookup_total_tokens, int) and (self.lookup_total_tokens == 0 or
                                                              2 <= self.lookup_total_tokens <= 512),
               f"tree lookup_total_tokens must be 0 (= total_tokens) or an integer in 2..512, "
               f"got {self.lookup_total_tokens!r}")
        _check(isinstance(self.plain_from_temperature, (int, float)) and not isinstance(self.plain_from_temperature, bool)
               and 0 <= self.plain_from_temperature <= 100,
               f"tree plain_from_temperature must be a number in 0..100 (0 = speculate at every temperature), "
               f"got {self.plain_from_temperature!r}")
        _check(isinstance(self.row_floor, bool), f"tree row_floor must be true or false, got {self.row_floor!r}")
        if self.static_paths is not None:
            paths = set(self.static_paths)
            _check(len(paths) > 0, "static tree needs at least one path")
            for p in paths:
                _check(len(p) >= 1 and all(isinstance(r, int) and r >= 0 for r in p),
                       f"static tree path {p!r} must be a non-empty tuple of ranks >= 0")
                _check(len(p) == 1 or p[:-1] in paths,
                       f"static tree path {p!r} has no parent path {p[:-1]!r}")

    @property
    def is_static(self) -> bool:
        return self.static_paths is not None

    def speculates_hot(self, temperature: float) -> bool:
        """False where sampling at `temperature` decodes plain (`plain_from_temperature`); greedy always speculates."""
        return not (self.plain_from_temperature and temperature >= self.plain_from_temperature)

    def speculates_at(self, context: int) -> bool:
        """False once the context reaches a plain-decoding cap ([min_context, 0, 0])."""
        return not any(c[0] <= context and c[1] == 0 for c in self.long_context)

    def at(self, context: int) -> "TreeConfig":
        """The tree for a step whose context holds `context` tokens: this one, capped by the last
        long_context entry that applies (static trees and trees without caps are unchanged)."""
        caps = [c for c in self.long_context if c[0] <= context and c[1] > 0]
        if not caps or self.is_static:
            return self
        _, depth, total = caps[-1]
        if depth >= self.depth and total >= max(self.total_tokens, self.lookup_total_tokens):
            return self
        # one step's shape, its caps applied: every other setting (lookup, plain_from_temperature, row_floor, ...) stays
        return replace(self, depth=min(self.depth, depth), total_tokens=min(self.total_tokens, total),
                       lookup_total_tokens=min(self.lookup_total_tokens, total) if self.lookup_total_tokens else 0,
                       long_context=())

    SHAPE = ("depth", "top_k", "total_tokens", "static_paths")  # what lookup_total_tokens was tuned for

    def override(self, **changes) -> "TreeConfig":
        """This tree (the default one: tuned, shipped or built in) with a user's settings over it:
        the one rule the CLIs, the API server and the app use. A change given as None is no change.
        The default's context lookup and long-chat caps stay unless changed, and `at` still caps a
        larger tree by hand in a long chat. The smaller head tree beside a lookup chain
        (`lookup_total_tokens`) was tuned for the default's shape, so it stays only while depth,
        top_k, total_tokens and static_paths are the default's: a tree shaped by hand keeps the size
        the user chose on every step. Raises ConfigError for an unknown setting or a bad value."""
        changes = {k: v for k, v in changes.items() if v is not None}
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        _check(not unknown, f"unknown tree setting(s) {', '.join(unknown)}")
        if "lookup_total_tokens" not in changes and any(changes.get(k, getattr(self, k)) != getattr(self, k)
                                                           for k in self.SHAPE):
            changes["lookup_total_tokens"] = 0
        return replace(self, **changes)

    def with_chain(self) -> "TreeConfig":
        """The head's tree for a step that also verifies a lookup chain (never larger than
        `total_tokens`: a tree made smaller by hand stays that small)."""
        if not self.lookup_total_tokens or self.lookup_total_tokens >= self.total_tokens or self.is_static:
            return self
        return replace(self, total_tokens=self.lookup_total_tokens)


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next-token distribution is shaped; temperature 0 means greedy.

    Plain sampling and speculative verification apply exactly the same processing
    (temperature, then top-k, then top-p), so the output distribution is the same.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               f"sampling top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def new_seed() -> int:
    """A seed for a sampled answer given none (core.decoding.gumbel: the seed and a token's position
    choose it): 31 bits, short enough to be shown with the answer and typed in again."""
    return secrets.randbelow(2**31)


@dataclass(frozen=True)
class GenerationConfig:
    """Everything one answer needs besides the prompt."""

    max_new_tokens: int = 256
    speculative: bool = True
    tree: TreeConfig = field(default_factory=TreeConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    # speculation follows measured speed: each step runs the mode measured faster in this
    # answer, probing the other now and then; the tree's long-context caps and hot pause only choose the start
    # (core.decoding.adaptive). Off: the caps decide alone (what tests that count steps rely on).
    adaptive: bool = False
    # start from the cache rows of the last prompt read where this one begins with it (core.decoding.prefix:
    # the same bits as reading it all, sooner). Off: read from the start, as a benchmark or a race of the
    # two modes on one prompt must, or the second reader would start ahead.
    reuse_prompt: bool = True
    # speculation's drafts come from the engine's EAGLE head and context lookup. Off (and always for an engine
    # without a head): from context lookup alone, where the context repeats (core.decoding.lookup); a step with
    # nothing to copy is a plain step
    head: bool = True

    def __post_init__(self) -> None:
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
               f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        _check(isinstance(self.adaptive, bool), f"adaptive must be True or False, got {self.adaptive!r}")
        _check(isinstance(self.reuse_prompt, bool), f"reuse_prompt must be True or False, got {self.reuse_prompt!r}")
        _check(isinstance(self.head, bool), f"head must be True or False, got {self.head!r}")
        _check(all(isinstance(s, str) and s for s in self.stop_strings),
               "stop strings must be non-empty strings")

    @property
    def paused_hot(self) -> bool:
        """Speculation asked for, but the tree decodes plain at this sampling temperature (TreeConfig.speculates_hot)."""
        return self.speculative and not self.tree.speculates_hot(self.sampling.temperature)

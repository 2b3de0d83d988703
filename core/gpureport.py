"""The GPU check's results (frozen dataclasses) and their markdown report: core.gpucheck
measures and fills them, prints the report and writes it beside the JSON. The results live here,
not in gpucheck, so the two modules import in one direction only."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import TreeConfig
from core.projection import REFERENCE_TREE, CostCurve, Projection


@dataclass(frozen=True)
class PromptCheck:
    identical: bool
    tokens_before_divergence: int  # length of the common prefix of the two answers
    plain_tokens: int
    spec_tokens: int


@dataclass(frozen=True)
class Correctness:
    prompts: tuple[PromptCheck, ...]
    identical: bool                 # every prompt identical
    agreement_rate: float           # fraction of prompts identical
    mean_prefix_fraction: float     # mean of tokens before divergence / plain answer length
    tau: float                      # speculative tokens per target forward (random head: ~1)
    plain_tokens_per_s: float       # measured wall time of the answers, prefill included
    spec_tokens_per_s: float
    plain_step_s: float             # median wall time of one plain step
    spec_step_s: float              # median wall time of one speculative step
    spec_tree_size: int             # median nodes verified per speculative step
    error: str | None = None        # what generation raised, if it did

    @classmethod
    def failed(cls, error: str) -> "Correctness":
        return cls((), False, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, error=error)


@dataclass(frozen=True)
class LogitCheck:
    """One target call over a chain of n tokens (tree mask) against n plain one-token steps."""
    context: int
    n: int
    bit_identical: bool
    max_abs_diff: float             # over all n x V logits
    argmax_agreement: float         # fraction of the n positions with the same greedy token


@dataclass(frozen=True)
class QuantResult:
    quant: str
    load_s: float
    peak_memory_gb: float
    peak_memory_kind: str
    correctness: Correctness
    logits: tuple[LogitCheck, ...]  # one per context
    other_s: float                  # per speculative step, outside target forward and drafting
    plain_other_s: float            # per plain step, outside the target forward
    curves: tuple[CostCurve, ...]
    projections: tuple[Projection, ...]


@dataclass(frozen=True)
class Report:
    target: str                     # shape name (random weights) or --model
    random_weights: bool
    head: str
    device: str
    device_name: str
    versions: dict[str, str]
    prompts: int
    prompt_tokens: int
    new_tokens: int
    tree: TreeConfig                # tree of the correctness runs
    top_k: int                      # top_k of the cost curve and the projection
    bandwidth_ratio: float | None
    results: tuple[QuantResult, ...]


DRAFT_DEPTHS_SHOWN = (1, 4, REFERENCE_TREE.depth, 8)


def _ms(s: float) -> str:
    return f"{1000 * s:.2f}"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def correctness_lines(q: QuantResult) -> list[str]:
    c = q.correctness
    if c.error:
        out = [f"Correctness: generation raised `{c.error}`."]
    else:
        same = sum(p.identical for p in c.prompts)
        out = [f"Correctness (greedy): identical {same}/{len(c.prompts)} (agreement rate {c.agreement_rate:.0%}); "
               f"tokens before the first divergence: {c.mean_prefix_fraction:.0%} of the answer on average; "
               f"tau {c.tau:.2f}. Measured: plain {c.plain_tokens_per_s:.1f} tokens/s, "
               f"speculative {c.spec_tokens_per_s:.1f} tokens/s."]
    checks = "; ".join(f"context {g.context}: {'bit-identical' if g.bit_identical else 'NOT bit-identical'}, "
                       f"max |logit diff| {g.max_abs_diff:.2g}, greedy tokens agree {g.argmax_agreement:.0%}"
                       for g in q.logits)
    n = q.logits[0].n if q.logits else 0
    return out + ["", f"Tree verification vs plain decoding ({n} tokens in one tree-masked call vs {n} "
                      f"one-token steps): {checks}.", ""]


def cost_lines(q: QuantResult, top_k: int) -> list[str]:
    curves = q.curves
    lines = [_row(["target call, new tokens"] + [f"ms at context {cv.context}" for cv in curves]),
             "|---" * (1 + len(curves)) + "|"]
    lines += [_row([n] + [_ms(cv.verify_s[n]) for cv in curves]) for n in curves[0].verify_s]
    lines.append(_row([f"head step ({top_k} nodes)"] + [_ms(cv.head_step_s) for cv in curves]))
    lines.append(_row([f"draft LM head ({top_k} rows)"] + [_ms(cv.draft_lm_head_s) for cv in curves]))
    lines += [_row([f"drafting to depth {d} (catch-up included)"] + [_ms(cv.draft_s[d]) for cv in curves])
              for d in DRAFT_DEPTHS_SHOWN if d in curves[0].draft_s]
    return lines + [""]


def projection_lines(q: QuantResult, ratio: float | None) -> list[str]:
    ref = REFERENCE_TREE
    head = ["tau", "context", "tree autotune picks (depth/top-k/nodes)", "tokens/step", "tokens/s",
            "plain tokens/s", "speed-up", f"tree {ref.depth}/{ref.top_k}/{ref.total_tokens}: tokens/s (speed-up)"]
    if ratio:
        head.append(f"memory-bound projection, all times x {ratio:g}: tokens/s")
    lines = [f"Projection, not a measurement (autotune's cost model on this curve, synthetic acceptance, "
             f"core.projection; step overhead {_ms(q.other_s)} ms speculative, {_ms(q.plain_other_s)} ms plain):",
             "", _row(head), "|---" * len(head) + "|"]
    for p in q.projections:
        cells = [f"{p.tau:g}", p.context, f"{p.tree.depth}/{p.tree.top_k}/{p.tree.total_tokens}",
                 f"{p.expected_tokens:.2f}", f"{p.tokens_per_s:.1f}", f"{p.plain_tokens_per_s:.1f}",
                 f"{p.speedup:.2f}x", f"{p.reference_tokens_per_s:.1f} ({p.reference_speedup:.2f}x)"]
        lines.append(_row(cells + ([f"{p.other_gpu_tokens_per_s:.1f}"] if ratio else [])))
    return lines + [""]


def to_markdown(r: Report) -> str:
    weights = "random weights, real architecture" if r.random_weights else "real weights"
    versions = ", ".join(f"{k} {v}" for k, v in r.versions.items())
    timer = "CUDA events" if r.device == "cuda" else "perf_counter"
    lines = [f"# GPU check: {r.target} on {r.device_name}", "",
             f"{versions}; {weights}; head: {r.head}. Greedy, {r.prompts} prompts of {r.prompt_tokens} random ids "
             f"x {r.new_tokens} new tokens, tree depth {r.tree.depth}, top-k {r.tree.top_k}, "
             f"{r.tree.total_tokens} nodes. Times: medians after warm-up ({timer}).", ""]
    for q in r.results:
        lines += [f"## {q.quant}", "",
                  f"Load {q.load_s:.1f} s; peak memory {q.peak_memory_gb:.2f} GB ({q.peak_memory_kind}).", ""]
        lines += correctness_lines(q) + cost_lines(q, r.top_k) + projection_lines(q, r.bandwidth_ratio)
    return "\n".join(lines)

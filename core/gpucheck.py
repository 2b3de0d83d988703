"""Run the GPU path for real: a 7B-class target (real shapes, random weights, or --model)
with an EAGLE head, checked for exactness, timed, and projected to tokens/s.

    python -m core.gpucheck --shape vicuna-7b --device cuda --quant all --out DIR
    python -m core.gpucheck --shape tiny --device cpu --out DIR      # the CI smoke test

Per quantization (nf4 through bitsandbytes with fp16 compute, as the catalogue loads it;
fp16; bf16; fp32; fp64) it reports:
  correctness  plain vs speculative greedy on random-id prompts: identical or not, tokens
               before the first divergence, the agreement rate, measured wall tokens/s.
  cost curve   the target over n = 1..128 new tokens in ONE call with a tree mask, at each
               context; one head step on top_k nodes; the draft LM head on those rows;
               drafting to depth d (catch-up included); peak memory. Medians after warm-up,
               timed with CUDA events on a GPU (core.clock).
  logits       one tree-masked call over 16 tokens vs 16 plain one-token steps: bit-identical
               or not, the largest logit difference, greedy agreement.
  projection   tokens/s for tau = 2..5 with autotune's cost model on the measured curve and
               synthetic acceptance (core.projection), the tree autotune would pick, the
               speed-up over plain; `--bandwidth-ratio R` divides by R for a memory-bound
               guess at a slower GPU. A projection, not a measurement.
Random weights: see core.shapes. Writes gpucheck.json and gpucheck.md (core.gpureport).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import core.threads  # noqa: I001

if __name__ == "__main__":  # run as a command: choose the OpenMP policy before torch loads (core.threads)
    core.threads.start()

import torch

from core.decoding import cache as kv
from core.autotune import DEPTHS
from core.clock import median_time
from core.config import GenerationConfig, TreeConfig
from core.decoding.engine import Engine
from core.decoding.forward import forward_tree, prefill
from core.gpureport import Correctness, LogitCheck, PromptCheck, QuantResult, Report, to_markdown
from core.decoding.head import HeadCache, HeadLoadError, load_head, new_head
from core.models import LoadedModel, ModelLoadError, load_target
from core.projection import CostCurve, project, step_overheads
from core.shapes import SHAPES, build_random, free_memory, random_nf4
from core.decoding.tree import DraftTree, catch_up, draft, tree_from_parents

CONTEXTS = {"tiny": (64, 256)}  # every other shape: 512 and 2048 tokens of context
QUANTS = {"nf4": torch.float16, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
          "fp64": torch.float64}  # name -> compute dtype (nf4: bitsandbytes 4-bit weights, fp16 compute)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # new tokens in one target call
LOGIT_CHECK_TOKENS = 16


class GpuCheckError(RuntimeError):
    """The check cannot run as asked (no CUDA, no bitsandbytes, ...); the message says why."""


# ---------------------------------------------------------------- targets and heads

def load_quant(args, quant: str) -> LoadedModel:
    if args.model:
        return load_target(args.model, dtype=QUANTS[quant], device=args.device, load_in_4bit=quant == "nf4")
    if quant == "nf4":
        return random_nf4(args.shape, args.device, args.seed)
    return build_random(args.shape, QUANTS[quant], args.device, args.seed)


def make_engine(target: LoadedModel, head_folder: str | None, seed: int) -> Engine:
    """The target with `head_folder`'s head, or a random EAGLE-1 head of the matching shape."""
    if head_folder:
        head, vocab = load_head(head_folder, target.model.config, dtype=target.dtype, device=target.device)
        return Engine(target, head, vocab)
    head = new_head(target.model.config, seed=seed).to(device=target.device, dtype=target.dtype).eval()
    return Engine(target, head.requires_grad_(False))


# ---------------------------------------------------------------- correctness

def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 32000), (length,), generator=gen).tolist() for _ in range(n)]


def _answer(engine: Engine, ids: list[int], config: GenerationConfig) -> tuple[list[int], list]:
    events = list(engine.generate(ids, config))
    return [t for ev in events for t in ev.token_ids], events


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_correctness(engine: Engine, prompts, new_tokens: int, tree: TreeConfig) -> Correctness:
    """Plain and speculative greedy answers to each prompt, compared token for token."""
    plain_cfg = GenerationConfig(max_new_tokens=new_tokens, speculative=False)
    spec_cfg = GenerationConfig(max_new_tokens=new_tokens, tree=tree)
    try:
        _answer(engine, prompts[0], replace(plain_cfg, max_new_tokens=4))  # warm-up
        _answer(engine, prompts[0], replace(spec_cfg, max_new_tokens=4))
        runs = [(_answer(engine, ids, plain_cfg), _answer(engine, ids, spec_cfg)) for ids in prompts]
    except (RuntimeError, ValueError, AssertionError) as e:  # report it; the measurements still run
        return Correctness.failed(f"{type(e).__name__}: {e}")
    checks = tuple(PromptCheck(p == s, common_prefix(p, s), len(p), len(s)) for (p, _), (s, _) in runs)
    plain_ev = [ev for (_, evs), _ in runs for ev in evs[1:]]  # events[0] is the prefill
    spec_ev = [ev for _, (_, evs) in runs for ev in evs[1:]]
    step_s = lambda evs: statistics.median(ev.draft_s + ev.verify_s + ev.other_s for ev in evs)
    rate = lambda i: sum(len(r[i][0]) for r in runs) / sum(r[i][1][-1].elapsed_s for r in runs)
    return Correctness(
        prompts=checks, identical=all(c.identical for c in checks),
        agreement_rate=sum(c.identical for c in checks) / len(checks),
        mean_prefix_fraction=statistics.mean(c.tokens_before_divergence / max(1, c.plain_tokens) for c in checks),
        tau=sum(ev.accepted_length for ev in spec_ev) / len(spec_ev),
        plain_tokens_per_s=rate(0), spec_tokens_per_s=rate(1), plain_step_s=step_s(plain_ev),
        spec_step_s=step_s(spec_ev), spec_tree_size=int(statistics.median(ev.tree_size for ev in spec_ev)))


# ---------------------------------------------------------------- cost curve

def _on(tree: DraftTree, device) -> DraftTree:
    return DraftTree(tokens=tree.tokens.to(device), parents=tree.parents.to(device), depths=tree.depths.to(device))


@torch.inference_mode()
def measure_curve(engine: Engine, context: int, top_k: int, reps: int,
                  warmup: int) -> tuple[CostCurve, LogitCheck]:
    """Costs at `context` committed tokens (target calls over n new tokens, head, drafting),
    and the logit check there."""
    model, device = engine.target.model, engine.target.device
    gen = torch.Generator().manual_seed(context)
    ids = torch.randint(3, min(model.config.vocab_size, 32000), (context + max(SIZES),), generator=gen).to(device)
    ids, new = ids[:context], ids[context:].tolist()  # committed context, then the tokens of the calls
    cache = kv.new_cache(model)
    features, _ = prefill(model, ids, cache)  # features: (context, H)
    time_it = lambda fn, after=None: median_time(fn, device, reps, warmup, after)
    verify = {}
    for n in SIZES:  # a chain: with a 4D mask the cost depends on n, not on the tree's shape
        tree = _on(tree_from_parents(new[:n], [-1] + list(range(n - 1))), device)
        verify[n] = time_it(lambda t=tree: forward_tree(model, t, cache, context),
                            lambda: kv.keep(cache, context, []))
    logits = compare_logits(model, cache, context, new[:LOGIT_CHECK_TOKENS], device)
    head_s, lm_s, drafts = measure_drafting(engine, ids, features, top_k, time_it)
    return CostCurve(context, verify, head_s, lm_s, drafts), logits


def measure_drafting(engine: Engine, ids: torch.Tensor, features: torch.Tensor, top_k: int,
                     time_it) -> tuple[float, float, dict[int, float]]:
    """ids (T,), features (T, H) of the committed context -> (one head step on top_k nodes,
    the draft LM head on their outputs, {depth: catch-up of 3 tokens + drafting to it})."""
    drafter, device = engine.drafter, ids.device
    head_cache = HeadCache(engine.head.config, engine.target.dtype, device)
    root_hidden = catch_up(drafter, head_cache, ids[1:], features[:-1])  # (H,)
    committed = head_cache.length
    reset = lambda: head_cache.truncate(committed)
    allowed = torch.cat([torch.ones(top_k, committed, dtype=torch.bool, device=device),
                         torch.eye(top_k, dtype=torch.bool, device=device)], 1)  # (k, committed + k)
    positions = torch.full((top_k,), committed, device=device)
    step = lambda: drafter.feed(head_cache, ids[-top_k:], features[-top_k:], positions, allowed)  # (k, H)
    head_s = time_it(step, reset)
    out = step()
    reset()
    lm_s = time_it(lambda: drafter.log_probs(out))
    catch_s = time_it(lambda: catch_up(drafter, head_cache, ids[:3], features[:3]), reset)
    drafts = {}
    for d in DEPTHS:  # tree sizes as autotune measures them
        cfg = TreeConfig(depth=d, top_k=top_k, total_tokens=min(512, 1 + top_k + (d - 1) * top_k))
        drafts[d] = catch_s + time_it(lambda c=cfg: draft(drafter, head_cache, int(ids[-1]), root_hidden, c))
    return head_s, lm_s, drafts


def compare_logits(model, cache, context: int, tokens: list[int], device) -> LogitCheck:
    """Tree verification vs plain decoding of the same tokens, from `context` cached tokens."""
    _, tree_logits = forward_tree(model, _on(tree_from_parents(tokens, [-1] + list(range(len(tokens) - 1))), device),
                                  cache, context)  # (n, V)
    kv.keep(cache, context, [])
    plain = []
    for i, tok in enumerate(tokens):  # the engine's plain step: one token, no mask
        out = model.model(input_ids=torch.tensor([[tok]], device=device),
                          position_ids=torch.tensor([[context + i]], device=device), cache=cache, use_cache=True)
        plain.append(model.lm_head(out.last_hidden_state[0, -1]))
    kv.keep(cache, context, [])
    plain = torch.stack(plain)  # (n, V)
    diff = float((tree_logits.double() - plain.double()).abs().max())
    agree = float((tree_logits.argmax(-1) == plain.argmax(-1)).double().mean())
    return LogitCheck(context, len(tokens), torch.equal(tree_logits, plain), diff, agree)


def peak_memory(device) -> tuple[float, str]:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "torch.cuda.max_memory_allocated"
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return rss_kb / 2**20, "process peak RSS (whole run so far)"


# ---------------------------------------------------------------- the run and its report

def clamp_contexts(contexts, max_context: int) -> tuple[int, ...]:
    room = max_context - max(SIZES) - 1  # the largest call must still fit
    return tuple(sorted({max(8, min(c, room)) for c in contexts}))


def run_quant(args, quant: str) -> tuple[QuantResult, int]:
    """Load, check, measure and project one quantization; (result, prompt length)."""
    if torch.device(args.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)
    start = time.perf_counter()
    target = load_quant(args, quant)
    engine = make_engine(target, args.head, args.seed + 1)
    load_s = time.perf_counter() - start
    contexts = clamp_contexts(args.contexts or CONTEXTS.get(args.shape, (512, 2048)), target.max_context)
    length = min(args.prompt_len or contexts[0], target.max_context - args.new_tokens - args.tree.depth - 2)
    prompts = random_prompts(args.prompts, length, target.model.config.vocab_size, args.seed)
    curves, logits = zip(*(measure_curve(engine, c, args.top_k, args.reps, args.warmup) for c in contexts))
    correctness = check_correctness(engine, prompts, args.new_tokens, args.tree)
    other, plain_other = (0.0, 0.0) if correctness.error else step_overheads(
        curves[0], correctness.spec_step_s, correctness.spec_tree_size, args.tree.depth, correctness.plain_step_s)
    projections = tuple(p for c in curves for tau in args.taus
                        if (p := project(c, tau, args.top_k, other, plain_other, args.bandwidth_ratio)))
    memory, kind = peak_memory(args.device)
    del engine, target
    free_memory()
    return QuantResult(quant, load_s, memory, kind, correctness, logits, other, plain_other, curves,
                       projections), length


# ---------------------------------------------------------------- command line

def check_nf4(device: str) -> None:
    """Fail early, with the fix, when bitsandbytes cannot quantize on `device`."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise GpuCheckError("nf4 needs bitsandbytes: `pip install bitsandbytes==0.50.2` (or --quant fp16)")
    try:
        import bitsandbytes.functional as bnbf

        bnbf.quantize_4bit(torch.randn(64, 64, device=device, dtype=torch.float16), quant_type="nf4")
    except Exception as e:  # a missing native backend surfaces as several exception types
        raise GpuCheckError(f"bitsandbytes cannot quantize to nf4 on {device}: {type(e).__name__}: {e}") from e


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m core.gpucheck", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a model folder or hub id (real weights, through core.models)")
    src.add_argument("--shape", choices=sorted(SHAPES), help="a real architecture with random weights (default: tiny)")
    p.add_argument("--quant", help=f"{'|'.join(QUANTS)}|all (= fp16,nf4), or a comma list; "
                                   "default: all on cuda, fp32 on cpu")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--head", help="an EAGLE-1/2 head folder (default: a random head of the matching shape)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, help="default: the first context")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--contexts", help="comma list of context lengths (default 512,2048; tiny 64,256)")
    p.add_argument("--tree", default="6,8,60", help="depth,top_k,total_tokens of the correctness runs")
    p.add_argument("--top-k", type=int, default=8, help="top_k of the cost curve and the projection")
    p.add_argument("--taus", default="2,3,4,5", help="tokens per step to project at (comma list)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-ratio", type=float,
                   help="project to a slower GPU for memory-bound decoding: every time x R "
                        "(e.g. 5.13 = H200 4.8 TB/s / RTX 3090 0.936 TB/s)")
    p.add_argument("--out", default="runs/gpucheck", help="folder for gpucheck.json and gpucheck.md")
    a = p.parse_args(argv)
    a.shape = None if a.model else (a.shape or "tiny")
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.quant = a.quant or ("all" if a.device == "cuda" else "fp32")
    a.quants = tuple(dict.fromkeys(q for part in a.quant.split(",")
                                   for q in (("fp16", "nf4") if part == "all" else (part.strip(),))))
    bad = [q for q in a.quants if q not in QUANTS]
    if bad:
        p.error(f"unknown --quant {', '.join(bad)}; choose from {', '.join(QUANTS)}, all")
    if a.prompts < 1 or a.new_tokens < 2:
        p.error("--prompts must be >= 1 and --new-tokens >= 2")
    try:
        a.tree = TreeConfig(*(int(x) for x in a.tree.split(",")))
        a.taus = tuple(float(t) for t in a.taus.split(","))
        a.contexts = tuple(int(c) for c in a.contexts.split(",")) if a.contexts else None
    except (ValueError, TypeError) as e:  # ConfigError is a ValueError
        p.error(f"--tree, --taus or --contexts: {e}")
    return a


def _versions() -> dict[str, str]:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    if importlib.util.find_spec("bitsandbytes"):
        from importlib.metadata import version

        out["bitsandbytes"] = version("bitsandbytes")
    return out


def run(args) -> Report:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise GpuCheckError("--device cuda, but torch sees no CUDA device "
                            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); use --device cpu")
    if "nf4" in args.quants:
        check_nf4(args.device)
    runs = [run_quant(args, q) for q in args.quants]
    cuda = args.device == "cuda"
    name = torch.cuda.get_device_name(args.device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    return Report(target=args.model or args.shape, random_weights=args.model is None,
                  head=args.head or "random EAGLE-1 head", device=args.device, device_name=name,
                  versions=_versions(), prompts=args.prompts, prompt_tokens=runs[0][1], new_tokens=args.new_tokens,
                  tree=args.tree, top_k=args.top_k, bandwidth_ratio=args.bandwidth_ratio,
                  results=tuple(r for r, _ in runs))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except (GpuCheckError, ModelLoadError, HeadLoadError) as e:
        print(f"gpucheck: error: {e}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    markdown = to_markdown(report)
    (out / "gpucheck.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    (out / "gpucheck.md").write_text(markdown)
    print(markdown)
    print(f"wrote {out / 'gpucheck.json'} and {out / 'gpucheck.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

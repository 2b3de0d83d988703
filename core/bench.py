"""Benchmark: `python -m core.bench [--modes plain,eagle,eagle-head,lookup,hf,hf-lookup,llama.cpp] [--out results.json] ...`.

Every mode answers the same prompts on the SAME model object, dtype and torch threads:
  plain      our decode loop without speculation (one target forward per token)
  eagle      our decode loop with the EAGLE draft head and tree verification (with the
             tree's context lookup, core.decoding.lookup)
  eagle-head the same without context lookup: what the head's tree alone accepts
  lookup     our decode loop with speculation by context lookup alone (no head: what a model without one runs;
             a step with nothing to copy is a plain step)
  hf         transformers' `model.generate` (greedy or sampled), what a user runs instead, on
             the same weights and dtype with transformers' stock kernels (sdpa attention)
  hf-fp32    `generate` on an fp32 copy of the target: what a plain transformers user gets
  hf-lookup  transformers' prompt-lookup decoding, `generate(prompt_lookup_num_tokens=k)`
  llama.cpp  llama.cpp's `llama-server` (core.llamacpp; --llama-cpp DIR or $EAGLE_CHAT_LLAMA_CPP)
             on the GGUF the target came from, given our chat template's token ids and the
             same token budget, threads and sampling; its own timings
Prompts are MT-bench style: later turns are asked after the mode's OWN answer to the
earlier ones. Each mode gets one warm-up generation, then the modes are interleaved per
prompt (order rotated from prompt to prompt) so machine noise hits all of them alike.
--prefill-tokens 1000,4000 also times the first token of long prompts (median of
PREFILL_REPS, interleaved): ours against llama.cpp's prompt processing; with
--long-decode-tokens N also the decode speed of the next N tokens after those prompts (a long
chat's replies: attention then reads thousands of cached keys per token), eagle with the
tree's long-context caps as the app serves it, and whether its answers equal plain's.

Words used in the results: `tokens` generated tokens; `seconds` wall time of the
generation calls (prefill included, prompt templating excluded); `first_token_s` mean time
until the first token (prefill; eagle also its head's catch-up on the prompt);
`decode_tokens_per_s` tokens after the first over the seconds after it (llama.cpp:
`predicted_per_second`, as llama-bench's tg measures); `target_forwards` target
model calls (hf modes: counted with a forward hook); `tau` tokens per target forward;
`accepted_length_histogram` (eagle modes) tokens committed per speculative step, bonus included.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import core.threads  # noqa: I001
from core.threads import set_threads

if __name__ == "__main__":  # run as a command: choose the OpenMP policy before torch loads (core.threads)
    core.threads.start()

import torch

from core.config import (WEIGHTS, WEIGHTS_HELP, ConfigError, GenerationConfig, SamplingConfig, TreeConfig,
                         add_tree_args, tree_changes)
from core.decoding.engine import Engine, EngineError, lookup_alone
from core.decoding.forward import uses_exact_kernels
from core.kernels.invariant import make_invariant, undo_invariant
from core.decoding.head import HeadLoadError, new_head
from core.decoding.head3 import draft_weights
from core.llamacpp import ENV as LLAMA_CPP_ENV, LlamaCppError, LlamaServer, find_server
from core.models import DEFAULT_HEAD_DIR, EMBEDDED, ModelLoadError, load_target
from core.decoding.treestore import BUILT_IN

BUILTIN_PROMPTS = Path(__file__).with_name("bench_prompts.jsonl")
LLAMA_CPP = "llama.cpp"
MODE_NAMES = ("plain", "eagle", "eagle-head", "lookup", "hf", "hf-fp32", "hf-lookup", LLAMA_CPP)
DEFAULT_MODES = ("plain", "eagle", "hf", "hf-lookup")  # and llama.cpp where a build is given
ENGINE_MODES = ("plain", "eagle", "eagle-head", "lookup")
SPEC_MODES = ("eagle", "eagle-head")  # eagle-head: the head's tree alone, no context lookup
WARMUP_TOKENS = 16
PREFILL_REPS = 3


class BenchError(ValueError):
    """Bad benchmark input (prompt file, modes, settings); the message says what to fix."""


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    tree: TreeConfig = field(default_factory=TreeConfig)
    tree_source: str = "manual"  # "manual", "auto", or why auto fell back to defaults
    lookup_tokens: int = 10      # hf-lookup: prompt_lookup_num_tokens
    warmup: bool = True
    adaptive: bool = False       # eagle modes: GenerationConfig.adaptive (the app's default)
    copy_tokens: int | None = None  # lookup mode's chain length (--lookup); None: what an engine without a head copies

    def __post_init__(self) -> None:
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise BenchError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not (isinstance(self.lookup_tokens, int) and self.lookup_tokens >= 1):
            raise BenchError(f"lookup_tokens must be an integer >= 1, got {self.lookup_tokens!r}")


@dataclass(frozen=True)
class Generation:
    """One answer (one turn) of one mode."""

    output_ids: tuple[int, ...]
    seconds: float
    target_forwards: int
    accepted_lengths: tuple[int, ...] = ()  # eagle: tokens committed per speculative step
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    first_s: float | None = None  # seconds until the first tokens arrived (None: not measured)
    first_n: int = 1              # how many came then (prompt lookup verifies several at once)


# ---------------------------------------------------------------------------- prompts

def _parse_prompt(obj, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise BenchError(f"{where}: expected a JSON object {{\"id\", \"category\", \"turns\"}}")
    missing = [k for k in ("id", "category", "turns") if k not in obj]
    if missing:
        raise BenchError(f"{where}: missing field(s) {', '.join(missing)}")
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns:
        raise BenchError(f"{where}: \"turns\" must be a non-empty list of strings")
    if not all(isinstance(t, str) and t.strip() for t in turns):
        raise BenchError(f"{where}: every turn must be a non-empty string")
    if not isinstance(obj["category"], str):
        raise BenchError(f"{where}: \"category\" must be a string")
    return Prompt(id=str(obj["id"]), category=obj["category"], turns=tuple(turns))


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read a prompts file, one JSON object a line; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(f"prompts file {path} does not exist")
    prompts, seen = [], set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
        prompt = _parse_prompt(obj, where)
        if prompt.id in seen:
            raise BenchError(f"{where}: duplicate prompt id {prompt.id!r}")
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise BenchError(f"prompts file {path} holds no prompts")
    return prompts


def parse_modes(modes: str | Sequence[str]) -> list[str]:
    names = [m.strip() for m in modes.split(",")] if isinstance(modes, str) else list(modes)
    unknown = [m for m in names if m not in MODE_NAMES]
    if unknown or not names:
        raise BenchError(f"unknown mode(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
                         f"choose from {', '.join(MODE_NAMES)}")
    if len(set(names)) != len(names):
        raise BenchError(f"a mode is listed twice in {','.join(names)}")
    return names


# ---------------------------------------------------------------------------- modes

def _engine_generate(engine: Engine, ids: list[int], s: BenchSettings, seed: int,
                     speculative: bool, head: bool = True) -> Generation:
    config = GenerationConfig(max_new_tokens=s.max_new_tokens, speculative=speculative, tree=s.tree,
                              sampling=s.sampling, seed=seed, adaptive=s.adaptive and speculative,
                              reuse_prompt=False, head=head)  # every mode reads the prompt from its start
    tokens, lengths, split = [], [], [0.0, 0.0, 0.0]
    forwards, first = 0, None
    start = time.perf_counter()
    for ev in engine.generate(ids, config):
        if first is None:
            first = time.perf_counter() - start
        tokens += ev.token_ids
        forwards = ev.target_forwards
        split = [split[0] + ev.draft_s, split[1] + ev.verify_s, split[2] + ev.other_s]
        if ev.tree_size:  # a speculative step (the prefill and plain steps have none)
            lengths.append(len(ev.token_ids))
    seconds = time.perf_counter() - start
    return Generation(tuple(tokens), seconds, forwards, tuple(lengths), *split, first_s=first)


class _CountForwards:
    """Counts calls of `model.forward` (what transformers' generate runs once per target call)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.count = model, 0

    def __enter__(self) -> "_CountForwards":
        self.handle = self.model.register_forward_hook(self._hook)
        return self

    def _hook(self, *_) -> None:
        self.count += 1

    def __exit__(self, *_) -> None:
        self.handle.remove()


class _FirstTokens:
    """A transformers streamer that notes when generate's first tokens arrive: its first `put`
    is the prompt, the second the first token (prompt lookup: the first verified chain)."""

    def __init__(self):
        self.puts, self.at, self.n = 0, None, 1

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at, self.n = time.perf_counter(), value.numel()

    def end(self) -> None:
        pass


def _truncate(ids: list[int], eos: Iterable[int], limit: int) -> tuple[int, ...]:
    """Cut after the first eos and at `limit`, the engine's stop rules."""
    eos = set(eos)
    end = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
    return tuple(ids[:min(end, limit)])


def _hf_generate(engine: Engine, ids: list[int], s: BenchSettings, seed: int,
                 lookup: int | None) -> Generation:
    from transformers import GenerationConfig as HFGenerationConfig

    target, sp = engine.target, s.sampling
    eos = list(target.eos_ids)
    budget = min(s.max_new_tokens, target.max_context - len(ids))
    sampled = {} if sp.greedy else {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k}
    config = HFGenerationConfig(max_new_tokens=budget, do_sample=not sp.greedy, eos_token_id=eos,
                                pad_token_id=eos[0], prompt_lookup_num_tokens=lookup, **sampled)
    x = torch.tensor([ids], device=target.device)
    torch.manual_seed(seed)
    first = _FirstTokens()
    with torch.inference_mode(), stock_kernels(target.model), _CountForwards(target.model) as counter:
        start = time.perf_counter()
        out = target.model.generate(x, attention_mask=torch.ones_like(x), generation_config=config, streamer=first)
        seconds = time.perf_counter() - start
    return Generation(_truncate(out[0, len(ids):].tolist(), eos, budget), seconds, counter.count,
                      first_s=None if first.at is None else first.at - start, first_n=first.n)


@contextlib.contextmanager
def stock_kernels(model):
    """transformers' own kernels for the duration (generate is not asked to be batch-invariant)."""
    exact = uses_exact_kernels(model)
    if exact:
        undo_invariant(model, "sdpa")
    try:
        yield
    finally:
        if exact:
            make_invariant(model)


@functools.lru_cache(maxsize=1)
def _fp32_engine(name: str, device: str) -> Engine:
    """An fp32 copy of the target for the hf-fp32 mode (loaded once)."""
    return Engine(load_target(name, dtype="float32", device=device))


def _hf_fp32(engine: Engine, ids: list[int], s: BenchSettings, seed: int) -> Generation:
    return _hf_generate(_fp32_engine(engine.target.name, str(engine.target.device)), ids, s, seed, None)


def _llama_cpp(engine: Engine, ids: list[int], s: BenchSettings, seed: int, *, server: LlamaServer) -> Generation:
    """llama.cpp's answer, timed by llama.cpp itself: prompt processing, then predicted_n - 1 steps."""
    budget = min(s.max_new_tokens, engine.max_context - len(ids))
    sp = s.sampling
    c = server.complete(ids, budget, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=seed)
    return Generation(_truncate(list(c.tokens), engine.target.eos_ids, budget), (c.prompt_ms + c.predicted_ms) / 1e3,
                      c.predicted_n, first_s=c.prompt_ms / 1e3)


Runner = Callable[[Engine, list[int], BenchSettings, int], Generation]


def lookup_alone_tree(engine: Engine, s: BenchSettings) -> TreeConfig:
    """What the lookup mode runs: the tree of an engine without a head on this machine (`lookup_alone`: its chain
    length, not the head's tree's), with --lookup's length where given."""
    tree = lookup_alone(engine.step).tree
    return tree if s.copy_tokens is None else replace(tree, lookup=s.copy_tokens)


def _lookup_alone(engine: Engine, ids: list[int], s: BenchSettings, seed: int) -> Generation:
    """Speculation by context lookup alone, as a model without a head speculates (lookup_alone_tree)."""
    return _engine_generate(engine, ids, replace(s, tree=lookup_alone_tree(engine, s)), seed, speculative=True,
                            head=False)


MODES: dict[str, Runner] = {
    "plain": functools.partial(_engine_generate, speculative=False),
    "eagle": functools.partial(_engine_generate, speculative=True),
    "eagle-head": lambda engine, ids, s, seed: _engine_generate(engine, ids, replace(s, tree=replace(s.tree, lookup=0)),
                                                                seed, speculative=True),
    "lookup": _lookup_alone,
    "hf": functools.partial(_hf_generate, lookup=None),
    "hf-fp32": _hf_fp32,
    "hf-lookup": lambda engine, ids, s, seed: _hf_generate(engine, ids, s, seed, s.lookup_tokens),
    LLAMA_CPP: _llama_cpp,  # run_benchmark gives it the server
}


def _no_llama_cpp() -> BenchError:
    return BenchError(f"mode {LLAMA_CPP!r} needs a llama.cpp build: --llama-cpp DIR (its bin folder, holding "
                      f"llama-server) or {LLAMA_CPP_ENV}=DIR")


def runners(modes: Sequence[str], llama: LlamaServer | None) -> dict[str, Runner]:
    """Each mode's runner; llama.cpp's needs a started server."""
    if LLAMA_CPP in modes and llama is None:
        raise _no_llama_cpp()
    return {m: functools.partial(MODES[m], server=llama) if m == LLAMA_CPP else MODES[m] for m in modes}


def run_conversation(engine: Engine, prompt: Prompt, run: Runner, s: BenchSettings, seed: int) -> list[Generation]:
    """All turns of one prompt in one mode; each turn's history holds this mode's own answers."""
    messages, answers = [], []
    for t, turn in enumerate(prompt.turns):
        messages.append({"role": "user", "content": turn})
        ids = engine.encode(messages)
        if len(ids) >= engine.max_context:
            raise BenchError(f"prompt {prompt.id!r}, turn {t + 1}: {len(ids)} tokens do not fit the "
                             f"model's context of {engine.max_context}")
        answers.append(run(engine, ids, s, seed + t))
        text = engine.target.tokenizer.decode(list(answers[-1].output_ids), skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
    return answers


def mode_order(modes: Sequence[str], i: int) -> list[str]:
    """Prompt i runs the modes rotated by i, so no mode always runs first (or last)."""
    k = i % len(modes)
    return list(modes[k:]) + list(modes[:k])


def run_benchmark(engine: Engine, prompts: Sequence[Prompt], modes: str | Sequence[str],
                  settings: BenchSettings = BenchSettings(), *, head_name: str | None = None,
                  progress: bool = False, llama: LlamaServer | None = None) -> dict:
    """Run every mode on every prompt (interleaved) and return the results dict (see module doc).
    `llama`: a started llama.cpp server, for mode llama.cpp."""
    from tqdm import tqdm

    modes = parse_modes(modes)
    spec = [m for m in modes if m in SPEC_MODES]
    if spec and not engine.has_head:
        raise BenchError(f"mode {spec[0]!r} needs a draft head; load one (--head) or drop the mode")
    if not prompts:
        raise BenchError("no prompts to run")
    run = runners(modes, llama)
    load_before = os.getloadavg()[0]
    if settings.warmup:
        warm = replace(settings, max_new_tokens=min(WARMUP_TOKENS, settings.max_new_tokens))
        for mode in modes:
            run[mode](engine, engine.encode(prompts[0].turns[0]), warm, settings.seed)
    runs: dict[str, list[list[Generation]]] = {m: [] for m in modes}
    with tqdm(total=len(prompts) * len(modes), disable=not progress, file=sys.stderr, unit="run") as bar:
        for i, prompt in enumerate(prompts):
            for mode in mode_order(modes, i):
                bar.set_description(f"{prompt.id} [{mode}]")
                runs[mode].append(run_conversation(engine, prompt, run[mode], settings, settings.seed + 100 * i))
                bar.update()
    result = _header(engine, settings, head_name, prompts, (load_before, os.getloadavg()[0]))
    if llama is not None:
        result["llama_cpp"] = llama.describe()
    result.update(_summaries(prompts, runs, settings.sampling.greedy))
    return result


# ---------------------------------------------------------------------------- time to first token

def prefill_prompt(engine: Engine, tokens: int) -> list[int]:
    """About `tokens` prompt tokens: a summary request over a fixed document (core.autotune.long_prompt)."""
    from core.autotune import long_prompt

    overhead = len(engine.encode(long_prompt(engine, 0)))
    ids = engine.encode(long_prompt(engine, max(tokens - overhead, 0)))
    if len(ids) >= engine.max_context:
        raise BenchError(f"--prefill-tokens {tokens}: the prompt does not fit the model's context of "
                         f"{engine.max_context}")
    return ids


@dataclass(frozen=True)
class LongAnswer:
    """One answer to a long prompt: seconds to its first token, then `decode` tokens/s over the
    tokens after the first (None when it wrote only one), and its token ids."""

    first_token_s: float
    decode: float | None
    tokens: tuple[int, ...]


def _our_long_answer(engine: Engine, ids: list[int], speculative: bool, tree: TreeConfig,
                     new_tokens: int, adaptive: bool = False) -> LongAnswer:
    """The engine's first event (eagle: after its head's catch-up on the prompt too), then up to
    `new_tokens` - 1 more tokens, greedy."""
    stream = engine.generate(ids, GenerationConfig(max_new_tokens=max(new_tokens, 2), speculative=speculative,
                                                   tree=tree, adaptive=adaptive and speculative, reuse_prompt=False))
    start = time.perf_counter()
    first = next(stream)
    first_s = time.perf_counter() - start
    tokens = list(first.token_ids)
    if new_tokens <= 1:
        stream.close()
        return LongAnswer(first_s, None, tuple(tokens))
    for ev in stream:
        tokens += ev.token_ids
    seconds = time.perf_counter() - start - first_s
    after = len(tokens) - len(first.token_ids)
    return LongAnswer(first_s, after / seconds if after and seconds > 0 else None, tuple(tokens))


def _llama_long_answer(llama: LlamaServer, ids: list[int], new_tokens: int) -> LongAnswer:
    c = llama.complete(ids, max(new_tokens, 1))
    # predicted_ms spans predicted_n - 1 decoding steps (core.llamacpp), as our tokens after the first
    decode = (c.predicted_n - 1) / (c.predicted_ms / 1e3) if new_tokens > 1 and c.predicted_ms > 0 else None
    return LongAnswer(c.prompt_ms / 1e3, decode, c.tokens)


def measure_prefill(engine: Engine, lengths: Sequence[int], modes: Sequence[str], settings: BenchSettings,
                    llama: LlamaServer | None = None, reps: int = PREFILL_REPS, decode_tokens: int = 0) -> dict:
    """Time to first token for prompts of about `lengths` tokens: plain (and eagle, where it is among
    `modes`) against llama.cpp's prompt processing (prompt_ms), interleaved, median of `reps`.
    With `decode_tokens` > 1 each answer goes on to that many tokens (greedy), and the rows also
    give the decode speed after the first token (median) and whether eagle's answers equal plain's."""
    new = decode_tokens if decode_tokens > 1 else 1
    answer = {"plain": lambda ids: _our_long_answer(engine, ids, False, settings.tree, new)}
    if "eagle" in modes and engine.has_head:
        answer["eagle"] = lambda ids: _our_long_answer(engine, ids, True, settings.tree, new, settings.adaptive)
    if llama is not None:
        answer[LLAMA_CPP] = lambda ids: _llama_long_answer(llama, ids, new)
    rows = []
    for n in lengths:
        ids = prefill_prompt(engine, n)
        if settings.warmup and not rows:
            for fn in answer.values():
                fn(ids)
        runs = {m: [] for m in answer}
        for r in range(reps):
            for m in mode_order(list(answer), r):
                runs[m].append(answer[m](ids))
        row = {"asked_tokens": n, "prompt_tokens": len(ids),
               "first_token_s": {m: statistics.median(a.first_token_s for a in got) for m, got in runs.items()},
               "runs_s": {m: [a.first_token_s for a in got] for m, got in runs.items()}}
        if new > 1:
            row["decode_tokens"] = new
            row["decode_tokens_per_s"] = {m: statistics.median(a.decode for a in got if a.decode)
                                          for m, got in runs.items() if any(a.decode for a in got)}
            if "eagle" in runs:
                tree = settings.tree.at(len(ids))
                capped = not settings.tree.speculates_at(len(ids))
                row["eagle_tree_there"] = (f"depth {tree.depth}, {tree.total_tokens} tokens" if not capped
                                           else "starts plain (long-context cap), speculates where measured faster"
                                           if settings.adaptive
                                           else "plain decoding (long-context cap)")
                row["eagle_identical"] = all(a.tokens == b.tokens for a, b in zip(runs["eagle"], runs["plain"]))
        rows.append(row)
    return {"reps": reps, "statistic": "median", "rows": rows}


# ---------------------------------------------------------------------------- results

FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")  # what the kernels use


def machine() -> dict:
    """Which machine the figures come from: the CPU's name, cores, the instruction sets our kernels
    and llama.cpp's use, and the memory."""
    from core.decoding.probe import _cpu_name
    from core.kernels.native import _cpu_flags

    flags = _cpu_flags()
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        memory = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        memory = None
    return {"cpu": _cpu_name() or "unknown", "cores": os.cpu_count(),
            "features": [f for f in FEATURES if f in flags], "memory_gib": memory}


def resident_memory() -> dict | None:
    """This process's resident memory now and its peak so far, in MB (VmRSS and VmHWM of Linux's
    /proc/self/status); None where the system does not say. Taken right after the model and head
    load, it is what the app holds for them (the same Engine.load)."""
    try:
        with open("/proc/self/status") as f:
            kib = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if k in ("VmRSS", "VmHWM")}
        return {"resident_mb": round(kib["VmRSS"] / 1024), "peak_mb": round(kib["VmHWM"] / 1024)}
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _header(engine: Engine, s: BenchSettings, head_name: str | None, prompts: Sequence[Prompt],
            load: tuple[float, float]) -> dict:
    import transformers

    return {
        "model": engine.target.name,
        "head": head_name or ("loaded" if engine.has_head else None),
        "device": str(engine.target.device),
        "dtype": str(engine.target.dtype).removeprefix("torch."),
        "numerics": engine.numerics.describe(),
        "draft_weights": draft_weights(engine.drafter) if engine.has_head else None,
        "threads": torch.get_num_threads(),
        "thread_policy": core.threads.policy().describe(),
        "settings": {"max_new_tokens": s.max_new_tokens, "temperature": s.sampling.temperature,
                     "top_p": s.sampling.top_p, "top_k": s.sampling.top_k, "seed": s.seed,
                     "tree": asdict(s.tree), "tree_source": s.tree_source, "lookup_tokens": s.lookup_tokens,
                     "lookup_alone": lookup_alone_tree(engine, s).lookup,
                     "warmup": s.warmup, "adaptive": s.adaptive, "prompts": len(prompts), "turns": sum(len(p.turns) for p in prompts),
                     "order": "modes interleaved per prompt, rotated"},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "machine": machine(),
        "load_average_1min": {"start": round(load[0], 2), "end": round(load[1], 2)},
    }


def _mode_summary(mode: str, prompts: Sequence[Prompt], runs: list[list[Generation]]) -> dict:
    flat = [g for turns in runs for g in turns]
    tokens = sum(len(g.output_ids) for g in flat)
    seconds = sum(g.seconds for g in flat)
    forwards = sum(g.target_forwards for g in flat)
    out = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
           **_decode_summary(flat), "target_forwards": forwards, "tau": tokens / forwards,
           "per_prompt": [{"id": p.id, "category": p.category, "tokens": sum(len(g.output_ids) for g in turns),
                           "seconds": sum(g.seconds for g in turns),
                           "target_forwards": sum(g.target_forwards for g in turns),
                           "output_ids": [list(g.output_ids) for g in turns]}  # one list per turn
                          for p, turns in zip(prompts, runs)]}
    if mode in ENGINE_MODES:
        out["time_split"] = {"draft_s": sum(g.draft_s for g in flat), "verify_s": sum(g.verify_s for g in flat),
                             "other_s": sum(g.other_s for g in flat)}
    if mode in SPEC_MODES + ("lookup",):
        lengths = [n for g in flat for n in g.accepted_lengths]
        out["accepted_length_histogram"] = {str(n): lengths.count(n) for n in sorted(set(lengths))}
        out["mean_accepted_length"] = sum(lengths) / len(lengths) if lengths else None
    return out


def _decode_summary(flat: Sequence[Generation]) -> dict:
    """Mean time to the first tokens, and tokens/s after them (None where a mode did not time them)."""
    if not flat or any(g.first_s is None for g in flat):
        return {"first_token_s": None, "decode_tokens_per_s": None}
    after = sum(g.seconds - g.first_s for g in flat)
    tokens = sum(max(len(g.output_ids) - g.first_n, 0) for g in flat)
    return {"first_token_s": sum(g.first_s for g in flat) / len(flat),
            "decode_tokens_per_s": tokens / after if after > 0 else None}


def _ratios(modes: dict, base: str, key: str = "tokens_per_s") -> dict:
    if base not in modes or not modes[base][key]:
        return {}
    return {m: v[key] / modes[base][key] for m, v in modes.items() if v[key] is not None}


def _summaries(prompts: Sequence[Prompt], runs: dict[str, list[list[Generation]]], greedy: bool) -> dict:
    modes = {m: _mode_summary(m, prompts, r) for m, r in runs.items()}
    identical, agreement = {}, {}
    if "plain" in runs:  # sampled: our modes draw a token from the seed and its position, others their own way
        ref = [[g.output_ids for g in turns] for turns in runs["plain"]]
        for m, r in runs.items():
            if not greedy and m not in ENGINE_MODES:
                continue
            same = [[g.output_ids for g in turns] == want for turns, want in zip(r, ref)]
            identical[m], agreement[m] = all(same), sum(same) / len(same)
    return {"modes": modes, "speedup_vs_plain": _ratios(modes, "plain"), "speedup_vs_hf": _ratios(modes, "hf"),
            "speedup_vs_hf_fp32": _ratios(modes, "hf-fp32"),
            "decode_speedup_vs_llama_cpp": _ratios(modes, LLAMA_CPP, "decode_tokens_per_s"),
            "identical_to_plain": identical, "prompts_identical_to_plain": agreement}


def write_results(result: dict, path: str | Path) -> Path:
    """JSON with lists of ids kept on one line each."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2)
    text = re.sub(r"\[[\d,\s]*\]", lambda m: json.dumps(json.loads(m.group(0))), text)
    path.write_text(text + "\n")
    return path


def format_table(result: dict) -> str:
    rows = [("mode", "tokens", "seconds", "tok/s", "decode tok/s", "fwd", "tau", "vs plain", "vs hf", "vs hf-fp32",
             "= plain")]
    for m, v in result["modes"].items():
        ratio = lambda key: f"{result[key][m]:.2f}x" if m in result[key] else "-"  # noqa: E731
        same = result["identical_to_plain"].get(m)
        decode = v.get("decode_tokens_per_s")
        rows.append((m, str(v["tokens"]), f"{v['seconds']:.1f}", f"{v['tokens_per_s']:.1f}",
                     "-" if decode is None else f"{decode:.1f}",
                     str(v["target_forwards"]), f"{v['tau']:.2f}", ratio("speedup_vs_plain"),
                     ratio("speedup_vs_hf"), ratio("speedup_vs_hf_fp32"),
                     "-" if same is None else ("yes" if same else "NO")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    if "eagle" in result["modes"]:
        split = result["modes"]["eagle"]["time_split"]
        eagle = result["modes"]["eagle"]
        lines.append("eagle time: " + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in split.items()) +
                     f" (draft share {split['draft_s'] / eagle['seconds']:.0%}); tree {result['settings']['tree']}; "
                     f"accepted lengths {eagle['accepted_length_histogram']}")
    lines += _llama_cpp_lines(result)
    if "machine" in result:
        m = result["machine"]
        lines.append(f"machine: {m['cpu']}, {m['cores']} cores, {' '.join(m['features']) or 'no AVX2'}"
                     + (f", {m['memory_gib']} GiB" if m.get("memory_gib") else ""))
    lines.append(f"numerics: {result.get('numerics', '?')}"
                 + (f"; draft head weights: {result['draft_weights']}" if result.get("draft_weights") else ""))
    if "thread_policy" in result:
        lines.append(f"threads: {result['threads']} ({result['thread_policy']})")
    if result.get("memory_after_load"):
        m = result["memory_after_load"]
        lines.append(f"memory after loading the model{' and head' if result.get('head') else ''}: "
                     f"{m['resident_mb']:,} MB resident (peak {m['peak_mb']:,} MB while loading)")
    lines += _prefill_lines(result)
    return "\n".join(lines)


def _prefill_lines(result: dict) -> list[str]:
    """The long prompts' rows: time to first token, and the decode after it where measured."""
    lines = []
    for row in result.get("prefill", {}).get("rows", []):
        times = ", ".join(f"{m} {s:.3f} s" for m, s in row["first_token_s"].items())
        lines.append(f"time to first token, {row['prompt_tokens']:,} prompt tokens (median of "
                     f"{result['prefill']['reps']}): {times}")
        if row.get("decode_tokens_per_s"):
            speeds = ", ".join(f"{m} {v:.1f} tok/s" for m, v in row["decode_tokens_per_s"].items())
            same = "" if "eagle_identical" not in row else \
                (f"; eagle's tree there: {row['eagle_tree_there']}, its answers "
                 f"{'identical to' if row['eagle_identical'] else 'DIFFER from'} plain's")
            lines.append(f"  then {row['decode_tokens']} tokens: {speeds}{same}")
    return lines


def _llama_cpp_lines(result: dict) -> list[str]:
    """Our decode speeds over llama.cpp's, and how far its greedy answers matched plain's."""
    ratios = result.get("decode_speedup_vs_llama_cpp") or {}
    if not ratios:
        return []
    ours = ", ".join(f"{m} {r:.2f}x" for m, r in ratios.items() if m != LLAMA_CPP)
    line = f"decode tok/s over llama.cpp's: {ours or '-'}"
    agreement = result["prompts_identical_to_plain"].get(LLAMA_CPP)
    if agreement is not None:
        line += (f"; llama.cpp's greedy answers equal plain's on {agreement:.0%} of the prompts (its own "
                 "numerics: a different answer is not an error)")
    return [line]


def write_plot(result: dict, path: str | Path) -> Path:
    """Tokens/s per mode, and (with eagle) the accepted-length histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eagle = result["modes"].get("eagle")
    fig, axes = plt.subplots(1, 2 if eagle else 1, figsize=(11 if eagle else 6, 4), squeeze=False)
    names = list(result["modes"])
    speeds = [result["modes"][m]["tokens_per_s"] for m in names]
    ax = axes[0][0]
    ax.bar(names, speeds, color=["tab:orange" if m == "eagle" else "tab:gray" for m in names])
    for x, y in enumerate(speeds):
        ax.annotate(f"{y:.1f}", (x, y), ha="center", va="bottom")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{result['model']} {result['dtype']}, {result['threads']} threads, "
                 f"T={result['settings']['temperature']}", fontsize=9)
    if eagle:
        hist = eagle["accepted_length_histogram"]
        ax = axes[0][1]
        lengths = [int(k) for k in hist]
        ax.bar(lengths, list(hist.values()), color="tab:orange")
        ax.set_xticks(range(1, max(lengths, default=1) + 1))
        ax.set_xlabel("tokens committed per step (accepted drafts + bonus)")
        ax.set_ylabel("steps")
        tree = result["settings"]["tree"]
        ax.set_title(f"eagle: tau {eagle['tau']:.2f} tokens per target forward; tree depth {tree['depth']}, "
                     f"top-k {tree['top_k']}, {tree['total_tokens']} tokens", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- CLI

def auto_tree(engine: Engine) -> tuple[TreeConfig, str]:
    """The tree the app drafts with: tuned on this machine (`python -m core.autotune`), else the
    one shipped beside the head; only where neither exists is one tuned now (cost model plus the
    end-to-end check of its best trees), and TreeConfig defaults where autotune is missing."""
    if engine.tree_origin != BUILT_IN:
        return engine.default_tree, f"auto ({engine.tree_origin})"
    try:
        from core.autotune import choose_tree
    except ModuleNotFoundError as e:
        if e.name != "core.autotune":
            raise
        return TreeConfig(), "auto unavailable (no core.autotune): TreeConfig defaults"
    return choose_tree(engine, confirm_top=4), "auto (tuned now)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m core.bench", description=__doc__.splitlines()[0])
    p.add_argument("--prompts", help=f"JSONL prompts file (default: built-in {BUILTIN_PROMPTS.name})")
    p.add_argument("--modes", help=f"comma-separated: {','.join(MODE_NAMES)} (default: {','.join(DEFAULT_MODES)}, "
                   f"and {LLAMA_CPP} where a llama.cpp build is given)")
    p.add_argument("--limit", type=int, help="only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree", choices=("auto", "manual"), help="auto (default unless --depth/--top-k/--total-tokens): "
                   "the tree the app drafts with, tuned now where none is tuned or shipped; manual: the engine's "
                   "default tree with those settings over it (TreeConfig.override: its lookup and long-chat caps "
                   "stay). Mode eagle-head always runs without lookup")
    add_tree_args(p)
    p.add_argument("--lookup-tokens", type=int, default=10, help="hf-lookup: prompt_lookup_num_tokens")
    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--head", default="default",
                   help="folder or hub id; 'default' = shipped head; 'random' = untrained head (exact, slow)")
    p.add_argument("--dtype", default="auto", help="auto: bf16 with exact kernels on CPU where the probe "
                   "passes, else fp32")
    p.add_argument("--attention", default="auto", help="auto, exact, sdpa or eager")
    p.add_argument("--weights", default="auto", choices=WEIGHTS, help=WEIGHTS_HELP)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch threads (default: every core on a quiet machine, the idle ones on a busy one)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--out", help="write results JSON here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--llama-cpp", metavar="DIR", help=f"a llama.cpp build's bin folder (holding llama-server): "
                   f"adds mode {LLAMA_CPP}, and llama.cpp's prompt processing to --prefill-tokens "
                   f"[default: ${LLAMA_CPP_ENV}]")
    p.add_argument("--llama-cpp-args", default="", metavar="ARGS",
                   help="more llama-server arguments, e.g. --llama-cpp-args=--no-repack (where its AMX kernels die)")
    p.add_argument("--gguf", help=f"the GGUF mode {LLAMA_CPP} runs [default: the one the target came from, the "
                   "embedded model's]; e.g. a BF16 copy made with llama-quantize")
    p.add_argument("--prefill-tokens", metavar="N,N", help="also time the first token of prompts of about N tokens "
                   "(e.g. 1000,4000): ours, and llama.cpp's prompt processing where a build is given")
    p.add_argument("--adaptive", action="store_true", help="eagle modes: each step runs the mode measured "
                   "faster in the answer (the app's default; GenerationConfig.adaptive)")
    p.add_argument("--long-decode-tokens", type=int, default=0, metavar="N",
                   help="with --prefill-tokens: each long prompt's answer goes on to N tokens (greedy), and the "
                   "decode speed after its first token is reported too (a long chat's replies)")
    return p.parse_args(argv)


def parse_lengths(text: str | None) -> list[int]:
    """--prefill-tokens "1000,4000" -> [1000, 4000]."""
    if not text:
        return []
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise BenchError(f"--prefill-tokens wants prompt lengths like 1000,4000, got {text!r}")
    return lengths


def llama_cpp_dir(a: argparse.Namespace) -> str | None:
    return a.llama_cpp or os.environ.get(LLAMA_CPP_ENV) or None


def llama_cpp_args(a: argparse.Namespace) -> list[str]:
    try:
        return shlex.split(a.llama_cpp_args)
    except ValueError as e:
        raise BenchError(f"--llama-cpp-args {a.llama_cpp_args!r}: {e}") from e


def llama_cpp_choice(a: argparse.Namespace, modes: Sequence[str], lengths: Sequence[int]) -> Path | None:
    """The llama-server to run (None: none needed or none given); a bad setup is refused before the model loads."""
    folder = llama_cpp_dir(a)
    if folder is None:
        if LLAMA_CPP in modes:
            raise _no_llama_cpp()
        return None
    if a.gguf is not None and not Path(a.gguf).is_file():
        raise BenchError(f"--gguf {a.gguf} is not a file")
    llama_cpp_args(a)
    return find_server(folder) if LLAMA_CPP in modes or lengths else None


def start_llama_cpp(a: argparse.Namespace, exe: Path | None, engine: Engine) -> LlamaServer | contextlib.nullcontext:
    """A llama-server for the benchmark (to enter), or a stand-in that gives None where none is to run."""
    if exe is None:
        return contextlib.nullcontext()
    gguf = a.gguf or engine.target.gguf
    if gguf is None:
        raise BenchError(f"mode {LLAMA_CPP} runs the GGUF the target came from, and {engine.target.name} came from "
                         "none: give --gguf FILE")
    return LlamaServer(exe, gguf, torch.get_num_threads(), engine.max_context, llama_cpp_args(a))


def _tree_choice(a: argparse.Namespace) -> tuple[bool, dict[str, int]]:
    """(manual?, the tree settings given), checked before the model loads; refuses auto mixed
    with settings of the tree's shape (--lookup goes with either)."""
    given = tree_changes(a)
    shaped = any(k != "lookup" for k in given)
    if a.tree == "auto" and shaped:
        raise BenchError("--tree auto chooses the tree itself; drop --depth/--top-k/--total-tokens")
    return shaped or a.tree == "manual", given


def bench_tree(engine: Engine, manual: bool, given: dict[str, int], spec: bool) -> tuple[TreeConfig, str]:
    """(the tree the eagle modes draft with, where it came from): the user's settings over the
    engine's default tree (manual) or over the app's tree (auto), by TreeConfig.override."""
    if manual:
        tree, source = engine.default_tree, "manual"
    elif spec:
        tree, source = auto_tree(engine)
    else:
        tree, source = TreeConfig(), "unused (no eagle mode)"
    lookup = f", lookup {given['lookup']} (--lookup)" if "lookup" in given else ""
    return tree.override(**given), source + lookup


def load_engine(a: argparse.Namespace, need_head: bool) -> tuple[Engine, str | None]:
    numerics = {"dtype": a.dtype, "attention": a.attention, "device": a.device, "weights": a.weights}
    if not need_head:
        return Engine.load(a.model, None, **numerics), None
    if a.head == "random":
        engine = Engine.load(a.model, None, **numerics)
        head = new_head(engine.target.model.config, seed=0).to(engine.target.device, engine.target.dtype)
        return Engine(engine.target, head.eval().requires_grad_(False), numerics=engine.numerics,
                      step=engine.step), "random (new_head seed 0)"
    engine = Engine.load(a.model, a.head, **numerics)
    if not engine.has_head:
        raise BenchError(f"mode 'eagle' needs a head and none is shipped at {DEFAULT_HEAD_DIR}; pass "
                         "--head FOLDER, or --head random (exact output, low acceptance)")
    return engine, str(DEFAULT_HEAD_DIR) if a.head == "default" else a.head


def main(argv=None) -> int:
    core.threads.start()  # no-op where the command line already did
    a = parse_args(argv)
    try:
        modes = parse_modes(a.modes or list(DEFAULT_MODES) + ([LLAMA_CPP] if llama_cpp_dir(a) else []))
        lengths = parse_lengths(a.prefill_tokens)
        if a.long_decode_tokens < 0 or (a.long_decode_tokens and not lengths):
            raise BenchError(f"--long-decode-tokens {a.long_decode_tokens}: give a number of tokens >= 0, with "
                             f"--prefill-tokens naming the prompt lengths (e.g. --prefill-tokens 1000,4000)")
        llama_exe = llama_cpp_choice(a, modes, lengths)
        prompts = load_prompts(a.prompts or BUILTIN_PROMPTS)
        if a.limit is not None:
            if a.limit < 1:
                raise BenchError(f"--limit must be >= 1, got {a.limit}")
            prompts = prompts[:a.limit]
        sampling = SamplingConfig(temperature=a.temperature, top_p=a.top_p)
        manual, given = _tree_choice(a)
        settings = BenchSettings(max_new_tokens=a.max_new_tokens, sampling=sampling, seed=a.seed,
                                 lookup_tokens=a.lookup_tokens, warmup=not a.no_warmup, adaptive=a.adaptive)
        if a.threads is not None:
            if a.threads < 1:
                raise BenchError(f"--threads must be >= 1, got {a.threads}")
        set_threads(a.threads)
        spec = any(m in SPEC_MODES for m in modes)
        engine, head_name = load_engine(a, spec)
        memory = resident_memory()  # before a tree is tuned, llama.cpp starts or any answer runs
        tree, source = bench_tree(engine, manual, given, spec)
        settings = replace(settings, tree=tree, tree_source=source, copy_tokens=given.get("lookup"))
        with start_llama_cpp(a, llama_exe, engine) as llama:
            result = run_benchmark(engine, prompts, modes, settings, head_name=head_name, progress=True, llama=llama)
            if lengths:
                result["prefill"] = measure_prefill(engine, lengths, modes, settings, llama,
                                                    decode_tokens=a.long_decode_tokens)
    except (BenchError, ConfigError, EngineError, ModelLoadError, HeadLoadError, LlamaCppError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["memory_after_load"] = memory
    result["settings"]["prompts_file"] = str(a.prompts or BUILTIN_PROMPTS)
    result["settings"]["weights"] = a.weights
    print(format_table(result))
    if a.out:
        print(f"results: {write_results(result, a.out)}")
    if a.plot:
        print(f"plot: {write_plot(result, a.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

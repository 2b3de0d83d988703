"""Headless generation: `python -m core.generate "PROMPT" [--plain] [--max-new-tokens N] ...`.

Streams the answer to stdout and ends with one summary line (tokens, tau, tokens/s and the
numerics that ran). A long prompt can come from a file (`--prompt-file F`) or standard
input (`-` as the prompt), which avoids the OS limit on argument length. Ctrl-C stops the answer
where it is (the text so far stays on stdout, the summary says `finish=interrupted`) and exits 130.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import core.threads
from core.config import (DTYPE_NAMES, ConfigError, GenerationConfig, SamplingConfig, add_runtime_args,
                         add_tree_args, new_seed, tree_changes)

# torch and transformers load only after the arguments are checked (that takes seconds)
EMBEDDED = "smollm2"
INTERRUPTED = 130  # the exit status shells give a command ended by Ctrl-C (128 + SIGINT)


class ArgumentError(ValueError):
    """A command-line value is refused before the model loads."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m core.generate", description=__doc__.splitlines()[0])
    p.add_argument("prompt", nargs="?", help="the user message; '-' reads it from standard input")
    p.add_argument("--prompt-file", type=Path, help="read the user message from this file")
    p.add_argument("--plain", action="store_true", help="plain decoding, no speculation")
    p.add_argument("--lookup-only", action="store_true", help="speculation by context lookup alone, without a head "
                   "(what a model without a head runs): drafts copied from where the text repeats")
    p.add_argument("--adaptive", action="store_true", help="each step runs the mode measured faster in "
                   "this answer (speculative or plain, probing the other now and then; the app's default), where "
                   "otherwise the tree's long-context caps decide alone")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    add_tree_args(p)
    p.add_argument("--model", default=EMBEDDED, help="'smollm2' (embedded), a hub id, owner/name:QUANT (a hub "
                   "repo's GGUF file), a local folder or a .gguf file")
    p.add_argument("--head", default="default", help="head folder or hub id; 'default' = shipped head")
    add_runtime_args(p)
    p.add_argument("--seed", type=int, default=None)
    return p.parse_args(argv)


def read_prompt(a) -> str:
    if a.prompt_file is not None and a.prompt is not None:
        raise ArgumentError("give the prompt as an argument or with --prompt-file, not both")
    if a.prompt_file is not None:
        try:
            return a.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ArgumentError(f"cannot read --prompt-file {a.prompt_file}: {e}") from e
    if a.prompt == "-":
        return sys.stdin.read()
    if a.prompt is None:
        raise ArgumentError("no prompt: give it as an argument, '-' for standard input, or --prompt-file FILE")
    return a.prompt


def check_args(a) -> tuple[str, dict, GenerationConfig]:
    """Everything that can be refused without the model, refused before it loads (seconds)."""
    prompt = read_prompt(a)
    if not prompt.strip():
        raise ArgumentError("the prompt is empty")
    if a.threads is not None and a.threads < 1:
        raise ArgumentError(f"--threads must be >= 1, got {a.threads}")
    if a.plain and a.lookup_only:
        raise ArgumentError("--plain and --lookup-only contradict each other: choose one")
    if a.dtype not in DTYPE_NAMES:
        raise ArgumentError(f"unknown --dtype {a.dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")
    given = tree_changes(a)
    sampling = SamplingConfig(temperature=a.temperature, top_p=a.top_p)
    seed = a.seed if a.seed is not None or sampling.greedy else new_seed()  # printed: --seed repeats it
    config = GenerationConfig(max_new_tokens=a.max_new_tokens, speculative=not a.plain, seed=seed,
                              sampling=sampling, adaptive=a.adaptive)
    return prompt, given, config


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        prompt, given, config = check_args(a)
    except (ArgumentError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    core.threads.start()  # before torch loads: OpenMP reads its wait policy once
    core.threads.set_threads(a.threads)
    import torch

    from core.decoding.engine import Engine, EngineError
    from core.decoding.head import HeadLoadError
    from core.models import ModelLoadError

    last, interrupted = None, False
    try:
        head = None if a.plain or a.lookup_only else a.head
        engine = Engine.load(a.model, head, dtype=a.dtype, attention=a.attention, device=a.device,
                             load_in_4bit=a.load_in_4bit, weights=a.weights)
        config = replace(config, tree=engine.default_tree.override(**given))
        for last in engine.generate(prompt, config):
            sys.stdout.write(last.text)
            sys.stdout.flush()
    except (ConfigError, EngineError, ModelLoadError, HeadLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: keep what was written, say where it stopped, exit 130 as shells expect
        interrupted = True
        if last is None:
            print("\n[stopped] interrupted (Ctrl-C) before the first token: nothing generated", file=sys.stderr)
            return INTERRUPTED
    tau = last.total_tokens / last.target_forwards
    sys.stdout.write("\n")  # the answer alone on stdout; statistics and diagnostics on stderr
    if interrupted:
        print(f"[stopped] interrupted (Ctrl-C) after {last.total_tokens} tokens; the text above is the answer so far",
              file=sys.stderr)
    hot = config.paused_hot and not config.adaptive  # adaptive: a hot answer starts plain and probes
    if hot:
        print(f"[eagle] speculation paused: sampling at temperature {config.sampling.temperature:g}, plain decoding "
              f"is faster on this machine (the tree's plain_from_temperature {config.tree.plain_from_temperature:g}; "
              "--plain-from-temperature 0 speculates anyway); the same answer either way", file=sys.stderr)
    if not config.sampling.greedy:
        print(f"[seed] sampled with seed {config.seed}: --seed {config.seed} gives this answer again, with or "
              "without speculation", file=sys.stderr)
    mode = "plain" if a.plain or hot else "eagle" if engine.has_head else "lookup"
    print(f"[{mode}] tokens={last.total_tokens} target_forwards="
          f"{last.target_forwards} tau={tau:.2f} tokens/s={last.total_tokens / last.elapsed_s:.1f} "
          f"finish={'interrupted' if interrupted else last.finish_reason} threads={torch.get_num_threads()} "
          f"({core.threads.policy().wait} wait)", file=sys.stderr)
    print(f"[numerics] {engine.numerics.describe()}" + (f"; tree {config.tree} ({engine.tree_origin})"
                                                        if config.speculative else ""), file=sys.stderr)
    return INTERRUPTED if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())

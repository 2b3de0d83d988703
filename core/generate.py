"""Headless generation: `python -m core.generate "PROMPT" [--plain] [--max-new-tokens N] ...`.

Streams the answer to stdout and ends with one summary line.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from core.config import ConfigError, GenerationConfig, SamplingConfig, TreeConfig
from core.engine import Engine, EngineError
from core.head import HeadLoadError
from core.models import EMBEDDED, ModelLoadError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m core.generate", description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--plain", action="store_true", help="plain decoding, no speculation")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--depth", type=int, default=None, help="tree depth (default: tuned for this machine)")
    p.add_argument("--top-k", type=int, default=None, help="draft tree branching")
    p.add_argument("--total-tokens", type=int, default=None, help="tree size incl. root")
    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--head", default="default", help="head folder or hub id; 'default' = shipped head")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--load-in-4bit", action="store_true")
    p.add_argument("--seed", type=int, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        sampling = SamplingConfig(temperature=a.temperature, top_p=a.top_p)
        given = {k: v for k, v in (("depth", a.depth), ("top_k", a.top_k), ("total_tokens", a.total_tokens))
                 if v is not None}
        TreeConfig(**given)  # refuse bad values before the model loads
        engine = Engine.load(a.model, None if a.plain else a.head, dtype=a.dtype, device=a.device,
                             load_in_4bit=a.load_in_4bit)
        tree = replace(engine.default_tree, **given)
        config = GenerationConfig(max_new_tokens=a.max_new_tokens, speculative=not a.plain, seed=a.seed,
                                  tree=tree, sampling=sampling)
        last = None
        for last in engine.generate(a.prompt, config):
            sys.stdout.write(last.text)
            sys.stdout.flush()
    except (ConfigError, EngineError, ModelLoadError, HeadLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tau = last.total_tokens / last.target_forwards
    print(f"\n[{'plain' if a.plain else 'eagle'}] tokens={last.total_tokens} target_forwards="
          f"{last.target_forwards} tau={tau:.2f} tokens/s={last.total_tokens / last.elapsed_s:.1f} "
          f"finish={last.finish_reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two or more heads or trees through the real engine, interleaved per prompt in one process.

    python scripts/ab.py assets/heldout_prompts.jsonl --exclude assets/bench/heldout20.jsonl --head runs/head_set3
    python scripts/ab.py PROMPTS.jsonl --head DIR [--head DIR ...] [--limit N]
    python scripts/ab.py PROMPTS.jsonl --tree 3,8,12 [--tree DEPTH,TOP_K,TOTAL ...] [--limit N]
    python scripts/ab.py PROMPTS.jsonl --temperature 0.7 --plain --tree 3,8,6   # which tree pays when sampling
    python scripts/ab.py PROMPTS.jsonl --plain --tree 1,8,3,10 --tree 1,8,3,24   # context-lookup lengths
    python scripts/ab.py PROMPTS.jsonl --plain --toggle-row-floor   # drafts pruned by the measured row cost

The first contender is always the shipped head with its `tree.json`; each `--head` adds a
head folder drafting the same tree, each `--tree` that depth, top-k and size (lookup and
long-context caps as shipped; a fourth number sets the context-lookup length, 0 = off) for the shipped head and every `--head` (heads x trees: a
better head may pay for a deeper tree, so heads are compared at each tree). `--out FILE`
writes the figures as JSON. Every prompt's first turn is answered
greedily (128 new tokens) by each contender in turn, the order alternating from prompt to
prompt, so the machine's slow and fast phases fall on all of them alike: on this VM only
ratios measured this way are worth comparing. Prints tau and tokens/s per contender, tau
per category, and how many answers are identical to the shipped contender's (greedy
speculation is lossless, so anything but all of them is a bug). `--temperature T` samples
instead (seed `--seed` + the prompt's index, the same for every contender; a sampled token is a
function of the seed and its position, so the answers are identical across contenders too), with
speculation at every temperature (the tree's `plain_from_temperature` pause off: what pays is what
this measures), and `--plain` adds plain decoding as a contender, so the speed-up over it is
measured in the same run; `--adaptive` the shipped head and tree in the chat's adaptive mode.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


DEPTHS = 5  # acceptance reported per depth up to this many draft tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompts", type=Path)
    p.add_argument("--head", action="append", default=[], help="another head folder (same target)")
    p.add_argument("--tree", action="append", default=[], help="DEPTH,TOP_K,TOTAL_TOKENS[,LOOKUP] for the shipped head")
    p.add_argument("--exclude", type=Path, help="skip the prompts whose ids this JSONL file holds")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); else sampled")
    p.add_argument("--seed", type=int, default=0, help="sampling: prompt i uses seed + i")
    p.add_argument("--plain", action="store_true", help="add plain decoding (no speculation) as a contender")
    p.add_argument("--adaptive", action="store_true",
                   help="add the shipped head and tree in adaptive mode (GenerationConfig.adaptive: the chat's default)")
    p.add_argument("--toggle-row-floor", action="store_true",
                   help="add the shipped head and tree with TreeConfig.row_floor switched (on where shipped off, and off where on)")
    p.add_argument("--out", type=Path, help="write tau, tok/s and tau per category per contender here (JSON)")
    args = p.parse_args(argv)
    shapes = {}
    for spec in args.tree:
        try:
            shapes[spec] = tuple(int(x) for x in spec.split(","))
        except ValueError:
            shapes[spec] = ()
        if len(shapes[spec]) not in (3, 4):
            p.error(f"--tree {spec!r}: expected DEPTH,TOP_K,TOTAL_TOKENS[,LOOKUP], e.g. 3,8,12 or 1,8,3,10")

    from core import threads

    threads.start()  # the OpenMP policy, before torch loads
    threads.set_threads(args.threads)
    from core.bench import load_prompts
    from core.config import GenerationConfig, SamplingConfig
    from core.decoding.engine import Engine
    from core.decoding.head3 import load_any_head

    shipped = Engine.load()
    tree = shipped.default_tree if not args.temperature else replace(shipped.default_tree, plain_from_temperature=0.0)
    heads = {"shipped": shipped}
    for folder in args.head:
        d = load_any_head(folder, shipped.target.model, dtype=shipped.target.dtype)
        heads[folder] = Engine(shipped.target, d.head, d.vocab, shipped.numerics, drafter=d, step=shipped.step)
    runs = {}  # contender -> (engine, tree or None for plain decoding, adaptive)
    for name, engine in heads.items():
        runs[name] = (engine, tree, False)
        for spec, (depth, top_k, total, *lookup) in shapes.items():
            label = f"tree {spec}" if name == "shipped" else f"{name} tree {spec}"
            runs[label] = (engine, replace(tree, depth=depth, top_k=top_k, total_tokens=total,
                                                  lookup=lookup[0] if lookup else tree.lookup), False)
    if args.toggle_row_floor:
        runs[f"row_floor {'off' if tree.row_floor else 'on'}"] = (shipped, replace(tree, row_floor=not tree.row_floor),
                                                                   False)
    if args.adaptive:
        runs["adaptive"] = (shipped, tree, True)
    if args.plain:
        runs["plain"] = (shipped, None, False)
    sampling = SamplingConfig(temperature=args.temperature)
    def config_for(t, max_new_tokens: int, seed: int, adaptive: bool) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=max_new_tokens, speculative=t is not None, tree=t or tree,
                                adaptive=adaptive, sampling=sampling, seed=seed if args.temperature else None,
                                reuse_prompt=False)  # every contender reads the prompt from its start
    skip = {q.id for q in load_prompts(args.exclude)} if args.exclude else set()
    prompts = [q for q in load_prompts(args.prompts) if q.id not in skip][: args.limit or None]
    names = list(runs)
    stats = {k: {"tokens": 0, "forwards": 0, "seconds": 0.0, "cat": {}, "steps": [0] * (DEPTHS + 1)} for k in names}
    identical = 0
    for engine, t, adaptive in runs.values():  # warm-up
        list(engine.generate(prompts[0].turns[0], config_for(t, 16, args.seed, adaptive)))
    from tqdm import tqdm

    for i, prompt in enumerate(tqdm(prompts, unit="prompt", desc="a/b")):
        order = names[i % len(names):] + names[:i % len(names)]
        outs = {}
        for k in (order if i % 2 else order[::-1]):
            engine, t, adaptive = runs[k]
            start = time.perf_counter()
            config = config_for(t, args.max_new_tokens, args.seed + i, adaptive)
            events = list(engine.generate(prompt.turns[0], config))
            s = stats[k]
            s["seconds"] += time.perf_counter() - start
            s["tokens"] += events[-1].total_tokens
            s["forwards"] += events[-1].target_forwards
            c = s["cat"].setdefault(prompt.category, [0, 0])
            c[0] += events[-1].total_tokens
            c[1] += events[-1].target_forwards
            for ev in events:  # speculative steps by draft tokens accepted (context lookup's included)
                if ev.tree_size:
                    s["steps"][min(ev.draft_tokens, DEPTHS)] += 1
            outs[k] = [tok for ev in events for tok in ev.token_ids]
        identical += all(o == outs["shipped"] for o in outs.values())
    plain_rate = stats["plain"]["tokens"] / stats["plain"]["seconds"] if args.plain else None
    for k, s in stats.items():
        s["speedup"] = s["tokens"] / s["seconds"] / plain_rate if plain_rate else None
        cats = " ".join(f"{c} {v[0] / v[1]:.2f}" for c, v in sorted(s["cat"].items()))
        vs = f" ({s['speedup']:.2f}x plain)" if plain_rate else ""
        s["accept_at"] = [sum(s["steps"][d:]) / max(1, sum(s["steps"])) for d in range(1, DEPTHS + 1)]
        if sum(s["steps"]):
            cats += "; steps accepting >= 1..%d draft tokens: %s" % (DEPTHS, " / ".join(f"{a:.2f}" for a in s["accept_at"]))
        print(f"{k}: tau {s['tokens'] / s['forwards']:.3f}, {s['tokens'] / s['seconds']:.1f} tok/s{vs}; {cats}")
    print(f"identical to the shipped contender: {identical} / {len(prompts)}"
          + (f" (sampled at temperature {args.temperature:g}, seed {args.seed} + the prompt's index)" if args.temperature else ""))
    if args.out:
        import json
        from dataclasses import asdict

        args.out.write_text(json.dumps({
            "prompts_file": str(args.prompts), "prompts": len(prompts), "threads": args.threads,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
            "identical": identical, "shipped_tree": asdict(tree),
            "contenders": {k: {"tau": s["tokens"] / s["forwards"], "tok_s": s["tokens"] / s["seconds"],
                               "speedup_vs_plain": s["speedup"], "accept_at_least": s["accept_at"],
                               "tau_per_category": {c: v[0] / v[1] for c, v in sorted(s["cat"].items())}}
                           for k, s in stats.items()}}, indent=1, default=str) + "\n")
    return 0 if identical == len(prompts) else 1


if __name__ == "__main__":
    raise SystemExit(main())

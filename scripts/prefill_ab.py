"""A cold prompt's prefill time, this checkout against another one, in processes that alternate.

    python scripts/prefill_ab.py --other PATH [--lengths 128,512,1000,4000] [--rounds 4] [--reps 2] [--threads 2]
    python scripts/prefill_ab.py --memory [--other PATH] [--lengths 4000]

Each round runs one process per checkout (the other one first in odd rounds), each reading prompts of random
tokens of every length into a fresh cache (`core.decoding.forward.prefill` on the embedded model, `reps` times),
so both sides see the same minutes of a machine whose speed drifts. Prints the medians per length and the ratio
of the sums (this checkout / the other). PATH is a checkout of another commit (`git worktree add PATH COMMIT`).
`--memory` reports each checkout's resident memory before a prefill and its peak during it (VmHWM, reset first).
Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if "--child" not in sys.argv:  # a child imports its own checkout's core (PYTHONPATH)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HERE = Path(__file__).resolve().parent.parent


def _status_mb(field: str) -> int:
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0]) // 1024


def child(lengths: list[int], reps: int, threads_n: int, memory: bool) -> None:
    """In the checkout's own process: prefill times (s) per length as one JSON line."""
    from core import threads

    threads.start()
    import torch

    from core.decoding import cache as kv
    from core.decoding.engine import Engine
    from core.decoding.forward import prefill

    torch.set_num_threads(threads_n)
    engine = Engine.load(head=None)
    model = engine.forwarder.hf
    out: dict[int, list[float]] = {}
    with torch.inference_mode():
        for rep in range(reps):
            for n in lengths:
                ids = torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(rep))
                if memory:
                    before = _status_mb("VmRSS")
                    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
                start = time.perf_counter()
                prefill(model, ids, kv.new_cache(model))
                out.setdefault(n, []).append(time.perf_counter() - start)
                if memory:
                    print(f"{n} tokens: resident {before} MB before the prefill, peak {_status_mb('VmHWM')} MB during it")
    print(json.dumps(out))


def run_side(checkout: Path, args) -> tuple[dict[str, list[float]], list[str]]:
    """One child process on `checkout`'s code: (its times per length, its memory lines)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--lengths", args.lengths,
           "--reps", str(args.reps), "--threads", str(args.threads)] + (["--memory"] if args.memory else [])
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{checkout}: the prefill process failed:\n{done.stderr[-2000:]}")
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--other", type=Path, help="a checkout of the commit to compare with")
    p.add_argument("--lengths", default="128,512,1000,4000")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--memory", action="store_true", help="this checkout's resident memory around one prefill")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    lengths = [int(n) for n in a.lengths.split(",")]
    if a.child:
        child(lengths, 1 if a.memory else a.reps, a.threads, a.memory)
        return
    if a.other is not None and not (a.other / "core").is_dir():
        p.error("--other must name a checkout of eagle-chat (git worktree add PATH COMMIT)")
    if a.memory:
        for name, checkout in (("this", HERE), ("other", a.other)):
            if checkout is not None:
                print(name, *run_side(checkout.resolve(), a)[1], sep="\n  ")
        return
    if a.other is None:
        p.error("--other PATH is needed to compare")
    sides = {"this": HERE, "other": a.other.resolve()}
    times: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
    for r in range(a.rounds):
        for side in (("this", "other") if r % 2 == 0 else ("other", "this")):
            for n, t in run_side(sides[side], a)[0].items():
                times[side].setdefault(n, []).extend(t)
        print(f"round {r + 1} of {a.rounds} done", file=sys.stderr)
    print("tokens  this (median)  other (median)  this / other (sums)")
    for n in map(str, lengths):
        mine, theirs = times["this"][n], times["other"][n]
        print(f"{n:>6}  {statistics.median(mine):11.3f} s  {statistics.median(theirs):12.3f} s  "
              f"{sum(mine) / sum(theirs):8.3f}")


if __name__ == "__main__":
    main()

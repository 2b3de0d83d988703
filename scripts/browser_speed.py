"""The speed a user of the app sees: the launcher on this machine, headless Chromium (Debian's `chromium`, driven by
pip's playwright) on the same machine, a fresh page per prompt, and the engine's tok/s read from each answer's stats
line. The page's rendering competes with decoding for the cores (docs/threads.md), which `core.bench` and
`core.generate` do not see.

    python scripts/browser_speed.py [--cwd CHECKOUT] [--rounds N] [-- launcher args, e.g. --threads 1]

--cwd runs the launcher of another checkout (a `git worktree` of an older commit) for an A/B in turn."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from screenshot import DONE, launched_page  # noqa: E402

PROMPTS = ["Write a Python function that checks whether a number is prime, then explain how it works.",
           "Explain the difference between a list and a tuple in Python, with examples.",
           "Write a short story about a robot who learns to paint."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cwd", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("launcher_args", nargs="*")
    args = ap.parse_args()
    with launched_page(args.cwd, args.launcher_args) as (page, url):
        for r in range(args.rounds):
            speeds = []
            for prompt in PROMPTS:
                page.goto(url)  # a fresh page: a new chat
                page.wait_for_selector("#message textarea", timeout=120_000)
                time.sleep(1.0)
                before = page.inner_text("#stats")
                page.fill("#message textarea", prompt)
                page.click("#send")
                # every 0.5 s: a check at every animation frame would itself load the page (layout for innerText)
                page.wait_for_function(f"old => document.querySelector('#stats').innerText !== old && ({DONE})",
                                       arg=before, polling=500, timeout=300_000)
                found = re.search(r"engine: ([\d.]+) tok/s \((\d+) tokens", page.inner_text("#stats"))
                speeds.append(f"{found.group(1)} tok/s ({found.group(2)} tokens)" if found else "?")
            print(f"{args.cwd} {' '.join(args.launcher_args) or '(default)'} round {r + 1}: " + ", ".join(speeds),
                  flush=True)


if __name__ == "__main__":
    main()

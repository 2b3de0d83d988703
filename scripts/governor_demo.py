"""The thread governor against a job that starts and stops between answers (docs/threads.md).

    python scripts/governor_demo.py            # governor on, as in the app
    python scripts/governor_demo.py --no-gov   # fixed thread count, for comparison

Answers the same prompt (eagle, 64 new tokens) twice on a quiet machine, three times while a
1-thread torch job runs on one core, and twice after it stopped; prints the thread count each
answer ran with and its tokens/s. Run it on an otherwise idle machine.
"""

import argparse
import subprocess
import sys
import time

from core import threads  # noqa: I001

if __name__ == "__main__":  # the OpenMP policy, before torch loads (core.threads)
    threads.start()

import torch

from core.config import GenerationConfig
from core.decoding.engine import Engine

HOG = ("import time, torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nt = time.time()\n"
       "while time.time() - t < 600:\n    a @ a\n")
PROMPT = [{"role": "user", "content": "Explain how a hash map works and give a short Python example."}]


def answer(engine: Engine, tag: str) -> None:
    config = GenerationConfig(max_new_tokens=64, tree=engine.default_tree)
    start, tokens = time.perf_counter(), 0
    for event in engine.generate(PROMPT, config):
        tokens += len(event.token_ids)
    print(f"{tag}: {torch.get_num_threads()} threads, {tokens / (time.perf_counter() - start):.1f} tok/s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-gov", action="store_true", help="keep the thread count fixed")
    a = p.parse_args()
    threads.set_threads(None)
    engine = Engine.load()
    threads.govern(not a.no_gov)
    for i in range(2):
        answer(engine, f"quiet {i + 1}")
    hog = subprocess.Popen([sys.executable, "-c", HOG])
    try:
        time.sleep(2)
        for i in range(3):
            answer(engine, f"another job running {i + 1}")
    finally:
        hog.kill()
    time.sleep(2)
    for i in range(2):
        answer(engine, f"quiet again {i + 1}")


if __name__ == "__main__":
    main()

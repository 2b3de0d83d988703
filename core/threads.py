"""CPU threading defaults, applied before torch loads.

Why: torch's CPU kernels run on an OpenMP team whose idle threads spin-wait (the default
"active" policy). On a machine where another process holds a core, the team's threads
spin against each other and every parallel region waits for a descheduled thread: here a
generation with 2 threads fell to 0.4 tok/s, against 7.7 tok/s with OMP_WAIT_POLICY=PASSIVE
and 4.6 tok/s with 1 thread (SmolLM2, bf16, a busy 2-core machine; README "Threads on a busy machine"). So the passive policy is the default (an explicit environment setting wins),
and `--threads` lets the user choose the team size.

Import this module before torch (the CLIs and the launcher do); OpenMP reads the policy once.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_threads(threads: int | None) -> int:
    """Use `threads` torch threads (None: the cores this process may use); returns the count."""
    import torch

    n = threads or available_cores()
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(n)
    return n

"""Timing that stays honest on CUDA.

CUDA kernels run asynchronously: `time.perf_counter()` around a call measures only the
launches, and the work lands in whatever is timed next. Two tools:

  now(device)        perf_counter() after the device's queued work has finished; use it
                     for step timings (draft / verify / other) that must add up to wall time.
  Timer(device)      a context manager; on CUDA a pair of timing events (GPU-side time, no
                     stall inside the block), elsewhere perf_counter. Use it for cost curves.
  median_time(...)   the median of several timed calls after warm-up.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


_CUDA: dict = {}  # device (as given) -> whether it is a CUDA device: now() runs several times a step


def is_cuda(device) -> bool:
    known = _CUDA.get(device)
    if known is None:
        known = _CUDA[device] = torch.device(device).type == "cuda"
    return known


def now(device) -> float:
    """Seconds (perf_counter) once all work queued on `device` has finished."""
    if is_cuda(device):
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Timer:
    """`with Timer(device) as t: work()`, then `t.seconds`: the time the work took.

    On CUDA the block records a start and an end event on the device's current stream;
    reading `seconds` waits for the end event only, so nothing stalls inside the block.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = is_cuda(self.device)
        self._start = self._end = None

    def __enter__(self) -> "Timer":
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record(stream)
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._end.record(torch.cuda.current_stream(self.device))
        else:
            self._end = time.perf_counter()

    @property
    def seconds(self) -> float:
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1000.0  # events report milliseconds
        return self._end - self._start


def median_time(fn: Callable[[], object], device, reps: int = 5, warmup: int = 1,
                after: Callable[[], object] | None = None) -> float:
    """Median seconds of `fn()` over `reps` timed calls, after `warmup` untimed ones.

    `after`, if given, runs untimed after every call (e.g. dropping what fn appended to a cache).
    """
    assert reps >= 1 and warmup >= 0
    times = []
    for i in range(warmup + reps):
        with Timer(device) as t:
            fn()
        if i >= warmup:
            times.append(t.seconds)
        if after is not None:
            after()
    return statistics.median(times)

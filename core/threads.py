"""CPU threading defaults, chosen from how busy the machine is when a command starts.

Why: torch's CPU kernels run on an OpenMP team (libgomp). A decoding step is hundreds of
small kernels with microsecond gaps between them, so what the team's idle threads do in a
gap decides the speed:
  - spin for a long time (libgomp's default, 300,000 spins): on a machine where another
    process holds a core, the team spins against it and every kernel waits for a
    descheduled thread (a 2-thread generation fell to 0.4 tok/s on this 2-core machine);
  - sleep at once (OMP_WAIT_POLICY=PASSIVE): safe on a busy machine, but on a quiet one
    every kernel pays a futex wake-up; plain decoding ran at 11 tok/s against 22 tok/s
    with a short spin (SmolLM2 bf16, 2 threads, docs/threads.md);
  - spin briefly, then sleep (GOMP_SPINCOUNT=10000, tens of microseconds): as fast as
    spinning on a quiet machine, and it gives the core back soon after.
So at start we sample /proc/stat for 0.2 s: a quiet machine (every core this process may
use is idle) gets the short spin and all its cores; a busy one gets the passive policy and
as many threads as there are idle cores (at least 1): with one of two cores taken, 1 thread
ran plain decoding at 16.5 tok/s against 7.3 with 2 passive threads. An OpenMP setting in
the environment, or `--threads N`, wins over the choice.

Importing this module (or `core`) does nothing but import: every command calls `start()`
before it imports torch (the CLIs under `if __name__ == "__main__":` at their top, the launcher,
the scripts), because OpenMP reads its settings once, when torch loads.
"""

from __future__ import annotations

import math
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

SHORT_SPIN = "10000"          # GOMP_SPINCOUNT on a quiet machine
SAMPLE_S = 0.2                # how long the idle sample looks
OMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


@dataclass(frozen=True)
class ThreadPolicy:
    """What was chosen at start, and why (shown by the CLIs and stored in bench results)."""

    idle_cores: float | None    # idle cores measured at start (None: not measured)
    cores: int                  # cores this process may use
    wait: str                   # "short spin", "passive" or "user: <VAR>=<value>"
    default_threads: int        # threads when --threads is not given

    def describe(self) -> str:
        idle = "not measured" if self.idle_cores is None else f"{self.idle_cores:.1f} of {self.cores} cores idle"
        return f"{self.default_threads} threads by default, {self.wait} wait ({idle} at start)"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies summed over the cores this process may use, from /proc/stat;
    None where unreadable (not Linux)."""
    try:
        cpus = set(os.sched_getaffinity(0))
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except (AttributeError, OSError):
        return None
    idle = total = 0
    for line in lines:
        name, *fields = line.split() or [""]
        if not name[3:].isdigit() or not name.startswith("cpu") or int(name[3:]) not in cpus:
            continue
        ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
        idle += ticks[3] + ticks[4]
        total += sum(ticks)
    return (idle, total) if total else None


def measure_idle_cores(interval: float = SAMPLE_S) -> float | None:
    """Idle cores among those this process may use, over `interval` seconds (None: unknown)."""
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(interval)
    second = _cpu_times()
    if second is None or second[1] <= first[1]:
        return None
    return available_cores() * (second[0] - first[0]) / (second[1] - first[1])


def choose(env: dict[str, str], idle: float | None, cores: int) -> tuple[ThreadPolicy, dict[str, str]]:
    """The policy for a machine with `idle` of `cores` idle, and the variables to set."""
    user = next((f"{k}={env[k]}" for k in OMP_VARIABLES if k in env), None)
    busy = idle is not None and idle < cores - 0.5
    threads = max(1, min(cores, int(idle + 0.5))) if busy else cores
    if user is not None:
        return ThreadPolicy(idle, cores, f"user: {user}", threads), {}
    if idle is None or busy:  # busy, or cannot tell: the safe choice
        return ThreadPolicy(idle, cores, "passive", threads), {"OMP_WAIT_POLICY": "PASSIVE"}
    return ThreadPolicy(idle, cores, "short spin", threads), {"GOMP_SPINCOUNT": SHORT_SPIN}


_policy: ThreadPolicy | None = None


def start() -> ThreadPolicy:
    """Choose the policy from how busy the machine is now and set its OpenMP variables in
    os.environ (an OpenMP variable already there wins: nothing is measured or set). Once per
    process: later calls return the same policy. Call it before torch loads."""
    global _policy
    if _policy is None:
        if any(k in os.environ for k in OMP_VARIABLES):
            _policy, _ = choose(dict(os.environ), None, available_cores())
        else:
            _policy, variables = choose(dict(os.environ), measure_idle_cores(), available_cores())
            os.environ.update(variables)
    return _policy


def policy() -> ThreadPolicy:
    """The policy this process runs with: the one `start()` chose (choosing it now if no command
    did, too late to change OpenMP's wait policy but right about the thread count)."""
    return start()


def __getattr__(name: str):
    if name == "POLICY":  # the name readers used when the policy was chosen at import (app/manager.py)
        return policy()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class LoadSample:
    wall_s: float    # monotonic clock
    busy_s: float    # CPU seconds spent busy on this process's cores, by everyone
    own_s: float     # CPU seconds spent by this process


def load_sample() -> LoadSample | None:
    """Busy and own CPU time now (None where /proc/stat is unreadable)."""
    times = _cpu_times()
    if times is None:
        return None
    return LoadSample(time.monotonic(), (times[1] - times[0]) / os.sysconf("SC_CLK_TCK"), time.process_time())


class Governor:
    """Refits the thread count to the cores other processes leave idle (docs/threads.md), used by the launcher when no
    thread count is given:

    - at an answer's start, from their load since the last refit: a job that starts after the app does would
      otherwise fight our threads for its core;
    - while an answer streams, every STEP_WINDOW_S, from their load since the answer started: the page showing the
      answer is re-rendered by a browser several times a second, on this machine where it runs here, and a team of
      threads that meets at barriers every few microseconds stalls whenever one of its cores is taken. That load
      comes back with every answer, so the next answer starts from it too (`streaming`), whatever the idle time
      between answers averaged it down to. Measured on a 2-core VM, 2026-12-07: the app's first answers in headless
      Chromium ran at 54-100 tok/s on two threads, later ones at 130-260 on the one thread the governor had moved to
      (docs/threads.md), and 270-360 without a page rendered."""

    MIN_WINDOW_S = 1.0   # between answers: shorter windows say too little about the others' load
    STEP_WINDOW_S = 0.5  # within an answer: a page streams a few updates in this time
    # Others holding more than this much of a core take it: a spinning team loses a core's worth of speed to far less
    # than a whole core taken (a page streaming into Chromium took 0.4-1.0 of one; rounding it to the nearest core
    # kept two threads at 0.4 and halved their speed)
    SPARE = 0.25

    def __init__(self, cores: int, threads: int, read=load_sample, clock=time.monotonic):
        self.cores, self.threads, self.read, self.clock = cores, threads, read, clock
        self.last = read()
        self.mark = self.last  # where the current answer's window starts
        self.streaming = 0.0   # cores other processes held while the last answer streamed

    def _fit(self, others: float) -> int:
        return max(1, min(self.cores, self.cores - math.ceil(max(0.0, others - self.SPARE))))

    @staticmethod
    def _others(a: LoadSample, b: LoadSample) -> float:
        return (b.busy_s - a.busy_s - (b.own_s - a.own_s)) / (b.wall_s - a.wall_s)

    def refit(self) -> int:
        """At an answer's start."""
        now = self.read()
        if now is None:
            return self.threads
        self.mark = now
        if self.last is None or now.wall_s - self.last.wall_s < self.MIN_WINDOW_S:
            return self.threads
        others, self.last = self._others(self.last, now), now
        self.threads = self._fit(max(others, self.streaming))
        return self.threads

    def during(self) -> int:
        """Between two steps of an answer (cheap until STEP_WINDOW_S has passed since the answer started or the last
        refit within it: no reading of /proc/stat)."""
        if self.mark is None or self.clock() - self.mark.wall_s < self.STEP_WINDOW_S:
            return self.threads
        now = self.read()
        if now is None or now.wall_s - self.mark.wall_s < self.STEP_WINDOW_S:
            return self.threads
        self.streaming, self.mark = self._others(self.mark, now), now
        self.threads = self._fit(self.streaming)
        return self.threads


_governor: Governor | None = None


def govern(enabled: bool = True) -> None:
    """Turn the per-answer refit on (the launcher does when the user chose no thread count)."""
    global _governor
    _governor = Governor(policy().cores, policy().default_threads) if enabled else None


def refit() -> None:
    """At the start of an answer: refit the thread count, if the governor is on."""
    if _governor is not None:
        _governor.refit()


def refit_during() -> None:
    """Between two steps of an answer: refit the thread count to the load while it streams, if the governor is on."""
    if _governor is not None:
        _governor.during()


def current() -> int:
    """The thread count decoding runs with: the governor's when it is on (the calling thread's
    own count may be stale), else this thread's."""
    if _governor is not None:
        return _governor.threads
    import torch

    return torch.get_num_threads()


def apply() -> None:
    """Before a decoding step, in the thread that runs it: use the governor's thread count.
    (torch keeps a thread count per OS thread, and Gradio moves a generator between threads.)"""
    if _governor is not None:
        import torch

        if torch.get_num_threads() != _governor.threads:
            torch.set_num_threads(_governor.threads)


def set_threads(threads: int | None) -> int:
    """Use `threads` torch threads (None: the policy's default); returns the count."""
    import torch

    n = threads or policy().default_threads
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(n)
    return n


@contextmanager
def one_torch_thread():
    """torch's CPU kernels on one thread inside the block (the count is restored after it).

    For computations whose bits must not depend on the process: on the Intel AMX VM, 30% of
    processes got a cos from the first parallel call of torch's vectorised cos after the model
    had loaded that was wrong by up to 1.5e-4 on the main thread's half of the elements (the
    other half, and every later call, exact). The bf16 rotary table built from it differed by one
    unit in a third of the positions, and that process's answers differed from every other
    process's from a few tokens on (plain and speculative alike, so no speculative check could
    see it). With the tables computed on one thread and the first calls made on one thread at load
    (core.kernels.step.warm_math), 0 of 28 processes differed (16 table checks, 12 answer checks);
    a first call on one thread before the load alone: 0 of 16 (docs/numerics.md)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---- one thread for all model work --------------------------------------------------------------
# OpenMP (torch's kernels and ours share one libgomp) keeps a pool of threads per thread that starts a
# parallel region, and once the threads of all pools outnumber the cores it stops spinning between
# regions (its "throttled" spin count, about OMP_WAIT_POLICY=PASSIVE). A server that advances an
# answer from whichever worker thread is free (Gradio moves a generator between threads, and read a
# prompt in a thread of its own) therefore ran every step of every later answer in that mode: on the
# AVX2 VM of 2026-12-07, the chat streamed 48-57 tok/s plain where the same engine on one thread runs
# 180-245 (`/work/runs/s24/thread_hop2.py`: a 2-thread answer on a second thread dropped both threads'
# answers to 63-69 tok/s from then on). The app and the API server run all model work (loading, every step) here.
_engine_pool = None
_engine_ident: int | None = None
_engine_lock = threading.Lock()


def _mark_engine_thread() -> None:
    global _engine_ident
    _engine_ident = threading.get_ident()


def engine_executor():
    """The executor of the process's one engine thread (started on first use)."""
    from concurrent.futures import ThreadPoolExecutor

    global _engine_pool
    with _engine_lock:
        if _engine_pool is None:
            _engine_pool = ThreadPoolExecutor(1, thread_name_prefix="engine", initializer=_mark_engine_thread)
    return _engine_pool


def on_engine_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on the process's one engine thread (at once where called from it); its
    result, or its exception raised here."""
    if threading.get_ident() == _engine_ident:
        return fn(*args, **kwargs)
    return engine_executor().submit(fn, *args, **kwargs).result()


def engine_stream(gen):
    """Iterate the generator `gen` with every step (and its closing) run on the engine thread, from
    whichever thread asks for the next item."""
    done = object()
    try:
        while (item := on_engine_thread(next, gen, done)) is not done:
            yield item
    finally:
        on_engine_thread(gen.close)

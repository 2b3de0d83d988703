"""A row-invariant bf16 GEMM for decoding on AVX-512 CPUs (C source: core/kernels/gemm_bf16.c).

Why: a decoding step multiplies 1 to a few dozen rows by every weight matrix, so its cost is
streaming the weights. On this project's CPUs oneDNN's bf16 GEMM moves them at 10-15 GB/s
on such skinny shapes (per-call overhead); this kernel reaches the memory bandwidth at one
row (about 30 GB/s, 1.7-2.9x faster per call) and stays 1.1-1.5x faster at 11-27 rows.

Exact by construction: the kernel computes every output element with one fixed instruction
sequence whatever the number of rows, so a token's row is bit-identical alone (a plain step)
or inside a draft tree. oneDNN is row-invariant here only for inner sizes up to 768, which
is why `core.invariant` otherwise splits wider reductions.

Built once per machine with gcc into `cache_home()/kernels`, loaded with ctypes, and checked
(against an fp32 reference, and row by row against a batch) before first use. Where any step
fails (not x86-64 Linux, no avx512_bf16, no gcc) `status()` says why and callers keep torch's
GEMM. `EAGLE_CHAT_GEMM=torch` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "kernels" / "gemm_bf16.c"
FLAGS = ("-O3", "-march=x86-64-v4", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
# Calls with more rows use torch's GEMM (a long prefill, where oneDNN's compute-bound kernels
# win). It exceeds the largest tree the engine can verify (TreeConfig: 512 nodes + a 32-token
# lookup chain), so every tree row and every plain step goes through this kernel.
MAX_ROWS = 576
OFF_ENV = "EAGLE_CHAT_GEMM"


@dataclass(frozen=True)
class GemmStatus:
    available: bool
    reason: str  # what runs, or why the kernel does not

    def describe(self) -> str:
        return "avx512-bf16 GEMM (core/kernels)" if self.available else f"torch GEMM ({self.reason})"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


def _build() -> Path:
    """Compile the kernel (once per source, flags and compiler) and return the library path."""
    from core.models import cache_home

    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        raise RuntimeError("no C compiler (gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha1(SOURCE.read_bytes() + " ".join(FLAGS + tuple(version)).encode()).hexdigest()[:12]
    lib = cache_home() / "kernels" / f"gemm_bf16-{key}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"gcc failed: {done.stderr.strip()[-300:]}")
        os.replace(tmp, lib)
    return lib


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, GemmStatus]:
    if os.environ.get(OFF_ENV, "").lower() in ("torch", "off", "0"):
        return None, GemmStatus(False, f"{OFF_ENV}={os.environ[OFF_ENV]}")
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None, GemmStatus(False, f"needs x86-64 Linux, this is {platform.system()} {platform.machine()}")
    if "avx512_bf16" not in _cpu_flags():
        return None, GemmStatus(False, "this CPU lacks avx512_bf16")
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError) as e:
        return None, GemmStatus(False, f"kernel build failed: {e}")
    fn = lib.gemm_bf16
    fn.restype = None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i32, i32, i32, i32]
    problem = _self_test(fn)
    if problem:
        return None, GemmStatus(False, f"kernel self-test failed: {problem}")
    return fn, GemmStatus(True, "built and self-tested")


def status() -> GemmStatus:
    return _library()[1]


def _call(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x (M, K) with unit stride in K; weight (N, K) likewise; bias (N,) or None -> (M, N) bf16
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
       None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k, torch.get_num_threads())
    return y


def _self_test(fn) -> str | None:
    gen = torch.Generator().manual_seed(0)
    for n, k in ((40, 100), (64, 576)):
        x = torch.randn(9, k, generator=gen).bfloat16()
        w = torch.randn(n, k, generator=gen).bfloat16()
        b = torch.randn(n, generator=gen).bfloat16()
        y = _call(fn, x, w, b)
        ref = x.float() @ w.float().T + b.float()
        if not torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max())):
            return f"wrong results for a {n}x{k} weight"
        if not all(torch.equal(_call(fn, x[i:i + 1], w, b)[0], y[i]) for i in range(x.shape[0])):
            return f"rows differ alone and in a batch for a {n}x{k} weight"
    return None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` serves this call: bf16 on the CPU, no autograd, at most MAX_ROWS rows."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.stride(1) == 1
            and x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and _library()[0] is not None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through the kernel: x (..., K) bf16, weight (N, K), bias (N,) -> (..., N) bf16."""
    fn = _library()[0]
    assert fn is not None and x.shape[-1] == weight.shape[1], "check gemm.usable(x, weight) first"
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    return _call(fn, rows, weight, bias).view(*x.shape[:-1], weight.shape[0])

"""Row-invariant bf16 decoding kernels for AVX-512 CPUs, in C (core/kernels/csrc): GEMM, attention, RMSNorm, argmax,
KV-row moves, and the draft's top-k log-probabilities.

Why: a decoding step multiplies 1 to a few dozen rows by every weight matrix, so its cost is
streaming the weights. On this project's CPUs oneDNN's bf16 GEMM moves them at 10-15 GB/s
on such skinny shapes (per-call overhead); this kernel reaches the memory bandwidth at one
row (about 30 GB/s, 1.7-2.9x faster per call) and stays 1.1-1.5x faster at 11-27 rows.

Exact by construction: the kernel computes every output element with one fixed instruction
sequence whatever the number of rows, so a token's row is bit-identical alone (a plain step)
or inside a draft tree. oneDNN is row-invariant here only for inner sizes up to 768, which
is why `core.kernels.invariant` otherwise splits wider reductions.

AMX (csrc/gemm_amx.c): on CPUs with AMX bf16 tiles (Intel Sapphire Rapids and later) the GEMM
runs on tiles for every shape with K % 32 == 0 and N % 16 == 0, again one fixed accumulation
chain per output element, so up to 16 rows cost what one does. The AVX-512 kernel costs about
1.5 ms per extra row of a 135M model on two cores, which made a 10-token verification 1.5
plain steps; on tiles it is 1.15 (autotune, SmolLM2, 2 threads: 23.4 ms for 1 token, 26.9 for
10, 28.5 for 16, against 25.8 / 39.4 / 49.0). The two kernels sum in different orders, so
which one runs is fixed per machine and shape, never per call. `EAGLE_CHAT_AMX=0` keeps the
AVX-512 GEMM. The tiles also take a prompt's prefill chunks (more than MAX_ROWS rows), where oneDNN
served before: cheaper per chunk, and a row's bits no longer depend on the call's size.

Attention (`attention`): each row attends to its keys in plain decoding's order with one fixed
instruction sequence (csrc/attention_bf16.c), so it needs none of core.kernels.invariant's block layout
and its dozens of small torch ops per layer. On AMX machines a row with at least 256 keys (head_dim 64)
attends on tiles instead (csrc/attention_amx.c: 512-key segments of logical keys, the rows and query
heads of a kv head sharing every tile product); the kernel follows from the row's own key count, the
same for a token alone or in a tree. `EAGLE_CHAT_AMX_ATTENTION=0` keeps the vector kernel.

RMSNorm (`rms_norm`, csrc/rmsnorm_bf16.c): the formula of transformers' LlamaRMSNorm in one call
instead of eight torch ops.

Built once per machine with gcc into `cache_home()/kernels`, loaded with ctypes, and checked
(against fp32 references, and row by row against a batch) before first use. Where any step
fails (not x86-64 Linux, neither avx512_bf16 nor AVX2, no gcc) `status()` says why and callers keep
torch's kernels. `EAGLE_CHAT_KERNELS=torch` turns them off. A CPU without avx512_bf16 builds the same
sources for AVX2 (csrc/avx2.h: each 512-bit intrinsic on two 256-bit halves, the same lane operations;
`EAGLE_CHAT_KERNELS=avx2` picks that build on an AVX-512 CPU too). `EAGLE_CHAT_KERNELS=amx-emulated` builds the
AVX-512 kernels with the AMX tile instructions as C functions (csrc/amx_emulate.h), so that the tile paths run, slowly,
where the CPU has no tiles: for tests (tests/test_amx_emulated.py), never for serving.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from core.config import switched_off

CSRC = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-fopenmp", "-shared", "-fPIC")
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16", "-mamx-int8")  # gcc >= 11; an older compiler builds the rest without AMX
# gcc 10 (the first with -mavx512bf16) knows neither -march=x86-64-v4 nor AMX (both gcc 11): the
# same instruction sets as x86-64-v4 named one by one. gcc 12 enables the same target options
# with both and emits the same instructions (objdump, every kernel), FMA contraction included.
COMPAT_FLAGS = ("-O3", "-mcx16", "-msahf", "-mpopcnt", "-msse3", "-msse4.1", "-msse4.2", "-mssse3", "-mavx", "-mavx2",
                "-mbmi", "-mbmi2", "-mf16c", "-mfma", "-mlzcnt", "-mmovbe", "-mxsave", "-mavx512f", "-mavx512bw",
                "-mavx512cd", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-fopenmp", "-shared", "-fPIC")
# A CPU without avx512_bf16 (AMD Zen 1-3, Intel's desktop chips): the same sources on AVX2 + FMA + F16C,
# each 512-bit intrinsic as two 256-bit halves (csrc/avx2.h). -ffp-contract=off: a multiply and an add the
# kernels write as two roundings stay two (the AVX-512 build fuses a few where that cannot change a target logit:
# csrc/avx2.h's header).
AVX2_FLAGS = ("-O3", "-march=x86-64-v3", "-DEAGLE_AVX2", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
# x86-64-v3, as /proc/cpuinfo names its features (abm: LZCNT): what -march=x86-64-v3 lets gcc emit
AVX2_FEATURES = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
BUILD_TIMEOUT_S = 300  # one build takes 4-5 s on two cores (each file on a core of its own); a hung compiler must not hang the load
# Calls with more rows (a long prefill) run on AMX tiles where the machine has them (`prompt_usable`),
# else in oneDNN's compute-bound GEMM. It exceeds the largest tree the engine can verify (TreeConfig:
# 512 nodes + a 32-token lookup chain), so every tree row and every plain step goes through this kernel.
MAX_ROWS = 576
OFF_ENV = "EAGLE_CHAT_KERNELS"
# EAGLE_CHAT_KERNELS=amx-emulated: the AVX-512 build with every tile instruction a C function (csrc/amx_emulate.h,
# -DEAGLE_AMX_EMULATE), so that the AMX code paths run, slowly, on a CPU without tiles: tests/test_amx_emulated.py
AMX_EMULATED = "amx-emulated"
AMX_EMULATE_FLAGS = ("-DEAGLE_AMX_EMULATE",)
AMX_ENV = "EAGLE_CHAT_AMX"  # "0" keeps the GEMM and attention on AVX-512 where the CPU has AMX tiles
# "0" keeps attention alone on AVX-512 (for measuring; the GEMM's tiles stay): csrc/attention_amx.c
AMX_ATTENTION_ENV = "EAGLE_CHAT_AMX_ATTENTION"
# "1" builds the kernels with per-stage clocks (-DEAGLE_PROFILE, a library of its own): `stage_times`,
# scripts/step_stages.py. Every number they compute is the same; thread 0 reads the clock between stages.
PROFILE_ENV = "EAGLE_CHAT_PROFILE"
# csrc/common.h's ST_* order: the stages of a forward, each ending at its closing barrier
STAGES = ("features", "norm", "qkv", "rotary", "attention", "o", "add", "gate/up", "silu", "down", "embed",
          "final norm", "lm head", "screen one", "screen centre", "screen two", "head fc")


@dataclass(frozen=True)
class NativeStatus:
    available: bool
    reason: str  # what runs, or why the kernel does not
    amx: bool = False  # GEMMs with K % 32 == 0 and N % 16 == 0 run on AMX tiles (csrc/gemm_amx.c)
    amx_attention: bool = False  # rows of head_dim 64 with enough keys attend on AMX tiles (csrc/attention_amx.c)
    amx_attention_from: int = 0  # ... from this many keys (a row's context and ancestors)
    isa: str = "avx512"  # the vector instructions the kernels were built for: "avx512", or "avx2" (csrc/avx2.h)
    amx_emulated: bool = False  # EAGLE_CHAT_KERNELS=amx-emulated: the tiles are C functions (csrc/amx_emulate.h)

    def describe(self) -> str:
        if not self.available:
            return f"torch kernels ({self.reason})"
        if self.amx_emulated:  # never a serving path: named apart so that nothing tuned under it is taken for AMX
            return ("tiles emulated in C (EAGLE_CHAT_KERNELS=amx-emulated: tests only, slow): "
                    + replace(self, amx_emulated=False).describe())
        if self.amx and self.amx_attention:
            return (f"AMX bf16 GEMM, attention on AMX tiles from {self.amx_attention_from} keys (head_dim 64), "
                    "AVX-512 below and RMSNorm (core/kernels/csrc)")
        if self.amx:
            return "AMX bf16 GEMM, AVX-512 attention and RMSNorm (core/kernels/csrc)"
        if self.isa == "avx2":
            return "AVX2 GEMM, attention and RMSNorm (core/kernels/csrc, AVX-512 kernels on 256-bit halves)"
        return "AVX-512 bf16 GEMM, attention and RMSNorm (core/kernels/csrc)"  # as before AMX: autotune keys hold it


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


@functools.cache
def source_digest() -> str:
    """A hash of the kernels' source (csrc/*.c, *.h): it names the built library, and the probe's
    cached verdict depends on it."""
    return hashlib.sha1(b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.[ch]")))).hexdigest()


class UnsafeCache(RuntimeError):
    """The kernel directory could be written by someone else: code loaded from it is not ours."""


def _owned_and_private(path: Path) -> bool:
    st = path.stat()
    return st.st_uid in (os.getuid(), 0) and not st.st_mode & 0o022


def _kernel_dir() -> Path:
    """cache_home()/kernels, created 0o700; refused where another user could write to it."""
    from core.models import cache_home

    folder = cache_home() / "kernels"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _owned_and_private(folder):
        st = folder.stat()
        raise UnsafeCache(f"{folder} is not ours alone (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}) and code "
                          "is loaded from it; chmod go-w it (or remove it) to build there")
    return folder


def _whole_elf(lib: Path) -> bool:
    """Whether the file holds every byte its ELF headers point at. dlopen maps a truncated library
    without complaint, and the process dies of SIGBUS at the first page past the file's end."""
    data = lib.read_bytes()
    if len(data) < 64 or data[:5] != b"\x7fELF\x02":  # 64-bit ELF
        return False
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 54)
    if phoff + phnum * phentsize > len(data) or shoff + shnum * shentsize > len(data):
        return False
    segments = (struct.unpack_from("<QQQQ", data, phoff + i * phentsize + 8) for i in range(phnum))
    return all(offset + filesz <= len(data) for offset, _, _, filesz in segments)


def _compile(cc: str, flags: tuple[str, ...], lib: Path) -> str:
    """Build `lib`; "" when done, else the compiler's complaint. Each source compiles on its own
    core (gcc compiles the files of one command one after another; they share nothing but the
    headers, so the objects are the same either way), then one link: 9.1 s -> 3.9 s on the 2-core
    Intel VM (the first start of the app waits for it). BUILD_TIMEOUT_S bounds the whole build."""
    import tempfile
    import time
    from concurrent.futures import ThreadPoolExecutor

    sources = sorted(CSRC.glob("*.c"))
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    objects_flags = tuple(f for f in flags if f != "-shared") + ("-c",)

    def run(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(args, capture_output=True, text=True, timeout=max(0.1, deadline - time.monotonic()))

    def failed(done: subprocess.CompletedProcess) -> str:
        return done.stderr.strip()[-300:] or f"{cc} exited with {done.returncode}"

    try:
        with tempfile.TemporaryDirectory(dir=lib.parent, prefix=".build-") as work:
            objects = [str(Path(work) / f"{src.stem}.o") for src in sources]
            with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
                compiled = list(pool.map(lambda so: run([cc, *objects_flags, str(so[0]), "-o", so[1]]),
                                         zip(sources, objects)))
            bad = next((done for done in compiled if done.returncode != 0), None)
            if bad is not None:
                return failed(bad)
            done = run([cc, *flags, *objects, "-o", str(tmp)])
            if done.returncode != 0:
                tmp.unlink(missing_ok=True)
                return failed(done)
    except subprocess.TimeoutExpired:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cc} took more than {BUILD_TIMEOUT_S} s to build the kernels") from None
    os.chmod(tmp, 0o700)  # whatever the umask: nobody else may rewrite code we load
    os.replace(tmp, lib)
    return ""


def _build(isa: str = "avx512") -> Path:
    """Compile the kernels (once per source, flags and compiler) and return the library path.
    AVX-512: with AMX flags first; where the compiler refuses them, without (csrc/gemm_amx.c then builds
    stubs and the AVX-512 GEMM serves every shape); where it refuses -march=x86-64-v4 too (gcc
    10), with the same instruction sets named one by one. AVX2: AVX2_FLAGS."""
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        raise RuntimeError("no C compiler (gcc) on PATH")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout.splitlines()[:1]
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{cc} --version did not answer within 60 s") from None
    folder = _kernel_dir()
    problem = ""
    profile = ("-DEAGLE_PROFILE",) if os.environ.get(PROFILE_ENV) == "1" else ()
    if isa == "avx2":
        tries = (AVX2_FLAGS,)
    elif amx_emulated():
        tries = (FLAGS + AMX_FLAGS + AMX_EMULATE_FLAGS,)
    else:
        tries = (FLAGS + AMX_FLAGS, FLAGS, COMPAT_FLAGS)
    for flags in tries:
        flags = flags + profile
        key = hashlib.sha1(" ".join((source_digest(), *flags, *version)).encode()).hexdigest()[:12]
        lib = folder / f"decode-{key}.so"
        if lib.is_file() and not (_owned_and_private(lib) and _whole_elf(lib)):
            lib.unlink()  # truncated, or not written by us alone: build it again
        if lib.is_file():
            return lib
        problem = _compile(cc, flags, lib)
        if not problem:
            return lib
    raise RuntimeError(f"gcc failed: {problem}")


def _load(isa: str = "avx512") -> ctypes.CDLL:
    """The built library; a cached file that does not load (corrupt) is rebuilt once."""
    lib = _build(isa)
    try:
        return ctypes.CDLL(str(lib))
    except OSError:
        lib.unlink(missing_ok=True)
        return ctypes.CDLL(str(_build(isa)))


def amx_emulated() -> bool:
    """EAGLE_CHAT_KERNELS=amx-emulated: tiles emulated in C (tests only; needs an avx512_bf16 CPU)."""
    return os.environ.get(OFF_ENV, "").lower() == AMX_EMULATED


def _has_amx(feature: str = "amx_bf16") -> bool:
    """The CPU has AMX tiles with `feature` (amx_bf16, amx_int8), or they are emulated."""
    return amx_emulated() or {"amx_tile", feature} <= _cpu_flags()


def kernel_isa() -> str | None:
    """Which build this CPU runs: "avx512" (avx512_bf16), "avx2" (x86-64-v3: AVX2, FMA, F16C, ...; or
    EAGLE_CHAT_KERNELS=avx2 on any CPU that has them), or None (neither)."""
    flags = _cpu_flags()
    if os.environ.get(OFF_ENV, "").lower() == "avx2" or "avx512_bf16" not in flags:
        return "avx2" if AVX2_FEATURES <= flags else None
    return "avx512"


# The classes a `// ctypes:` declaration names -> ctypes types (void: no result)
CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float,
          "f64": ctypes.c_double, "void": None}
_DECLARED = re.compile(r"(\w+)\((.*)\)\s*->\s*(\w+)")


@dataclass(frozen=True)
class Signature:
    """An exported C function as the `// ctypes:` comment directly above its definition in csrc
    declares it, e.g. `// ctypes: argmax_bf16(ptr x, i64 ldx, ptr out, i32 M, i32 N, i32 nthreads) -> void`
    (continued on the next comment lines until its `-> result`). tests/test_native.py checks each
    one against the C parameter list below it: ctypes converts by the declaration alone, so a
    mismatch would pass wrong bits or a short stack silently. The int results are 0, or -1 where
    work memory could not be had (or an argument the C refuses)."""

    name: str
    params: tuple[tuple[str, str], ...]  # (class, the C parameter's name), in order
    result: str                          # a CTYPES class
    line: int                            # 1-based: the line after the declaration, where the definition starts

    @property
    def argtypes(self) -> list:
        return [CTYPES[c] for c, _ in self.params]

    @property
    def restype(self):
        return CTYPES[self.result]


def parse_declarations(text: str, where: str = "C source") -> list[Signature]:
    """The `// ctypes:` declarations in one C source, in order. RuntimeError for one it cannot read."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("// ctypes:"):
            continue
        body, end = line.removeprefix("// ctypes:"), i + 1
        while "->" not in body and end < len(lines) and lines[end].startswith("//"):
            body, end = body + " " + lines[end].removeprefix("//"), end + 1
        found = _DECLARED.fullmatch(" ".join(body.split()))
        params = tuple(tuple(p.split()) for p in found.group(2).split(",")) if found and found.group(2) else ()
        if (not found or found.group(3) not in CTYPES
                or any(len(p) != 2 or p[0] not in CTYPES or p[0] == "void" for p in params)):
            raise RuntimeError(f"{where}:{i + 1}: unreadable declaration {line.strip()!r} (classes: {', '.join(CTYPES)})")
        out.append(Signature(found.group(1), params, found.group(3), end + 1))
    return out


@functools.cache
def signatures() -> dict[str, Signature]:
    """Every exported C function's declaration (csrc/*.c), by name: the table the library is bound with."""
    table = {}
    for path in sorted(CSRC.glob("*.c")):
        for sig in parse_declarations(path.read_text(), path.name):
            if sig.name in table:
                raise RuntimeError(f"{path.name}:{sig.line}: {sig.name} is declared a second time")
            table[sig.name] = sig
    return table


class _Kernels:
    """The library's functions, as attributes named like their C symbols (`signatures()`)."""

    def __init__(self, lib: ctypes.CDLL):
        for name, sig in signatures().items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = sig.argtypes, sig.restype
            setattr(self, name, fn)


@functools.cache
def _library() -> tuple[_Kernels | None, NativeStatus]:
    if os.environ.get(OFF_ENV, "").lower() in ("torch", "off", "0"):
        return None, NativeStatus(False, f"{OFF_ENV}={os.environ[OFF_ENV]}")
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None, NativeStatus(False, f"needs x86-64 Linux, this is {platform.system()} {platform.machine()}")
    isa = kernel_isa()
    if isa is None:
        return None, NativeStatus(False, "this CPU lacks both avx512_bf16 and AVX2 (x86-64-v3: AVX2, FMA, F16C, BMI2, ...)")
    try:
        kernels = _Kernels(_load(isa))
    except (OSError, RuntimeError) as e:
        return None, NativeStatus(False, f"kernel build failed: {e}")
    amx = bool(kernels.amx_enable(int(amx_wanted())))
    kernels.x8_amx_enable(int(amx and _has_amx("amx_int8")))
    attention_amx = bool(kernels.attn_amx_enable(int(amx and amx_attention_wanted())))
    problem = _self_test(kernels)
    if problem:
        return None, NativeStatus(False, f"kernel self-test failed: {problem}")
    return kernels, NativeStatus(True, "built and self-tested", amx=amx, amx_attention=attention_amx,
                                 amx_attention_from=int(kernels.attn_amx_min_keys(-1)), isa=isa,
                                 amx_emulated=amx and amx_emulated())


def amx_wanted() -> bool:
    """The CPU has AMX bf16 tiles and EAGLE_CHAT_AMX does not turn them off (Linux must still grant them)."""
    return _has_amx() and not switched_off(AMX_ENV)


def amx_attention_wanted() -> bool:
    """Attention on AMX tiles unless EAGLE_CHAT_AMX_ATTENTION turns it off (the tiles must be granted too)."""
    return not switched_off(AMX_ATTENTION_ENV)


def set_amx_attention(on: bool, from_keys: int | None = None) -> bool:
    """Attention on AMX tiles on or off, for rows with at least `from_keys` keys (None: as it is;
    tests compare the kernels and use small thresholds; numerics differ, so an engine must not switch
    between calls). Returns whether the tiles serve head_dim 64 now."""
    k, st = _library()
    if k and from_keys is not None:
        k.attn_amx_min_keys(int(from_keys))
    return bool(k and k.attn_amx_enable(int(on and st.amx)))


def set_x8_amx(on: bool) -> bool:
    """AMX-INT8 for 8-bit-activation GEMMs of 9+ rows on or off (tests compare it with VNNI);
    on only where the CPU has amx_int8 and the tiles were granted. Returns whether it serves now."""
    k, st = _library()
    return bool(k and k.x8_amx_enable(int(on and st.amx and _has_amx("amx_int8"))))


def status() -> NativeStatus:
    return _library()[1]


def stage_times() -> dict[str, dict[str, float]] | None:
    """Seconds spent in each stage of the target's forwards ("target") and the draft head's ("head") since
    the last call, then zeroed; None where the kernels were not built with EAGLE_CHAT_PROFILE=1."""
    k = _library()[0]
    if k is None:
        return None
    buf = (ctypes.c_double * (2 * len(STAGES)))()
    count = k.step_profile(buf, len(buf))
    if count < 0:
        return None
    assert count == len(STAGES), f"csrc/common.h has {count} stages, STAGES names {len(STAGES)}"
    return {part: {name: buf[j * count + i] for i, name in enumerate(STAGES)} for j, part in enumerate(("target", "head"))}


def gemm_kind() -> str | None:
    """Which decoding GEMM runs here: "amx", "avx512", "avx2", or None (torch's kernels). What a verified
    row costs depends on it, so shipped draft trees may differ by it (core.decoding.treestore)."""
    st = status()
    return ("amx" if st.amx else st.isa) if st.available else None


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """x (..., K) -> (a tensor whose rows are x's rows, M, its row stride)."""
    if x.is_contiguous():
        return x, x.numel() // x.shape[-1], x.shape[-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, rows.shape[0], rows.stride(0)


def _expect(ok: bool, what: Callable[[], str]) -> None:
    """A public wrapper's entry check: the C reads raw pointers, so a wrong dtype, device or
    layout would be read as garbage (or past an end), never caught there. `what` builds the
    message only when it is needed (describing every tensor of every call cost 0.2 ms a
    decoding step)."""
    if not ok:
        raise ValueError(f"core.kernels.native: {what()}")


def _bf16_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype is torch.bfloat16 and t.is_cpu) for t in tensors)


def _about(*tensors: torch.Tensor | None) -> str:
    """What a wrapper got, for its error message."""
    return ", ".join("None" if t is None else f"{t.dtype} {t.device} {tuple(t.shape)} strides {t.stride()}"
                     for t in tensors)


def _bias_ok(bias: torch.Tensor | None, n: int) -> bool:
    return bias is None or (bias.dtype is torch.bfloat16 and bias.is_cpu and bias.shape == (n,))


def _linear(k: _Kernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x (..., K) bf16; weight (N, K) with unit stride in K; bias (N,) or None -> (..., N) bf16
    rows, m, ldx = _rows(x)
    n = weight.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16, device=x.device)
    if k.gemm_bf16(rows.data_ptr(), ldx, weight.data_ptr(), weight.stride(0),
              None if bias is None else bias.contiguous().data_ptr(), y.data_ptr(), n, m, n, x.shape[-1],
              torch.get_num_threads()):
        raise MemoryError(f"the native GEMM could not allocate its work memory for {m} rows of a {n} x {x.shape[-1]} weight")
    return y


def _attention(k: _Kernels, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, committed: int,
               ancestors: torch.Tensor, counts: torch.Tensor, scale: float) -> torch.Tensor:
    # q (n, nh, hd); key, value (kvh, T, hd), unit stride in hd, same strides;
    # ancestors (n, A) int64 slots past `committed`, counts (n,) -> (n, nh, hd) bf16
    n, nh, hd = q.shape
    out = torch.empty(n, nh, hd, dtype=torch.bfloat16, device=q.device)
    if k.attention_bf16(q.data_ptr(), q.stride(0), q.stride(1), key.data_ptr(), value.data_ptr(), key.stride(0),
                   key.stride(1), ancestors.data_ptr(), ancestors.stride(0), counts.data_ptr(), out.data_ptr(),
                   n, nh, key.shape[0], hd, committed, scale, torch.get_num_threads()):
        raise MemoryError(f"native attention could not allocate its scores for {n} rows over {committed} keys")
    return out


def _rms_norm(k: _Kernels, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x (..., H) bf16; weight (H,) contiguous -> (..., H) bf16
    rows, m, ldx = _rows(x)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    k.rmsnorm_bf16(rows.data_ptr(), ldx, weight.data_ptr(), y.data_ptr(), x.shape[-1], m, x.shape[-1], eps,
               torch.get_num_threads())
    return y


def _argmax(k: _Kernels, x: torch.Tensor) -> torch.Tensor:
    # x (..., V) bf16 -> (...) int64: index of each row's first maximum
    rows, m, ldx = _rows(x)
    out = torch.empty(x.shape[:-1], dtype=torch.int64, device=x.device)
    k.argmax_bf16(rows.data_ptr(), ldx, out.data_ptr(), m, x.shape[-1], torch.get_num_threads())
    return out


def _topk_log_probs(k: _Kernels, x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    # x (m, V) bf16 logits -> (m, top) fp32 log-probabilities, best first; (m, top) int64 indices
    rows, m, ldx = _rows(x)
    vals = torch.empty(m, top, dtype=torch.float32, device=x.device)
    idx = torch.empty(m, top, dtype=torch.int64, device=x.device)
    if k.topk_logprobs_bf16(rows.data_ptr(), ldx, vals.data_ptr(), idx.data_ptr(), m, x.shape[-1], top,
                            torch.get_num_threads()):
        raise ValueError(f"core.kernels.native: top-k needs 1 <= top <= {TOPK_MAX}, got {top}")
    return vals, idx


@dataclass(frozen=True)
class Int8Weight:
    """A weight (N, K) as int8 with one fp32 scale per output row, and each row's integer sum."""

    q: torch.Tensor      # (N, K) int8, contiguous
    scale: torch.Tensor  # (N,) float32: weight[n] ~ scale[n] * q[n]
    sums: torch.Tensor   # (N,) int32: q[n].sum()


def _quantize(k: _Kernels, weight: torch.Tensor) -> Int8Weight:
    n, kdim = weight.shape
    q = torch.empty(n, kdim, dtype=torch.int8)
    scale, sums = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.int32)
    k.quantize_weight_s8(weight.data_ptr(), weight.stride(0), q.data_ptr(), scale.data_ptr(), sums.data_ptr(), n, kdim,
                  torch.get_num_threads())
    return Int8Weight(q, scale, sums)


def _linear_s8(k: _Kernels, x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    # x (..., K) bf16 -> (..., N) bf16, approximately x @ weight.T + bias
    rows, m, ldx = _rows(x)
    n = w.q.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16, device=x.device)
    if k.gemm_s8(rows.data_ptr(), ldx, w.q.data_ptr(), w.scale.data_ptr(), w.sums.data_ptr(),
                  None if bias is None else bias.contiguous().data_ptr(), y.data_ptr(), n, m, n, x.shape[-1],
                  torch.get_num_threads()):
        raise MemoryError(f"the int8 GEMM could not allocate its quantized copy of {m} rows")
    return y


def _rotary(k: _Kernels, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    # x (n, heads * hd) bf16, unit stride; cos, sin (n, hd) bf16, same strides -> (n, heads, hd) bf16
    n, width = x.shape
    hd = width // heads
    out = torch.empty(n, heads, hd, dtype=torch.bfloat16, device=x.device)
    k.rotary_bf16(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr(), n, heads, hd)
    return out


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, the formula `rms_norm` computes."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def reference_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, committed: int,
                        ancestors: torch.Tensor, counts: torch.Tensor, scale: float) -> torch.Tensor:
    """What `attention` computes, in fp32 torch (for tests and the self-test)."""
    n, nh, hd = q.shape
    g = nh // key.shape[0]
    out = torch.empty(n, nh, hd)
    for i in range(n):
        slots = torch.cat([torch.arange(committed), committed + ancestors[i, :int(counts[i])]])
        kk, vv = key[:, slots].float().repeat_interleave(g, 0), value[:, slots].float().repeat_interleave(g, 0)
        p = torch.softmax((q[i].float()[:, None] @ kk.transpose(-1, -2))[:, 0] * scale, dim=-1)  # (nh, keys)
        out[i] = (p[:, None] @ vv)[:, 0]
    return out


def _self_test(k: _Kernels) -> str | None:
    gen = torch.Generator().manual_seed(0)
    for n, kdim in ((40, 100), (64, 576)):
        x = torch.randn(9, kdim, generator=gen).bfloat16()
        w = torch.randn(n, kdim, generator=gen).bfloat16()
        b = torch.randn(n, generator=gen).bfloat16()
        y = _linear(k, x, w, b)
        ref = x.float() @ w.float().T + b.float()
        if not torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max())):
            return f"wrong GEMM results for a {n}x{kdim} weight"
        if not all(torch.equal(_linear(k, x[i:i + 1], w, b)[0], y[i]) for i in range(x.shape[0])):
            return f"GEMM rows differ alone and in a batch for a {n}x{kdim} weight"
    q = torch.randn(3, 4, 64, generator=gen).bfloat16()
    key, value = torch.randn(2, 40 + 3, 64, generator=gen).bfloat16(), torch.randn(2, 43, 64, generator=gen).bfloat16()
    anc, counts = torch.tensor([[0, 0], [0, 1], [0, 2]]), torch.tensor([1, 2, 2])
    out = _attention(k, q, key, value, 40, anc, counts, 0.125)
    if not torch.allclose(out.float(), reference_attention(q, key, value, 40, anc, counts, 0.125), atol=2e-2):
        return "wrong attention results"
    if not torch.equal(_attention(k, q[2:], key, value, 40, anc[2:], counts[2:], 0.125), out[2:]):
        return "attention rows differ alone and in a batch"
    x = torch.randn(5, 100, generator=gen).bfloat16()
    w = torch.randn(100, generator=gen).bfloat16()
    y = _rms_norm(k, x, w, 1e-5)
    if not torch.allclose(y.float(), reference_rms_norm(x, w, 1e-5).float(), rtol=2e-2, atol=2e-2):
        return "wrong RMSNorm results"
    if not torch.equal(_rms_norm(k, x[3:4], w, 1e-5), y[3:4]):
        return "RMSNorm rows differ alone and in a batch"
    logits = torch.randn(4, 1000, generator=gen).bfloat16()
    logits[1, 7] = logits[1, 900] = 99.0  # a tie: the first index wins
    logits[2] = float("-inf")
    logits[3, 5] = float("nan")
    if not torch.equal(_argmax(k, logits), torch.tensor([int(logits[0].float().argmax()), 7, 0, 5])):
        return "wrong argmax results"
    vals, idx = _topk_log_probs(k, logits[:2], 8)
    ref = torch.log_softmax(logits[:2].float(), -1).clamp(max=0.0).topk(8)
    if not (torch.allclose(vals, ref.values, atol=1e-5) and int(idx[1, 0]) == 7 and int(idx[1, 1]) == 900
            and torch.equal(idx[0], ref.indices[0])):
        return "wrong top-k log-probabilities"
    g, u = torch.randn(3, 37, generator=gen).bfloat16() * 4, torch.randn(3, 37, generator=gen).bfloat16()
    act = torch.empty_like(g)
    k.silu_mul_bf16(g.data_ptr(), 37, u.data_ptr(), 37, act.data_ptr(), 37, 3, 37, 1)
    if not torch.allclose(act.float(), (F.silu(g.float()) * u.float()), rtol=2e-2, atol=1e-2):
        return "wrong SiLU x up results"
    if _int8_kernel(kernel_isa()):  # int8_available(), before _library returns
        w = torch.randn(40, 100, generator=gen).bfloat16()
        x = torch.randn(5, 100, generator=gen).bfloat16()
        ref = x.float() @ w.float().T
        y = _linear_s8(k, x, _quantize(k, w), None).float()
        if not torch.allclose(y, ref, atol=0.05 * float(ref.abs().max())):
            return "wrong int8 GEMM results"
    return None


def _gemm_args(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x and a weight (N, K) `linear` reads: bf16 on the CPU, unit stride in K, no autograd (cheap checks only)."""
    return (x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16 and x.is_cpu and weight.is_cpu
            and weight.dim() == 2 and weight.stride(1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` serves this call: bf16 on the CPU, no autograd, at most MAX_ROWS rows."""
    return _gemm_args(x, weight) and x.numel() <= MAX_ROWS * x.shape[-1] and _library()[0] is not None


def _tile_shape(n: int, k: int) -> bool:
    """Whether an (n, k) weight runs on AMX tiles here (csrc/gemm_amx.c's amx_serves)."""
    return status().amx and n % 16 == 0 and k % 32 == 0


def prompt_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` also serves a prompt-sized call (more than MAX_ROWS rows): where this shape runs on
    AMX tiles (csrc/gemm_amx.c; chosen by shape, never by M, so a row's bits do not depend on the call's
    size). There a 1,024-row prefill chunk costs less than in oneDNN's bf16 GEMM, which reorders the
    weight on every call and needs K_CHUNK's fp32 partials for row invariance (docs/long-context.md,
    2026-12-05, twelfth session). Without tiles the vector kernel re-reads the weight for every 16 rows,
    so oneDNN keeps those calls. On AVX2 (no avx512_bf16) torch's bf16 GEMM is a dot-product loop
    (`bf16_dot_with_fp32_arith`: 73% of a 552-token prefill, 30 s), so the vector kernel serves them all there."""
    return _gemm_args(x, weight) and x.shape[-1] == weight.shape[1] and (
        _tile_shape(*weight.shape) or status().isa == "avx2")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through the kernel: x (..., K) bf16, weight (N, K), bias (N,) -> (..., N) bf16."""
    k = _library()[0]
    assert k is not None, "check native.usable(x, weight) first"
    _expect(_bf16_cpu(x, weight) and weight.dim() == 2 and weight.stride(1) == 1 and x.shape[-1] == weight.shape[1]
            and _bias_ok(bias, weight.shape[0]), lambda: "linear needs bf16 CPU x (..., K), weight (N, K) with unit stride in K, "
            f"bias (N,) or None; got {_about(x, weight, bias)}")
    return _linear(k, x, weight, bias)


def attention_usable(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `attention` serves this call: bf16 on the CPU, head_dim a multiple of 32 up to 256."""
    return (query.dtype == key.dtype and attention_serves(query.dtype, query.device, query.shape[-1],
                                                          query.shape[1], key.shape[1]))


def attention_serves(dtype: torch.dtype, device, head_dim: int, heads: int, kv_heads: int) -> bool:
    """`attention_usable` from the shapes alone (for callers that decide before the tensors exist)."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and head_dim % 32 == 0
            and head_dim <= 256 and heads % kv_heads == 0 and _library()[0] is not None)


def attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, committed: int,
              ancestors: torch.Tensor, counts: torch.Tensor, scale: float) -> torch.Tensor:
    """Row i attends to cache slots 0 .. committed-1, then committed + ancestors[i, :counts[i]]
    (its ancestors and itself, root first). q (n, nh, hd); key, value (kvh, T, hd);
    ancestors (n, A) int64; counts (n,) int64 -> (n, nh, hd) bf16."""
    k = _library()[0]
    assert k is not None, "check native.attention_usable(query, key) first"
    _expect(_bf16_cpu(q, key, value) and q.dim() == 3 and key.dim() == 3 and value.shape == key.shape
            and q.shape[2] == key.shape[2] and q.shape[2] % 32 == 0 and q.shape[2] <= 256 and q.shape[1] % key.shape[0] == 0
            and ancestors.dtype is torch.int64 and counts.dtype is torch.int64 and ancestors.is_cpu and counts.is_cpu
            and ancestors.dim() == 2 and counts.shape == (q.shape[0],) == ancestors.shape[:1]
            and 0 <= committed <= key.shape[1],
            lambda: "attention needs bf16 CPU q (n, nh, hd), key and value (kvh, T, hd) with hd % 32 == 0 up to 256, "
            f"int64 ancestors (n, A) and counts (n,), 0 <= committed <= T; got {_about(q, key, value, ancestors, counts)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if key.stride(-1) != 1 or value.stride(-1) != 1 or key.stride() != value.stride():
        key, value = key.contiguous(), value.contiguous()
    return _attention(k, q, key, value, committed, ancestors.contiguous(), counts.contiguous(), scale)


def argmax_usable(x: torch.Tensor) -> bool:
    """Whether `argmax` serves this call: bf16 rows on the CPU, unit stride along the vocabulary."""
    return (x.dtype is torch.bfloat16 and x.is_cpu and x.dim() >= 1 and x.stride(-1) == 1
            and 0 < x.shape[-1] < 2**31 and _library()[0] is not None)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) over bf16 logits in one call: x (..., V) -> (...) int64, the first
    maximum of each row (NaN counting as the maximum, as in torch)."""
    k = _library()[0]
    assert k is not None, "check native.argmax_usable(x) first"
    _expect(_bf16_cpu(x) and x.dim() >= 1 and 0 < x.shape[-1] < 2**31, lambda: f"argmax needs bf16 CPU rows; got {_about(x)}")
    return _argmax(k, x)


def as_int64(v: int) -> int:
    """A Python int taken modulo 2^64, as the signed 64-bit value with the same bits (ctypes i64)."""
    v &= 2**64 - 1
    return v - 2**64 if v & 2**63 else v


def gumbel_usable(device: torch.device | str) -> bool:
    """Whether `gumbel_noise` serves draws on this device (the CPU, with the library built)."""
    return torch.device(device).type == "cpu" and _library()[0] is not None


def gumbel_noise(key: int, ids: torch.Tensor | None, n: int) -> torch.Tensor:
    """Gumbel noise keyed by (key, token id), csrc/gumbel.c: ids (n,) int64 (None = 0 .. n - 1) ->
    (n,) fp32. key: any 64-bit value (Python int, taken modulo 2^64)."""
    k = _library()[0]
    assert k is not None, "check native.gumbel_usable(device) first"
    out = torch.empty(n, dtype=torch.float32)
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        _expect(ids.is_cpu and ids.shape == (n,), lambda: f"gumbel_noise needs (n,) CPU ids; got {_about(ids)}")
    k.gumbel_noise(as_int64(key), None if ids is None else ids.data_ptr(), out.data_ptr(), n)
    return out


def gumbel_argmax(x: torch.Tensor, key: int, reach: float) -> int:
    """The Gumbel-max over one row, csrc/gumbel.c: x (V,) fp32 CPU (-inf: dropped) -> the first
    argmax of x + gumbel_noise(key, None, V), or -1 where no entry is finite. Tokens more than
    `reach` below the row's maximum get no noise (the caller's bound on it)."""
    k = _library()[0]
    assert k is not None, "check native.gumbel_usable(device) first"
    x = x.contiguous()
    _expect(x.dtype is torch.float32 and x.is_cpu and x.dim() == 1 and 0 < x.shape[0] < 2**31,
            lambda: f"gumbel_argmax needs an fp32 CPU row; got {_about(x)}")
    return int(k.gumbel_argmax(x.data_ptr(), x.shape[0], as_int64(key), reach))


def gumbel_argmax_bf16(logits: torch.Tensor, key: int, temperature: float, reach: float) -> int:
    """gumbel_argmax of logits / temperature, read from (V,) bf16 CPU logits in one native call
    (csrc/gumbel.c): the same draw as gumbel_argmax(logits.float() / temperature, key, reach)."""
    k = _library()[0]
    assert k is not None, "check native.gumbel_usable(device) first"
    logits = logits.contiguous()
    _expect(logits.dtype is torch.bfloat16 and logits.is_cpu and logits.dim() == 1 and 0 < logits.shape[0] < 2**31
            and temperature > 0, lambda: f"gumbel_argmax_bf16 needs a bf16 CPU row and a temperature > 0; got "
            f"{_about(logits)}, temperature {temperature}")
    return int(k.gumbel_argmax_bf16(logits.data_ptr(), logits.shape[0], as_int64(key), temperature, reach))


def rotary_usable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> bool:
    """Whether `rotary` serves this call: bf16 x (n, heads * hd) and cos, sin (n, hd) on the CPU,
    unit strides, an even hd, no autograd."""
    return (x.dtype is torch.bfloat16 and cos.dtype is torch.bfloat16 and sin.dtype is torch.bfloat16
            and x.is_cpu and x.dim() == 2 and cos.dim() == 2 and x.shape[1] % heads == 0
            and cos.shape == sin.shape == (x.shape[0], x.shape[1] // heads) and cos.shape[1] % 2 == 0
            and x.stride(1) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride()
            and not (torch.is_grad_enabled() and x.requires_grad) and _library()[0] is not None)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' rotary embedding in bf16, bit for bit, in one call: x (n, heads * hd) (a
    projection's output rows), cos, sin (n, hd) -> (n, heads, hd) = x * cos + rotate_half(x) * sin."""
    k = _library()[0]
    assert k is not None, "check native.rotary_usable(x, cos, sin, heads) first"
    _expect(_bf16_cpu(x, cos, sin) and x.dim() == 2 and cos.dim() == 2 and x.shape[1] % heads == 0
            and cos.shape == sin.shape == (x.shape[0], x.shape[1] // heads) and cos.shape[1] % 2 == 0
            and x.stride(1) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride(),
            lambda: f"rotary needs bf16 CPU x (n, heads * hd), cos and sin (n, hd) alike, unit strides, even hd; got {_about(x, cos, sin)}")
    return _rotary(k, x, cos, sin, heads)


S8_MAX_ROWS = 64  # int8 drafting GEMM: decoding-sized calls only (a prompt's catch-up keeps bf16)


@functools.cache
def int8_available() -> bool:
    """Whether the int8 drafting GEMM runs here (the kernels, and VNNI's vpdpbusd or, in the AVX2
    build, its exact emulation: csrc/avx2.h)."""
    return _library()[0] is not None and _int8_kernel(status().isa)


def _int8_kernel(isa: str | None) -> bool:
    """Whether gemm_s8 has its integer dot product in this build: VNNI's vpdpbusd, or the AVX2 build's
    exact emulation of it."""
    return isa == "avx2" or "avx512_vnni" in _cpu_flags()


def quantize(weight: torch.Tensor) -> Int8Weight:
    """A bf16 CPU weight (N, K) -> Int8Weight: per output row, scale max|w| / 127, round to nearest."""
    k = _library()[0]
    assert k is not None and int8_available(), "check native.int8_available() first"
    _expect(weight.is_cpu and weight.dim() == 2 and weight.is_floating_point(), lambda: f"quantize needs a CPU weight (N, K); got {_about(weight)}")
    weight = weight.detach().to(torch.bfloat16).contiguous()
    return _quantize(k, weight)


def linear_s8_usable(x: torch.Tensor, w: Int8Weight) -> bool:
    """Whether `linear_s8` serves this call: bf16 rows on the CPU (at most S8_MAX_ROWS), no autograd."""
    return (x.dtype is torch.bfloat16 and x.is_cpu and x.shape[-1] == w.q.shape[1]
            and x.numel() <= S8_MAX_ROWS * x.shape[-1]
            and not (torch.is_grad_enabled() and x.requires_grad) and int8_available())


def linear_s8(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Approximately F.linear(x, weight, bias) from the int8 weight, for drafting: x (..., K) bf16
    -> (..., N) bf16. Each x row is quantized to int8 on the fly (scale max|x| / 127); the
    integer dot products are exact, so a row's result does not depend on the others. Relative
    error about 1% of the output's scale: drafts only, never the target."""
    k = _library()[0]
    assert k is not None, "check native.linear_s8_usable(x, w) first"
    _expect(_bf16_cpu(x) and x.shape[-1] == w.q.shape[1] and _bias_ok(bias, w.q.shape[0]),
            lambda: f"linear_s8 needs bf16 CPU x (..., K) for an int8 weight (N, K), bias (N,) or None; got {_about(x, w.q, bias)}")
    return _linear_s8(k, x, w, bias)


TOPK_MAX = 64  # csrc/topk_bf16.c's MAX_K


def topk_usable(x: torch.Tensor, top: int) -> bool:
    """Whether `topk_log_probs` serves this call: bf16 rows (m, V) on the CPU, unit stride along
    the vocabulary, 1 <= top <= min(V, TOPK_MAX)."""
    return (x.dtype is torch.bfloat16 and x.is_cpu and x.dim() == 2 and x.stride(-1) == 1
            and 1 <= top <= min(x.shape[-1], TOPK_MAX) and x.shape[-1] < 2**31 and _library()[0] is not None)


def topk_log_probs(x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`log_softmax(x.float(), -1).clamp(max=0).topk(top)` in one call, for drafting: x (m, V) bf16
    logits -> values (m, top) fp32 (within 1e-6 of torch's) and indices (m, top) int64, best first,
    the lower index first on equal logits. The exponentials are a polynomial (relative error
    about 1e-7), so this is for draft scores only, never for the target's choices."""
    k = _library()[0]
    assert k is not None, "check native.topk_usable(x, top) first"
    _expect(_bf16_cpu(x) and x.dim() == 2 and 1 <= top <= min(x.shape[-1], TOPK_MAX) and x.shape[-1] < 2**31,
            lambda: f"topk_log_probs needs bf16 CPU logits (m, V) and 1 <= top <= min(V, {TOPK_MAX}); got top={top}, {_about(x)}")
    return _topk_log_probs(k, x, top)


def norm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` serves this call: bf16 rows and weight on the CPU, no autograd."""
    return (x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16 and x.is_cpu and weight.dim() == 1
            and weight.shape[0] == x.shape[-1] and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and _library()[0] is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in one call: x (..., H) bf16, weight (H,) -> (..., H) bf16."""
    k = _library()[0]
    assert k is not None, "check native.norm_usable(x, weight) first"
    _expect(_bf16_cpu(x, weight) and weight.dim() == 1 and weight.shape[0] == x.shape[-1] and weight.is_contiguous(),
            lambda: f"rms_norm needs bf16 CPU x (..., H) and a contiguous weight (H,); got {_about(x, weight)}")
    return _rms_norm(k, x, weight, eps)


def move_rows_usable(buffers: list[torch.Tensor]) -> bool:
    """Whether `move_rows` serves these buffers: CPU tensors (1, heads, capacity, head_dim), each
    head's rows contiguous, all with the same shape and strides (a KV cache's layers)."""
    if not buffers or _library()[0] is None:
        return False
    first = buffers[0]
    return (first.dim() == 4 and first.shape[0] == 1 and first.stride(-1) == 1 and first.stride(-2) == first.shape[-1]
            and all(b.is_cpu and b.shape == first.shape and b.stride() == first.stride() and b.dtype == first.dtype
                    for b in buffers))


def move_rows(buffers: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """In every buffer (1, heads, capacity, head_dim) and head, row src[i] -> row dst[i], in place,
    in order of i (safe when dst[i] <= src[i] and src ascends: KV cache compaction)."""
    assert _library()[0] is not None, "check native.move_rows_usable(buffers) first"
    _expect(move_rows_usable(buffers), lambda: "move_rows needs CPU buffers (1, heads, capacity, head_dim) of one "
            f"shape, stride and dtype, each head's rows contiguous; got {_about(*buffers[:2])}")
    RowMover.over(buffers).move(src, dst)


@dataclass(frozen=True)
class RowMover:
    """move_rows over buffers checked once (move_rows_usable) and their addresses gathered once: a
    KV cache's layers, for as long as its buffers stay (core.decoding.cache keeps one per cache
    until core.decoding.cache.buffers_epoch changes). It holds addresses, not the buffers."""

    bases: torch.Tensor  # (buffers,) int64 data pointers
    heads: int
    head_bytes: int      # stride between heads
    row_bytes: int

    @classmethod
    def over(cls, buffers: list[torch.Tensor]) -> "RowMover":
        first = buffers[0]
        item = first.element_size()
        return cls(torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64), first.shape[1],
                   first.stride(1) * item, first.shape[-1] * item)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        _expect(src.dim() == dst.dim() == 1 and src.shape == dst.shape and not src.is_floating_point()
                and not dst.is_floating_point(), lambda: f"move_rows needs integer src, dst (n,); got {_about(src, dst)}")
        src, dst = src.to(torch.int64).contiguous(), dst.to(torch.int64).contiguous()
        _library()[0].move_rows(self.bases.data_ptr(), self.bases.shape[0], self.heads, self.head_bytes,
                                self.row_bytes, src.data_ptr(), dst.data_ptr(), src.shape[0])


class WMat(ctypes.Structure):
    """csrc/weights.h's wmat: a weight as the GEMMs read it, bf16 rows or GGUF blocks (core.kernels.quant).
    It points into tensors it does not own: keep them alive while it is used."""

    _fields_ = [("type", ctypes.c_int32), ("N", ctypes.c_int32), ("K", ctypes.c_int32), ("tiled", ctypes.c_int32),
                ("data", ctypes.c_void_p), ("ld", ctypes.c_int64)]


WT_BF16 = 30  # csrc/weights.h; the block types use their ggml ids (core.kernels.quant.SUPPORTED)


def wmat(weight: torch.Tensor | None = None, blocks=None) -> WMat:
    """A WMat over a bf16 weight (N, K) with unit stride in K, or over core.kernels.quant.Blocks."""
    if blocks is not None:
        return WMat(blocks.type, blocks.n, blocks.k, int(blocks.tiled), blocks.data.data_ptr(), blocks.data.stride(0))
    _expect(weight is not None and _bf16_cpu(weight) and weight.dim() == 2 and weight.stride(1) == 1,
            lambda: f"wmat needs a bf16 CPU weight (N, K) with unit stride in K; got {_about(weight)}")
    return WMat(WT_BF16, weight.shape[0], weight.shape[1], 0, weight.data_ptr(), weight.stride(0))


def _gemm_w(name: str, x: torch.Tensor, w: WMat, bias: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """x (..., K) bf16 through the C GEMM `name` (gemm_w's arguments) -> (y (..., N) bf16, its return code)."""
    k = _library()[0]
    assert k is not None, "needs the kernels"
    _expect(_bf16_cpu(x) and x.shape[-1] == w.K and _bias_ok(bias, w.N),
            lambda: f"{name} needs bf16 CPU x (..., {w.K}), bias ({w.N},) or None; got {_about(x, bias)}")
    rows, m, ldx = _rows(x)
    y = torch.empty((*x.shape[:-1], w.N), dtype=torch.bfloat16)
    code = getattr(k, name)(rows.data_ptr(), ldx, ctypes.byref(w), None if bias is None else bias.contiguous().data_ptr(),
                            y.data_ptr(), w.N, m, torch.get_num_threads())
    return y, code


def linear_w(x: torch.Tensor, w: WMat, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) bf16 @ w.T (+ bias) -> (..., N) bf16, for a weight of any kind; a block weight
    gives the bits its bf16 copy gives."""
    y, code = _gemm_w("gemm_w", x, w, bias)
    if code:
        raise MemoryError(f"the native GEMM could not allocate its scratch for a {w.N} x {w.K} weight")
    return y


TILE_TYPES = (WT_BF16, 2, 3, 8, 100, 105, 107)  # what gemm_tiles reads: bf16, Q4_0, Q4_1, Q8_0 and the 4-bit X8
                                                # layouts Q4_X8, Q4K_X8, Q40_X8 (csrc/weights.h is_nibbles)


def tiles_serve(w: WMat) -> bool:
    """Whether `linear_tiles` serves this weight here: AMX tiles, K % 32 == 0, N % 16 == 0, a kind they read."""
    return w.type in TILE_TYPES and _tile_shape(w.N, w.K)


def linear_tiles(x: torch.Tensor, w: WMat, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A prompt's x (..., K) bf16 @ w.T (+ bias) -> (..., N) bf16 on AMX tiles, block weights dequantized
    tile by tile into cache (csrc/gemm_bf16.c: gemm_tiles): the bits `linear(x, dequantize(w), bias)`
    gives, without the bf16 copy. Check `tiles_serve(w)` first."""
    y, code = _gemm_w("gemm_tiles", x, w, bias)
    if code == -2:
        raise ValueError(f"linear_tiles does not serve a {w.N} x {w.K} weight of type {w.type} here: check tiles_serve(w)")
    if code:
        raise MemoryError(f"the tile GEMM could not allocate its work memory for {x.numel() // w.K} rows of a "
                          f"{w.N} x {w.K} weight")
    return y


def dequantize(w: WMat) -> torch.Tensor:
    """The bf16 values (N, K) the GEMMs read from w."""
    k = _library()[0]
    assert k is not None
    out = torch.empty(w.N, w.K, dtype=torch.bfloat16)
    k.dequantize_bf16(ctypes.byref(w), out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul_usable(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `silu_mul` serves this call: bf16 CPU tensors of one shape, unit stride, no autograd."""
    return (gate.dtype is torch.bfloat16 and up.dtype is torch.bfloat16 and gate.is_cpu and up.is_cpu
            and gate.shape == up.shape and gate.dim() >= 1 and gate.stride(-1) == 1 and up.stride(-1) == 1
            and not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))
            and _library()[0] is not None)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(bf16(silu(gate)) * up), the Llama MLP's `act_fn(gate) * up` in bf16, with one fixed
    vector sequence per element (row-invariant by construction; csrc/silu_mul.c)."""
    k = _library()[0]
    assert k is not None, "check native.silu_mul_usable(gate, up) first"
    _expect(_bf16_cpu(gate, up) and gate.shape == up.shape and gate.dim() >= 1,
            lambda: f"silu_mul needs bf16 CPU gate and up of one shape; got {_about(gate, up)}")
    g, m, ldg = _rows(gate)
    u, _, ldu = _rows(up)
    out = torch.empty(gate.shape, dtype=torch.bfloat16)
    k.silu_mul_bf16(g.data_ptr(), ldg, u.data_ptr(), ldu, out.data_ptr(), gate.shape[-1], m, gate.shape[-1],
               torch.get_num_threads())
    return out

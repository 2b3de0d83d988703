"""Weights the decode step streams, placed side by side in memory that asks Linux for transparent huge pages.

Why: a decoding step reads every packed weight once, front to back, from memory. In ordinary 4 KB pages a 4 GB
model spans a million pages: the hardware prefetchers stop at each page's end and every page costs a TLB miss.
In 2 MB pages the same stream reads faster: one-row GEMMs over 8 packed Q4_K weights of 14,336 x 4,096, the
same bytes either way, alternating in one process, 1.457 -> 1.362 and 1.728 -> 1.651 ms a weight (AMD EPYC
Zen 4 VM, 2 threads, 2026-12-07; docs/native-step.md). Linux gives huge pages to anonymous memory only where
asked (`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on most distributions), so the packed blocks
are copied into chunks of anonymous memory marked MADV_HUGEPAGE, one after another (64-byte aligned), instead of
one allocation each: a huge page is resident as soon as one byte of it is touched, and a page per tensor would
waste up to 2 MB for each of a small model's 200 tensors.

The bytes are the same, so the numerics are: nothing but the speed of reading them changes. Where huge pages
are off (`never`), the platform has no madvise, or EAGLE_CHAT_HUGE_PAGES=0, the tensors are kept as they are."""

import mmap
import os
from dataclasses import replace

import torch

HUGE = 2 << 20      # the x86-64 huge page
CHUNK = 64 << 20    # anonymous memory asked for at a time (more for a larger tensor)
ALIGN = 64


def wanted() -> bool:
    """Whether packed weights go to huge-page memory here."""
    if os.environ.get("EAGLE_CHAT_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


class Arena:
    """Places tensors side by side in MADV_HUGEPAGE chunks. Each placed tensor keeps its chunk alive (torch.frombuffer
    holds the mapping), so the arena itself may be dropped once loading is done."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = wanted() if enabled is None else enabled
        self._chunk: torch.Tensor | None = None  # the current chunk's bytes, from a 2 MB boundary
        self._used = 0
        self.placed = 0  # bytes placed, for the tests and the load's report

    def _grow(self, need: int) -> None:
        size = max(CHUNK, -(-need // HUGE) * HUGE)
        mm = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without THP: ordinary pages, still one allocation
            pass
        raw = torch.frombuffer(mm, dtype=torch.uint8)
        start = (-raw.data_ptr()) % HUGE
        self._chunk, self._used = raw[start:start + size], 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of t (uint8, contiguous) in huge-page memory, or t itself where the arena is off."""
        if not self.enabled or t.dtype is not torch.uint8 or not t.is_contiguous() or t.numel() == 0:
            return t
        n = t.numel()
        if self._chunk is None or self._used + n > self._chunk.numel():
            try:
                self._grow(n)
            except (OSError, ValueError):  # no address space for another chunk: ordinary memory from here on
                self.enabled = False
                return t
        out = self._chunk[self._used:self._used + n].view(t.shape)
        out.copy_(t)
        self._used += -(-n // ALIGN) * ALIGN
        self.placed += n
        return out

    def place_blocks(self, blocks):
        """A core.kernels.quant.Blocks with its bytes placed (the same Blocks where the arena is off)."""
        return replace(blocks, data=self.place(blocks.data))

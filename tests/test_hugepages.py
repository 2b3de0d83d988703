"""Packed weights placed side by side in memory that asks for transparent huge pages (core.kernels.hugepages)."""

import gc

import pytest
import torch

from core.kernels import hugepages


def vm_flags(ptr: int) -> str:
    """The VmFlags line of /proc/self/smaps for the mapping that holds address ptr."""
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("VmFlags:"):
            return line
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_placed_tensors_keep_their_bytes_side_by_side_in_huge_page_memory():
    gen = torch.Generator().manual_seed(0)
    arena = hugepages.Arena(enabled=True)
    sizes = [1000, 64 * 1024 + 3, 5 << 20, hugepages.CHUNK + 12345, 77]
    src = [torch.randint(0, 256, (n,), generator=gen, dtype=torch.int32).to(torch.uint8) for n in sizes]
    src[2] = src[2].view(5 * 1024, 1024)  # shapes are kept
    out = [arena.place(t) for t in src]
    for t, o in zip(src, out):
        assert o.shape == t.shape and torch.equal(o, t) and o.data_ptr() % hugepages.ALIGN == 0
    assert out[0].data_ptr() % hugepages.HUGE == 0                     # a chunk starts on a huge page
    assert out[1].data_ptr() == out[0].data_ptr() + 1024               # then side by side, 64-byte aligned
    assert out[2].data_ptr() == out[1].data_ptr() + 64 * 1024 + 64
    assert out[3].data_ptr() % hugepages.HUGE == 0                     # larger than what was left: a chunk of its own
    assert arena.placed == sum(sizes)
    if hasattr(hugepages.mmap, "MADV_HUGEPAGE"):
        assert " hg" in vm_flags(out[0].data_ptr())                    # madvise(MADV_HUGEPAGE) took
    del arena
    gc.collect()
    assert all(torch.equal(o, t) for t, o in zip(src, out))           # the tensors keep their memory alive


def test_without_huge_pages_tensors_stay_as_they_are(monkeypatch):
    t = torch.arange(100, dtype=torch.uint8)
    assert hugepages.Arena(enabled=False).place(t) is t
    assert hugepages.Arena(enabled=True).place(t.float()).dtype is torch.float32  # only packed bytes move
    full = hugepages.Arena(enabled=True)
    monkeypatch.setattr(hugepages.mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError(12, "no memory")))
    assert full.place(t) is t and not full.enabled  # no room for a chunk: the tensor stays where it is
    monkeypatch.undo()
    monkeypatch.setenv("EAGLE_CHAT_HUGE_PAGES", "0")
    assert not hugepages.wanted() and not hugepages.Arena().enabled


@pytest.mark.skipif(not hugepages.wanted(), reason="transparent huge pages are off here")
def test_the_loaded_step_reads_its_blocks_from_huge_page_memory():
    from core.decoding.engine import Engine

    blocks = Engine.load(head=None).step.blocks  # the embedded model, 8-bit activations
    layer0 = [blocks[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    for a, b in zip(layer0, layer0[1:]):  # packed as read, placed one after another
        assert b.data.data_ptr() == a.data.data_ptr() + -(-a.nbytes // 64) * 64
    assert " hg" in vm_flags(blocks["lm_head.weight"].data.data_ptr())

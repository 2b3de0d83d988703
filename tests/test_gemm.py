"""core.gemm: the AVX-512 bf16 decoding GEMM is accurate, row-invariant by construction, and
steps aside (with its reason) where it cannot run."""

import pytest
import torch
import torch.nn.functional as F

from core import gemm
from core.invariant import InvariantLinear, swap_linears

needs_kernel = pytest.mark.skipif(not gemm.status().available,
                                  reason=f"core.gemm kernel unavailable here: {gemm.status().reason}")

# (N, K): SmolLM2's projections and LM heads, and odd sizes (K % 32 tail, N % 16 tail)
SHAPES = [(1536, 576), (576, 1536), (192, 576), (8192, 576), (37, 100), (16, 32), (5, 7)]


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_an_fp32_reference(n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(13, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    ref = x.float() @ w.float().T + b.float()  # exact products of bf16 inputs, fp32 sums
    y = gemm.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (13, n)
    # one bf16 rounding of the output plus fp32 summation-order noise
    assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-3 * float(ref.abs().max()))
    assert torch.equal(gemm.linear(x, w), gemm.linear(x, w, None))
    assert not torch.equal(gemm.linear(x, w), y)  # the bias is added


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
def test_every_row_is_bit_identical_alone_and_in_any_batch(n, k):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    full = gemm.linear(x, w)
    for m in (1, 2, 3, 4, 5, 8, 11, 17, 27):  # every tile path: 4x4, 1x16 leftovers, 1x1 tails
        assert torch.equal(gemm.linear(x[:m], w), full[:m]), m
    for i in range(x.shape[0]):
        assert torch.equal(gemm.linear(x[i:i + 1], w)[0], full[i]), i


@needs_kernel
def test_thread_count_does_not_change_results():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 576, generator=gen).bfloat16()
    w = torch.randn(1000, 576, generator=gen).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm.linear(x, w)
        torch.set_num_threads(2)
        two = gemm.linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_strided_and_batched_inputs():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 200, generator=gen).bfloat16()
    w = torch.randn(64, 100, generator=gen).bfloat16()
    sliced = x[..., 50:150]  # rows with a stride of 200
    assert torch.equal(gemm.linear(sliced, w), gemm.linear(sliced.contiguous(), w))
    assert gemm.linear(sliced, w).shape == (2, 3, 64)


def test_usable_only_for_what_the_kernel_computes():
    w = torch.randn(8, 32).bfloat16()
    ok = gemm.status().available
    assert gemm.usable(torch.randn(3, 32).bfloat16(), w) == ok
    assert not gemm.usable(torch.randn(3, 32), w.float())  # fp32: torch's GEMM
    assert not gemm.usable(torch.randn(gemm.MAX_ROWS + 1, 32).bfloat16(), w)  # a long prefill
    assert not gemm.usable(torch.randn(3, 32).bfloat16(), w.t().contiguous().t())  # weight not row-major
    needs_grad = torch.randn(3, 32).bfloat16().requires_grad_()
    assert not gemm.usable(needs_grad, w)  # training: torch's GEMM, with autograd


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(gemm.OFF_ENV, "torch")
    gemm._library.cache_clear()
    try:
        st = gemm.status()
        assert not st.available and gemm.OFF_ENV in st.reason and gemm.OFF_ENV in st.describe()
        assert not gemm.usable(torch.randn(2, 32).bfloat16(), torch.randn(4, 32).bfloat16())
    finally:
        gemm._library.cache_clear()


def test_a_failed_build_falls_back_with_the_reason(monkeypatch):
    monkeypatch.delenv(gemm.OFF_ENV, raising=False)
    monkeypatch.setattr(gemm, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(gemm.platform, "system", lambda: "Linux")
    monkeypatch.setattr(gemm.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    gemm._library.cache_clear()
    try:
        st = gemm.status()
        assert not st.available and "no C compiler" in st.reason
    finally:
        gemm._library.cache_clear()


def test_invariant_linear_falls_back_to_chunked_onednn(monkeypatch):
    """Without the kernel, InvariantLinear still gives F.linear's values within bf16 rounding."""
    monkeypatch.setattr(gemm, "_library", lambda: (None, gemm.GemmStatus(False, "off for this test")))
    layer = torch.nn.Linear(1536, 64, bias=True).bfloat16()
    assert swap_linears(torch.nn.Sequential(layer)) == 1 and isinstance(layer, InvariantLinear)
    x = torch.randn(5, 1536).bfloat16()
    with torch.no_grad():
        assert torch.allclose(layer(x).float(), F.linear(x, layer.weight, layer.bias).float(), rtol=2e-2, atol=2e-2)

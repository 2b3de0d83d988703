"""core.kernels.native: the AVX-512 bf16 decoding GEMM and attention are accurate, row-invariant by
construction, and step aside (with their reason) where they cannot run."""

import ctypes
import platform
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from core.kernels import native
from core.kernels.invariant import InvariantLinear, chunked_linear, swap_linears

needs_kernel = pytest.mark.skipif(not native.status().available,
                                  reason=f"core.kernels.native kernel unavailable here: {native.status().reason}")

# (N, K): SmolLM2's projections and LM heads, odd sizes (K % 32 tail, N % 16 tail: the AVX-512
# GEMM on every machine) and, for AMX, a last task of fewer than four 16-column blocks (80, 96)
SHAPES = [(1536, 576), (576, 1536), (192, 576), (8192, 576), (80, 96), (37, 100), (16, 32), (5, 7)]


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_an_fp32_reference(n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(13, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    ref = x.float() @ w.float().T + b.float()  # exact products of bf16 inputs, fp32 sums
    y = native.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (13, n)
    # one bf16 rounding of the output plus fp32 summation-order noise
    assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-3 * float(ref.abs().max()))
    assert torch.equal(native.linear(x, w), native.linear(x, w, None))
    assert not torch.equal(native.linear(x, w), y)  # the bias is added


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
def test_every_row_is_bit_identical_alone_and_in_any_batch(n, k):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    full = native.linear(x, w)
    for m in (1, 2, 3, 4, 5, 8, 11, 17, 27):  # every tile path: 4x4, 1x16 leftovers, 1x1 tails
        assert torch.equal(native.linear(x[:m], w), full[:m]), m
    for i in range(x.shape[0]):
        assert torch.equal(native.linear(x[i:i + 1], w)[0], full[i]), i


@needs_kernel
def test_thread_count_does_not_change_results():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 576, generator=gen).bfloat16()
    w = torch.randn(1000, 576, generator=gen).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.linear(x, w)
        torch.set_num_threads(2)
        two = native.linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_strided_and_batched_inputs():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 200, generator=gen).bfloat16()
    w = torch.randn(64, 100, generator=gen).bfloat16()
    sliced = x[..., 50:150]  # rows with a stride of 200
    assert torch.equal(native.linear(sliced, w), native.linear(sliced.contiguous(), w))
    assert native.linear(sliced, w).shape == (2, 3, 64)


def test_usable_only_for_what_the_kernel_computes():
    w = torch.randn(8, 32).bfloat16()
    ok = native.status().available
    assert native.usable(torch.randn(3, 32).bfloat16(), w) == ok
    assert not native.usable(torch.randn(3, 32), w.float())  # fp32: torch's GEMM
    assert not native.usable(torch.randn(native.MAX_ROWS + 1, 32).bfloat16(), w)  # a long prefill
    assert not native.usable(torch.randn(3, 32).bfloat16(), w.t().contiguous().t())  # weight not row-major
    needs_grad = torch.randn(3, 32).bfloat16().requires_grad_()
    assert not native.usable(needs_grad, w)  # training: torch's GEMM, with autograd


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(native.OFF_ENV, "torch")
    native._library.cache_clear()
    try:
        st = native.status()
        assert not st.available and native.OFF_ENV in st.reason and native.OFF_ENV in st.describe()
        assert not native.usable(torch.randn(2, 32).bfloat16(), torch.randn(4, 32).bfloat16())
    finally:
        native._library.cache_clear()


needs_avx512 = pytest.mark.skipif(not native.status().available or native.status().isa != "avx512",
                                  reason="the AVX-512 build does not serve here (no avx512_bf16, or EAGLE_CHAT_KERNELS=avx2)")
# the emulated tiles (EAGLE_CHAT_KERNELS=amx-emulated) build with AMX flags only: no fallback build to test there
real_builds = pytest.mark.skipif(native.amx_emulated(), reason="EAGLE_CHAT_KERNELS=amx-emulated builds one way only")


def needs_amx(test):
    """Skipped without AMX tiles, and marked to run on emulated ones (tests/test_amx_emulated.py)."""
    return pytest.mark.tiles(pytest.mark.skipif(
        not native.status().amx, reason="no AMX tiles here (or EAGLE_CHAT_AMX=0): the AVX-512 GEMM serves every shape")(test))


@needs_amx
def test_amx_and_avx512_gemms_are_each_row_invariant_and_agree(monkeypatch):
    """On an AMX machine the tile GEMM serves K % 32 == 0, N % 16 == 0; EAGLE_CHAT_AMX=0 turns it
    off. Each path is row-invariant on its own; they sum in different orders, so they agree
    only to bf16 rounding (a machine keeps one of them for every call of a shape)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(40, 576, generator=gen).bfloat16()
    w = torch.randn(1536, 576, generator=gen).bfloat16()
    b = torch.randn(1536, generator=gen).bfloat16()
    ref = x.float() @ w.float().T + b.float()
    amx = native.linear(x, w, b)
    monkeypatch.setenv(native.AMX_ENV, "0")
    native._library.cache_clear()
    try:
        st = native.status()
        assert st.available and not st.amx and "AVX-512 bf16 GEMM" in st.describe()
        avx = native.linear(x, w, b)
        for m in (1, 3, 16, 17):
            assert torch.equal(native.linear(x[:m], w, b), avx[:m]), m
    finally:
        monkeypatch.delenv(native.AMX_ENV)
        native._library.cache_clear()
    assert native.status().amx and "AMX bf16 GEMM" in native.status().describe()
    for y in (amx, avx):
        assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-3 * float(ref.abs().max()))
    assert not torch.equal(amx, avx)  # two reduction orders: the switch really changed kernels
    for m in (1, 2, 15, 16, 17, 31, 33):  # one and several 16-row tile columns
        assert torch.equal(native.linear(x[:m], w, b), amx[:m]), m
    assert torch.equal(native.linear(x[39:40], w, b)[0], amx[39])
    wide = torch.zeros(40, 579, dtype=torch.bfloat16)
    wide[:, 1:577] = x  # rows that start one element (2 bytes) past an aligned address, odd stride
    assert torch.equal(native.linear(wide[:, 1:577], w, b), amx)


@needs_amx
def test_a_prompt_sized_call_runs_on_tiles_with_each_row_as_in_a_decoding_call(monkeypatch):
    """More than MAX_ROWS rows (a prefill chunk): on AMX tiles too (prompt_usable), not oneDNN, so a row's
    bits depend on neither the call's size nor the rows beside it (oneDNN's bf16 GEMM picks its
    algorithm by M); without tiles, and for shapes the tiles do not take, oneDNN keeps such calls."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(1500, 576, generator=gen).bfloat16()
    w = torch.randn(1536, 576, generator=gen).bfloat16()
    assert native.prompt_usable(x, w) and not native.usable(x, w)
    y = native.linear(x, w)
    for lo, hi in ((0, 700), (800, 1500), (0, 3), (576, 1153)):
        assert torch.equal(native.linear(x[lo:hi], w), y[lo:hi]), (lo, hi)
    layer = InvariantLinear(576, 1536, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w)
        assert torch.equal(layer(x), y) and torch.equal(layer(x[:5]), y[:5])
    assert not native.prompt_usable(x, w[:, :544].contiguous())  # K 576 != 544: the call's own shapes
    assert not native.prompt_usable(x[:, :560], torch.randn(1536, 560).bfloat16())  # K % 32 != 0
    assert not native.prompt_usable(x, w[:1530].contiguous())  # N % 16 != 0
    monkeypatch.setenv(native.AMX_ENV, "0")
    native._library.cache_clear()
    try:
        assert not native.prompt_usable(x, w)
        with torch.no_grad():
            assert torch.equal(layer(x), chunked_linear(x, w, None))
    finally:
        monkeypatch.delenv(native.AMX_ENV)
        native._library.cache_clear()


@needs_avx512
@real_builds
def test_a_compiler_without_amx_flags_still_builds_the_avx512_kernels(monkeypatch, tmp_path):
    """gcc < 11 refuses -mamx-tile: the build retries without AMX (gemm_amx.c becomes stubs)."""
    import core.models

    monkeypatch.setattr(native, "AMX_FLAGS", ("-mno-such-amx-flag",))
    monkeypatch.setattr(core.models, "cache_home", lambda: tmp_path)
    native._library.cache_clear()
    try:
        st = native.status()
        assert st.available and not st.amx and "AVX-512 bf16 GEMM" in st.describe()
        assert len(list((tmp_path / "kernels").glob("decode-*.so"))) == 1  # the second attempt only
        gen = torch.Generator().manual_seed(5)
        x, w = torch.randn(17, 576, generator=gen).bfloat16(), torch.randn(64, 576, generator=gen).bfloat16()
        assert torch.equal(native.linear(x[3:4], w)[0], native.linear(x, w)[3])
    finally:
        native._library.cache_clear()


def test_a_failed_build_falls_back_with_the_reason(monkeypatch):
    monkeypatch.delenv(native.OFF_ENV, raising=False)
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(native.platform, "system", lambda: "Linux")
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    native._library.cache_clear()
    try:
        st = native.status()
        assert not st.available and "no C compiler" in st.reason
    finally:
        native._library.cache_clear()


def test_invariant_linear_falls_back_to_chunked_onednn(monkeypatch):
    """Without the kernel, InvariantLinear still gives F.linear's values within bf16 rounding."""
    monkeypatch.setattr(native, "_library", lambda: (None, native.NativeStatus(False, "off for this test")))
    layer = torch.nn.Linear(1536, 64, bias=True).bfloat16()
    assert swap_linears(torch.nn.Sequential(layer)) == 1 and isinstance(layer, InvariantLinear)
    x = torch.randn(5, 1536).bfloat16()
    with torch.no_grad():
        assert torch.allclose(layer(x).float(), F.linear(x, layer.weight, layer.bias).float(), rtol=2e-2, atol=2e-2)


def _tree_case(n_ctx: int, nh: int, kvh: int, hd: int, seed: int):
    """A 6-node tree (root; 2 children; a chain under the first) after n_ctx context keys."""
    gen = torch.Generator().manual_seed(seed)
    parents = [-1, 0, 0, 1, 3, 4]
    anc = torch.tensor([[0, -1, -1, -1, -1], [0, 1, -1, -1, -1], [0, 2, -1, -1, -1], [0, 1, 3, -1, -1],
                        [0, 1, 3, 4, -1], [0, 1, 3, 4, 5]])
    counts = torch.tensor([1, 2, 2, 3, 4, 5])
    q = torch.randn(len(parents), nh, hd, generator=gen).bfloat16()
    key = torch.randn(kvh, n_ctx + len(parents), hd, generator=gen).bfloat16()
    value = torch.randn(kvh, n_ctx + len(parents), hd, generator=gen).bfloat16()
    return q, key, value, anc, counts


@needs_kernel
@pytest.mark.parametrize("n_ctx,nh,kvh,hd", [(0, 4, 4, 32), (40, 9, 3, 64), (100, 8, 2, 128), (17, 2, 1, 256)])
def test_attention_matches_an_fp32_reference(n_ctx, nh, kvh, hd):
    q, key, value, anc, counts = _tree_case(n_ctx, nh, kvh, hd, seed=n_ctx + hd)
    scale = hd ** -0.5
    out = native.attention(q, key, value, n_ctx, anc, counts, scale)
    ref = native.reference_attention(q, key, value, n_ctx, anc, counts, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2)
    # the root alone sees only the context and itself: softmax over exactly those keys
    keys = torch.cat([torch.arange(n_ctx), torch.tensor([n_ctx])])
    k0 = key[:, keys].float().repeat_interleave(nh // kvh, 0)
    p = torch.softmax((k0 @ q[0].float()[:, :, None])[..., 0] * scale, -1)
    assert torch.allclose(out[0].float(), (p[:, None] @ value[:, keys].float().repeat_interleave(nh // kvh, 0))[:, 0],
                          rtol=1e-2, atol=1e-2)


@needs_kernel
def test_attention_rows_are_bit_identical_alone_and_in_the_tree():
    q, key, value, anc, counts = _tree_case(150, 9, 3, 64, seed=5)
    full = native.attention(q, key, value, 150, anc, counts, 0.125)
    for i in range(q.shape[0]):
        alone = native.attention(q[i:i + 1], key, value, 150, anc[i:i + 1, :int(counts[i])], counts[i:i + 1], 0.125)
        assert torch.equal(alone, full[i:i + 1]), i
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.attention(q, key, value, 150, anc, counts, 0.125), full)
    finally:
        torch.set_num_threads(before)


def _random_tree(gen: torch.Generator, rows: int) -> list[int]:
    """Parents of a random draft tree in slot order (node 0 the root, parents before children)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, rows)]


@pytest.fixture(params=["avx512", "amx", "mixed"])
def attention_kernel(request):
    """Each attention kernel this machine has: the vector one; the AMX one (csrc/attention_amx.c)
    for every row, where tiles serve; both ("mixed": the test sets from how many keys tiles serve)."""
    if not native.status().available:
        pytest.skip("native kernels unavailable")
    st = native.status()
    if not native.set_amx_attention(request.param != "avx512", from_keys=0) and request.param != "avx512":
        pytest.skip("no AMX tiles here")
    yield request.param
    native.set_amx_attention(st.amx_attention, from_keys=st.amx_attention_from)


@pytest.mark.parametrize("n_ctx,nh,kvh", [(0, 9, 3), (5, 9, 3), (31, 9, 3), (32, 9, 3), (33, 9, 3), (63, 9, 3),
                                         (64, 9, 3), (100, 9, 3), (161, 9, 3), (505, 9, 3), (512, 9, 3),
                                         (1100, 9, 3), (40, 14, 2), (40, 4, 4), (40, 16, 1)])
@pytest.mark.tiles  # the "amx" and "mixed" kernels
def test_a_tree_rows_attention_is_plain_decodings_bit_for_bit(attention_kernel, n_ctx, nh, kvh):
    """Row i of a tree (its ancestors scattered over the tree's slots, beside other rows) computes the
    bits plain decoding computes for the same token: the context and its ancestors laid out one after
    the other, the row alone. Contexts around the AMX kernel's 16- and 32-key blocks, trees of up to
    19 rows (more than one AMX task of 5 rows), SmolLM2's 9 query heads over 3 kv heads, and across
    the AMX kernel's 512-key segments (rows of one and of two or three segments in one call); "mixed":
    rows from n_ctx + 3 keys on tiles, the shallower ones on the vector kernel, in the same calls.
    Other head layouts: 7 query heads a kv head (2 rows a task, as Qwen2-0.5B), 1 (16 rows), 16 (1 row)."""
    if attention_kernel == "mixed":
        native.set_amx_attention(True, from_keys=n_ctx + 3)
    gen = torch.Generator().manual_seed(n_ctx + nh)
    hd = 64
    for rows in (1, 4, 19):
        parents = _random_tree(gen, rows)
        chains = []
        for i in range(rows):
            chain, j = [], i
            while j >= 0:
                chain.append(j)
                j = parents[j]
            chains.append(chain[::-1])
        anc = torch.full((rows, max(map(len, chains))), -1, dtype=torch.int64)
        for i, c in enumerate(chains):
            anc[i, :len(c)] = torch.tensor(c)
        counts = torch.tensor([len(c) for c in chains])
        q = torch.randn(rows, nh, hd, generator=gen).bfloat16()
        key = (torch.randn(kvh, n_ctx + rows, hd, generator=gen) * 2).bfloat16()
        value = torch.randn(kvh, n_ctx + rows, hd, generator=gen).bfloat16()
        tree = native.attention(q, key, value, n_ctx, anc, counts, hd ** -0.5)
        assert torch.allclose(tree.float(), native.reference_attention(q, key, value, n_ctx, anc, counts, hd ** -0.5),
                              rtol=2e-2, atol=2e-2)
        for i, chain in enumerate(chains):
            slots = torch.cat([torch.arange(n_ctx), n_ctx + torch.tensor(chain)])
            plain = native.attention(q[i:i + 1], key[:, slots], value[:, slots], len(slots) - 1,
                                     torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), hd ** -0.5)
            assert torch.equal(plain[0], tree[i]), (attention_kernel, n_ctx, rows, i)


@needs_amx
def test_the_amx_attention_serves_only_head_dim_64_and_stays_close_to_the_vector_kernel():
    """Both kernels compute softmax(q k / sqrt(d)) v; they round differently (the tiles' sums, p in
    bf16), so the same inputs agree within bf16 steps, not bits. Other head sizes keep the vector kernel."""
    before = native.status().amx_attention
    try:
        outs = {}
        for on in (False, True):
            native.set_amx_attention(on, from_keys=0)
            outs[on] = [native.attention(*_tree_case(n_ctx, nh, kvh, hd, seed=7)[:3], n_ctx,
                                         *_tree_case(n_ctx, nh, kvh, hd, seed=7)[3:], hd ** -0.5)
                        for n_ctx, nh, kvh, hd in ((300, 9, 3, 64), (40, 8, 2, 128))]
        a, b = outs[False][0].float(), outs[True][0].float()
        assert not torch.equal(a, b) and torch.allclose(a, b, rtol=2e-2, atol=1e-2)
        assert torch.equal(outs[False][1], outs[True][1])  # head_dim 128: the vector kernel either way
        # from a threshold on: rows with at least that many keys are the tiles', the others the vector kernel's
        q, key, value, anc, counts = _tree_case(300, 9, 3, 64, seed=7)
        native.set_amx_attention(True, from_keys=303)
        mixed = native.attention(q, key, value, 300, anc, counts, 0.125)
        for i, c in enumerate(counts.tolist()):
            assert torch.equal(mixed[i], (outs[True] if 300 + c >= 303 else outs[False])[0][i]), i
    finally:
        native.set_amx_attention(before, from_keys=native.status().amx_attention_from)


def test_attention_usable_only_for_what_the_kernel_computes():
    ok = native.status().available
    assert native.attention_usable(torch.randn(1, 4, 2, 64).bfloat16(), torch.randn(1, 2, 9, 64).bfloat16()) == ok
    assert not native.attention_usable(torch.randn(1, 4, 2, 48).bfloat16(), torch.randn(1, 2, 9, 48).bfloat16())
    assert not native.attention_usable(torch.randn(1, 4, 2, 64), torch.randn(1, 2, 9, 64))


@needs_kernel
@pytest.mark.parametrize("h", [576, 100, 4096])
def test_rms_norm_is_transformers_llama_rmsnorm(h):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(h)
    norm = LlamaRMSNorm(h, eps=1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h, generator=gen))
    x = (3 * torch.randn(2, 7, h, generator=gen)).bfloat16()
    with torch.no_grad():
        hf = norm(x)
    ours = native.rms_norm(x, norm.weight.detach(), 1e-5)
    assert ours.shape == x.shape and ours.dtype == torch.bfloat16
    # the same formula and roundings; the fp32 sum of squares may differ in its last bits
    assert (ours.float() - hf.float()).abs().max() <= 0.02 * hf.float().abs().max()
    assert (ours == hf).float().mean() > 0.95
    flat = x.reshape(-1, h)
    for i in range(flat.shape[0]):  # each row alone: bit-identical
        assert torch.equal(native.rms_norm(flat[i:i + 1], norm.weight.detach(), 1e-5)[0], ours.reshape(-1, h)[i])


@needs_kernel
def test_make_invariant_swaps_llama_norms_and_undo_restores_them():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from core.kernels.invariant import make_invariant, undo_invariant

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg).bfloat16().eval()
    ids = torch.randint(0, 64, (1, 9))
    with torch.inference_mode():
        before = model(ids).logits
        make_invariant(model)
        norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
        assert len(norms) == 5 and all(type(m).__name__ == "NativeLlamaRMSNorm" for m in norms)
        after = model(ids).logits  # prefill: sdpa, native GEMMs and norms
        assert torch.allclose(after.float(), before.float(), atol=0.1, rtol=0.05)
        undo_invariant(model)
        assert all(type(m) is LlamaRMSNorm for m in model.modules() if isinstance(m, LlamaRMSNorm))
        assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


@needs_kernel
def test_argmax_is_torch_argmax_with_its_tie_and_nan_rules():
    g = torch.Generator().manual_seed(0)
    for v in (1, 15, 16, 17, 1000, 49152):
        x = (torch.randn(7, v, generator=g) * 3).bfloat16()  # bf16 rounding makes ties
        assert torch.equal(native.argmax(x), x.float().argmax(-1)), v
        assert int(native.argmax(x[2])) == int(x[2].float().argmax())  # a single row (a plain step)
    x = torch.randint(-2, 3, (50, 33), generator=g).bfloat16()  # many exact ties: the first index wins
    assert torch.equal(native.argmax(x), x.float().argmax(-1))
    x = torch.full((3, 40), float("-inf")).bfloat16()
    x[1, 39] = float("nan")
    x[2, [4, 30]] = float("nan")  # NaN counts as the maximum; the first one wins
    assert native.argmax(x).tolist() == [0, 39, 4] == x.float().argmax(-1).tolist()
    strided = (torch.randn(6, 200, generator=g)).bfloat16()[::2, :150]
    assert torch.equal(native.argmax(strided), strided.float().argmax(-1))


def test_argmax_usable_only_for_what_the_kernel_computes():
    x = torch.randn(2, 64).bfloat16()
    assert native.argmax_usable(x) == native.status().available
    assert not native.argmax_usable(x.float())
    assert not native.argmax_usable(x.t())  # unit stride along the vocabulary is needed


@needs_kernel
def test_attention_with_more_than_64_query_heads_per_kv_head():
    """Multi-query models (e.g. 71 heads over one kv head) put every head in one task: the
    per-head softmax sums must not live in a fixed-size buffer."""
    q, key, value, anc, counts = _tree_case(30, 72, 1, 32, seed=3)
    out = native.attention(q, key, value, 30, anc, counts, 32 ** -0.5)
    ref = native.reference_attention(q, key, value, 30, anc, counts, 32 ** -0.5)
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2)


@needs_kernel
@pytest.mark.parametrize("m,v,k", [(1, 8192, 8), (8, 8192, 8), (3, 49152, 10), (4, 100, 64), (2, 17, 17)])
def test_topk_log_probs_is_torchs_log_softmax_topk(m, v, k):
    """Draft scores: torch's log_softmax + clamp + topk, values within 1e-6 (relative) of exact, the same tokens (the
    same logits where bf16 ties make the order arbitrary), best first, ties to the lower index."""
    from core.decoding.tree import log_probs, top_log_probs

    g = torch.Generator().manual_seed(m * 1000 + k)
    x = (torch.randn(m, v, generator=g) * 3).bfloat16()
    x[0, 5] = x[0, 3] = 40.0  # a tie at the top: index 3 first
    vals, idx = native.topk_log_probs(x, k)
    ref = log_probs(x).topk(k, dim=-1)
    # against the exact values (float64): torch's fp32 log_softmax is itself off by up to 4e-6 on AVX2
    exact = torch.log_softmax(x.double(), -1).clamp(max=0.0).gather(1, ref.indices)
    torch.testing.assert_close(vals.double(), exact, rtol=1e-6, atol=1e-6)
    assert torch.equal(x.gather(1, idx), x.gather(1, ref.indices))  # the same logits, in order
    assert idx[0, :2].tolist() == [3, 5]
    assert bool((vals <= 0).all()) and bool((vals[:, :-1] >= vals[:, 1:]).all())
    assert all(len(set(row)) == k for row in idx.tolist())
    got = top_log_probs(x, k)  # the drafting entry point takes the kernel for bf16 rows
    assert torch.equal(got[0], vals) and torch.equal(got[1], idx)
    assert native.topk_usable(x, k) and not native.topk_usable(x.float(), k)
    assert not native.topk_usable(x, v + 1) and not native.topk_usable(x, native.TOPK_MAX + 1)


needs_int8 = pytest.mark.skipif(not native.int8_available(), reason="no int8 drafting kernel (needs avx512_vnni or AVX2)")


def _reference_s8(x: torch.Tensor, w: torch.Tensor, bias=None):
    """What csrc/gemm_s8.c computes, in torch: per-row symmetric int8 weights and inputs, exact
    integer dot products (float64), rescaled in fp32."""
    wf = w.float()
    ws = wf.abs().amax(1) / 127.0
    ws = torch.where(ws > 0, ws, torch.ones_like(ws))
    wq = (wf / ws[:, None]).round().clamp(-127, 127)
    xf = x.float()
    xs = xf.abs().amax(1) / 127.0
    xs = torch.where(xs > 0, xs, torch.ones_like(xs))
    xq = (xf / xs[:, None]).round().clamp(-127, 127)
    dots = (xq.double() @ wq.double().T).float()
    y = (xs[:, None] * ws[None, :]) * dots
    if bias is not None:
        y = y + bias.float()
    return wq.to(torch.int8), ws, wq.sum(1).to(torch.int32), y


@needs_int8
@pytest.mark.parametrize("m,n,k", [(1, 8192, 576), (3, 96, 576), (8, 1536, 576), (5, 576, 1536), (13, 37, 70), (4, 40, 64)])
def test_int8_linear_is_its_integer_reference_and_near_the_bf16_product(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    qw = native.quantize(w)
    wq, ws, sums, ref = _reference_s8(x, w, bias)
    assert torch.equal(qw.q, wq) and torch.equal(qw.scale, ws) and torch.equal(qw.sums, sums)
    y = native.linear_s8(x, qw, bias)
    assert y.dtype is torch.bfloat16 and y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref.to(torch.bfloat16).float(), rtol=8e-3, atol=1e-3)
    exact = x.float() @ w.float().T + bias.float()
    assert float((y.float() - exact).norm() / exact.norm()) < 0.03  # about 1% error: for drafts only
    for i in range(m):  # integer sums: a row's result does not depend on the rest of the call
        assert torch.equal(native.linear_s8(x[i:i + 1], qw, bias)[0], y[i])


@needs_int8
def test_draft_heads_draft_from_int8_copies_and_keep_their_weights(monkeypatch):
    from core.decoding.head3 import drafter_for
    from core.kernels.invariant import Int8DraftLinear
    from tests.tiny import random_head, tiny_target

    target = tiny_target(dtype=torch.bfloat16)
    head = random_head(target, seed=3).requires_grad_(False)  # as load_head returns it
    keys = {name: p.clone() for name, p in head.state_dict().items()}
    drafter = drafter_for(head, target.model)
    assert type(head.layers[0].mlp.down_proj) is Int8DraftLinear and type(head.layers[0].self_attn.q_proj) is Int8DraftLinear
    assert type(head.fc) is not Int8DraftLinear  # its input is the target's features: kept in bf16
    assert drafter.lm_int8 is not None
    state = head.state_dict()  # the published layout and values, untouched
    assert state.keys() == keys.keys() and all(torch.equal(state[name], keys[name]) for name in keys)
    fc = head.layers[0].mlp.up_proj
    few = torch.randn(3, fc.in_features).bfloat16()
    assert torch.equal(fc(few), native.linear_s8(few, fc.int8))  # drafting-sized: int8
    many = torch.randn(native.S8_MAX_ROWS + 1, fc.in_features).bfloat16()
    assert torch.equal(fc(many), native.linear(many, fc.weight))  # a prompt's catch-up: bf16
    hidden = torch.randn(2, target.model.config.hidden_size).bfloat16()
    assert torch.equal(drafter.logits(hidden), native.linear_s8(hidden, drafter.lm_int8))

    monkeypatch.setenv("EAGLE_CHAT_DRAFT_INT8", "0")
    plain = drafter_for(random_head(target, seed=3), target.model)
    assert type(plain.head.layers[0].mlp.up_proj) is not Int8DraftLinear and plain.lm_int8 is None


@needs_kernel
@pytest.mark.parametrize("n,heads,hd", [(1, 9, 64), (8, 3, 64), (5, 4, 40), (3, 2, 6)])
def test_rotary_is_transformers_bf16_rotary_bit_for_bit(n, heads, hd):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(n * heads + hd)
    q = torch.randn(n, heads * hd, generator=g).bfloat16()
    angles = torch.randn(n, hd // 2, generator=g) * 10
    cos = torch.cat([angles.cos(), angles.cos()], -1).bfloat16()
    sin = torch.cat([angles.sin(), angles.sin()], -1).bfloat16()
    ref, _ = apply_rotary_pos_emb(q.view(1, n, heads, hd).transpose(1, 2), q.view(1, n, heads, hd).transpose(1, 2),
                                  cos[None], sin[None])  # (1, heads, n, hd)
    assert native.rotary_usable(q, cos, sin, heads)
    assert torch.equal(native.rotary(q, cos, sin, heads), ref[0].transpose(0, 1))
    assert not native.rotary_usable(q.float(), cos, sin, heads) and not native.rotary_usable(q, cos[:, :-2], sin[:, :-2], heads)


# ---- the build: an older compiler, a hung one, a corrupt or unsafe cache (issue 32, item 8) ----

def _fake_cc(tmp_path, refuse: str = "", sleep: int = 0):
    """A CC that passes everything to gcc, except that it refuses any flag matching `refuse`
    (as gcc 10 refuses -march=x86-64-v4 and -mamx-*) or hangs on a build."""
    script = tmp_path / "old-gcc"
    script.write_text(f"""#!/bin/sh
[ "$1" = --version ] && exec gcc --version
for a in "$@"; do case "$a" in {refuse or "-no-flag-matches-this"}) echo "gcc: error: unrecognized option '$a'" >&2; exit 1;; esac; done
{f"exec sleep {sleep}" if sleep else ""}
exec gcc "$@"
""")
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """core.kernels.native loads again with its kernel cache under tmp_path/home."""
    import core.models

    monkeypatch.setattr(core.models, "cache_home", lambda: tmp_path / "home")
    native._library.cache_clear()
    yield tmp_path / "home" / "kernels"
    native._library.cache_clear()


@needs_avx512
@real_builds
def test_a_compiler_without_x86_64_v4_builds_the_same_kernels_from_named_instruction_sets(monkeypatch, tmp_path):
    """gcc 10 knows neither -march=x86-64-v4 nor AMX: the third attempt names x86-64-v4's
    instruction sets one by one and computes the same bits (as the vector attention: that build has
    no AMX attention)."""
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(7, 100, generator=gen).bfloat16(), torch.randn(37, 100, generator=gen).bfloat16()  # AVX-512 GEMM
    q, key, value, anc, counts = _tree_case(30, 9, 3, 64, seed=4)
    norm_w = torch.randn(100, generator=gen).bfloat16()
    run = lambda: (native.linear(x, w), native.attention(q, key, value, 30, anc, counts, 0.125),
                   native.rms_norm(x, norm_w, 1e-5), native.silu_mul(x, x * 2))
    amx_attention = native.status().amx_attention
    native.set_amx_attention(False)
    before = run()
    native.set_amx_attention(amx_attention)
    import core.models

    monkeypatch.setenv("CC", _fake_cc(tmp_path, refuse="-march=x86-64-v4|-mamx-*"))
    monkeypatch.setattr(core.models, "cache_home", lambda: tmp_path / "home")
    native._library.cache_clear()
    try:
        st = native.status()
        assert st.available and not st.amx, st.reason
        assert len(list((tmp_path / "home" / "kernels").glob("decode-*.so"))) == 1  # the third attempt only
        after = run()
    finally:
        native._library.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def _as_if_capable(monkeypatch):
    """Any machine: the checks before the build pass."""
    monkeypatch.delenv(native.OFF_ENV, raising=False)
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(native.platform, "system", lambda: "Linux")
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")


def test_a_hung_compiler_times_out_with_a_clear_reason(monkeypatch, tmp_path, fresh_cache):
    _as_if_capable(monkeypatch)
    monkeypatch.setenv("CC", _fake_cc(tmp_path, sleep=30))
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 1)
    st = native.status()
    assert not st.available and "took more than 1 s to build the kernels" in st.reason
    assert not list(fresh_cache.glob("*"))  # no half-written library left behind


@needs_kernel
@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_a_corrupt_cached_library_is_rebuilt(damage, monkeypatch, tmp_path, fresh_cache):
    """A truncated library (a full disk, a killed copy) would map and die of SIGBUS; one for
    another machine (here: its ELF header says aarch64) fails to load. Both are built again."""
    import core.models

    assert native.status().available
    built = next(fresh_cache.glob("decode-*.so"))
    good = built.read_bytes()
    # the same name in another cache (the loader reuses a path it has loaded, whatever is there now)
    other = tmp_path / "other"
    (other / "kernels").mkdir(parents=True, mode=0o700)
    lib = other / "kernels" / built.name
    lib.write_bytes(good[:4096] if damage == "truncated" else good[:18] + bytes([0xB7, 0]) + good[20:])
    lib.chmod(0o700)
    monkeypatch.setattr(core.models, "cache_home", lambda: other)
    native._library.cache_clear()
    st = native.status()
    assert st.available, st.reason
    assert lib.read_bytes() == good


def test_the_kernel_cache_is_private_and_an_open_one_is_refused(monkeypatch, fresh_cache):
    _as_if_capable(monkeypatch)
    monkeypatch.setenv("CC", "true")  # any program: the build is replaced
    monkeypatch.setattr(native, "_compile", lambda cc, flags, lib: "refused for this test")
    assert "refused for this test" in native.status().reason  # the build ran: the directory was fine
    assert fresh_cache.stat().st_mode & 0o777 == 0o700
    native._library.cache_clear()
    fresh_cache.chmod(0o777)  # anyone could drop a library in
    st = native.status()
    assert not st.available and "not ours alone" in st.reason and "mode 777" in st.reason


# ---- the boundary between Python and C (issue 32, item 9) ----

@needs_kernel
def test_the_kernels_and_torch_share_one_openmp_runtime():
    """Two OpenMP runtimes would run two spinning thread teams on the same cores."""
    assert native.status().available
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


# The ctypes declarations (issue 34 item 6): each exported C function's `// ctypes:` comment, right
# above its definition, against that definition's real parameter list. ctypes converts by the
# declaration alone: an i32 declared where the C takes an int64_t, or a parameter too few, would
# pass wrong bits silently.

C_CLASSES = {"int": "i32", "int32_t": "i32", "int64_t": "i64", "float": "f32", "double": "f64", "void": "void"}
# A definition starts at column 0: [static ...] result-type name(parameters) {
C_DEFINITION = re.compile(r"^([A-Za-z_][\w \t*]*?)\b(\w+)\s*\(([^()]*)\)\s*\{", re.M)


@dataclass(frozen=True)
class CDefinition:
    name: str
    params: tuple[tuple[str, str], ...]  # (class, name), as native.Signature holds them
    result: str
    line: int       # 1-based, where the definition starts
    exported: bool  # not static


def c_class(words: list[str]) -> str:
    """A C type, as words -> its declaration class; any pointer or array is a ptr."""
    if "*" in words:
        return "ptr"
    base = " ".join(w for w in words if w not in ("const", "volatile"))
    return C_CLASSES.get(base, f"<no class for C type {base!r}>")


def c_parameter(text: str) -> tuple[str, str]:
    """One C parameter, e.g. "const int64_t *anc" -> ("ptr", "anc")."""
    words = re.sub(r"\[[^]]*\]", " * ", text).replace("*", " * ").split()
    return c_class(words[:-1]), words[-1]


def c_definitions(text: str) -> list[CDefinition]:
    """Every function definition in a C source (comments blanked first, line numbers kept)."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    out = []
    for m in C_DEFINITION.finditer(code):
        head = m.group(1).replace("*", " * ").split()
        params = [p for p in m.group(3).split(",") if p.split() not in ([], ["void"])]
        out.append(CDefinition(m.group(2), tuple(map(c_parameter, params)),
                               c_class([w for w in head if w not in ("static", "inline")]),
                               code.count("\n", 0, m.start()) + 1, "static" not in head))
    return out


def declaration_problems(sources: dict[str, str]) -> list[str]:
    """How the `// ctypes:` declarations in `sources` (file name -> C text) disagree with the C: a
    declaration not directly above an exported definition of its name, a name declared twice, or
    an exported definition of a declared name (a stub under #if too) whose parameters (count,
    order, names, classes) or result differ from the declaration."""
    problems, declared, defined = [], {}, {}
    for file, text in sources.items():
        definitions = c_definitions(text)
        starts = {d.line: d for d in definitions}
        for d in definitions:
            defined.setdefault(d.name, []).append((file, d))
        for sig in native.parse_declarations(text, file):
            below = starts.get(sig.line)
            if below is None or below.name != sig.name or not below.exported:
                problems.append(f"{file}:{sig.line}: the declaration of {sig.name} is not right above its exported definition")
            if sig.name in declared:
                problems.append(f"{file}:{sig.line}: {sig.name} is declared twice")
            declared[sig.name] = sig
    for name, sig in declared.items():
        for file, d in defined.get(name, []):
            differs = difference(d, sig) if d.exported else None
            if differs:
                problems.append(f"{file}:{d.line}: {name} {differs}")
    return problems


def difference(d: CDefinition, sig: native.Signature) -> str | None:
    """The first way a definition differs from its declaration, in words; None if it does not."""
    if d.result != sig.result:
        return f"returns {d.result} in C, declared {sig.result}"
    if len(d.params) != len(sig.params):
        return f"takes {len(d.params)} parameters in C, declared {len(sig.params)}"
    return next((f"parameter {i} is {' '.join(c)} in C, declared {' '.join(s)}"
                 for i, (c, s) in enumerate(zip(d.params, sig.params), 1) if c != s), None)


def c_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(native.CSRC.glob("*.c"))}


def test_every_ctypes_declaration_matches_its_c_definition():
    sources = c_sources()
    assert declaration_problems(sources) == []
    table = native.signatures()
    assert set(table) >= {"gemm_bf16", "gemm_w", "attention_bf16", "decode_step", "head_step", "gemm_s8", "amx_enable"}
    exported = {d.name for text in sources.values() for d in c_definitions(text) if d.exported}
    assert set(table) <= exported
    stubs = [d for d in c_definitions(sources["gemm_amx.c"]) if d.name == "amx_enable"]
    assert len(stubs) == 2, "the #if stub and the real amx_enable: both are checked"


def test_the_library_is_bound_by_its_declarations():
    table = native.signatures()
    assert table["attention_bf16"].argtypes[-2:] == [ctypes.c_float, ctypes.c_int32]
    assert table["argmax_bf16"].restype is None and table["gemm_w"].restype is ctypes.c_int32
    if native.status().available:
        k = native._library()[0]
        for name, sig in table.items():
            fn = getattr(k, name)
            assert (fn.argtypes, fn.restype) == (sig.argtypes, sig.restype), name


@pytest.mark.parametrize("file,old,new,says", [
    ("rmsnorm_bf16.c", "int M, int H, float eps, int nthreads) {", "int M, int H, double eps, int nthreads) {",
     "rmsnorm_bf16 parameter 8 is f64 eps in C, declared f32 eps"),
    ("move_rows.c", "const int64_t *src, const int64_t *dst, int n) {", "const int64_t *src, int64_t dst, int n) {",
     "move_rows parameter 7 is i64 dst in C, declared ptr dst"),
    ("argmax_bf16.c", "int M, int N, int nthreads) {", "int M, int N) {",
     "argmax_bf16 takes 5 parameters in C, declared 6"),
    ("topk_bf16.c", "int topk_logprobs_bf16(", "int64_t topk_logprobs_bf16(",
     "topk_logprobs_bf16 returns i64 in C, declared i32"),
    ("gemm_amx.c", "int amx_enable(int want) { (void)want;", "int amx_enable(int64_t want) { (void)want;",
     "amx_enable parameter 1 is i64 want in C"),  # the #if stub
    ("gemm_bf16.c", "int64_t ldx, const uint16_t *w, int64_t ldw,", "int64_t ldx, const uint16_t *w, int64_t stride,",
     "gemm_bf16 parameter 4 is i64 stride in C, declared i64 ldw"),  # a renamed (or reordered) one
    ("silu_mul.c", "-> void\nvoid silu_mul_bf16(", "-> void\n\nvoid silu_mul_bf16(", "not right above"),
    ("dequant.c", "-> void\nvoid dequantize_bf16(", "-> void\nstatic void dequantize_bf16(", "not right above"),
    ("gemm_x8.c", "// ctypes: x8_amx_enable(", "// ctypes: amx_enable(", "declared twice"),
])
def test_a_declaration_that_disagrees_with_the_c_is_found(file, old, new, says):
    """The negative control: each doctored copy of the real sources is caught."""
    sources = c_sources()
    assert sources[file].count(old) == 1
    sources[file] = sources[file].replace(old, new)
    problems = declaration_problems(sources)
    assert any(says in p for p in problems), problems


def test_an_unreadable_declaration_is_refused():
    for bad in ("// ctypes: f(int x) -> i32", "// ctypes: f(ptr) -> i32", "// ctypes: f(ptr p) -> i16",
                "// ctypes: f(ptr p, void v) -> void", "// ctypes: f(ptr p"):
        with pytest.raises(RuntimeError, match="unreadable declaration"):
            native.parse_declarations(bad + "\nint f(void *p) {}\n", "x.c")
    sig, = native.parse_declarations("// ctypes: f(ptr p,\n//          i64 n) -> void\nvoid f(void *p, int64_t n) {}\n")
    assert (sig.name, sig.params, sig.result, sig.line) == ("f", (("ptr", "p"), ("i64", "n")), "void", 3)


@needs_kernel
def test_wrappers_refuse_what_the_c_would_misread():
    x, w = torch.randn(3, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    bad = [lambda: native.linear(x.float(), w), lambda: native.linear(x, w.t().contiguous().t()),
           lambda: native.linear(x, w, torch.zeros(7).bfloat16()), lambda: native.linear(x, w, torch.zeros(8)),
           lambda: native.rms_norm(x, torch.ones(32), 1e-5), lambda: native.rms_norm(x, torch.ones(64).bfloat16()[::2], 1e-5),
           lambda: native.argmax(x.float()), lambda: native.topk_log_probs(x, 33),
           lambda: native.topk_log_probs(x[0], 4), lambda: native.silu_mul(x, x[:, :16]),
           lambda: native.linear_w(x.float(), native.wmat(w)), lambda: native.wmat(w.float()),
           lambda: native.rotary(x, torch.ones(3, 8), torch.ones(3, 8), 4)]
    q, key, value, anc, counts = _tree_case(10, 4, 2, 32, seed=1)
    bad += [lambda: native.attention(q, key, value, 10, anc.int(), counts, 0.1),
            lambda: native.attention(q, key, value, 10, anc, counts[:3], 0.1),
            lambda: native.attention(q, key, value, 10 + key.shape[1], anc, counts, 0.1),
            lambda: native.attention(q.float(), key, value, 10, anc, counts, 0.1)]
    buffers = [torch.zeros(1, 2, 8, 4).bfloat16() for _ in range(2)]
    bad += [lambda: native.move_rows(buffers, torch.tensor([1, 2]), torch.tensor([0])),
            lambda: native.move_rows([buffers[0], torch.zeros(1, 2, 9, 4).bfloat16()], torch.tensor([1]), torch.tensor([0]))]
    for call in bad:
        with pytest.raises(ValueError, match="core.kernels.native"):
            call()
    if native.int8_available():
        with pytest.raises(ValueError, match="linear_s8 needs"):
            native.linear_s8(x.float(), native.quantize(w))


@needs_kernel
def test_c_kernels_report_what_they_cannot_do_instead_of_crashing():
    """Work memory no machine has (2^51 bytes, beyond any address space): -1, before any pointer is
    read; a top-k wider than the C's candidate buffer: -1."""
    k = native._library()[0]
    rows, kdim = 2**31 - 1, 2**20
    assert k.gemm_bf16(None, 0, None, 0, None, None, 0, rows, 16, kdim, 1) == -1
    assert k.gemm_s8(None, 0, None, None, None, None, None, 0, rows, 16, kdim, 1) == -1
    assert k.topk_logprobs_bf16(None, 0, None, None, 1, 100, native.TOPK_MAX + 1, 1) == -1
    x = torch.randn(2, 100).bfloat16()
    assert torch.equal(native.topk_log_probs(x, 3)[1], native.topk_log_probs(x, native.TOPK_MAX)[1][:, :3])


# ---- CPUs without AVX-512: the same kernels on AVX2 halves (csrc/avx2.h) ----

needs_avx2 = pytest.mark.skipif(not native.AVX2_FEATURES <= native._cpu_flags() or platform.machine() != "x86_64",
                                reason="this CPU lacks x86-64-v3 (AVX2, FMA, F16C, ...)")


@needs_avx2
@pytest.mark.parametrize("how", ["no avx512_bf16", "EAGLE_CHAT_KERNELS=avx2"])
def test_a_cpu_without_avx512_runs_the_avx2_build_and_its_rows_are_invariant(how, monkeypatch, fresh_cache):
    """Where avx512_bf16 is missing (AMD Zen 1-3, Intel desktop chips), or on request, the kernels are
    built for AVX2: they serve (the self-test passed), say so, and each computes what it does on
    AVX-512: a row the same alone or in any batch, near its reference."""
    flags = native._cpu_flags()
    if how == "no avx512_bf16":
        monkeypatch.setattr(native, "_cpu_flags", lambda: {f for f in flags if not f.startswith(("avx512", "amx"))})
    else:
        monkeypatch.setenv(native.OFF_ENV, "avx2")
    st = native.status()
    assert st.available and st.isa == "avx2" and not st.amx and not st.amx_attention, st.reason
    assert "AVX2" in st.describe() and native.gemm_kind() == "avx2" and native.int8_available.__wrapped__()
    assert len(list(fresh_cache.glob("decode-*.so"))) == 1
    gen = torch.Generator().manual_seed(11)
    for n, k in [(1536, 576), (37, 100)]:
        x, w = torch.randn(9, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
        y = native.linear(x, w)
        ref = x.float() @ w.float().T
        assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
        assert all(torch.equal(native.linear(x[i:i + 1], w)[0], y[i]) for i in range(9))
    q, key, value, anc, counts = _tree_case(40, 9, 3, 64, seed=5)
    out = native.attention(q, key, value, 40, anc, counts, 0.125)
    for i in range(q.shape[0]):  # row i alone: its own ancestors, nothing else
        alone = native.attention(q[i:i + 1], key, value, 40, anc[i:i + 1, :int(counts[i])], counts[i:i + 1], 0.125)
        assert torch.equal(alone[0], out[i])
    ref = native.reference_attention(q, key, value, 40, anc, counts, 0.125)
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2)
    norm_w = torch.randn(100, generator=gen).bfloat16()
    xs = torch.randn(5, 100, generator=gen).bfloat16()
    assert torch.equal(native.rms_norm(xs, norm_w, 1e-5)[2], native.rms_norm(xs[2:3], norm_w, 1e-5)[0])


def test_a_cpu_with_neither_avx512_nor_avx2_keeps_torchs_kernels_and_says_why(monkeypatch, fresh_cache):
    _as_if_capable(monkeypatch)
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"sse4_2", "avx"})
    st = native.status()
    assert not st.available and "lacks both avx512_bf16 and AVX2" in st.reason and native.gemm_kind() is None
    assert not list(fresh_cache.glob("*"))  # nothing was built


def _kernel_outputs() -> list[torch.Tensor]:
    """What the target's kernels compute on fixed inputs (the w4a8 and bf16 GEMMs, attention, RMSNorm,
    SiLU x up, rotary, argmax) with whichever library serves now."""
    from gguf import quants

    from core.kernels import quant
    from tests.test_step import TYPES

    gen = torch.Generator().manual_seed(21)
    w = torch.randn(96, 576, generator=gen) * 0.05
    outs = []
    for kind in ("Q4_1", "Q4_0", "Q8_0"):
        raw = quants.quantize(w.numpy(), TYPES[kind])
        blocks = quant.Blocks(int(TYPES[kind]), torch.from_numpy(raw.copy()), 96, 576)
        for packed in (quant.pack_x8(blocks),) + ((quant.split_q8(blocks),) if kind == "Q8_0" else ()):
            x = torch.randn(9, 576, generator=gen).bfloat16()
            outs.append(native.linear_w(x, native.wmat(blocks=packed)))
    x, wb = torch.randn(7, 100, generator=gen).bfloat16(), torch.randn(37, 100, generator=gen).bfloat16()
    outs.append(native.linear(x, wb))
    q, key, value, anc, counts = _tree_case(300, 9, 3, 64, seed=6)
    outs.append(native.attention(q, key, value, 300, anc, counts, 0.125))
    outs.append(native.rms_norm(x, torch.randn(100, generator=gen).bfloat16(), 1e-5))
    outs.append(native.silu_mul(x, x * 3))
    angles = torch.randn(5, 32, generator=gen) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1).bfloat16(), torch.cat([angles.sin()] * 2, -1).bfloat16()
    outs.append(native.rotary(torch.randn(5, 4 * 64, generator=gen).bfloat16(), cos, sin, 4))
    outs.append(native.argmax(torch.randn(3, 49152, generator=gen).bfloat16()))
    return outs


@needs_avx512
def test_the_avx2_build_computes_the_avx512_builds_bits(monkeypatch):
    """csrc/avx2.h computes each AVX-512 intrinsic lane for lane on 256-bit halves: on an AVX-512 machine (AMX off,
    as AVX2 machines have none) the two builds give the target's kernels the same bits."""
    monkeypatch.setenv(native.AMX_ENV, "0")
    native._library.cache_clear()
    try:
        assert native.status().isa == "avx512"
        wide = _kernel_outputs()
        monkeypatch.setenv(native.OFF_ENV, "avx2")
        native._library.cache_clear()
        assert native.status().isa == "avx2", native.status().reason
        halves = _kernel_outputs()
    finally:
        monkeypatch.delenv(native.OFF_ENV, raising=False)
        monkeypatch.delenv(native.AMX_ENV)
        native._library.cache_clear()
    assert [i for i, (a, b) in enumerate(zip(wide, halves)) if not torch.equal(a, b)] == []

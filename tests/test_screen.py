"""The screened LM head (core.kernels.screen, csrc/gemm_x8.c lm_screen_team): a greedy step reads
the split head's h nibbles to bound every logit, and computes exactly only the groups that can hold
a row's maximum. What must hold: the split head computes the unsplit head's bits; the screened
argmax is the full head's argmax (ties to the first index included) for any hidden state, however
close the runners-up; the logits it computes are the full head's; and the test catches a screen
whose bound is wrong."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from core.kernels import native, quant, screen

pytestmark = pytest.mark.skipif(not native.status().available,
                                reason=f"core.kernels.native unavailable: {native.status().reason}")


def q8_blocks(w: np.ndarray) -> quant.Blocks:
    raw = quants.quantize(w.astype(np.float32), GGMLQuantizationType.Q8_0)
    return quant.Blocks(8, torch.from_numpy(raw.copy()), *w.shape)


def crowded_head(seed: int, groups: int = 48, k: int = 128) -> tuple[np.ndarray, quant.Blocks]:
    """A Q8_0 head with runners-up as close as the format allows: random rows, exact copies of
    some (ties, in other groups, before and after the original), and copies with one code moved
    by one step (logits a few 1e-3 apart)."""
    g = np.random.default_rng(seed)
    w = g.standard_normal((16 * groups, k)).astype(np.float32) * 0.05
    for i in range(0, 16 * groups, 7):
        src = g.integers(0, 16 * groups)
        w[i] = w[src]
    b = q8_blocks(w)
    raw = b.data.numpy().reshape(b.n, k // 32, 34)
    for i in range(3, b.n, 11):  # near copies: row i = row src with one code moved by one
        src = int(g.integers(0, b.n))
        raw[i] = raw[src]
        blk, pos = int(g.integers(0, k // 32)), int(g.integers(2, 34))
        raw[i, blk, pos] = np.uint8((int(raw[i, blk, pos]) + (1 if g.random() < 0.5 else -1)) % 256)
    return w, quant.Blocks(8, torch.from_numpy(np.ascontiguousarray(raw.reshape(b.n, -1))), b.n, k)


def hidden_rows(seed: int, n: int, k: int, w: np.ndarray) -> torch.Tensor:
    """Hidden states that mostly lie in a few directions (as a model's final ones do), some of
    them aimed at a weight row so that its copies and near copies compete for the maximum."""
    g = np.random.default_rng(seed)
    basis = g.standard_normal((4, k))
    x = g.standard_normal((n, 4)) @ basis * 3 + g.standard_normal((n, k)) * 0.5
    aimed = g.integers(0, w.shape[0], n // 2)
    x[: n // 2] += w[aimed] * 400
    return torch.from_numpy(x.astype(np.float32)).bfloat16()


@pytest.mark.tiles
def test_the_split_head_computes_the_unsplit_heads_bits_on_vnni_and_amx():
    w = np.random.default_rng(0).standard_normal((16 * 12, 192)).astype(np.float32) * 0.05
    b = q8_blocks(w)
    kept = quant.split_q8(b), quant.pack_x8(b)  # the WMats point into these tensors
    split, packed = (native.wmat(blocks=k) for k in kept)
    assert kept[0].nbytes == kept[1].nbytes  # the same bytes, another order
    assert torch.equal(native.dequantize(split), native.dequantize(packed))
    x = torch.randn(17, 192, generator=torch.Generator().manual_seed(1)).bfloat16()
    had = native.set_x8_amx(True)
    try:
        for m in (1, 3, 9, 16, 17):
            for amx in sorted({False, had}):
                native.set_x8_amx(amx)
                assert torch.equal(native.linear_w(x[:m], split), native.linear_w(x[:m], packed)), (m, amx)
    finally:
        native.set_x8_amx(had)
    with pytest.raises(quant.QuantWeightError, match="cannot be split"):
        quant.split_q8(quant.pack_x8(b))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_screened_argmax_is_the_full_heads_with_ties_and_near_ties(seed):
    w, b = crowded_head(seed)
    head = quant.split_q8(b)
    x = hidden_rows(seed + 10, 96, b.k, w)
    sc = screen.build(b, screen.directions(x[48:].float().numpy(), rank=8))
    full = native.linear_w(x, native.wmat(blocks=head))
    computed, ties, before = [], 0, torch.get_num_threads()
    for start, m in ((0, 1), (1, 2), (3, 5), (8, 16), (24, 16), (40, 1), (41, 16), (57, 16), (73, 16), (89, 7)):
        rows = slice(start, start + m)
        for threads in (1, 2, 3):  # groups split over the team differently: the same argmax
            torch.set_num_threads(threads)
            try:
                y = screen.screened_logits(x[rows], head, sc)
            finally:
                torch.set_num_threads(before)
            assert torch.equal(native.argmax(y), native.argmax(full[rows])), (seed, start, threads)
            finite = torch.isfinite(y.float())
            assert torch.equal(y[finite], full[rows][finite])  # what it computes is the full head's bits
        best = full[rows].float().max(-1).values[:, None]
        ties += int(((full[rows].float() == best).sum(-1) > 1).sum())
        computed.append(finite.float().mean().item())
    assert ties > 0  # exact ties for the maximum occurred: the first index had to win
    assert np.mean(computed) < 0.6  # and the screen left most of the head unread


def test_a_screen_without_its_bound_is_caught():
    """Negative control: with the bound's coefficients zeroed the screen trusts A x + C z alone,
    and the same checks see a wrong argmax on the crowded head."""
    wrong = 0
    for seed in range(3):
        w, b = crowded_head(seed)
        head = quant.split_q8(b)
        x = hidden_rows(seed + 10, 96, b.k, w)
        sc = screen.build(b, screen.directions(x[48:].float().numpy(), rank=8))
        sc = screen.Screen(sc.basis, sc.proj, torch.zeros_like(sc.coef))
        full = native.linear_w(x, native.wmat(blocks=head))
        for start in range(0, 96, 16):
            y = screen.screened_logits(x[start:start + 16], head, sc)
            wrong += int((native.argmax(y) != native.argmax(full[start:start + 16])).sum())
    assert wrong > 0


def test_the_screen_refuses_what_it_cannot_serve():
    w, b = crowded_head(0, groups=4)
    x = hidden_rows(1, 17, b.k, w)
    sc = screen.build(b, screen.directions(x.float().numpy(), rank=4))
    with pytest.raises(ValueError, match="cannot serve 17 rows"):
        screen.screened_logits(x, quant.split_q8(b), sc)
    with pytest.raises(ValueError, match="Q8x8 head"):
        screen.screened_logits(x[:2], quant.pack_x8(b), sc)


def test_the_screen_is_built_once_per_file_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path))
    w, b = crowded_head(0, groups=4, k=64)
    rows = hidden_rows(2, 40, 64, w).float().numpy()
    calls = []
    calibrate = lambda: calls.append(1) or rows  # noqa: E731
    monkeypatch.setattr(screen, "RANK", 8)
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF stand-in")
    first = screen.load_or_build(b, source, calibrate)
    [cached] = list((tmp_path / "screen").glob("model-*.safetensors"))
    again = screen.load_or_build(b, source, calibrate)
    assert len(calls) == 1  # the second load read the file
    assert all(torch.equal(getattr(first, f), getattr(again, f)) for f in ("basis", "proj", "coef"))
    cached.write_bytes(b"not a safetensors file")
    rebuilt = screen.load_or_build(b, source, calibrate)
    assert len(calls) == 2 and torch.equal(rebuilt.coef, first.coef)


def test_a_row_that_is_not_finite_is_computed_in_full():
    """A hidden state holding inf (a broken model, not a bound to trust): every group is computed,
    so the row's logits are the full head's, bit for bit, NaN included."""
    w, b = crowded_head(1, groups=6)
    head = quant.split_q8(b)
    x = hidden_rows(3, 3, b.k, w)
    sc = screen.build(b, screen.directions(x.float().numpy(), rank=4))
    x[1, 7] = float("inf")
    y = screen.screened_logits(x, head, sc)
    full = native.linear_w(x, native.wmat(blocks=head))
    assert torch.equal(y[1].view(torch.int16), full[1].view(torch.int16))
    assert torch.equal(native.argmax(y), native.argmax(full))


def test_an_unwritable_cache_still_gives_the_screen(tmp_path, monkeypatch):
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    monkeypatch.setenv("EAGLE_CHAT_HOME", str(home))
    w, b = crowded_head(0, groups=4, k=64)
    rows = hidden_rows(2, 40, 64, w).float().numpy()
    monkeypatch.setattr(screen, "RANK", 8)
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF stand-in")
    assert screen.load_or_build(b, source, lambda: rows).basis.shape == (8, 64)


@pytest.mark.slow
def test_a_screen_that_cannot_be_fitted_leaves_the_full_head_and_says_so(tmp_path, monkeypatch):
    """Fitting asks the model for a few answers through its chat template; where that fails (a
    model without one, say) the step serves the whole head and its line says why."""
    from core.decoding import cache as kv
    from core.decoding.forward import plain_forward, prefill
    from core.decoding.numerics import set_numerics
    from core.kernels.step import load_step
    from core.models import EMBEDDED, load_target

    from tests.app_server import shared_home

    # a fresh screen cache (the fit must run and fail); the conversion and the kernels are the run's own
    monkeypatch.setenv("EAGLE_CHAT_HOME", str(shared_home(tmp_path / "home", ("models", "kernels", "probe"))))

    def no_template(step, target):
        raise ValueError("this tokenizer has no chat template")

    target = load_target(EMBEDDED, dtype="bfloat16")
    set_numerics(target, "exact")  # what the step serves (core.decoding.numerics.load_numerics does the same)
    step, text = load_step(target, "w4a8", calibrate=no_template)
    assert step.screen is None
    assert text.endswith("(greedy steps read the whole LM head: its screen could not be fitted: "
                         "this tokenizer has no chat template)")
    with torch.inference_mode():
        cache = kv.new_cache(step.hf)
        prefill(step, torch.tensor([1, 2, 3]), cache)
        logits = plain_forward(step, 4, cache, 3, only_max=True)[1]
    assert torch.isfinite(logits.float()).all()  # the whole head, computed



def test_calibration_reads_each_answers_rows_as_the_model_writes_them_alone(monkeypatch):
    """The screen's fit reads the final hidden states of the model's greedy answers to its calibration prompts,
    written side by side (core.decoding.batched): prompt by prompt, the rows a one-at-a-time answer feeds, bit for
    bit, up to TOKENS rows each or until the answer's stop token."""
    from core.decoding import cache as kv
    from core.decoding.forward import prefill

    from core.decoding import batched

    from tests.test_batched import native_engine

    engine = native_engine()
    step, tok = engine.step, engine.target.tokenizer
    monkeypatch.setattr(screen, "CALIBRATION", ["w5 w9", "w7", "w11 w12 w13 w14", "w300"])
    monkeypatch.setattr(screen, "TOKENS", 9)

    @torch.inference_mode()
    def alone(prompt: str) -> tuple[list[np.ndarray], list[int]]:  # (rows, the tokens fed)
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt")
        ids = (ids["input_ids"] if not torch.is_tensor(ids) else ids)[0]
        cache, eos = kv.new_cache(step), set(engine.target.eos_ids)
        _, logits = prefill(step, ids, cache)
        token, rows, fed = int(native.argmax(logits[None])[0]), [], []
        for i in range(screen.TOKENS):
            if token in eos:
                break
            one = torch.ones(1, dtype=torch.long)
            hidden, logits = step.forward(torch.tensor([token]), torch.tensor([len(ids) + i]), len(ids) + i,
                                          one[:, None] - 1, one, cache)
            rows.append(hidden[0].float().numpy().copy())
            fed.append(token)
            token = int(native.argmax(logits)[0])
        return rows, fed

    rows, fed = alone("w5 w9")
    assert len(rows) == screen.TOKENS
    engine.target.model.generation_config.eos_token_id = fed[3]  # the first answer now stops after 3 rows
    expected = [alone(p)[0] for p in screen.CALIBRATION]
    assert len(expected[0]) == 3 and max(map(len, expected)) == screen.TOKENS
    got = batched.calibration_hidden(step, engine.target)
    assert got.shape == (sum(map(len, expected)), step.hf.config.hidden_size)
    assert np.array_equal(got, np.concatenate([np.stack(e) for e in expected if e]))

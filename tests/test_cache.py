"""core.decoding.cache: the buffered KV cache behaves exactly like transformers' DynamicCache (plus `keep`)."""

import pytest
import torch
from transformers import DynamicCache

from core.decoding import cache as kv
from core.kernels import native


def _entries(n, start, kvh=2, hd=4):
    # (1, kvh, n, hd) keys whose values name their position, head and lane
    k = torch.arange(start, start + n, dtype=torch.float32)[None, None, :, None].expand(1, kvh, n, hd).clone()
    k += 0.25 * torch.arange(kvh)[None, :, None, None] + 0.0625 * torch.arange(hd)
    return k, -k


def _reference_keep(keys, committed, path):
    return torch.cat([keys[:, :, :committed], keys[:, :, [committed + p for p in path]]], dim=2)


@pytest.mark.parametrize("mover", ["native", "torch"])
def test_updates_and_keeps_match_a_concatenating_cache(mover, monkeypatch):
    """Prefill, tree writes and keeps (moved and in-place paths), past the first buffer's size;
    keep moves rows in one native call for every layer where it can, else layer by layer."""
    if mover == "native" and not native.status().available:
        pytest.skip(f"core.kernels.native unavailable here: {native.status().reason}")
    calls = []
    if mover == "torch":
        monkeypatch.setattr(native, "move_rows_usable", lambda buffers: False)
    else:
        move = native.RowMover.move
        monkeypatch.setattr(native.RowMover, "move", lambda self, *a: calls.append(1) or move(self, *a))
    mine, ref = kv.new_cache(None), DynamicCache()
    k, v = _entries(200, 0)
    for cache in (mine, ref):
        for layer in range(3):
            cache.update(k, v, layer)
    pos = 200
    for step, path in enumerate([[0, 2, 5], [0, 1, 2], [0], [0, 3, 4, 9], [0, 1]] * 8):
        k, v = _entries(10, 1000 * (step + 1))
        for layer in range(3):
            got_k, got_v = mine.update(k, v, layer)
            want_k, want_v = ref.update(k, v, layer)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        kv.keep(mine, pos, path)
        for layer in ref.layers:
            layer.keys, layer.values = _reference_keep(layer.keys, pos, path), _reference_keep(layer.values, pos, path)
        pos += len(path)
        assert kv.cache_length(mine) == pos == kv.cache_length(ref)
    assert pos > kv.MIN_CAPACITY  # the buffer grew on the way
    for a, b in zip(mine.layers, ref.layers):
        assert isinstance(a, kv.BufferedLayer)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert len(calls) == (16 if mover == "native" else 0)  # one per moved keep (24 of 40 keep in place)


def test_crop_and_reset():
    cache = kv.new_cache(None)
    cache.update(*_entries(7, 0), 0)
    cache.crop(-3)
    assert kv.cache_length(cache) == 4 and torch.equal(cache.layers[0].keys, _entries(4, 0)[0])
    keys, _ = cache.update(*_entries(2, 50), 0)
    assert torch.equal(keys[0, 0, :, 0], torch.tensor([0.0, 1, 2, 3, 50, 51]))
    cache.reset()
    assert kv.cache_length(cache) == 0
    keys, _ = cache.update(*_entries(3, 9), 0)
    assert torch.equal(keys, _entries(3, 9)[0])
    # keys / values are views of the buffers, cut at the current length; only clearing them is allowed
    layer = cache.layers[0]
    cache.crop(-1)
    assert layer.keys.shape[-2] == 2 and layer.keys.data_ptr() == layer._k.data_ptr()
    with pytest.raises(RuntimeError, match="write through update"):
        layer.keys = _entries(2, 0)[0]
    layer.values = None  # what transformers' reset does: nothing to clear, the buffers stay
    assert layer.values.shape[-2] == 2

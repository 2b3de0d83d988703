"""The target's KV cache and the three operations we need.

  new_cache      an empty cache for the model: transformers' DynamicCache whose layers
                 write into preallocated buffers (`BufferedLayer`) instead of growing by
                 `torch.cat`, so a step costs the new entries, not a copy of the whole cache.
  cache_length   committed tokens in it.
  keep           after a tree forward: keep the committed prefix plus the accepted
                 path's entries, moved into contiguous slots; drop every other node.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from core.kernels import native

MIN_CAPACITY = 256  # first buffer, in positions; it doubles when full
_epoch = 0  # counts every change of any BufferedLayer's buffers (see buffers_epoch)


def buffers_epoch() -> int:
    """A number that changes whenever any BufferedLayer's buffers are replaced (a layer initialized,
    grown or reset): whoever keeps their addresses (core.kernels.step) reads them again then."""
    return _epoch


def _buffers_changed() -> None:
    global _epoch
    _epoch += 1


class _BufferView:
    """A BufferedLayer's `keys` or `values`: the first `length` positions of its buffer, or None.
    transformers' DynamicLayer assigns them only to clear them (None, or an empty tensor at
    initialization); anything else would bypass the buffers, so it is refused."""

    def __init__(self, buffer: str):
        self.buffer = buffer

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        buf = getattr(layer, self.buffer, None)
        return None if buf is None else buf.narrow(-2, 0, layer.length)

    def __set__(self, layer, value) -> None:
        if value is not None and value.numel() != 0:
            raise RuntimeError("a BufferedLayer's keys and values live in its buffers: write through update()")


class BufferedLayer(DynamicLayer):
    """A DynamicLayer over buffers (B, kvh, capacity, hd): `keys` / `values` are views of the
    first `length` positions; an update writes the new entries in place (growing the buffer
    by doubling when full), so nothing of the committed context is copied per step."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None
        self.length = 0
        _buffers_changed()

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, need: int) -> None:
        cap = 0 if self._k is None else self._k.shape[-2]
        if need <= cap:
            return
        new_cap = max(MIN_CAPACITY, 2 * cap, need)
        k = key_states.new_empty((*key_states.shape[:-2], new_cap, key_states.shape[-1]))
        v = value_states.new_empty((*value_states.shape[:-2], new_cap, value_states.shape[-1]))
        if self.length:
            k[..., :self.length, :] = self._k[..., :self.length, :]
            v[..., :self.length, :] = self._v[..., :self.length, :]
        self._k, self._v = k, v
        _buffers_changed()

    def reserve(self, need: int) -> None:
        """Room for `need` positions (an initialized layer; core.kernels.step writes into the buffers)."""
        self._reserve(self._k, self._v, need)

    # `keys` / `values`: views of the buffers' first `length` positions, made when read (an
    # update returns them) rather than on every length change (keep() changes 30 layers' a step)
    keys = _BufferView("_k")
    values = _BufferView("_v")

    def _set_length(self, length: int) -> None:
        self.length = length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: (B, kvh, n, hd) -> all keys / values so far, (B, kvh, length, hd)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._reserve(key_states, value_states, self.length + n)
        self._k[..., self.length:self.length + n, :] = key_states
        self._v[..., self.length:self.length + n, :] = value_states
        self._set_length(self.length + n)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the number of tokens to remove as a negative integer")
        if tokens_to_remove and self.is_initialized:
            self._set_length(max(0, self.length + tokens_to_remove))

    def keep(self, committed: int, slots: torch.Tensor) -> None:
        """Entries [0, committed), then slots[i] in slot committed + i; the rest is dropped."""
        n = slots.shape[0]
        # the gather copies first, so overlapping source and destination slots are safe
        self._k[..., committed:committed + n, :] = self._k[..., slots, :]
        self._v[..., committed:committed + n, :] = self._v[..., slots, :]
        self._set_length(committed + n)

    def reset(self) -> None:
        self._k = self._v = None
        self.length = 0
        _buffers_changed()
        super().reset()


def new_cache(model) -> DynamicCache:
    # No config: plain full-attention layers even for sliding-window models; our own 4D
    # masks decide what each token sees, and `keep` can move entries in every layer the same way.
    cache = DynamicCache()
    cache.layer_class_to_replicate = BufferedLayer  # Cache.update appends one per new layer index
    return cache


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def keep(cache: DynamicCache, committed: int, path: torch.Tensor | list[int]) -> None:
    """Keep entries [0, committed) and committed + path[i], in that order; drop the rest.

    CPU caches move the kept rows of every layer in one native call (core.kernels.native.RowMover:
    about 20 us against 0.5 ms for two indexed copies per layer); elsewhere each layer gathers.
    """
    path = path.tolist() if isinstance(path, torch.Tensor) else [int(p) for p in path]  # a few ints: on the host
    n = len(path)
    layers, mover = _layers_and_mover(cache)
    if path != list(range(n)):  # else the accepted nodes are already in place: just cut
        if mover is not None:
            mover.move(torch.tensor(path) + committed, torch.arange(committed, committed + n))
        else:
            slots = {}  # device -> the kept entries' cache slots
            for layer in layers:
                device = layer.keys.device
                if device not in slots:
                    slots[device] = (committed + torch.tensor(path)).to(device)
                layer.keep(committed, slots[device])
    for layer in layers:
        layer.length = committed + n


def append_rows(cache: DynamicCache, source: DynamicCache, n: int) -> None:
    """Append the first n entries of every layer of `source` to `cache` (both from new_cache, initialized):
    another sequence's rows, bit for bit (core.decoding.batched puts each answer's prompt in this way)."""
    at = cache_length(cache)
    for dst, src in zip(cache.layers, source.layers, strict=True):
        dst.reserve(at + n)
        dst._k[..., at:at + n, :] = src._k[..., :n, :]
        dst._v[..., at:at + n, :] = src._v[..., :n, :]
        dst.length = at + n


def _layers_and_mover(cache: DynamicCache) -> tuple[list[BufferedLayer], native.RowMover | None]:
    """The cache's initialized layers and the native mover of their rows (None where it cannot
    serve), found again only when a buffer changed (buffers_epoch): the check compares 60-odd
    shapes and strides, a fifth of keep()'s time when run every step."""
    seen = getattr(cache, "_native_moves", None)
    if seen is not None and seen[0] == _epoch and len(seen[1]) == len(cache.layers):
        return seen[1], seen[2]
    assert all(isinstance(layer, BufferedLayer) for layer in cache.layers), "keep() serves caches from new_cache()"
    layers = [layer for layer in cache.layers if layer.is_initialized]
    buffers = [t for layer in layers for t in (layer._k, layer._v)]
    mover = native.RowMover.over(buffers) if native.move_rows_usable(buffers) else None
    cache._native_moves = (_epoch, layers, mover)
    return layers, mover

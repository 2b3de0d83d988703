"""The target's KV cache (transformers' DynamicCache) and the three operations we need.

  new_cache      an empty cache for the model.
  cache_length   committed tokens in it.
  keep           after a tree forward: keep the committed prefix plus the accepted
                 path's entries, moved into contiguous slots; drop every other node.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    # No config: plain full-attention layers even for sliding-window models; our own 4D
    # masks decide what each token sees, and `keep` can slice every layer the same way.
    return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def keep(cache: DynamicCache, committed: int, path: torch.Tensor | list[int]) -> None:
    """Keep entries [0, committed) and committed + path[i], in that order; drop the rest."""
    path = torch.as_tensor(path, dtype=torch.long).cpu()  # a few ints: decide on the host
    n = path.shape[0]
    contiguous = torch.equal(path, torch.arange(n))  # accepted nodes already in place: just cut
    for layer in cache.layers:
        if contiguous:
            layer.keys, layer.values = layer.keys[:, :, :committed + n], layer.values[:, :, :committed + n]
            continue
        idx = (committed + path).to(layer.keys.device)
        # keys/values: (1, kvh, L, hd)
        layer.keys = torch.cat([layer.keys[:, :, :committed], layer.keys[:, :, idx]], dim=2)
        layer.values = torch.cat([layer.values[:, :, :committed], layer.values[:, :, idx]], dim=2)

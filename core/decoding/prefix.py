"""The prompt read last, kept: a chat's next turn starts with the turns before it, and reads only what follows.

A chat sends its whole conversation with each message (the app, and every OpenAI-style client of
core.serve), so without this each turn reads every earlier turn again: ~1 s per 1,000 tokens on a
2-core CPU before the first new token. The engine keeps the cache rows and the target features of
the last prompt it read, in whole prefill chunks (core.decoding.forward.prefill_chunk), and a prompt
that begins with the same tokens starts from a copy of them. Prefill chunks start at fixed positions,
so the rows a prompt continues from are the bits a fresh read of it computes: the answer is the same
whether the turn before was kept or not (tests/test_prefix.py), the first token only comes sooner.

The kept rows are those of the prompt alone: the answer's own rows come from decoding steps (the
native step's numerics), which a prefill of the same tokens would not reproduce bit for bit, so a
next turn reads the previous answer again. A prompt shorter than one chunk keeps nothing. At most
MAX_BYTES of cache rows are kept (a 7B model's rows are 20x SmolLM2's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.config import switched_off
from core.decoding.forward import prefill_chunk

ENV = "EAGLE_CHAT_PREFIX_CACHE"  # "0": every prompt is read from its start
MAX_BYTES = 128 << 20  # the kept keys and values, in whole chunks: SmolLM2 5,120 tokens (a 7B model: none)


@dataclass(frozen=True)
class Prefix:
    """The first rows of a prompt's prefill: its tokens, every layer's keys and values, its features."""

    ids: tuple[int, ...]                  # (B,), B a multiple of prefill_chunk()
    keys: tuple[torch.Tensor, ...]        # per layer (1, kv heads, B, head_dim)
    values: tuple[torch.Tensor, ...]
    features: torch.Tensor                # (B, F): what prefill returned for those tokens
    feature_layers: tuple[int, ...] | None


def _layers(feature_layers) -> tuple[int, ...] | None:
    """feature_layers as Prefix keeps them (a list and a tuple of the same layers are the same features)."""
    return None if feature_layers is None else tuple(feature_layers)


def enabled() -> bool:
    return not switched_off(ENV)


def reusable(kept: Prefix | None, ids: list[int], feature_layers) -> int:
    """How many of the prompt's first tokens `kept` holds, in whole chunks, leaving at least one to read
    (its logits choose the first token); 0 where none."""
    if kept is None or not enabled() or kept.feature_layers != _layers(feature_layers):
        return 0
    limit, same = min(len(kept.ids), len(ids) - 1), 0
    while same < limit and kept.ids[same] == ids[same]:
        same += 1
    chunk = prefill_chunk(kept.keys[0].device)
    return same // chunk * chunk


def restore(kept: Prefix, rows: int, cache) -> torch.Tensor:
    """Copy `kept`'s first `rows` into the empty `cache`; returns their features (rows, F)."""
    assert cache.get_seq_length() == 0, "restore into an empty cache"
    for layer, (k, v) in enumerate(zip(kept.keys, kept.values)):
        cache.update(k[..., :rows, :], v[..., :rows, :], layer)
    return kept.features[:rows]


def keep(ids: list[int], cache, features: torch.Tensor, feature_layers, kept: Prefix | None = None) -> Prefix | None:
    """What to keep after a prompt's prefill: its whole chunks (at most MAX_BYTES of rows) copied from the
    cache, or `kept` where those would add nothing to it (the prompt continues it without another whole
    chunk, or is shorter than a chunk), or None where the switch is off."""
    layers = cache.layers
    if not enabled() or not layers:
        return None
    per_row = sum(2 * l.keys.shape[1] * l.keys.shape[-1] * l.keys.element_size() for l in layers)
    chunk = prefill_chunk(layers[0].keys.device)
    rows = min(len(ids), MAX_BYTES // max(1, per_row)) // chunk * chunk
    layers_key = _layers(feature_layers)
    if rows == 0 or (kept is not None and kept.feature_layers == layers_key and rows <= len(kept.ids)
                     and tuple(ids[:len(kept.ids)]) == kept.ids):
        return kept
    return Prefix(tuple(ids[:rows]), tuple(l.keys[..., :rows, :].clone() for l in layers),
                  tuple(l.values[..., :rows, :].clone() for l in layers), features[:rows].clone(), layers_key)

"""The drafter seam: what the decode loop (core.decoding.engine) and the tree builders (core.decoding.tree) ask of a
draft model, written down once.

A drafter is an EAGLE head plus what it borrows from the target (the input embedding, rows of
the LM head). Two kinds implement this protocol: core.decoding.tree.Drafter (EAGLE-1/2 heads, which read
the target's last hidden state) and core.decoding.head3.Drafter3 (EAGLE-3 heads, which read three fused
target layers and score a draft vocabulary of their own). A new head kind is one more class
with these members; core.decoding.head3.drafter_for picks the class for a head, and nothing in
core.decoding.tree or core.decoding.engine changes.

Words used here:
  features   what the head reads per input token: a target hidden state (catch-up; (m, 3H)
             fused layers for EAGLE-3) or the head's own output for a draft node (tree rounds)
  hidden     the head's output (m, H): it predicts the features after its token, and the
             drafter's log-probabilities over the draft vocabulary are read off it
  draft id   a row of the drafter's vocabulary (Vd rows); `to_target_ids` maps it to the
             target's id (V); Vd == V where the drafter scores the whole vocabulary
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from core.decoding.head import HeadCache, TreeRows

# Members a drafter MAY have, which the library uses where present and composes from the protocol
# where absent:
#   catch_up_top(cache, tokens, features, k) -> (hidden (H,), (log-probs (1, k), draft ids (1, k))) | None
#       core.decoding.tree.catch_up_top in one call (feed, then top_log_probs on the last row), or
#       None where this call cannot be fused (the EAGLE-1/2 drafter's native head: one C call)
#   target_id_list(idx) -> list[int]
#       to_target_ids(idx).flatten().tolist() without a tensor op (a host copy of the vocabulary)
OPTIONAL = frozenset({"catch_up_top", "target_id_list"})


@runtime_checkable
class DraftModel(Protocol):
    """What drafting needs of a head, whatever its kind (see the module docstring)."""

    @property
    def head(self) -> nn.Module:
        """The head module; its `config` sizes the head's KV cache (core.decoding.head.HeadCache)."""
        ...

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """Which target hidden states the head reads: None = the last one (after the final
        norm); else the decoder layers whose outputs are fused (core.decoding.head3.target_features)."""
        ...

    @property
    def vocab(self) -> torch.Tensor | None:
        """(Vd,) the target ids of the draft vocabulary; None = the whole target vocabulary."""
        ...

    def feed(self, cache: HeadCache, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
             allowed: torch.Tensor | TreeRows | None = None) -> torch.Tensor:
        """Run the head on m new inputs and append their keys and values to `cache`: tokens (m,)
        target ids t_{j+1}, features (m, F) f_j, positions (m,) -> hidden (m, H).

        `allowed`: None = causal after the cache; bool (m, cache length + m), the whole mask; or
        the tree part (the last T keys; every earlier key is seen), as bool (m, T) or TreeRows
        (core.decoding.head.head_mask)."""
        ...

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (m, H) -> fp32 draft log-probabilities (m, Vd), clamped at 0 (core.decoding.tree.log_probs)."""
        ...

    def top_log_probs(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (m, H) -> the min(k, Vd) best draft log-probabilities (m, k), best first, and
        their draft ids (m, k)."""
        ...

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids, same shape."""
        ...

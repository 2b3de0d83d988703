"""The target's forwards: a draft tree verified in one forward, a plain decoding step, a prompt's prefill.

Each takes the target explicitly (a transformers *ForCausalLM, or the native step of core.kernels.step
that serves its decoding forwards) with its KV cache and the positions, and returns (features,
logits); the cache is the one thing they change (they append the rows they computed). Only the
model's public forward is used: a 4D mask, or core.kernels.invariant's tree layout where the exact kernels
run. The decode loop (core.decoding.engine), the probe (core.decoding.probe) and the measuring commands (autotune,
gpucheck) all call these, so what the probe checks is what the loop runs.
"""

from __future__ import annotations

import torch

from core.kernels import invariant, native
from core.decoding.head import additive
from core.decoding.head3 import target_features
from core.kernels.step import NativeStep, SpecStep
from core.decoding.tree import DraftTree
from core.decoding.verify import greedy_tokens


def uses_exact_kernels(model) -> bool:
    """Whether the model runs core.kernels.invariant's batch-invariant kernels (the "exact" attention)."""
    return model.config._attn_implementation == invariant.NAME


def _window_masks(model, allowed: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor,
                  dtype: torch.dtype):
    """The 4D mask(s) for a tree forward, with the model's sliding window built in."""
    cfg = model.config
    full = additive(allowed, dtype)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or []
    if not window or (types and "sliding_attention" not in types):
        return full
    near = key_positions[None, :] > positions[:, None] - window  # (n, L + n)
    sliding = additive(allowed & near, dtype)
    return {"full_attention": full, "sliding_attention": sliding} if types else sliding


def forward_tree(model, tree: DraftTree, cache, committed: int, feature_layers: tuple[int, ...] | None = None,
                 only_max: bool = False, choices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the tree's n nodes -> (features (n, F), logits (n, V)).

    Each node sees the committed context and its own ancestors; its position is the
    context length plus its depth. The forward appends n entries to `cache`. Features are
    the last hidden state, or the fused layers an EAGLE-3 head reads. only_max: the caller
    reads each row's argmax only (greedy), so the native step may screen its LM head
    (core.kernels.screen: -inf where a logit cannot be the maximum). choices: an (n,) int64 CPU
    tensor that receives each row's argmax (greedy_tokens of the logits; the native step finds
    them inside its own call).
    """
    device = tree.tokens.device
    positions = tree.positions(committed)  # (n,)
    if isinstance(model, NativeStep):
        ancestors = invariant.tree_ancestors(tree.parents, tree.depths)
        return model.forward(tree.tokens, positions, committed, ancestors, tree.depths + 1, cache, feature_layers,
                             only_max, choices)
    kwargs = {}
    if uses_exact_kernels(model):
        kwargs["tree_layout"] = invariant.TreeLayout.from_tree(tree.parents, tree.depths, committed)
    else:
        allowed = torch.cat([torch.ones(tree.size, committed, dtype=torch.bool, device=device), tree.mask], 1)
        key_pos = torch.cat([torch.arange(committed, device=device), positions])
        kwargs["attention_mask"] = _window_masks(model, allowed, positions, key_pos,
                                                 model.get_input_embeddings().weight.dtype)
    out = model.model(input_ids=tree.tokens[None], position_ids=positions[None], cache=cache, use_cache=True,
                      output_hidden_states=feature_layers is not None, **kwargs)
    logits = model.lm_head(out.last_hidden_state[0])
    if choices is not None:
        choices.copy_(greedy_tokens(logits))
    return target_features(out, feature_layers)[0], logits


def plain_forward(model, token: int, cache, position: int, feature_layers=None,
                  only_max: bool = False, choices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain decoding step -> (features (1, F), logits (V,)); the same kernels as a tree row
    (only_max and choices, here (1,), as forward_tree's)."""
    if isinstance(model, NativeStep):
        if not only_max and choices is None:  # the one-row call without argument tensors
            features, logits, _ = model.forward_one(token, position, cache, feature_layers)
            return features, logits[0]
        one = torch.ones(1, dtype=torch.long)
        features, logits = model.forward(torch.tensor([token]), torch.tensor([position]), position, one[:, None] - 1,
                                         one, cache, feature_layers, only_max, choices)
        return features, logits[0]
    device = model.get_input_embeddings().weight.device
    kwargs = {"tree_layout": invariant.TreeLayout.single(position, device)} if uses_exact_kernels(model) else {}
    out = model.model(input_ids=torch.tensor([[token]], device=device),
                      position_ids=torch.tensor([[position]], device=device), cache=cache, use_cache=True,
                      output_hidden_states=feature_layers is not None, **kwargs)
    logits = model.lm_head(out.last_hidden_state[0, -1])
    if choices is not None:
        choices.copy_(greedy_tokens(logits))
    return target_features(out, feature_layers)[0], logits


def forward_tree_greedy(model, tree: DraftTree, cache, committed: int,
                        feature_layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, list[int]]:
    """forward_tree for a greedy caller, which reads each row's argmax alone -> (features (n, F), the
    rows' argmaxes)."""
    if isinstance(model, NativeStep):  # the tree's arguments built on the host, in one buffer
        features, _, choices = model.forward_rows(*tree.host, committed, cache, feature_layers, greedy=True)
        return features, choices
    choices = torch.empty(tree.size, dtype=torch.int64)
    features, _ = forward_tree(model, tree, cache, committed, feature_layers, True, choices)
    return features, choices.tolist()


def spec_step_greedy(model, tree: DraftTree, cache, committed: int, drafter, head_cache, k: int) -> SpecStep | None:
    """forward_tree_greedy, the walk (core.decoding.verify.accept_greedy's path) and the head's catch-up on
    the accepted path with the new root's k best children (core.decoding.tree.catch_up_top) in one native
    call, where the native step and the native head both serve and the head reads the last hidden state;
    else None (the caller runs them one by one: the same tokens, the same proposals)."""
    if not isinstance(model, NativeStep) or drafter.feature_layers is not None:
        return None
    top_call = getattr(drafter, "top_call", None)
    head = top_call(head_cache, tree.size, k) if top_call is not None else None
    if head is None:
        return None
    return model.spec_step_greedy(*tree.host, committed, cache, head, head_cache)


def plain_forward_greedy(model, token: int, cache, position: int,
                         feature_layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, int]:
    """plain_forward for greedy decoding -> (features (1, F), the argmax), as forward_tree_greedy."""
    if isinstance(model, NativeStep):
        features, _, choice = model.forward_one(token, position, cache, feature_layers, greedy=True)
        return features, choice
    choice = torch.empty(1, dtype=torch.int64)
    features, _ = plain_forward(model, token, cache, position, feature_layers, True, choice)
    return features, int(choice[0])


def plain_logits(model, token: int, cache, position: int) -> torch.Tensor:
    return plain_forward(model, token, cache, position)[1]


# Prompt tokens per forward of a prefill (prefill_chunk). Chunks start at multiples of the chunk's size in
# positions (the cache's rows counted), so a chunk's bits depend on its tokens and the cache's rows alone: a
# prompt that continues rows read before (core.decoding.prefix, which keeps whole chunks) gets exactly a fresh
# prefill's bits.
# - PREFILL_CHUNK_TILES (1,024) where the prompt's GEMMs run on AMX tiles (a call of PROMPT_TILE_ROWS rows or more,
#   invariant.reading_prompt), and on GPUs: each tile call dequantizes its tiles again (~20 ms for SmolLM2's
#   layers, ~0.6 ms a row after it), so few calls pay. Measured on the Intel AMX VM (2026-12-05,
#   docs/long-context.md): a cold prefill of 1,000 / 2,000 / 4,000 tokens 0.74 / 1.70 / 3.57 s.
# - PREFILL_CHUNK (256) elsewhere: a chunk of at most native.MAX_ROWS rows multiplies the 4-bit blocks in place
#   (BlockLinear: no bf16 copy of the weights, whose oneDNN GEMM ran slower), and a chat's next turn keeps every
#   whole 256 tokens of the last prompt instead of every 1,024. Measured on the AMD Zen 4 VM (2026-12-07,
#   scripts/prefill_ab.py, processes alternating): 700 / 1,000 / 2,000 / 4,000 tokens 0.70 / 1.02 / 2.62 / 7.55 s
#   against 0.92 / 1.21 / 3.06 / 8.00 s in chunks of 1,024; the peak during a 4,000-token prefill 786 MB
#   against 1,043 MB (no dequantized copy); 128 and 512 measured within noise of 256.
PREFILL_CHUNK_TILES, PREFILL_CHUNK = 1024, 256


def prefill_chunk(device: torch.device | str = "cpu") -> int:
    """Prompt tokens per forward of a prefill on `device` here (the comment above)."""
    if torch.device(device).type != "cpu":
        return PREFILL_CHUNK_TILES
    return PREFILL_CHUNK_TILES if native.gemm_kind() == "amx" else PREFILL_CHUNK


class StopReading(Exception):
    """A prefill's `should_stop` said stop between two chunks (the cache then holds the chunks read)."""


def prefill(model, ids: torch.Tensor, cache, feature_layers=None,
            should_stop=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids (T,) after the cache's rows -> (features (T, F), logits of the last position (V,)),
    in chunks aligned to prefill_chunk(). Through transformers also where the native step serves the
    decoding steps (compute-bound GEMMs for a long prompt; both decoding modes share it).
    `should_stop()`, if given, is asked before each chunk: True raises StopReading (a Stop pressed while a
    long prompt is read takes effect within one chunk, ~1 s on a 2-core CPU)."""
    if isinstance(model, NativeStep):
        model = model.hf
    exact = uses_exact_kernels(model)
    at, done, features, last = cache.get_seq_length(), 0, [], None
    chunk = prefill_chunk(ids.device)
    several = at % chunk + ids.shape[0] > chunk  # one chunk: nothing to keep between chunks
    with invariant.reading_prompt(keep_weights=several):
        while done < ids.shape[0]:
            if should_stop is not None and should_stop():
                raise StopReading(f"stopped after {done} of {ids.shape[0]} prompt tokens")
            n = min(chunk - at % chunk, ids.shape[0] - done)
            out = model.model(input_ids=ids[None, done:done + n], cache=cache, use_cache=True,
                              output_hidden_states=feature_layers is not None,
                              **({"prefill_past": at} if exact and at else {}))
            features.append(target_features(out, feature_layers)[0])
            last = out.last_hidden_state[0, -1:]
            at, done = at + n, done + n
    return (features[0] if len(features) == 1 else torch.cat(features)), model.lm_head(last)[0]

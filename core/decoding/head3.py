"""The EAGLE-3 draft head (arXiv 2503.01840), in the published checkpoint layout.

Words used here (H = hidden size, Ht = the target's hidden size, Vd = draft vocabulary):
  fused features  cat(target hidden states of a low, a middle and a high layer), (m, 3Ht);
                  `feature_layers` are their indices in transformers' `output_hidden_states`
                  (entry i = the input of decoder layer i), default (2, L//2, L-3) as in the
                  reference implementation.
  head state      the decoder layer's output h^ (m, H), before the final norm. It is what the
                  head feeds back to itself when drafting further than the target's features.
  d2t, t2d        draft id -> target id is `id + d2t[id]`; t2d (V,) marks target ids in the
                  draft vocabulary.

Forward, one position: x = fc(fused) (first step only; later steps feed h^ directly), then
  h^ = x + attn(cat(input_layernorm(embed(token)), hidden_norm(x)))   (q/k/v are 2H wide)
  h^ = h^ + mlp(post_attention_layernorm(h^))
and the draft distribution is softmax(lm_head(norm(h^))) over the draft vocabulary.
Keys: fc.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
norm.weight, lm_head.weight, d2t, t2d (optional embed_tokens.weight, a copy of the target's).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from core.kernels import native
from core.decoding.drafter import DraftModel
from core.decoding.head import (CONFIG_FILE, WEIGHTS_FILE, Attention, HeadCache, HeadConfig, HeadLoadError, MLP,
                       RMSNorm, TreeRows, _rotary, causal_mask, head_mask, read_checkpoint)
from core.kernels.invariant import draft_int8_enabled, quantize_linears, swap_linears

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
MAP_KEYS = ("d2t", "t2d")  # absent from checkpoints whose draft vocabulary is the full one
OPTIONAL_KEYS = ("embed_tokens.weight",)


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The reference's low/middle/high choice: inputs of layers 2, L//2 and L-3 (ascending)."""
    return tuple(sorted((2, num_layers // 2, num_layers - 3)))


@dataclass(frozen=True)
class Head3Config(HeadConfig):
    draft_vocab_size: int = 0
    target_hidden_size: int | None = None  # None = hidden_size
    layer_ids: tuple[int, ...] = ()  # saved as `eagle3_layer_ids`

    @property
    def fused_size(self) -> int:
        return len(self.layer_ids) * (self.target_hidden_size or self.hidden_size)

    @classmethod
    def from_target3(cls, target_config, draft_vocab_size: int,
                     layer_ids: tuple[int, ...] | None = None) -> "Head3Config":
        base = asdict(HeadConfig.from_target(target_config, bias=False))
        ids = tuple(layer_ids or default_layer_ids(target_config.num_hidden_layers))
        return cls(**base, draft_vocab_size=draft_vocab_size, layer_ids=ids)

    @classmethod
    def from_dict3(cls, d: dict, target_layers: int) -> "Head3Config":
        base = asdict(HeadConfig.from_dict(d))
        base["bias"] = False
        base["num_hidden_layers"] = 1  # the EAGLE-3 layout has exactly one midlayer
        if "draft_vocab_size" not in d:
            raise HeadLoadError("EAGLE-3 head config.json lacks the field 'draft_vocab_size'")
        ids = tuple(int(i) for i in d.get("eagle3_layer_ids") or default_layer_ids(target_layers))
        ths = d.get("target_hidden_size")
        return cls(**base, draft_vocab_size=int(d["draft_vocab_size"]), layer_ids=ids,
                   target_hidden_size=int(ths) if ths else None)

    def to_llama_dict(self) -> dict:
        """config.json as published (LlamaConfig, one layer, draft_vocab_size) + our layer ids."""
        d = asdict(self)
        d.pop("layer_ids")
        if d["target_hidden_size"] is None:
            d.pop("target_hidden_size")
        d.update(architectures=[EAGLE3_ARCH], model_type="llama", num_hidden_layers=1,
                 head_dim=self.dim_per_head, eagle3_layer_ids=list(self.layer_ids))
        return d


class Attention3(Attention):
    """Llama attention whose q/k/v read the 2H-wide cat(embedding, state)."""

    def __init__(self, c: HeadConfig):
        super().__init__(c)
        self.q_proj = nn.Linear(2 * c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.kvh * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.kvh * self.hd, bias=False)


class MidLayer(nn.Module):
    """The EAGLE-3 decoder layer: the residual stream is the state, attention also sees the token."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = Attention3(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = MLP(c)

    def attn_input(self, emb: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], dim=-1)  # (B, n, 2H)

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, emb, x, cos, sin, mask, cache):
        return self.finish(x, self.self_attn(self.attn_input(emb, x), cos, sin, mask, cache))


class Eagle3Head(nn.Module):
    def __init__(self, config: Head3Config):
        super().__init__()
        assert config.draft_vocab_size > 0 and config.layer_ids, "an EAGLE-3 head needs a vocabulary and layers"
        assert config.fused_size != config.hidden_size, "fused and state widths must differ (feed dispatches on it)"
        self.config = config
        self.fc = nn.Linear(config.fused_size, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = _rotary(config)

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache: HeadCache | None = None) -> torch.Tensor:
        """token_embeds (1, n, H); features (1, n, 3Ht) fused or (1, n, H) head states;
        positions (n,) -> head states (1, n, H). `mask`: additive (1, 1, n, cache length
        after the write); None = causal over the n inputs (an empty cache or no cache)."""
        assert token_embeds.shape[:2] == features.shape[:2] and token_embeds.shape[1] == positions.shape[0]
        x = self.fc(features) if features.shape[-1] == self.fc.in_features else features
        assert x.shape[-1] == self.config.hidden_size, f"features of width {features.shape[-1]}"
        if mask is None and cache is not None and cache.length > 0:
            raise ValueError("a head call on a non-empty cache needs an explicit mask")
        if mask is None and cache is not None:
            mask = causal_mask(positions.shape[0], 0, x.dtype, x.device)
        cos, sin = self.rotary(x, positions[None])
        return self.midlayer(token_embeds.to(x.dtype), x, cos.to(x.dtype), sin.to(x.dtype), mask, cache)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """(..., H) head states -> (..., Vd) draft-vocabulary logits."""
        return self.lm_head(self.norm(states))

    def target_ids(self) -> torch.Tensor:
        """(Vd,) the target id of every draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t


def set_draft_vocab(head: Eagle3Head, target_ids: torch.Tensor) -> None:
    """Fill d2t/t2d from the (Vd,) target ids of the draft vocabulary (ascending, as published)."""
    ids = target_ids.to(torch.long).cpu()
    assert ids.shape == head.d2t.shape and bool((ids[1:] > ids[:-1]).all()), "distinct ascending ids"
    head.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))
    head.t2d.zero_()
    head.t2d[ids.to(head.t2d.device)] = True


def new_head3(target_config, draft_vocab_ids: torch.Tensor, *, layer_ids: tuple[int, ...] | None = None,
              seed: int | None = None, lm_rows: torch.Tensor | None = None,
              norm_weight: torch.Tensor | None = None) -> Eagle3Head:
    """A randomly initialised head (Llama's 0.02 init) over `draft_vocab_ids` (Vd,) target ids.

    `lm_rows` (Vd, H), rows in ascending target-id order (e.g. the target's LM-head rows of the
    draft vocabulary), start lm_head there instead of at random; `norm_weight` (H,) (e.g. the
    target's final norm) starts the head's own norm there instead of at ones."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    config = Head3Config.from_target3(target_config, int(draft_vocab_ids.shape[0]), layer_ids)
    head = Eagle3Head(config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.02)
        if lm_rows is not None:
            head.lm_head.weight.copy_(lm_rows)
        if norm_weight is not None:
            head.norm.weight.copy_(norm_weight)
        set_draft_vocab(head, draft_vocab_ids.sort().values)
    return head


def save_head3(head: Eagle3Head, folder: str | Path) -> Path:
    """config.json + model.safetensors in the published layout (no embedding copy)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(head.config.to_llama_dict(), indent=2))
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    return folder


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise HeadLoadError(f"head checkpoint {folder} has no {CONFIG_FILE}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HeadLoadError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt") from e


def head_kind(folder: str | Path) -> str:
    """'eagle3' or 'eagle1', from the checkpoint's config.json."""
    d = _read_config(Path(folder))
    archs = " ".join(d.get("architectures") or []).lower()
    return "eagle3" if "draft_vocab_size" in d or "eagle3" in archs else "eagle1"


def check_state3(head: Eagle3Head, state: dict[str, torch.Tensor]) -> None:
    """Strict key and shape check; names every missing, unexpected or mis-shaped key."""
    expected = head.state_dict()
    optional = set(OPTIONAL_KEYS) | (set(MAP_KEYS) if head.config.draft_vocab_size == head.config.vocab_size else set())
    missing = sorted(set(expected) - set(state) - optional)
    unexpected = sorted(set(state) - set(expected) - set(OPTIONAL_KEYS))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs head {tuple(v.shape)}"
              for k, v in expected.items() if k in state and state[k].shape != v.shape]
    problems = [f"{what} {items}" for what, items in
                (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", shapes)) if items]
    if problems:
        raise HeadLoadError("head checkpoint does not match the EAGLE-3 layout: " + "; ".join(problems))


def check_maps(head: Eagle3Head) -> None:
    """d2t must map into the target vocabulary, distinct ids, and agree with t2d."""
    ids = head.target_ids()
    v = head.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= v or ids.unique().shape[0] != ids.shape[0]:
        raise HeadLoadError("the head's d2t maps draft ids outside the target vocabulary or onto one id twice")
    if int(head.t2d.sum()) != ids.shape[0] or not bool(head.t2d[ids].all()):
        raise HeadLoadError("the head's d2t and t2d disagree about which target tokens are in the draft vocabulary")


def load_head3(folder: str | Path, target_config, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> Eagle3Head:
    """Load a published (or our own) EAGLE-3 head for `target_config`, strictly."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HeadLoadError(f"head checkpoint folder {folder} does not exist")
    config = Head3Config.from_dict3(_read_config(folder), target_config.num_hidden_layers)
    _check_target(config, target_config)
    _, state = read_checkpoint(folder)  # weight-file errors, named
    head = Eagle3Head(config)
    check_state3(head, state)
    if "embed_tokens.weight" in state and state["embed_tokens.weight"].shape != (config.vocab_size, config.hidden_size):
        raise HeadLoadError("embed_tokens.weight in the head has the wrong shape")
    if config.draft_vocab_size == config.vocab_size and "d2t" not in state:  # identity maps
        state = {**state, "d2t": head.d2t, "t2d": torch.ones_like(head.t2d)}
    head.load_state_dict({k: v for k, v in state.items() if k not in OPTIONAL_KEYS}, strict=True)
    check_maps(head)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _check_target(config: Head3Config, target_config) -> None:
    th = config.target_hidden_size or config.hidden_size
    if th != target_config.hidden_size:
        raise HeadLoadError(f"this head is for another model: hidden size {th}, "
                            f"the target has {target_config.hidden_size}")
    if config.hidden_size != target_config.hidden_size:
        raise HeadLoadError(f"head width {config.hidden_size} differs from the target's {target_config.hidden_size}: "
                            "heads that need their own embedding are not supported")
    if config.vocab_size != target_config.vocab_size:
        raise HeadLoadError(f"this head is for another model: vocabulary {config.vocab_size}, "
                            f"the target has {target_config.vocab_size}")
    n = target_config.num_hidden_layers
    if len(config.layer_ids) != 3 or not all(0 <= i < n for i in config.layer_ids):
        raise HeadLoadError(f"eagle3_layer_ids {list(config.layer_ids)} must be three target layers in 0..{n - 1}")


def fuse(hidden_states: tuple[torch.Tensor, ...], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' `output_hidden_states` tuple (L + 1 entries of (B, n, Ht)) -> (B, n, 3Ht)."""
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


def target_features(out, layer_ids: tuple[int, ...] | None) -> torch.Tensor:
    """What a head reads from a target forward `out` (run with output_hidden_states=True when
    layer_ids is given): (B, n, H) last hidden state (EAGLE-1, None) or (B, n, 3H) fused."""
    return out.last_hidden_state if layer_ids is None else fuse(out.hidden_states, layer_ids)


@dataclass(frozen=True)
class Drafter3:
    """An EAGLE-3 head plus the target's input embedding: a core.decoding.drafter.DraftModel."""

    head: Eagle3Head
    embed: nn.Module  # the target's input embedding

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.config.layer_ids

    @property
    def vocab(self) -> torch.Tensor:
        """(Vd,) target ids of the draft vocabulary."""
        return self.head.target_ids()

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: (m, H) head states -> (m, Vd), as core.decoding.tree.Drafter
        from core.decoding.tree import log_probs

        return log_probs(self.head.logits(hidden))

    def top_log_probs(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden: (m, H) -> the k best draft log-probabilities (m, k) and their draft ids
        from core.decoding.tree import top_log_probs

        return top_log_probs(self.head.logits(hidden), k)

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        return idx + self.head.d2t[idx]

    def feed(self, cache: HeadCache, tokens: torch.Tensor, features: torch.Tensor,
             positions: torch.Tensor, allowed: torch.Tensor | TreeRows | None = None) -> torch.Tensor:
        """tokens (m,); features (m, 3Ht) fused target features (catch-up) or (m, H) head
        states (tree rounds) -> head states (m, H). `allowed`: the tree mask, whole
        (m, cache length + m) or its tree part (m, T, or TreeRows) (core.decoding.head.head_mask); None = causal."""
        m = tokens.shape[0]
        dtype = self.head.fc.weight.dtype
        emb = self.embed(tokens)[None].to(dtype)  # (1, m, H)
        mask = head_mask(allowed, cache.length, m, dtype, self.head.config, tokens.device)
        return self.head(emb, features[None].to(dtype), positions, mask, cache)[0]


def drafter_for(head: nn.Module, target_model, vocab: torch.Tensor | None = None) -> DraftModel:
    """The drafting seam for either kind of head on `target_model` (a *ForCausalLM).

    On CPUs with the int8 kernel the head's linear layers and its LM head draft from int8
    copies of their weights (core.kernels.invariant.quantize_linears; EAGLE_CHAT_DRAFT_INT8=0 turns
    it off): drafting streams those weights from memory every round, so half the bytes make a
    round cheaper. The target is untouched, so the output is the same either way; only which
    tokens the tree proposes can change (about 1% error on a draft logit)."""
    from core.kernels.headstep import native_head

    fused = native_head(head)  # from the bf16 weights, before the int8 copies
    if native.status().available:  # drafting is decoding-sized GEMMs too: the faster kernel
        swap_linears(head)
    quantize_linears(head)
    if isinstance(head, Eagle3Head):
        return Drafter3(head=head, embed=target_model.get_input_embeddings())
    from core.decoding.tree import Drafter

    weight = lm_head_weight(target_model)
    lm_weight = (weight if vocab is None else weight[vocab].clone()).to(weight.dtype)
    lm_int8 = native.quantize(lm_weight) if draft_int8_enabled(lm_weight) else None
    return Drafter(head=head, embed=target_model.get_input_embeddings(), lm_weight=lm_weight, vocab=vocab,
                   lm_int8=lm_int8, native=fused)


def lm_head_weight(target_model) -> torch.Tensor:
    """The target's LM head as a bf16 (V, H) tensor, also where the native step serves it from
    blocks (core.kernels.step, w4a8: the module's weight is empty): a tied head is the input embedding
    (the same values), an untied one is dequantized."""
    lm = target_model.lm_head
    if lm.weight.numel():
        return lm.weight
    if getattr(target_model.config, "tie_word_embeddings", False):
        return target_model.get_input_embeddings().weight
    return native.dequantize(lm.wmat)


def draft_weights(drafter) -> str:
    """How a drafter's head multiplies: the native head (core.kernels.headstep), 'int8' (copies of its
    weights, drafter_for) or its dtype."""
    from core.kernels.invariant import Int8DraftLinear

    fused = getattr(drafter, "native", None)
    if fused is not None:
        steps = ("; with the native step, a greedy step's forward, walk and catch-up in one call"
                 if getattr(drafter, "lm_int8", None) is not None else "")
        return f"{fused.block_kind} blocks x 8-bit activations, one native call per head forward{steps}"
    if any(isinstance(m, Int8DraftLinear) for m in drafter.head.modules()):
        return "int8"
    return str(drafter.head.fc.weight.dtype).removeprefix("torch.")


def load_any_head(folder: str | Path, target_model, *, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> DraftModel:
    """Load an EAGLE-1/2 or EAGLE-3 head (told apart by config.json) -> a Drafter or Drafter3."""
    if head_kind(folder) == "eagle3":
        return drafter_for(load_head3(folder, target_model.config, dtype=dtype, device=device), target_model)
    from core.decoding.head import load_head

    head, vocab = load_head(folder, target_model.config, dtype=dtype, device=device)
    return drafter_for(head, target_model, vocab)

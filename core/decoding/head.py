"""The EAGLE-1/2 draft head: fc(cat(embed(t_{j+1}), f_j)) -> Llama decoder layer(s) -> f^_{j+1}.

Published heads have one decoder layer; `grow_head` appends more (config num_hidden_layers,
keys layers.1.*, ...), each with its own slots in the head cache.
The head owns only its own weights (fc + its decoder layers, the published key names);
the target's embedding and LM head are passed in by the caller, never stored here, so
`state_dict()` is exactly the published checkpoint layout minus `embed_tokens.weight`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from core.kernels import native
from core.threads import one_torch_thread

CONFIG_FILE, WEIGHTS_FILE, PICKLE_FILE = "config.json", "model.safetensors", "pytorch_model.bin"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # optional extra: target ids the head drafts over
OPTIONAL_KEYS = ("embed_tokens.weight",)  # published heads often carry a copy of the target's


class HeadLoadError(RuntimeError):
    """A head checkpoint is missing, corrupt, or made for another model; the message says which."""


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    bias: bool = True
    hidden_act: str = "silu"
    num_hidden_layers: int = 1  # the published heads have one decoder layer; ours may have more

    @classmethod
    def from_target(cls, target_config, **overrides) -> "HeadConfig":
        c = target_config
        rope = getattr(c, "rope_parameters", None) or {}
        values = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, vocab_size=c.vocab_size,
                      head_dim=getattr(c, "head_dim", None), rms_norm_eps=c.rms_norm_eps,
                      rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
                      max_position_embeddings=c.max_position_embeddings)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        try:
            config = cls(hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
                         num_attention_heads=int(d["num_attention_heads"]),
                         num_key_value_heads=int(d.get("num_key_value_heads", d["num_attention_heads"])),
                         vocab_size=int(d["vocab_size"]), head_dim=d.get("head_dim"),
                         rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                         rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
                         rope_scaling=scaling,
                         max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                         bias=bool(d.get("bias", True)), hidden_act=d.get("hidden_act", "silu"),
                         num_hidden_layers=int(d.get("num_hidden_layers", 1)))
        except KeyError as e:
            raise HeadLoadError(f"head config.json lacks the field {e.args[0]!r}") from e
        if config.num_hidden_layers < 1:
            raise HeadLoadError(f"head config.json says num_hidden_layers {config.num_hidden_layers}; "
                                "a head has at least one decoder layer (published heads: 1)")
        return config

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def to_llama_dict(self) -> dict:
        """config.json in the published layout (a LlamaConfig with `bias`; one layer unless grown)."""
        d = asdict(self)
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=self.dim_per_head)
        return d


class HeadCache:
    """The head's own KV cache, one pair of buffers per decoder layer: allocated once (grown by
    doubling), written by index. Every layer writes the same slots; the cache's length moves on
    when the last layer has written (a one-layer head: at each write, as before)."""

    def __init__(self, config: HeadConfig, dtype: torch.dtype, device: torch.device, capacity: int = 1024):
        self.shape = (1, config.num_key_value_heads, capacity, config.dim_per_head)
        self.num_layers = config.num_hidden_layers
        self.layer_keys = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.layer_values = [torch.zeros_like(k) for k in self.layer_keys]
        self.length = 0

    def reserve(self, need: int, layer: int | None = None) -> None:
        """Room for `need` slots in `layer`'s buffers (None: every layer), grown by at least doubling."""
        for i in range(self.num_layers) if layer is None else (layer,):
            keys, values = self.layer_keys[i], self.layer_values[i]
            capacity = keys.shape[2]
            if need > capacity:
                extra = keys.new_zeros((1, keys.shape[1], max(capacity, need - capacity), keys.shape[3]))
                self.layer_keys[i] = torch.cat([keys, extra], dim=2)
                self.layer_values[i] = torch.cat([values, torch.zeros_like(extra)], dim=2)

    def write(self, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: (1, kvh, n, hd) -> this layer's keys/values so far, (1, kvh, length + n, hd)
        n = k.shape[2]
        self.reserve(self.length + n, layer)
        keys, values = self.layer_keys[layer], self.layer_values[layer]
        end = self.length + n
        keys[:, :, self.length:end] = k
        values[:, :, self.length:end] = v
        if layer == self.num_layers - 1:
            self.length = end
        return keys[:, :, :end], values[:, :, :end]

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding: x (..., hd) with cos, sin broadcast to it."""
    return x * cos + _rotate_half(x) * sin


NATIVE_ROWS = 32  # head calls up to this many rows use the native attention


@dataclass(frozen=True)
class KeyLayout:
    """Which keys each of n new rows attends to, for the native attention kernel: every key
    before `committed`, then keys committed + ancestors[i, :counts[i]] (ascending)."""

    committed: int
    ancestors: torch.Tensor  # (n, A) int64
    counts: torch.Tensor     # (n,) int64

    @classmethod
    def causal(cls, n: int, past: int, device) -> "KeyLayout":
        """n new rows after `past` cached keys, each seeing the past and the new rows up to itself."""
        slots = torch.arange(n, device=device)
        return cls(past, slots.expand(n, n).contiguous(), slots + 1)

    @classmethod
    def tree(cls, rows: torch.Tensor, committed: int) -> "KeyLayout":
        """rows: bool (n, T), which of the T keys after `committed` each row sees (itself included)."""
        n, t = rows.shape
        slots = torch.arange(t, device=rows.device).expand(n, t)
        counts = rows.sum(1)  # (n,)
        seen_first = torch.where(rows, slots, slots + t).sort(dim=1).values  # seen slots first, ascending
        return cls(committed, seen_first[:, :int(counts.max())].contiguous(), counts)


@dataclass(frozen=True)
class TreeRows:
    """The tree part of a draft round's mask as lists (drafting keeps its tree on lists):
    row i sees the slots rows[i] (ascending) of the last `width` keys, and every key before."""

    rows: tuple[tuple[int, ...], ...]
    width: int

    def dense(self, device) -> torch.Tensor:
        """bool (n, width), the tensor form head_mask also takes."""
        out = torch.zeros(len(self.rows), self.width, dtype=torch.bool, device=device)
        for i, row in enumerate(self.rows):
            out[i, list(row)] = True
        return out

    def layout(self, committed: int, device) -> KeyLayout:
        longest = max(len(row) for row in self.rows)
        slots = [list(row) + [0] * (longest - len(row)) for row in self.rows]
        return KeyLayout(committed, torch.tensor(slots, dtype=torch.long, device=device),
                         torch.tensor([len(row) for row in self.rows], dtype=torch.long, device=device))


def native_rows(n: int, dtype: torch.dtype, config: "HeadConfig", device) -> bool:
    """Whether a head call on n rows runs the native attention kernel (head_mask then gives a KeyLayout)."""
    return (n <= NATIVE_ROWS and not torch.is_grad_enabled()
            and native.attention_serves(dtype, device, config.dim_per_head, config.num_attention_heads,
                                        config.num_key_value_heads))


def head_mask(allowed: "torch.Tensor | TreeRows | None", past: int, n: int, dtype: torch.dtype, config: "HeadConfig",
              device: torch.device):
    """The mask of a head call on n new rows after `past` cached keys.

    allowed: None = causal; bool (n, past + n), every key; or bool (n, T) with T < past + n
    (or TreeRows, its list form), the tree part: every key before the last T is seen, and `allowed` says which of the last T
    each row sees (a draft round: the committed context, then the fed draft nodes).
    Calls up to NATIVE_ROWS rows (catch-up: the few tokens a step accepted; draft rounds: the
    frontier) go through the native attention kernel where it serves the head (bf16 decoding
    on the CPU): at 1-8 rows sdpa took 60-260 us a call, the kernel a fifth to a half of that.
    Longer calls (the prompt's catch-up) and training keep sdpa.
    """
    kernel = native_rows(n, dtype, config, device)
    if isinstance(allowed, TreeRows):
        if kernel:
            return allowed.layout(past + n - allowed.width, device)
        allowed = allowed.dense(device)
    tree_part = allowed is not None and allowed.shape[1] < past + n
    if kernel and (allowed is None or tree_part):
        if allowed is None:
            return KeyLayout.causal(n, past, device)
        return KeyLayout.tree(allowed, past + n - allowed.shape[1])
    if tree_part:
        allowed = torch.cat([torch.ones(n, past + n - allowed.shape[1], dtype=torch.bool, device=device), allowed], 1)
    return additive(causal_allowed(n, past, device) if allowed is None else allowed, dtype)


def causal_allowed(n: int, past: int, device) -> torch.Tensor:
    """bool (n, past + n): every new token sees the past and earlier new tokens."""
    return torch.ones(n, past + n, dtype=torch.bool, device=device).tril(diagonal=past)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """q (1, nh, n, hd); k, v (1, kvh, L, hd); mask: KeyLayout, additive (1, 1, n, L) or None
    (causal) -> (1, n, nh, hd)."""
    if isinstance(mask, KeyLayout):
        out = native.attention(q[0].transpose(0, 1), k[0], v[0], mask.committed, mask.ancestors, mask.counts,
                               q.shape[-1] ** -0.5)  # (n, nh, hd)
        return out[None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, c: HeadConfig, layer: int = 0):
        super().__init__()
        self.layer = layer  # which of the cache's per-layer buffers this attention writes
        self.nh, self.kvh, self.hd = c.num_attention_heads, c.num_key_value_heads, c.dim_per_head
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kvh * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kvh * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache: HeadCache | None):
        # x: (1, n, H); cos/sin: (1, n, hd); mask: KeyLayout, additive (1, 1, n, L) or None (= causal)
        b, n, _ = x.shape
        if isinstance(mask, KeyLayout) and cache is not None and b == 1:
            return self._decode(x[0], cos[0], sin[0], mask, cache)[None]
        q, k, v = self.qkv(x, cos, sin)
        if cache is not None:
            k, v = cache.write(k, v, self.layer)  # (1, kvh, L, hd)
        return self.o_proj(attend(q, k, v, mask).reshape(b, n, self.nh * self.hd))

    def qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, n, in); cos/sin: (B, n, hd) -> q (B, nh, n, hd), k, v (B, kvh, n, hd), rotated."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kvh, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kvh, self.hd).transpose(1, 2)
        return _rope(q, cos[:, None], sin[:, None]), _rope(k, cos[:, None], sin[:, None]), v

    def _decode(self, x, cos, sin, mask: KeyLayout, cache: HeadCache) -> torch.Tensor:
        """A drafting call through the native kernels: x (n, H), cos/sin (n, hd) -> (n, H).
        The same values as the general path (the rotary kernel is transformers' bf16 formula bit
        for bit), in two kernel calls instead of the twenty-odd view, rotate and copy ops."""
        n = x.shape[0]
        q, k = self.q_proj(x), self.k_proj(x)  # (n, nh * hd), (n, kvh * hd)
        v = self.v_proj(x).view(n, self.kvh, self.hd)
        if native.rotary_usable(q, cos, sin, self.nh) and native.rotary_usable(k, cos, sin, self.kvh):
            q, k = native.rotary(q, cos, sin, self.nh), native.rotary(k, cos, sin, self.kvh)  # (n, heads, hd)
        else:
            c, s = cos[:, None], sin[:, None]
            q, k = _rope(q.view(n, self.nh, self.hd), c, s), _rope(k.view(n, self.kvh, self.hd), c, s)
        keys, values = cache.write(k.transpose(0, 1)[None], v.transpose(0, 1)[None], self.layer)  # (1, kvh, L, hd)
        out = native.attention(q, keys[0], values[0], mask.committed, mask.ancestors, mask.counts,
                               self.hd ** -0.5)  # (n, nh, hd)
        return self.o_proj(out.reshape(n, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer without input_layernorm, as in the published EAGLE heads."""

    def __init__(self, c: HeadConfig, layer: int = 0):
        super().__init__()
        self.self_attn = Attention(c, layer)
        self.mlp = MLP(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(x, cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.bias)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.rotary = _rotary(config)

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache: HeadCache | None = None) -> torch.Tensor:
        """token_embeds, features: (1, n, H); positions: (n,) -> predicted next features (1, n, H).

        `mask` is an additive float mask (1, 1, n, cache length after the write); None
        means plain causal attention over the n inputs (training, or prefill of an empty cache).
        """
        assert token_embeds.shape == features.shape and token_embeds.shape[1] == positions.shape[0]
        x = self.fc(torch.cat([token_embeds, features], dim=-1))  # (1, n, H)
        cos, sin = self.rotary(x, positions[None])  # (1, n, hd)
        if mask is None and cache is not None and cache.length > 0:
            raise ValueError("a head call on a non-empty cache needs an explicit mask")
        if mask is None and cache is not None:
            mask = causal_mask(positions.shape[0], 0, x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype), mask, cache)
        return x


def _rotary(c: HeadConfig) -> "RotaryTable":
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling:
        rope.update({k: v for k, v in c.rope_scaling.items() if k != "type"})
        rope["rope_type"] = c.rope_scaling.get("rope_type", c.rope_scaling.get("type", "default"))
    lc = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                     head_dim=c.dim_per_head, max_position_embeddings=c.max_position_embeddings,
                     rope_parameters=rope)
    return RotaryTable(LlamaRotaryEmbedding(lc), rope["rope_type"])


class RotaryTable(nn.Module):
    """transformers' rotary embedding, looked up in a table of cos / sin (fp32, grown by
    doubling) instead of recomputed per call: the 10-odd small ops it takes were a tenth of a
    draft round's head call. The table holds what the module computes (one product per
    angle, so bit for bit the same). Rope types whose frequencies depend on the sequence
    length (dynamic, longrope) and non-CPU devices compute per call."""

    STATIC = ("default", "linear", "llama3")

    def __init__(self, rotary: nn.Module, rope_type: str):
        super().__init__()
        self.rotary = rotary
        self.static = rope_type in self.STATIC
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin: (P, hd) fp32; not state

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: (..., n, ·) for dtype and device; positions (1, n) -> cos, sin (1, n, hd) in x's dtype
        if not self.static or x.device.type != "cpu":
            return self.rotary(x, positions)
        need = int(positions.max()) + 1
        if self._table is None or self._table[0].shape[0] < need:
            size = max(need, 256, 2 * (0 if self._table is None else self._table[0].shape[0]))
            with one_torch_thread():  # bits that must not depend on the process (core.threads)
                cos, sin = self.rotary(x.new_empty(0, dtype=torch.float32), torch.arange(size, device=x.device)[None])
            self._table = cos[0], sin[0]
        cos, sin = self._table
        return cos[positions].to(x.dtype), sin[positions].to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (the same weight, the same key) whose inference runs core.kernels.native's kernel on
    bf16 CPU rows: one call instead of torch's six ops (about 50 us a head call)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.eps is not None and native.norm_usable(x, self.weight):
            return native.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


def causal_mask(n: int, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask (1, 1, n, past + n): every new token sees the past and earlier new tokens."""
    return additive(causal_allowed(n, past, device), dtype)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (n, L) -> additive float (1, 1, n, L): 0 where allowed, dtype-min elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def new_head(target_config, *, bias: bool = True, seed: int | None = None, layers: int = 1) -> EagleHead:
    """A randomly initialised head sized for the target (small init, like Llama's 0.02)."""
    if layers < 1:
        raise ValueError(f"a head needs at least one decoder layer, not {layers}")
    return _initialise(EagleHead(HeadConfig.from_target(target_config, bias=bias, num_hidden_layers=layers)), seed)


def _initialise(head: EagleHead, seed: int | None, zero: tuple[str, ...] = ()) -> EagleHead:
    """Norm weights 1, biases and the parameters whose names end with `zero` 0, the rest N(0, 0.02)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("bias", *zero)):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return head


def grow_head(head: EagleHead, layers: int, *, seed: int | None = None) -> EagleHead:
    """The same head with decoder layers appended up to `layers`, computing exactly what it did:
    each new layer's output projections (o_proj, down_proj) start at zero, so the layer adds
    nothing to the residual stream until training moves them (its other weights start as in
    new_head). A warm start for a deeper head from a trained one-layer head."""
    from dataclasses import replace

    have = head.config.num_hidden_layers
    if layers < have:
        raise ValueError(f"cannot grow a {have}-layer head to {layers} layers; pass at least {have}")
    ref = next(head.parameters())
    grown = _initialise(EagleHead(replace(head.config, num_hidden_layers=layers)), seed,
                        zero=("o_proj.weight", "down_proj.weight"))
    missing, unexpected = grown.load_state_dict(head.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("layers.") and int(k.split(".")[1]) >= have for k in missing)
    return grown.to(device=ref.device, dtype=ref.dtype).train(head.training).requires_grad_(ref.requires_grad)


def save_head(head: EagleHead, folder: str | Path, draft_vocab: torch.Tensor | None = None) -> Path:
    """Write config.json + model.safetensors in the published layout (no embedding copy)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(head.config.to_llama_dict(), indent=2))
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    if draft_vocab is not None:
        save_file({"token_ids": draft_vocab.to(torch.int64).cpu().contiguous()}, str(folder / DRAFT_VOCAB_FILE))
    return folder


def read_checkpoint(folder: Path) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.is_file():
        raise HeadLoadError(f"head checkpoint {folder} has no {CONFIG_FILE}")
    try:
        config = HeadConfig.from_dict(json.loads(cfg_path.read_text()))
    except json.JSONDecodeError as e:
        raise HeadLoadError(f"{cfg_path} is not valid JSON ({e}); the checkpoint is corrupt") from e
    if (folder / WEIGHTS_FILE).is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(str(folder / WEIGHTS_FILE))
        except (SafetensorError, OSError) as e:
            raise HeadLoadError(f"{folder / WEIGHTS_FILE} is corrupt or truncated ({e}); "
                                "download or train the head again") from e
    elif (folder / PICKLE_FILE).is_file():
        try:
            state = torch.load(folder / PICKLE_FILE, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for bad pickles
            raise HeadLoadError(f"{folder / PICKLE_FILE} cannot be read safely ({type(e).__name__}: "
                                f"{e}); the file is corrupt or not a plain state dict") from e
    else:
        raise HeadLoadError(f"head checkpoint {folder} has neither {WEIGHTS_FILE} nor {PICKLE_FILE}")
    return config, state


def check_state(head: EagleHead, state: dict[str, torch.Tensor]) -> None:
    """Strict key and shape check; names every missing, unexpected or mis-shaped key."""
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - set(OPTIONAL_KEYS))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs head {tuple(v.shape)}"
              for k, v in expected.items() if k in state and state[k].shape != v.shape]
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if shapes:
        problems.append(f"wrong shapes {shapes}")
    if problems:
        raise HeadLoadError("head checkpoint does not match the EAGLE-1 layout: " + "; ".join(problems))


def load_head(folder: str | Path, target_config, *, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> tuple[EagleHead, torch.Tensor | None]:
    """Load a published (or our own) EAGLE-1/2 head for `target_config`, strictly.

    Returns the head and its optional draft vocabulary (target token ids), else None.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise HeadLoadError(f"head checkpoint folder {folder} does not exist")
    config, state = read_checkpoint(folder)
    if config.hidden_size != target_config.hidden_size:
        raise HeadLoadError(f"this head is for another model: hidden size {config.hidden_size}, "
                            f"the target has {target_config.hidden_size}")
    if config.vocab_size != target_config.vocab_size:
        raise HeadLoadError(f"this head is for another model: vocabulary {config.vocab_size}, "
                            f"the target has {target_config.vocab_size}")
    head = EagleHead(config)
    check_state(head, state)
    if "embed_tokens.weight" in state and state["embed_tokens.weight"].shape[1] != config.hidden_size:
        raise HeadLoadError("embed_tokens.weight in the head has the wrong width")
    head.load_state_dict({k: v for k, v in state.items() if k not in OPTIONAL_KEYS}, strict=True)
    draft_vocab = None
    if (folder / DRAFT_VOCAB_FILE).is_file():
        from safetensors.torch import load_file

        draft_vocab = load_file(str(folder / DRAFT_VOCAB_FILE))["token_ids"].to(device)
        if draft_vocab.numel() == 0 or int(draft_vocab.max()) >= target_config.vocab_size:
            raise HeadLoadError(f"{folder / DRAFT_VOCAB_FILE} holds token ids outside the vocabulary")
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False), draft_vocab


def param_count(head: nn.Module) -> int:
    return sum(p.numel() for p in head.parameters())



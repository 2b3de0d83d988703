"""The native decode step: a whole target forward over n new tokens in ONE C call.

Why: a plain step of the embedded 135M model spent about 8 ms of its 18-26 ms outside the
kernels (transformers' module dispatch, torch glue, Python: ~2,000 crossings per forward).
csrc/decode_step.c runs the Llama decoder itself (embedding, 30 x [RMSNorm, q/k/v, rotary,
cache write, tree attention, o_proj, residual, RMSNorm, gate/up, SiLU x up, down, residual],
final norm, LM head) with the same row-invariant kernels and the same roundings as the
transformers-driven exact path (core.kernels.invariant), so its logits are bit-identical to that
path's, row by row, alone or in a tree (tests/test_step.py), and the start-up probe checks it.

Weights (core.config.WEIGHTS): the GGUF's own 4-bit blocks times 8-bit activations ("w4a8",
the default where the model came from a GGUF: integer dot products as llama.cpp computes,
csrc/gemm_x8.c; its own numerics, row-invariant by construction), the same blocks rebuilt per
panel to the bf16 copy's values ("q4": bit-identical to "bf16", weights at the file's size), or
the model's bf16 tensors ("bf16").

transformers stays the loader, the prefill (long prompts: oneDNN's compute-bound GEMMs and
sdpa, shared by both decoding modes) and the reference; the step writes its keys and values
into the same cache buffers (core.decoding.cache.BufferedLayer), so the two interleave freely.
"""

from __future__ import annotations

import ctypes
import weakref
from collections import Counter
from dataclasses import dataclass, replace

import torch

from core.kernels import native
from core.kernels.invariant import ancestor_rows
from core.threads import one_torch_thread
from core.decoding.cache import BufferedLayer, buffers_epoch
from core.config import WEIGHTS, switched_off  # WEIGHTS: w4a8 / q4: the GGUF's blocks where the target came from one
from core.kernels.quant import SPLIT, X8, X8_BITS

SCREEN_ENV = "EAGLE_CHAT_SCREEN"  # "0": greedy steps read the whole LM head
# The screen serves forwards of up to this many rows. It saves bytes, not integer work (its pass over
# h costs a row what the whole head does), so it pays where a forward is memory-bound: Intel AMX VM,
# real chains, target forward screened / full: 1 row 0.962-0.974, 2 rows 0.967-0.993, 3 rows 1.00-1.02,
# 8 rows 1.08 (scripts/screen_cost.py; docs/native-step.md).
SCREEN_ROWS = 2
# On AVX2 (csrc/avx2.h) the full head's 8-bit codes cost two nibble passes per row and the screen's first
# pass one, so there it saves integer work too and serves every forward it can (csrc: up to 16 rows).
SCREEN_ROWS_AVX2 = 16


def screen_rows() -> int:
    """How many rows a greedy forward may have and still screen the LM head, on this machine's kernels."""
    return SCREEN_ROWS_AVX2 if native.status().isa == "avx2" else SCREEN_ROWS

ROPE_TYPES = ("default", "linear", "llama3")  # rotary tables that do not depend on the sequence length
STEP_TYPES = ("llama", "mistral", "qwen2")
_PROJ = ("q", "k", "v", "o", "gate", "up", "down")
_ERRORS = {-1: "out of memory", -2: "a token id outside the vocabulary", -3: "a position past the rotary table",
           -4: "a weight type the kernels do not read"}


class StepError(RuntimeError):
    """The native step refused a call (the message says why)."""


class _Layer(ctypes.Structure):  # csrc/decode_step.c's step_layer
    _fields_ = ([(p, native.WMat) for p in _PROJ]
                + [(b, ctypes.c_void_p) for b in ("bq", "bk", "bv", "ln1", "ln2", "kc", "vc")]
                + [("kv_head", ctypes.c_int64)])


class _Model(ctypes.Structure):  # csrc/decode_step.c's step_model
    _fields_ = ([(f, ctypes.c_int32) for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab",
                                               "pad")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("embed", native.WMat),
                   ("lm_head", native.WMat), ("norm", ctypes.c_void_p), ("cos", ctypes.c_void_p),
                   ("sin", ctypes.c_void_p), ("max_pos", ctypes.c_int64), ("layer", ctypes.POINTER(_Layer)),
                   ("screen", ctypes.c_void_p)])


def _give_back_freed_memory() -> None:
    """glibc keeps freed heap memory for reuse; the bf16 weights just freed (213 MB for
    SmolLM2) would stay resident without a trim (measured: VmRSS 822 -> 578 MB with it)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def unsupported(model) -> str | None:
    """Why the native step cannot run this transformers model (None: it can)."""
    c = model.config
    st = native.status()
    if not st.available:
        return f"native kernels unavailable ({st.reason})"
    first = model.get_input_embeddings().weight
    if first.dtype is not torch.bfloat16 or not first.is_cpu:
        return "the step computes in bf16 on the CPU"
    if model.config._attn_implementation != "eagle_exact":
        return "the step serves the exact (batch-invariant) numerics only"
    if c.model_type not in STEP_TYPES:
        return f"model type {c.model_type} (the step runs {', '.join(STEP_TYPES)})"
    if getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(c, "hidden_act", "silu") != "silu" or getattr(c, "mlp_bias", False):
        return "an MLP other than SiLU-gated without bias"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope not in ROPE_TYPES:
        return f"rotary scaling {rope!r} (the step has tables for {', '.join(ROPE_TYPES)})"
    attn = model.model.layers[0].self_attn
    hd = attn.head_dim
    if hd % 32 or hd > 256 or attn.o_proj.bias is not None:
        return f"head_dim {hd} or an o_proj bias"
    if any(isinstance(m, torch.nn.Linear) and m.weight.dtype is not torch.bfloat16 for m in model.modules()):
        return "a quantized (4-bit) transformers model"
    return None


@dataclass(frozen=True)
class StepInfo:
    weights: str        # e.g. "4-bit weights x 8-bit activations (Q4x8/Q8x8 blocks from SmolLM2-...gguf) (96 MB
                        # per token)", "Q4_1 blocks from SmolLM2-...gguf (123 MB per token)", "bf16 (269 MB per token)"
    weight_bytes: int   # bytes the step's GEMMs stream per forward
    activations: str = "bf16"  # what the GEMMs multiply the weights by: "bf16", or "int8" (w4a8)


@dataclass(frozen=True)
class HeadCall:
    """The head's part of NativeStep.spec_step_greedy (core.kernels.headstep.NativeHead.top_call): head_step_top's
    arguments after the step's own, bound to a head cache with room for a catch-up of up to n rows."""

    at: int                # the head cache's length before the catch-up (spec_step_greedy's head_committed)
    args: tuple            # hm, fc, fc_bias, embed, n_embed, head_out, lm_q, lm_scale, lm_sums, vocab,
                           # head_logits, vals, idx, k (csrc/decode_step.c's spec_step_greedy, after head_committed)
    out: torch.Tensor      # (n, H) bf16: the catch-up rows' outputs
    vals: torch.Tensor     # (k,) fp32: the proposal's log-probabilities, best first
    idx: torch.Tensor      # (k,) int64: their draft ids


@dataclass(frozen=True)
class SpecStep:
    """A greedy speculative step's outcome (NativeStep.spec_step_greedy)."""

    path: tuple[int, ...]      # the accepted tree rows, root first
    tokens: tuple[int, ...]    # the accepted draft tokens, then the bonus token
    head_hidden: torch.Tensor  # (H,) the head's output at the new root (its children's predictor)
    top: tuple[torch.Tensor, torch.Tensor]  # (1, k) each: the root's best children (catch_up_top's)
    forward_s: float           # the target's part: forward, argmax and walk
    head_s: float              # the head's catch-up and proposal


def rotary_table(rotary, probe: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary embedding module's cos / sin for positions [0, size) -> two (size, head_dim)
    tensors in probe's dtype, computed on one thread (core.threads.one_torch_thread says why:
    a process-dependent table made answers differ between runs of the same command)."""
    with one_torch_thread(), torch.inference_mode():
        cos, sin = rotary(probe, torch.arange(size)[None])  # (1, size, hd)
    return cos[0].contiguous(), sin[0].contiguous()


def warm_math() -> None:
    """The process's first calls of torch's vectorised math, on one thread (core.threads.one_torch_thread)."""
    with one_torch_thread(), torch.inference_mode():
        x = torch.linspace(0.0, 1.0, 64)
        for f in (torch.cos, torch.sin, torch.exp, torch.rsqrt, torch.sigmoid):
            f(x)


class NativeStep:
    """A transformers Llama-family model's forward as one native call. `forward` appends the n
    new tokens' keys and values to `cache` (a core.decoding.cache cache that prefill has started)."""

    def __init__(self, model, blocks: dict | None = None, source: str = ""):
        reason = unsupported(model)
        if reason:
            raise StepError(f"the native step cannot run this model: {reason}")
        self.hf = model
        c, attn = model.config, model.model.layers[0].self_attn
        params = dict(model.named_parameters())
        blocks = blocks or {}
        self.blocks = blocks  # the block tensors the C structures point into (bf16 ones: the model's)

        def weight(name: str) -> native.WMat:
            return native.wmat(blocks=blocks[name]) if name in blocks else native.wmat(params[name].detach())

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.detach().data_ptr()

        layers = (_Layer * c.num_hidden_layers)()
        for i, layer in enumerate(model.model.layers):
            base = f"model.layers.{i}."
            for p in _PROJ:
                part = "self_attn" if p in ("q", "k", "v", "o") else "mlp"
                setattr(layers[i], p, weight(f"{base}{part}.{p}_proj.weight"))
            sa = layer.self_attn
            layers[i].bq, layers[i].bk, layers[i].bv = ptr(sa.q_proj.bias), ptr(sa.k_proj.bias), ptr(sa.v_proj.bias)
            layers[i].ln1, layers[i].ln2 = ptr(layer.input_layernorm.weight), ptr(layer.post_attention_layernorm.weight)
        lm_name = "lm_head.weight" if "lm_head.weight" in blocks or "lm_head.weight" in params else "model.embed_tokens.weight"
        self._layers = layers
        self._m = _Model(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                         kv_heads=c.num_key_value_heads, head_dim=attn.head_dim, ffn=c.intermediate_size,
                         vocab=model.lm_head.weight.shape[0], eps=model.model.norm.variance_epsilon,
                         scale=attn.scaling, embed=weight("model.embed_tokens.weight"),
                         lm_head=weight(lm_name), norm=ptr(model.model.norm.weight), layer=layers)
        self.screen = None  # core.kernels.screen.Screen once set_screen gives one
        self.screen_rows = screen_rows()
        self._lm_name = lm_name
        self._tables(4096)
        self._bound = None  # (weakref to the cache, its room in positions, buffers_epoch()) once bound
        self._feature_ids: dict[tuple[int, ...], torch.Tensor] = {}
        # one plain row's arguments (forward_one): token, position, ancestor offset 0, count 1, its argmax
        self._one = (ctypes.c_int64 * 5)(0, 0, 0, 1, 0)
        self._one_at = ctypes.addressof(self._one)
        self._scratch_logits = torch.empty(1, self._m.vocab, dtype=torch.bfloat16)
        self._scratch_hidden = torch.empty(1, self._m.hidden, dtype=torch.bfloat16)  # spec_step_greedy's rows
        names = {b.type_name for b in blocks.values()}
        streamed = sum(blocks[n].nbytes if n in blocks else params[n].numel() * 2
                       for n in params if n.endswith("proj.weight")) + (
            blocks[lm_name].nbytes if lm_name in blocks else params[lm_name].numel() * 2)
        kind = f"{'/'.join(sorted(names))} blocks from {source}" if names else "bf16"
        int8 = any(b.type in X8 for b in blocks.values())
        if int8:  # the layers' code widths (the LM head's 8 bits aside): "4-bit", "4/5/8-bit" (a Q4_K_M file)
            bits = sorted({X8_BITS.get(b.type, 8) for n, b in blocks.items() if ".layers." in n} or {4})
            kind = f"{'/'.join(map(str, bits))}-bit weights x 8-bit activations ({kind})"
        self.info = StepInfo(f"{kind} ({streamed / 1e6:.0f} MB per token)", streamed, "int8" if int8 else "bf16")

    def set_screen(self, screen) -> None:
        """Greedy forwards (only_max) screen the LM head with `screen` (core.kernels.screen.Screen),
        which must belong to this step's split LM head (core.kernels.quant.split_q8)."""
        lm = self.blocks.get(self._lm_name)
        assert lm is not None and lm.type == SPLIT and screen.coef.shape[0] == lm.n // 16, "a screen needs the split head"
        self.screen, self._screen = screen, screen.struct()
        self._m.screen = ctypes.addressof(self._screen)
        mb = lm.nbytes * 288 // 544 / 1e6
        self.info = replace(self.info, weights=f"{self.info.weights}; greedy steps screen the LM head "
                                                f"({mb:.0f} of its {lm.nbytes / 1e6:.0f} MB, then the rows that can win)")

    @property
    def config(self):
        return self.hf.config

    def drop_bf16_layers(self) -> int:
        """Serve the transformers model's layer linears from the step's blocks too
        (invariant.BlockLinear) and free their bf16 copies, so the weights stay in RAM at the
        GGUF's size; returns the bytes freed. Prefill then dequantizes each weight per call, to
        the same bf16 values (the same answers); call it once the numerics are settled (a probe
        that fails falls back to fp32 on the bf16 weights)."""
        from core.kernels.invariant import BlockLinear

        freed = 0
        embedding = self.hf.get_input_embeddings().weight
        for name, module in self.hf.named_modules():
            b = self.blocks.get(f"{name}.weight")
            if b is None or not isinstance(module, torch.nn.Linear) or isinstance(module, BlockLinear):
                continue
            if module.weight.data_ptr() != embedding.data_ptr():  # a tied LM head's weight stays: the embedding
                freed += module.weight.numel() * module.weight.element_size()
            module.__class__ = BlockLinear
            module.blocks, module.wmat = b, native.wmat(blocks=b)
            module.weight = torch.nn.Parameter(module.weight.new_empty(0), requires_grad=False)
        _give_back_freed_memory()
        return freed

    def _tables(self, size: int) -> None:
        """cos / sin (size, head_dim) from the model's own rotary embedding (its bf16 values)."""
        emb = self.hf.get_input_embeddings().weight
        self._cos, self._sin = rotary_table(self.hf.model.rotary_emb, emb[:0], size)
        self._m.cos, self._m.sin, self._m.max_pos = self._cos.data_ptr(), self._sin.data_ptr(), size

    def _bind_cache(self, cache, need: int) -> None:
        """Room for `need` positions in every layer of `cache`, and its buffers' addresses in the
        step's layer table; read again only when the cache, its room or any buffer changed."""
        bound = self._bound
        if bound is not None and bound[0]() is cache and need <= bound[1] and bound[2] == buffers_epoch():
            return
        layers = cache.layers
        assert len(layers) == self._m.layers and all(isinstance(l, BufferedLayer) and l.is_initialized for l in layers), \
            "prefill the cache (core.decoding.forward.prefill) before native steps"
        for layer in layers:
            layer.reserve(need)
        for i, l in enumerate(layers):
            assert l._k.is_contiguous() and l._v.is_contiguous() and l._k.dtype is torch.bfloat16
            self._layers[i].kc, self._layers[i].vc = l._k.data_ptr(), l._v.data_ptr()
            self._layers[i].kv_head = l._k.stride(1)
        self._bound = (weakref.ref(cache), min(l._k.shape[-2] for l in layers), buffers_epoch())

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, committed: int, ancestors: torch.Tensor,
                counts: torch.Tensor, cache, feature_layers: tuple[int, ...] | None = None, only_max: bool = False,
                choices: torch.Tensor | None = None, at: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions (n,) int64; row i sees cache slots [0, committed) and committed +
        ancestors[i, :counts[i]] (root first, itself last) -> (features (n, F), logits (n, V) bf16).
        Row i's key and value go to slot `at` + i: at is the cache's length, committed unless given
        (core.decoding.batched gives committed 0 and each row its branch's slots as ancestors).
        Features: the last hidden state (after the final norm), or the fused layers
        `feature_layers` (transformers' output_hidden_states indices) for an EAGLE-3 head.
        only_max: the caller takes each row's argmax only (greedy); with a screen, logits that
        cannot be a row's maximum come back -inf (the argmax is the full head's, exactly). choices: an
        (n,) int64 tensor the call writes each row's argmax into (core.decoding.verify.greedy_tokens' kernel)."""
        n = tokens.shape[0]
        top = int(positions.max())
        tokens, positions = tokens.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        ancestors, counts = ancestors.to(torch.int64).contiguous(), counts.to(torch.int64).contiguous()
        return self._run(n, committed, top, tokens.data_ptr(), positions.data_ptr(), ancestors.data_ptr(),
                         ancestors.stride(0), counts.data_ptr(), cache, feature_layers, only_max,
                         None if choices is None else _choices_ptr(choices, n), None,
                         committed if at is None else at)

    def forward_one(self, token: int, committed: int, cache, feature_layers: tuple[int, ...] | None = None,
                    greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """A plain decoding step: `token` at position `committed` (the cache's length), as forward's one
        row (the same call) without building its argument tensors -> (features (1, F), logits (1, V),
        the row's argmax with `greedy`, else None). greedy: only_max, and the logits are a buffer the
        next call overwrites (the caller reads the argmax alone)."""
        one = self._one
        one[0], one[1] = token, committed
        at, size = self._one_at, ctypes.sizeof(ctypes.c_int64)
        features, logits = self._run(1, committed, committed, at, at + size, at + 2 * size, 1, at + 3 * size, cache,
                                     feature_layers, greedy, at + 4 * size if greedy else None,
                                     self._scratch_logits if greedy else None)
        return features, logits, (one[4] if greedy else None)

    def forward_rows(self, tokens: list[int], parents: list[int], depths: list[int], committed: int, cache,
                     feature_layers: tuple[int, ...] | None = None,
                     greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
        """A tree given as lists (topological order, parents[0] == -1; node i at position committed +
        depths[i], seeing its ancestors), as forward's rows with its arguments built on the host in
        one buffer -> (features (n, F), logits (n, V), each row's argmax with `greedy`, else None).
        greedy: only_max, and the logits are a buffer the next call overwrites."""
        n, width = len(tokens), max(depths) + 1
        buf, at, row = _tree_buffer(tokens, parents, depths, committed)
        if greedy and self._scratch_logits.shape[0] < n:
            self._scratch_logits = torch.empty(n, self._m.vocab, dtype=torch.bfloat16)
        features, logits = self._run(n, committed, committed + width - 1, at, at + row, at + 4 * row, width, at + 2 * row,
                                     cache, feature_layers, greedy, at + 3 * row if greedy else None,
                                     self._scratch_logits[:n] if greedy else None)
        return features, logits, (buf[3 * n:4 * n] if greedy else None)

    def spec_step_greedy(self, tokens: list[int], parents: list[int], depths: list[int], committed: int, cache,
                         head: HeadCall, head_cache) -> SpecStep:
        """A greedy speculative step in one native call (csrc/decode_step.c's spec_step_greedy): forward_rows
        (greedy) over a draft tree given as lists, the walk down it (core.decoding.verify.walk's path) and
        the head's catch-up on the accepted path with its proposal for the next root (head_step_top, from
        `head`: core.kernels.headstep.NativeHead.top_call on `head_cache`, room for the tree's rows). The
        same kernels in the same order, so the same bits as those calls one by one; the Python between
        them, which runs on cold caches after the forward, is what goes. The head reads the last hidden
        state (an EAGLE-1/2 head). The target cache keeps every row; the caller keeps the path (kv.keep)."""
        n, width = len(tokens), max(depths) + 1
        buf, at, row = _tree_buffer(tokens, parents, depths, committed, [0] * n + parents)  # then path, parents
        self._bind_rows(cache, committed, committed, n, committed + width - 1)
        if self._scratch_logits.shape[0] < n:
            self._scratch_logits = torch.empty(n, self._m.vocab, dtype=torch.bfloat16)
        if self._scratch_hidden.shape[0] < n:
            self._scratch_hidden = torch.empty(n, self._m.hidden, dtype=torch.bfloat16)
        seconds = (ctypes.c_double * 2)()
        length = native._library()[0].spec_step_greedy(
            ctypes.byref(self._m), at, at + row, n, committed, at + 4 * row, width, at + 2 * row,
            at + (5 + width) * row, self._scratch_hidden.data_ptr(), self._scratch_logits.data_ptr(), at + 3 * row,
            int(n <= self.screen_rows), at + (4 + width) * row, ctypes.addressof(seconds), torch.get_num_threads(),
            head.at, *head.args)
        if length < 1:
            raise StepError(f"the native step failed: {_ERRORS.get(length, length)}")
        for layer in cache.layers:
            layer.length = committed + n
        head_cache.length = head.at + length
        path = tuple(buf[(4 + width) * n:(4 + width) * n + length])
        bonus = buf[3 * n + path[-1]]
        return SpecStep(path, tuple([tokens[i] for i in path[1:]] + [bonus]), head.out[length - 1],
                        (head.vals[None], head.idx[None]), seconds[0], seconds[1])

    def _bind_rows(self, cache, committed: int, at: int, n: int, top: int) -> None:
        """Room for n new rows at slots at .. at + n - 1 of `cache` (its length: after every cached row) and a
        rotary table reaching position `top`."""
        assert at == cache.get_seq_length() and 0 <= committed <= at, "the new rows go after every cached one"
        if top >= self._m.max_pos:
            self._tables(max(2 * self._m.max_pos, top + 1))
        self._bind_cache(cache, at + n)

    def _run(self, n: int, committed: int, top: int, tokens: int, positions: int, ancestors: int, stride: int,
             counts: int, cache, feature_layers, only_max: bool, choices: int | None,
             logits: torch.Tensor | None, at: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """decode_step over n rows given by address (forward's contract); `top` is the largest position;
        the rows' keys and values go to slots at .. at + n - 1 (at: committed unless given)."""
        at = committed if at is None else at
        self._bind_rows(cache, committed, at, n, top)
        H = self._m.hidden
        hidden = torch.empty(n, H, dtype=torch.bfloat16)
        if logits is None:
            logits = torch.empty(n, self._m.vocab, dtype=torch.bfloat16)
        ids = feats = None
        if feature_layers is not None:
            feature_layers = tuple(feature_layers)
            ids = self._feature_ids.get(feature_layers)
            if ids is None:
                if max(feature_layers) >= self._m.layers or min(feature_layers) < 0:  # the last entry is transformers' normed one
                    raise StepError(f"feature layers {feature_layers} outside 0..{self._m.layers - 1}")
                ids = self._feature_ids[feature_layers] = torch.tensor(feature_layers, dtype=torch.int32)
            feats = torch.empty(n, len(feature_layers) * H, dtype=torch.bfloat16)
        code = native._library()[0].decode_step(
            ctypes.byref(self._m), tokens, positions, n, committed, at, ancestors, stride, counts,
            None if ids is None else ids.data_ptr(), 0 if ids is None else ids.shape[0],
            None if feats is None else feats.data_ptr(), hidden.data_ptr(), logits.data_ptr(), choices,
            int(only_max and n <= self.screen_rows), torch.get_num_threads())
        if code:
            raise StepError(f"the native step failed: {_ERRORS.get(code, code)}")
        for layer in cache.layers:
            layer.length = at + n
        return (hidden if feats is None else feats), logits


def _tree_buffer(tokens: list[int], parents: list[int], depths: list[int], committed: int,
                 tail: list[int] = ()) -> tuple[ctypes.Array, int, int]:
    """A tree's native arguments in one host buffer: tokens, positions, counts, n zeros (the choices), the
    ancestor lists (n, width: max depth + 1), then `tail` -> (the buffer, its address, one row of n
    int64s in bytes)."""
    anc = [node for row in ancestor_rows(parents, depths) for node in row]  # (n, width), row by row
    buf = (ctypes.c_int64 * (4 * len(tokens) + len(anc) + len(tail)))(
        *tokens, *[committed + d for d in depths], *[d + 1 for d in depths], *[0] * len(tokens), *anc, *tail)
    return buf, ctypes.addressof(buf), len(tokens) * ctypes.sizeof(ctypes.c_int64)


def _choices_ptr(choices: torch.Tensor, n: int) -> int:
    if not (choices.dtype is torch.int64 and choices.is_cpu and choices.is_contiguous() and choices.numel() == n):
        raise StepError(f"choices must be a contiguous CPU int64 tensor of {n} elements, got {choices.dtype} "
                        f"{tuple(choices.shape)}")
    return choices.data_ptr()


def screen_wanted() -> bool:
    """Greedy steps screen a Q8_0 LM head unless EAGLE_CHAT_SCREEN=0 (for measuring against the full head)."""
    return not switched_off(SCREEN_ENV)


def load_step(target, weights: str = "auto", calibrate=None) -> tuple[NativeStep | None, str]:
    """The native step for a loaded target (core.models.LoadedModel), or None, and one line
    saying what serves decoding steps and why. weights (core.config.WEIGHTS): "w4a8" the GGUF's
    own blocks times 8-bit activations (csrc/gemm_x8.c; its LM head the file's Q8_0 embedding),
    "q4" the same blocks rebuilt to bf16 (bit-identical to "bf16"), "bf16" the model's bf16
    tensors; "auto" is w4a8 where the target came from a GGUF it can read, else bf16 (with the
    reason). "w4a8" and "q4" are errors where they cannot serve. calibrate(step, target): the
    hidden states a w4a8 LM head's screen is fitted on where no fitted screen is cached
    (core.decoding.batched.calibration_hidden; core.kernels.screen.load_or_build); None: no screen."""
    assert weights in WEIGHTS, weights
    reason = unsupported(target.model)
    if reason:
        if weights in ("q4", "w4a8"):
            raise StepError(f"--weights {weights} needs the native step, which cannot run here: {reason}")
        return None, f"transformers forward ({reason})"
    note = ""
    blocks, screened = {}, False
    if weights != "bf16":
        from core.kernels.hugepages import Arena
        from core.kernels.quant import REPACKED, QuantWeightError, load_llama_blocks, pack_x8, split_q8, tile_blocks

        if target.gguf is None:
            if weights != "auto":
                raise StepError(f"--weights {weights} reads a GGUF's blocks, and this model was not loaded from one")
        else:
            try:  # q4 promises the bf16 path's bits: only the file's own Q4_0 / Q4_1 / Q8_0 blocks serve it
                # q4: layers only: the embedding / tied LM head stays bf16 (on its Q8_0 blocks rebuilt to bf16
                # the step measured no faster, 10.5-10.8 against 10.6-11.0 ms); w4a8: the LM head too, below
                layer = tile_blocks if weights == "q4" else pack_x8  # each layer tensor as it is read, then
                arena = Arena()  # placed side by side in huge-page memory (core.kernels.hugepages)
                found = load_llama_blocks(target.gguf, target.model.config, requantize=weights != "q4",
                                          prepare=lambda name, b: arena.place_blocks(layer(b)) if ".layers." in name
                                          else b)
                if moved := Counter(b.source for b in found.values() if b.source):
                    note = (f" ({sum(moved.values())} tensors of other types: " + ", ".join(
                        f"{k} ({v}) {REPACKED.get(k, 'requantized to Q8_0')}" for k, v in sorted(moved.items())) + ")")
                blocks = {k: v for k, v in found.items() if ".layers." in k}
                if weights != "q4":  # the file's own (or its tied embedding's) Q8_0 blocks
                    lm = found.get("lm_head.weight", found["model.embed_tokens.weight"])
                    screened = calibrate is not None and screen_wanted() and lm.type == 8 and lm.n % 16 == 0
                    blocks["lm_head.weight"] = arena.place_blocks(split_q8(lm) if screened else pack_x8(lm))
            except QuantWeightError as e:
                if weights != "auto" or getattr(target, "lean", False):  # lean: no bf16 layer weights to fall back on
                    raise
                note = f" (bf16 weights: {e})"
    step = NativeStep(target.model, blocks, target.gguf.name if blocks else "")
    if getattr(target, "lean", False):  # no bf16 layer weights to fall back on: transformers' linears read the
        step.drop_bf16_layers()         # blocks from here on (the probe and the screen's answers included)
        note += " (read from the file alone: its fp32 copy would not fit here, so no bf16 copy of its layers)"
    if screened:  # greedy steps then read about half of the LM head (core.kernels.screen)
        from core.kernels import screen

        try:  # fitting needs the model to answer a few prompts through its chat template
            step.set_screen(screen.load_or_build(lm, target.gguf, lambda: calibrate(step, target)))
        except (ValueError, RuntimeError, TypeError, KeyError, OSError) as e:
            note += f" (greedy steps read the whole LM head: its screen could not be fitted: {e})"
    return step, f"native decode step, {step.info.weights}{note}"

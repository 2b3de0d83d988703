"""The batch-invariance probe: does a draft tree verify bit-identically to plain decoding here?

At load, on the loaded target at its real shapes, it prefills a random context that ends
just before a 64-position block boundary (so tree rows straddle it), verifies one random
tree with siblings, then replays every root-to-leaf path as plain one-token steps and
compares each node's logits bit for bit. The verdict depends on the kernels the CPU and
torch pick, so it is cached per machine, model, dtype, attention and thread count, and per
version of what computes it (torch, transformers, this project, the C kernels' source): an
upgrade checks again. A cached verdict costs nothing at the next start.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import platform
import re
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from core.decoding import cache as kv
from core.kernels import native
from core.decoding.forward import forward_tree, plain_logits, prefill
from core.models import cache_home, write_atomic
from core.decoding.tree import tree_from_parents


@dataclass(frozen=True)
class ProbeResult:
    exact: bool
    reason: str        # one line: what was compared, or the first difference found
    seconds: float     # time the probe took when it ran
    checked_at: str    # UTC time of the run (cached verdicts keep it)
    cached: bool = False


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


@functools.cache
def project_version() -> str:
    """eagle-chat's version: pyproject.toml's in a source checkout (an editable install's metadata
    keeps the version it was installed at), else the installed package's."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        text = pyproject.read_text()
    except OSError:
        text = ""
    found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    if found and re.search(r'^name\s*=\s*"eagle-chat"', text, re.M):
        return found.group(1)
    try:
        return importlib.metadata.version("eagle-chat")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def probe_key(model, dtype: torch.dtype, attention: str, device) -> str:
    """`model`: the transformers model, or the native step (core.kernels.step) that serves it."""
    import transformers

    c = model.config
    step = getattr(model, "info", None)  # a NativeStep: its weights decide its GEMMs' inputs
    parts = [f"step {step.weights}" if step else "transformers",
             _cpu_name() if torch.device(device).type == "cpu" else torch.cuda.get_device_name(device),
             torch.__version__, c.model_type, str(c.hidden_size), str(c.num_hidden_layers), str(c.vocab_size),
             str(getattr(c, "intermediate_size", "")), str(dtype), attention, f"threads{torch.get_num_threads()}",
             native.status().describe(), f"kernels {native.source_digest()}", f"transformers {transformers.__version__}",
             f"eagle-chat {project_version()}"]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def _probe_tree(vocab: int, gen: torch.Generator, device):
    """A 9-node tree: root -> 3 children; two chains below them (depths up to 4)."""
    parents = [-1, 0, 0, 0, 1, 1, 4, 2, 7]
    tokens = torch.randint(0, vocab, (len(parents),), generator=gen).tolist()
    return tree_from_parents(tokens, parents, device)


def _preorder(parents: list[int]) -> list[int]:
    children = {i: [] for i in range(len(parents))}
    for i, p in enumerate(parents[1:], start=1):
        children[p].append(i)
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    return order


def probe_context() -> int:
    """The probe's context length: 62 tokens, or, where rows with at least N keys attend on AMX tiles
    (csrc/attention_amx.c), N - 2, so the tree's rows (depths 0-4) straddle N: both kernels in one call."""
    st = native.status()
    return max(62, st.amx_attention_from - 2) if st.amx_attention else 62


def run_probe(model, context: int = 62, seed: int = 0) -> ProbeResult:
    """Compare tree-verified logits with plain-step logits for every node of a random tree."""
    t0 = time.perf_counter()
    device = getattr(model, "hf", model).get_input_embeddings().weight.device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (context,), generator=gen).to(device)
    tree = _probe_tree(vocab, gen, device)
    cache = kv.new_cache(model)
    reason = None
    with torch.inference_mode():
        prefill(model, ids, cache)
        _, tree_logits = forward_tree(model, tree, cache, context)
        kv.keep(cache, context, [])
        # every node once, in depth-first order: cropping the cache to the node's depth leaves
        # exactly its ancestors in it (the previous node's path shares them)
        for node in _preorder(tree.parents.tolist()):
            depth = int(tree.depths[node])
            kv.keep(cache, context + depth, [])
            logits = plain_logits(model, int(tree.tokens[node]), cache, context + depth)
            if reason is None and not torch.equal(logits, tree_logits[node]):
                diff = float((logits.float() - tree_logits[node].float()).abs().max())
                reason = f"tree row {node} (depth {depth}) differs from its plain step by up to {diff:.3g} in the logits"
    seconds = time.perf_counter() - t0
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if reason is None:
        return ProbeResult(True, f"{tree.size} tree rows bit-identical to plain steps", seconds, now)
    return ProbeResult(False, reason, seconds, now)


def probe(model, dtype: torch.dtype, attention: str, device, refresh: bool = False) -> ProbeResult:
    """The cached verdict for this machine/model/numerics, running the probe if there is none."""
    path = cache_home() / "probe" / f"{probe_key(model, dtype, attention, device)}.json"
    if not refresh and path.is_file():
        try:
            return ProbeResult(**(json.loads(path.read_text()) | {"cached": True}))
        except (ValueError, TypeError):
            pass  # unreadable: probe again
    result = run_probe(model, context=probe_context())
    try:
        write_atomic(path, json.dumps(asdict(result) | {"cached": False}))
    except OSError:
        pass  # a read-only cache only costs the probe again next time
    return result

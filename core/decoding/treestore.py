"""Where the default draft tree comes from: tuned trees on disk, read and written atomically.

Below both the engine (which reads the default tree at load) and core.autotune (which
measures and writes it), so neither imports the other. A tree is looked up in order:
  1. tuned on this machine: `~/.cache/eagle-chat/autotune/<key>.json`, keyed by model, head,
     device, dtype, attention, draft vocabulary, thread count and OpenMP wait policy;
  2. shipped: `tree.<gemm>.json` beside the head where this machine's decoding GEMM
     (`engine_gemm`: "amx", "avx512", "avx2", "amx-w4a8", "avx512-w4a8", "avx2-w4a8") has its own tuned tree, else `tree.json`
     (tuned where the head was trained). A verified row costs about 1.5 ms with the AVX-512
     GEMM and almost nothing on AMX tiles, so the fastest tree differs between them;
  3. built in: `TreeConfig()`.
`TreeChoice.origin` says which, so the UI can show it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from core import threads
from core.kernels import native
from core.config import TreeConfig
from core.decoding.head import HeadLoadError
from core.models import cache_home, write_atomic

BUILT_IN = "built-in default"  # TreeChoice.origin when neither a tuned nor a shipped tree exists
TREE_FILE = "tree.json"  # beside a head: the tree tuned on the machine that trained it


class TreeFileError(HeadLoadError):
    """A tree.json beside a head is unreadable; the message names the file."""


@dataclass(frozen=True)
class TreeChoice:
    tree: TreeConfig
    origin: str  # "tuned on this machine at ...", "shipped with the head", "built-in default"


def head_fingerprint(head: torch.nn.Module) -> str:
    first = next(head.parameters()).detach().float().flatten()[:4096].cpu().numpy().tobytes()
    return hashlib.sha1(first).hexdigest()[:12]


def profile_key(engine) -> str:
    vocab = engine.drafter.vocab
    parts = [engine.target.name, head_fingerprint(engine.head), str(engine.target.device),
             str(engine.target.dtype), engine.numerics.attention, f"threads{torch.get_num_threads()}",
             f"wait:{threads.policy().wait}", native.status().describe(),
             str(None if vocab is None else vocab.numel()),
             engine.step.info.weights if engine.step else "transformers forward"]  # what a verified row costs
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def tuned_path(engine) -> Path:
    return cache_home() / "autotune" / f"{profile_key(engine)}.json"


def save_tuned(engine, tree: TreeConfig, report: dict) -> Path:
    path = tuned_path(engine)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    write_atomic(path, json.dumps({"choice": asdict(tree), "tuned_at": stamp} | report, indent=1))
    return path


def tuned_tree(engine) -> TreeChoice | None:
    """The tree chosen earlier for this engine's key, if any (an unreadable file counts as none)."""
    if not engine.has_head:
        return None
    path = tuned_path(engine)
    try:
        data = json.loads(path.read_text())
        return TreeChoice(TreeConfig(**data["choice"]), f"tuned on this machine at {data.get('tuned_at', '?')}")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def engine_gemm(engine) -> str | None:
    """The decoding GEMM this engine's target runs on ("amx", "avx512"; "amx-w4a8", "avx512-w4a8"
    on 8-bit activations, where a verified row costs more than on AMX bf16 tiles), None off the CPU."""
    if not str(engine.target.device).startswith("cpu"):
        return None
    kind = native.gemm_kind()
    step = getattr(engine, "step", None)
    return f"{kind}-w4a8" if kind and step is not None and step.info.activations == "int8" else kind


def shipped_tree_path(head_folder, gemm: str | None = None) -> Path:
    """The shipped tree file that applies to a machine with this GEMM: `tree.<gemm>.json`
    where the head has one, else `tree.json` (which may not exist)."""
    folder = Path(head_folder)
    special = folder / f"{Path(TREE_FILE).stem}.{gemm}.json"
    return special if gemm and special.is_file() else folder / TREE_FILE


def _read_tree(path: Path) -> TreeConfig | None:
    if not path.is_file():
        return None
    try:
        return TreeConfig(**json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise TreeFileError(f"{path} is not a valid tree setting: {e}") from e


def shipped_tree(head_folder, gemm: str | None = None) -> TreeConfig | None:
    """The tree shipped beside the head for this GEMM (`shipped_tree_path`), if any."""
    return _read_tree(shipped_tree_path(head_folder, gemm))


def default_tree(engine, head_folder) -> TreeChoice:
    tuned = tuned_tree(engine)
    if tuned is not None:
        return tuned
    if head_folder:
        gemm = engine_gemm(engine)
        path = shipped_tree_path(head_folder, gemm)
        shipped = _read_tree(path)
        if shipped is not None:
            return TreeChoice(shipped, "shipped with the head" if path.name == TREE_FILE
                              else f"shipped with the head for the {gemm} GEMM ({path.name})")
    return TreeChoice(TreeConfig(), BUILT_IN)

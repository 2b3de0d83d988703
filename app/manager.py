"""The model manager: which engine serves, downloading targets and heads with byte-level
progress, and switching models (after the answer being generated, one model in memory at a
time).

Loading itself is core's (`Engine.load` via the injected `loader`); this module only
orchestrates and reports.
"""

from __future__ import annotations

import gc
import io
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from tqdm import tqdm as base_tqdm

from app.remote import RemoteBackend, ServerInfo
from app.state import ModelChoice, remember
from core import threads
from core.models import (CATALOGUE, EMBEDDED, EMBEDDED_HUB_ID, CatalogueEntry, ModelLoadError, catalogue_entry,
                         download, is_gguf_file, names_gguf)

CUSTOM = "Custom (hub id, local folder or .gguf file)"
POLL_S = 0.2


class ByteRecorder:
    """A thread-safe record of the byte progress bars huggingface_hub opens.

    snapshot_download updates its byte bars from worker threads, so the UI cannot rely on
    tqdm tracking; it polls `snapshot()` from the event thread instead.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bars: list = []

    def tqdm_class(self):
        recorder = self

        class RecordingTqdm(base_tqdm):
            # a plain tqdm subclass: huggingface_hub passes it no `name`/`disable` and we stay silent
            def __init__(self, *args, **kwargs):
                kwargs.setdefault("file", io.StringIO())
                kwargs["disable"] = False
                super().__init__(*args, **kwargs)
                if self.unit == "B":
                    with recorder._lock:
                        recorder._bars.append(self)

        return RecordingTqdm

    def snapshot(self) -> tuple[int, int]:
        """(bytes done, bytes total) of the byte bar that has advanced furthest."""
        with self._lock:
            bars = [(int(b.n), int(b.total or 0)) for b in self._bars]
        return max(bars, default=(0, 0))


def download_with_progress(repo_id: str, on_progress, *, endpoint: str | None = None,
                           allow_patterns: list[str] | None = None) -> Path:
    """core.models.download in a worker thread, reporting (done, total) bytes every POLL_S.

    Raises ModelLoadError (gated, missing, offline, disk full) from the worker unchanged.
    """
    recorder = ByteRecorder()
    result: dict = {}

    def work():
        try:
            result["path"] = download(repo_id, allow_patterns=allow_patterns, endpoint=endpoint,
                                      tqdm_class=recorder.tqdm_class())
        except BaseException as e:  # handed to the caller's thread below
            result["error"] = e

    worker = threading.Thread(target=work, name=f"download {repo_id}", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(POLL_S)
        on_progress(*recorder.snapshot())
    on_progress(*recorder.snapshot())
    if "error" in result:
        raise result["error"]
    return result["path"]


def is_hub_id(name: str | None) -> bool:
    if not name or name in ("default", EMBEDDED, EMBEDDED_HUB_ID):
        return False
    return not Path(name).expanduser().exists() and not name.startswith((".", "/", "~")) and name.count("/") == 1


def is_cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def check_disk_space(repo_id: str) -> None:
    """Refuse at once, with numbers, a catalogue download that cannot fit on the disk.

    Only catalogue targets have a known size (16-bit checkpoints, 2 bytes per parameter);
    anything else relies on core.models.download's disk-full error.
    """
    from huggingface_hub import constants

    entry = catalogue_entry(repo_id)
    if entry is None or entry.target == EMBEDDED or is_cached(repo_id):
        return
    folder = Path(constants.HF_HUB_CACHE)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    need, free = entry.params_billion * 2e9, shutil.disk_usage(folder).free
    if free < need * 1.05:
        raise ModelLoadError(f"not enough disk space for {repo_id}: about {need / 1e9:.0f} GB needed, "
                             f"{free / 1e9:.1f} GB free under {folder}. Free some space or point HF_HOME "
                             "at a bigger disk, then retry (a partial download resumes)")


def catalogue_frame() -> pd.DataFrame:
    rows = []
    for e in CATALOGUE:
        embedded = e.target == EMBEDDED
        rows.append({"model": e.key, "target": EMBEDDED_HUB_ID if embedded else e.target,
                     "EAGLE head": "ours (assets/)" if embedded else e.head,
                     "params": f"{e.params_billion:g} B",
                     "memory 16-bit": f"{e.memory_gb(False):g} GB", "memory 4-bit": f"{e.memory_gb(True):g} GB",
                     "gated": "yes (token)" if e.gated else "no",
                     "downloaded": "built in" if embedded else ("yes" if is_cached(e.target) else "no")})
    return pd.DataFrame(rows)


def catalogue_choice(key: str) -> CatalogueEntry | None:
    return next((e for e in CATALOGUE if e.key == key), None)


@dataclass(frozen=True)
class Request:
    """A model asked for in the manager tab, before anything is fetched or loaded."""

    choice: ModelChoice

    @classmethod
    def parse(cls, key: str, custom_target: str, custom_head: str, dtype: str, device: str,
              four_bit: bool) -> "Request":
        entry = catalogue_choice(key)
        if entry is not None:
            head = "default" if entry.target == EMBEDDED else entry.head
            return cls(ModelChoice(entry.target, head, dtype, device, bool(four_bit)))
        target = (custom_target or "").strip()
        if not target:
            raise ModelLoadError("enter a hub id (owner/name), a local folder or a .gguf file for the target model")
        head = (custom_head or "").strip() or None
        if head is not None and names_gguf(head):
            raise ModelLoadError(f"{head} is a GGUF model file: the head field takes an EAGLE head's folder or hub "
                                 "repo, and a GGUF file goes in the target field")
        return cls(ModelChoice(target, head, dtype, device, bool(four_bit)))

    def missing_folders(self) -> list[str]:
        """Local folders (or the target's .gguf file) this request names that do not exist (checked before
        anything is unloaded)."""
        named = [r for r in (self.choice.model, self.choice.head)
                 if r and r not in ("default", EMBEDDED, EMBEDDED_HUB_ID) and not is_hub_id(r)]
        return [r for r in named if not Path(r).expanduser().is_dir()
                and not (r == self.choice.model and is_gguf_file(r) and Path(r).expanduser().is_file())]

    def hub_ids(self) -> list[str]:
        """Repos this request would download (local folders and the embedded model need none)."""
        return [r for r in (self.choice.model, self.choice.head) if is_hub_id(r)]


class ModelManager:
    """Owns the serving engine. `loader` is `Engine.load` (injected so tests can count loads).

    `lane` is the one generation lane: answers hold it while they generate, and a switch takes
    it, so one model at a time is in memory and no answer runs on a model being replaced.
    """

    def __init__(self, loader, choice: ModelChoice, engine=None, *, endpoint: str | None = None,
                 backend: RemoteBackend | None = None):
        self.loader = loader
        self.endpoint = endpoint if endpoint is not None else os.environ.get("HF_ENDPOINT")
        self.choice = choice
        self.backend = backend  # chat through this server instead of the engine; no model is loaded for it
        self.engine = engine if engine is not None or backend is not None else self._load(choice)
        self.lane = threading.Lock()
        self.last_speed = 0.0  # the engine's tokens/s in the last local answer, for the header

    def _load(self, choice: ModelChoice):
        # on the one thread every step runs on too (core.threads.on_engine_thread says why)
        return threads.on_engine_thread(self.loader, model=choice.model, head=choice.head, dtype=choice.dtype,
                                        attention=choice.attention, device=choice.device,
                                        load_in_4bit=choice.load_in_4bit, weights=choice.weights)

    def connect(self, url: str, api_key: str | None = None) -> ServerInfo:
        """Chat through the OpenAI-compatible server at `url` from now on (raises RemoteError).
        A local engine stays loaded, so going back to it is instant; an answer already streaming
        from a previous server finishes on it (its client is left to the garbage collector)."""
        backend = RemoteBackend(url, api_key=api_key)
        info = backend.connect()
        self.backend = backend
        return info

    def use_local(self):
        """Chat with the local engine again, loading `choice` first if none is loaded (raises
        what the loader raises, and then the remote backend stays in use)."""
        with self.lane:
            if self.engine is None:
                self.engine = self._load(self.choice)
            self.backend = None
            return self.engine

    def download(self, request: Request, on_progress) -> list[Path]:
        """Fetch (or resume) every hub repo of the request; on_progress(repo, done, total)."""
        paths = []
        for repo in request.hub_ids():
            check_disk_space(repo)
        for repo in request.hub_ids():
            paths.append(download_with_progress(repo, lambda n, t, r=repo: on_progress(r, n, t),
                                                endpoint=self.endpoint))
        return paths

    def switch(self, request: Request):
        """Wait for the lane, free the current model, load the requested one.

        If loading fails, the previous model is loaded again (from its local copy) and the error
        propagates; answers waiting in the queue then run on the previous model.
        """
        with self.lane:
            previous, self.engine = self.engine, None
            had_engine = previous is not None  # False when started with only a remote backend
            del previous  # the last reference: no answer is running while we hold the lane
            free_memory()
            try:
                self.engine = self._load(request.choice)
            except BaseException:
                if had_engine:
                    self.engine = self._load(self.choice)
                raise
            self.choice = request.choice
            self.backend = None  # loading a model means chatting with it
            remember(self.choice)
            return self.engine

    def status_markdown(self) -> str:
        """The header's one plain line: the model, whether answers are exact, and speed."""
        if self.backend is not None:
            info = self.backend.info
            return f"**Chatting through** {info.url} — {info.kind} server, model `{info.model}`"
        e = self.engine
        if e is None:
            return f"**Switching models**: loading {self.choice.describe()} …"
        badge = ("✓ **exact**: the same text as the model alone" if e.numerics.exact
                 else "exactness not checked" if e.numerics.probe is None
                 else "**exactness not guaranteed** here (see the details)")
        head = ("EAGLE speculation available" if e.has_head
                else "no EAGLE head: speculation copies from the conversation (context lookup)")
        speed = f" · last answer {self.last_speed:.0f} tok/s" if self.last_speed else ""
        return f"**Serving** `{self.choice.model}` · {badge} · {head}{speed}"

    def details_markdown(self) -> str:
        """The technical details behind the header (a collapsed section)."""
        if self.backend is not None or self.engine is None:
            return self.status_markdown()
        e = self.engine
        return (f"**Model:** {self.choice.describe()} · context {e.max_context} tokens\n\n"
                f"**Numerics:** {e.numerics.describe()}\n\n"
                f"**CPU threads:** {threads.current()} now; {threads.POLICY.describe()}")

    def tree_markdown(self) -> str:
        """The default draft tree and where it came from (tuned here, shipped, built in)."""
        e = self.engine
        if self.backend is not None or e is None:
            return ""
        t, origin = e.default_tree, getattr(e, "tree_origin", "")
        if not e.has_head:  # context lookup alone (core.decoding.engine.lookup_alone)
            return (f"No draft tree: this model has no EAGLE head. Each step copies up to {t.lookup} tokens from "
                    "earlier text where it repeats and verifies them with the next token; plain steps elsewhere")
        shape = f"Default tree: depth {t.depth}, top-k {t.top_k}, {t.total_tokens} nodes"
        if t.lookup:
            shape += f", plus up to {t.lookup} tokens copied from earlier text when it repeats"
            if (beside := t.with_chain().total_tokens) < t.total_tokens:
                shape += f" (then {beside} nodes)"
        if t.long_context:  # TreeConfig.at: every tree row attends to the whole chat
            shape += "; in long chats " + ", ".join(
                f"plain decoding from {c:,} tokens (chat answers speculate there while it measures faster)"
                if d == 0 else f"{n} nodes from {c:,} tokens" if d >= t.depth
                else f"depth {d} and {n} nodes from {c:,} tokens" for c, d, n in t.long_context)
        if t.plain_from_temperature:  # TreeConfig.speculates_hot: measured slower than plain this hot
            shape += (f"; plain decoding when sampling at temperature {t.plain_from_temperature:g} or above "
                      "(chat answers start plain there and speculate while it measures faster)")
        if t.row_floor:  # the floor follows what a verified row costs now
            from core.decoding import rowcost

            shape += (f"; greedy steps verify only drafts likely enough to pay for their row at the cost measured "
                      f"while answering (now {rowcost.floor(e.row_costs):.0%} and up)")
        return f"{shape} · {origin}" if origin else shape


def free_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def format_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def progress_text(repo: str, done: int, total: int, started: float) -> str:
    rate = done / max(time.monotonic() - started, 1e-6)
    return f"{repo}: {format_bytes(done)} / {format_bytes(total)} ({format_bytes(int(rate))}/s)"

"""Handlers of the Models tab: download (with byte progress) and switch, and who may use them.

A failed download or load shows its reason in the result line and a toast; the catalogue
table keeps its content (see app.errors).
"""

from __future__ import annotations

import time

import gradio as gr

from app.controls import CONTROLS, control_updates
from app.errors import UserError, fault, plain_reason, refuse, user_error
from app.manager import Request, catalogue_frame, progress_text
from core.config import ConfigError
from core.decoding.head import HeadLoadError
from core.models import ModelLoadError, is_gguf_file

# loading can also fail deeper (CUDA out of memory, a missing bitsandbytes, a corrupt file)
LOAD_ERRORS = (ConfigError, ModelLoadError, HeadLoadError, RuntimeError, OSError, ValueError, ImportError)
LOCKED = ("Model downloads and switching are disabled for visitors through the public link while the app "
          "has no password (restart it with --auth USER:PASS to allow them).")
# model, dtype, device, 4-bit, custom target, custom head, Download, Download & switch,
# remote backend URL, API key, Connect, Use local engine
MANAGED_CONTROLS = 12


class ModelHandlers:
    """Mixed into app.session.Handlers, which provides `manager` and `access`."""

    def models_access(self, request) -> tuple:
        """Page-load updates: the lock notice, and the tab's controls enabled or not, for this visitor."""
        allowed = self.access.can_manage_models(request)
        return (gr.update(visible=not allowed),) + (gr.update(interactive=allowed),) * MANAGED_CONTROLS

    def _request(self, key, target, head, dtype, device, four_bit, request) -> Request:
        if not self.access.can_manage_models(request):
            raise UserError(LOCKED)
        try:
            model = Request.parse(key, target, head, dtype, device, four_bit)
        except ModelLoadError as e:
            raise UserError(str(e)) from e
        if missing := model.missing_folders():
            raise UserError(f"There is no folder {', '.join(f'`{m}`' for m in missing)} on this machine (a local "
                            "path is read where the app runs). Check the path, or give a hub id as owner/name "
                            "(or, for the target, a .gguf file). "
                            "Nothing was changed: the current model keeps serving.")
        return model

    def _download(self, model: Request, progress) -> None:
        started = time.monotonic()

        def report(repo, done, total):
            if total:
                progress((done, total), desc=progress_text(repo, done, total, started), unit="B")

        try:
            self.manager.download(model, report)
        except ModelLoadError as e:
            raise UserError(f"Download failed: {e}. The current model keeps serving.") from e

    def _after_failed_load(self) -> str:
        backend = self.manager.backend
        if backend is not None:
            return f"The chat still goes to {backend.url}."
        return "The previous model is serving again."

    @staticmethod
    def _guarded(work, n_outputs: int):
        """work() -> its outputs, or, on a problem, the message first and every other output kept."""
        try:
            return work()
        except UserError as e:
            return refuse(user_error(str(e)), n_outputs, 0)
        except Exception as e:  # a bug
            return refuse(fault(e), n_outputs, 0)

    def download(self, key, target, head, dtype, device, four_bit, progress=gr.Progress(),
                 request: gr.Request = None):
        def work():
            model = self._request(key, target, head, dtype, device, four_bit, request)
            if not model.hub_ids():
                return "Nothing to download: this model is built in or already in a local folder.", catalogue_frame()
            self._download(model, progress)
            return f"Downloaded {', '.join(f'`{r}`' for r in model.hub_ids())}.", catalogue_frame()

        return self._guarded(work, 2)

    def load(self, key, target, head, dtype, device, four_bit, progress=gr.Progress(),
             request: gr.Request = None):
        """Download & switch; outputs: result, status, catalogue, tree origin, app.controls.CONTROLS."""
        def work():
            model = self._request(key, target, head, dtype, device, four_bit, request)
            self._download(model, progress)
            first = " (a .gguf file's first load converts it once, ~5 s per 100 MB of file here)" if \
                is_gguf_file(model.choice.model) else ""
            progress(None, desc=f"Waiting for the answer being generated, then loading {model.choice.model}{first} …")
            try:
                engine = self.manager.switch(model)
            except LOAD_ERRORS as e:
                raise UserError(f"Loading failed: {plain_reason(e)}. {self._after_failed_load()}") from e
            note = "" if engine.has_head else (" This model has no EAGLE head: speculation copies drafts from the "
                                               "conversation where it repeats (context lookup).")
            return (f"Now serving {model.choice.describe()}. Numerics: {engine.numerics.describe()}.{note}",
                    self.manager.status_markdown(), catalogue_frame(), self.manager.tree_markdown(),
                    *control_updates(self.manager))

        return self._guarded(work, 4 + len(CONTROLS))

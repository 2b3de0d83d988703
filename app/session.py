"""Event handlers behind the UI: chat, regenerate, stop, side by side, and the model manager.

Each handler parses the controls, asks the engine for a stream of step events and renders
them with app.chat; errors become gr.Error messages and never lose the conversation.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import gradio as gr

from app.chat import AnswerView, compare_markdown, empty_frame, engine_messages, trim_to_context
from app.manager import ModelManager, Request, catalogue_frame, progress_text
from app.state import Access, generation_config
from core.config import ConfigError
from core.engine import EngineError
from core.head import HeadLoadError
from core.models import ModelLoadError

USER_ERRORS = (ConfigError, EngineError, ModelLoadError, HeadLoadError)
# loading can also fail deeper (CUDA out of memory, a missing bitsandbytes, a corrupt file)
LOAD_ERRORS = (*USER_ERRORS, RuntimeError, OSError, ValueError, ImportError)
NO_HEAD = "No EAGLE head is loaded for this model, so this answer used plain decoding."


class StopFlag(threading.Event):
    """Set by Stop or Clear (from outside the queue); read by the streaming handler each step."""

    clear_chat = False

    def reset(self) -> None:
        self.clear_chat = False
        self.clear()


def _session(request: gr.Request | None) -> str:
    return getattr(request, "session_hash", None) or "local"


class Handlers:
    def __init__(self, manager: ModelManager, access: Access):
        self.manager = manager
        self.access = access
        self._stops: dict[str, StopFlag] = {}

    # ---- stop -------------------------------------------------------------------------
    def _stop_flag(self, request) -> StopFlag:
        return self._stops.setdefault(_session(request), StopFlag())

    def stop(self, request: gr.Request):
        """Runs outside the queue; the streaming handler sees the flag after the current step
        and closes the engine's generator, which stops decoding at once."""
        self._stop_flag(request).set()

    # ---- chat -------------------------------------------------------------------------
    @staticmethod
    def _config(settings: tuple):
        temperature, top_p, max_new, spec, depth, top_k, tree_size = settings
        try:
            return generation_config(max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                                     speculative=spec, depth=depth, top_k=top_k, tree_size=tree_size)
        except ConfigError as e:
            raise gr.Error(f"Invalid setting: {e}") from e

    @staticmethod
    def _prompt(engine, turns, system, cfg, notices: list[str]) -> list[dict]:
        """The chat-template messages for this answer, oldest turns trimmed to fit the context."""
        try:
            msgs, dropped = trim_to_context(engine_messages(turns, system), engine.count_tokens,
                                            engine.max_context, cfg.max_new_tokens)
            too_long = engine.count_tokens(msgs) >= engine.max_context
        except (*USER_ERRORS, ValueError) as e:  # e.g. a tokenizer without a chat template
            raise gr.Error(f"Cannot build the prompt: {e}") from e
        if dropped:
            notices.append(f"Note: the conversation no longer fits the model's context ({engine.max_context} "
                           f"tokens): the oldest {dropped} exchange(s) were left out of the prompt.")
            gr.Warning(notices[-1])
        if too_long:
            raise gr.Error(f"This message is longer than the model's whole context ({engine.max_context} "
                           "tokens); shorten it.")
        return msgs

    def respond(self, message, history, system, temperature, top_p, max_new, spec, depth, top_k,
                tree_size, highlight, request: gr.Request):
        message = (message or "").strip()
        if not message:
            raise gr.Error("Type a message first.")
        cfg = self._config((temperature, top_p, max_new, spec, depth, top_k, tree_size))
        turns = list(history or []) + [{"role": "user", "content": message}]
        yield from self._answer(list(history or []), turns, system, cfg, highlight, request)

    def regenerate(self, history, system, temperature, top_p, max_new, spec, depth, top_k,
                   tree_size, highlight, request: gr.Request):
        history = list(history or [])
        users = [i for i, m in enumerate(history) if m["role"] == "user"]
        if not users:
            raise gr.Error("Nothing to regenerate yet: send a message first.")
        cfg = self._config((temperature, top_p, max_new, spec, depth, top_k, tree_size))
        yield from self._answer(history, history[:users[-1] + 1], system, cfg, highlight, request)

    def clear(self, request: gr.Request):
        """Empty the chat; an answer still streaming stops and ends by showing the empty chat."""
        stop = self._stop_flag(request)
        stop.clear_chat = True
        stop.set()
        return self.cleared()

    @staticmethod
    def cleared():
        return [], [], "", empty_frame(), "", {}, "", ""

    def _answer(self, before, turns, system, cfg, highlight, request):
        """Stream one answer to `turns`; on a failure before the first token, restore `before`.

        Yields (chatbot, history, textbox, chart, stats, stats json, token view, notice).
        """
        engine = self.manager.engine
        notices = []
        if cfg.speculative and not engine.has_head:
            cfg = replace(cfg, speculative=False)
            notices.append(NO_HEAD)
        msgs = self._prompt(engine, turns, system, cfg, notices)
        view = AnswerView("speculative" if cfg.speculative else "plain")
        stop = self._stop_flag(request)
        stop.reset()
        shown = turns + [{"role": "assistant", "content": ""}]
        y_max = cfg.tree.depth + 1 if cfg.speculative else 2
        yield self._render(shown, view, highlight, notices, y_max, clear_box=True)
        gen = engine.generate(msgs, cfg)
        try:
            for ev in gen:
                view.add(ev)
                shown[-1] = {"role": "assistant", "content": view.text}
                if stop.is_set():
                    view.stopped = True
                    break
                yield self._render(shown, view, highlight, notices, y_max)
        except USER_ERRORS as e:
            if not view.rows:
                yield self._render(before, view, highlight, notices, y_max)
                raise gr.Error(str(e)) from e
            notices.append(f"Note: the answer was cut short: {e}")
        finally:
            gen.close()
        if stop.clear_chat:
            yield self.cleared()
            return
        if view.stopped:
            notices.append("Stopped.")
        elif view.finish_reason == "context":
            notices.append("Note: the context window is full: the answer was cut. Clear the chat to continue.")
        yield self._render(shown, view, highlight, notices, y_max)

    @staticmethod
    def _render(history, view: AnswerView, highlight, notices, y_max, clear_box=False):
        chart = gr.BarPlot(value=view.frame() if view.rows else empty_frame(), y_lim=[0, y_max],
                           sort=view.step_labels() or None)
        return (history, history, "" if clear_box else gr.skip(), chart, view.stats_markdown(),
                view.summary(), view.highlight_html() if highlight else "", "\n\n".join(notices))

    # ---- side by side -----------------------------------------------------------------
    def compare(self, prompt, system, temperature, top_p, max_new, depth, top_k, tree_size,
                request: gr.Request):
        prompt = (prompt or "").strip()
        if not prompt:
            raise gr.Error("Type a prompt to compare.")
        engine = self.manager.engine
        if not engine.has_head:
            raise gr.Error("Side by side needs an EAGLE head: load a model with a head in the Models tab.")
        settings = (temperature, top_p, max_new, True, depth, top_k, tree_size)
        spec_cfg = self._config(settings)
        plain_cfg = replace(spec_cfg, speculative=False)
        msgs = engine_messages([{"role": "user", "content": prompt}], system)
        stop = self._stop_flag(request)
        stop.reset()
        plain, spec = AnswerView("plain"), AnswerView("speculative")
        for view, cfg in ((plain, plain_cfg), (spec, spec_cfg)):
            gen = engine.generate(msgs, cfg)
            try:
                for ev in gen:
                    view.add(ev)
                    if stop.is_set():
                        view.stopped = True
                        break
                    yield self._compare_outputs(plain, spec, "running…")
            except USER_ERRORS as e:
                raise gr.Error(str(e)) from e
            finally:
                gen.close()
            if view.stopped:
                yield self._compare_outputs(plain, spec, "Stopped.")
                return
        summary = compare_markdown(plain, spec, greedy=spec_cfg.sampling.greedy)
        yield self._compare_outputs(plain, spec, summary, greedy=spec_cfg.sampling.greedy)

    @staticmethod
    def _compare_outputs(plain: AnswerView, spec: AnswerView, summary: str, greedy: bool | None = None):
        data = {"plain": plain.summary(), "speculative": spec.summary()}
        for key in ("plain", "speculative"):
            data[key].pop("per_step")
        if greedy is not None:
            data["speedup"] = round(spec.tokens_per_s / plain.tokens_per_s, 3) if plain.tokens_per_s else 0.0
            data["identical"] = plain.text == spec.text if greedy else None
        return (f"**Plain** · {plain.tokens_per_s:.1f} tok/s\n\n{plain.text}",
                f"**Speculative** · {spec.tokens_per_s:.1f} tok/s · τ {spec.tau:.2f}\n\n{spec.text}",
                summary, data)

    # ---- model manager ----------------------------------------------------------------
    def _request(self, key, target, head, dtype, device, four_bit) -> Request:
        if not self.access.can_manage_models:
            raise gr.Error("Model downloads and switching are disabled on a public link without a "
                           "password (restart with --auth USER:PASS to allow them).")
        try:
            return Request.parse(key, target, head, dtype, device, four_bit)
        except ModelLoadError as e:
            raise gr.Error(str(e)) from e

    def _download(self, request: Request, progress) -> None:
        started = time.monotonic()

        def report(repo, done, total):
            if total:
                progress((done, total), desc=progress_text(repo, done, total, started), unit="B")

        try:
            self.manager.download(request, report)
        except ModelLoadError as e:
            raise gr.Error(f"Download failed: {e}. The current model keeps serving.") from e

    def download(self, key, target, head, dtype, device, four_bit, progress=gr.Progress()):
        request = self._request(key, target, head, dtype, device, four_bit)
        if not request.hub_ids():
            return "Nothing to download: this model is built in or a local folder.", catalogue_frame()
        self._download(request, progress)
        return f"Downloaded {', '.join(f'`{r}`' for r in request.hub_ids())}.", catalogue_frame()

    def load(self, key, target, head, dtype, device, four_bit, progress=gr.Progress()):
        request = self._request(key, target, head, dtype, device, four_bit)
        self._download(request, progress)
        progress(None, desc=f"Loading {request.choice.model} …")
        try:
            engine = self.manager.switch(request)
        except LOAD_ERRORS as e:
            raise gr.Error(f"Loading failed ({type(e).__name__}): {e}. The previous model keeps serving.") from e
        note = "" if engine.has_head else " This model has no EAGLE head: speculation is off."
        return (f"Now serving {request.choice.describe()}.{note}", self.manager.status_markdown(),
                gr.Checkbox(value=engine.has_head, interactive=engine.has_head), catalogue_frame())

    def page_load(self, banner: str):
        engine = self.manager.engine
        return (self.manager.status_markdown(), banner,
                gr.Checkbox(value=engine.has_head, interactive=engine.has_head))

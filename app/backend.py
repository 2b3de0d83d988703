"""Chatting through a remote OpenAI-compatible server (app.remote): the Models tab's Connect and
"Use local engine" handlers, and a remote answer streamed into the chat. The answer's panel
shows what the server reports (app.remote.stats_markdown), labelled remote; what the local
engine alone can show is disabled meanwhile (app.controls).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import gradio as gr

from app.chat import SAME_AGAIN, Pace, empty_frame, opening, same_again
from app.controls import CONTROLS, control_updates
from app.errors import UserError, plain_reason, refuse, user_error
from app.models_tab import LOAD_ERRORS, LOCKED
from app.remote import RemoteBackend, RemoteError, RemoteEvent, ServerInfo, stats_markdown

# Connect and "Use local engine": the result line, the header, the tree origin, app.controls.CONTROLS
BACKEND_OUTPUTS = 3 + len(CONTROLS)
REMOTE_FINISH = {"stop": "end of answer", "length": "max new tokens reached"}


@dataclass
class RemoteView:
    """One remote answer: its text so far and the latest event (the server's running numbers)."""

    info: ServerInfo
    text: str = ""
    last: RemoteEvent | None = None
    stopped: bool = False
    seed: int | None = None  # a sampled answer's seed, sent with the request

    def add(self, ev: RemoteEvent) -> None:
        self.text += ev.text
        self.last = ev

    @property
    def finish_reason(self) -> str | None:
        return self.last.finish_reason if self.last is not None and self.last.finished else None

    def stats_markdown(self) -> str:
        ev = self.last
        end = ("stopped by you" if self.stopped else
               REMOTE_FINISH.get(self.finish_reason or "", self.finish_reason or "streaming…")
               if ev is not None and ev.finished else "streaming…")
        seed = (f" · sampled with seed {self.seed} (type it into Sampling → Seed to ask the server for this "
                "answer again; an eagle-chat server gives it, another server may ignore seeds)"
                if self.seed is not None else "")
        return f"{stats_markdown(self.info, ev.stats if ev else None, ev)}\n\n{end}{seed}"

    def summary(self) -> dict:
        ev = self.last
        return {"backend": "remote", "server": self.info.url, "kind": self.info.kind, "model": self.info.model,
                "elapsed_s": round(ev.elapsed_s, 3) if ev else 0.0, "finish_reason": self.finish_reason,
                "stopped": self.stopped, "stats": asdict(ev.stats) if ev and ev.stats else None,
                **({"seed": self.seed} if self.seed is not None else {})}


class BackendHandlers:
    """Mixed into app.session.Handlers, which provides `manager`, `access`, `_guarded` and `cleared`."""

    def connect(self, url, api_key, request: gr.Request = None):
        """Models tab: chat through the server at `url` from now on."""
        def work():
            if not self.access.can_manage_models(request):
                raise UserError(LOCKED)
            address = (url or "").strip()
            if not address:
                raise UserError("Enter the server's address, e.g. http://127.0.0.1:8000")
            try:
                info = self.manager.connect(address, (api_key or "").strip() or None)
            except RemoteError as e:
                raise UserError(f"Could not connect: {e}. The chat goes on as before.") from e
            return (f"Connected: the chat now goes to {info.url} ({info.kind} server, model `{info.model}`).",
                    self.manager.status_markdown(), self.manager.tree_markdown(), *control_updates(self.manager))

        return self._guarded(work, BACKEND_OUTPUTS)

    def use_local(self, progress=gr.Progress(), request: gr.Request = None):
        """Models tab: back to the local engine (loading the last model first if none is loaded)."""
        def work():
            if not self.access.can_manage_models(request):
                raise UserError(LOCKED)
            if self.manager.engine is None:
                progress(None, desc=f"Loading {self.manager.choice.describe()} …")
            try:
                engine = self.manager.use_local()
            except LOAD_ERRORS as e:
                raise UserError(f"Loading the local model failed: {plain_reason(e)}. The chat still "
                                "goes to the remote server.") from e
            return (f"Chatting with the local engine: {self.manager.choice.describe()}. "
                    f"Numerics: {engine.numerics.describe()}.",
                    self.manager.status_markdown(), self.manager.tree_markdown(), *control_updates(self.manager))

        return self._guarded(work, BACKEND_OUTPUTS)

    def _remote_answer(self, backend: RemoteBackend, msgs, cfg, seconds, before, turns, ticket, notices, restore,
                       continues: bool = False):
        """Stream one answer from the server (`continues`: more of the answer `turns` end with). Failing
        before any text: the conversation as it was and the message back in its box; failing
        mid-answer: the text so far is kept."""
        view = RemoteView(backend.info, seed=None if cfg.sampling.greedy else cfg.seed)
        shown, prefix = opening(turns, continues)
        yield self._remote_render(shown, view, notices, box=None if restore is None else "", first=True)
        deadline = time.monotonic() + seconds if seconds else None
        events = backend.chat(msgs, max_tokens=cfg.max_new_tokens, temperature=cfg.sampling.temperature,
                              top_p=cfg.sampling.top_p, seed=cfg.seed, continue_final=continues)
        timed_out, pace = False, Pace()
        try:
            for ev in events:
                view.add(ev)
                shown[-1] = {"role": "assistant", "content": prefix + view.text}
                timed_out = bool(deadline and time.monotonic() > deadline and not ev.finished)
                if ticket.stop.is_set() or timed_out:
                    view.stopped = ticket.stop.is_set()
                    break
                if not ev.finished and ev.text and pace.due() is not None:  # see app.chat.Pace
                    yield self._remote_render(shown, view, notices)
        except RemoteError as e:
            message = user_error(str(e))
            if not view.text:  # nothing answered: back to the conversation as it was
                yield (before, before, gr.skip() if restore is None else restore, *refuse(message, 5, 4))
                return
            notices.append(f"Note: the answer was cut short: {message}")
        finally:
            events.close()  # leaves the HTTP stream: the server stops generating
        if ticket.clear_chat:
            yield self.cleared()
            return
        if view.stopped:
            notices.append("Stopped.")
        elif timed_out:
            notices.append(f"Limit for visitors through the public link: the answer was cut after {seconds:g} s.")
        elif cfg.sampling.greedy and not continues and same_again(before, turns, shown):
            notices.append(SAME_AGAIN)
        yield self._remote_render(shown, view, notices)

    @staticmethod
    def _remote_render(history, view: RemoteView, notices, box=None, first=False):
        """The chat outputs; the chart and the token view are cleared once (nothing local to show)."""
        return (history, history, gr.skip() if box is None else box, empty_frame() if first else gr.skip(),
                view.stats_markdown(), view.summary(), "" if first else gr.skip(), "\n\n".join(notices))

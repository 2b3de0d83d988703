"""Event handlers behind the UI: chat, regenerate, stop, clear, side by side, page load and
session end. The model manager's handlers are in app.models_tab.

Each handler parses the controls, asks the engine for a stream of step events and renders
them with app.chat. A problem never blanks the page: it is shown as a message (a toast plus
the notice under the chat) while every component keeps its content, and it is logged as one
line; only a real fault (a bug) logs its traceback.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from pathlib import Path

import gradio as gr

from app.attach import attach
from app.backend import BackendHandlers
from app.chat import (SAME_AGAIN, AnswerView, Pace, empty_frame, engine_messages, flatten, opening, same_again,
                      trim_to_context)
from app.chats_ui import ChatsHandlers
from app.compare import compare_outputs, race
from app.controls import control_updates
from app.errors import TOAST_S, UserError, fault, log, refuse, user_error
from app.lane import Ticket, Tickets, session_of, visitor_of
from app.longchat import PREFILL_NOTE_S, LongChat, new_chat_hint, plan, reading
from app.manager import ModelManager
from app.models_tab import ModelHandlers
from app.remote import RemoteError
from app.state import Access, ChatSettings, tree_limit
from core import threads
from core.config import ConfigError, new_seed
from core.decoding.forward import prefill_chunk
from core.decoding.engine import EngineError
from core.decoding.head import HeadLoadError
from core.models import ModelLoadError

USER_ERRORS = (UserError, ConfigError, EngineError, ModelLoadError, HeadLoadError, RemoteError)
EMPTY_MESSAGE, EMPTY_PROMPT = "Type a message first.", "Type a prompt to compare."
NOTHING_TO_REGENERATE = "Nothing to regenerate yet: send a message first."
NOTHING_TO_CONTINUE = "Nothing to continue: the chat does not end with an answer."
NOTHING_ADDED = "The answer was already complete: the model ended it at once and added nothing."
NOT_EDITABLE = "That message is no longer in this chat, so it cannot be edited."
EMPTY_ANSWER = ("An answer cannot be edited to nothing: to drop it, edit your message above it, or press Regenerate "
                "for another.")
EDITED_ANSWER = "Answer edited (the turns after it were dropped): Continue writes on from it, or send a message."
EDIT_CHANGED = ("The chat changed before the edit was answered (another answer or chat came first), so nothing "
                "was changed: edit the message again.")
TEXT_IN_BOX = " Your edited text is in the message box."
# Clear waits this long at most for a running answer's last update (a step, or a chunk of a long prompt)
CLEAR_WAIT_S = 10.0
# sessions whose last Regenerate or edit keeps the chat it read, for its versions (Handlers.regenerated)
REGENERATED = 1024
STOPPED_READING = "Stopped while the prompt was read, before the first token: the chat is as it was before Send."
# the chat events' outputs, in the order of ui.build's `outs`
CHAT_OUTPUT_NAMES = ("chatbot", "history", "box", "chart", "stats", "stats_json", "tokens", "notice")
CHAT_OUTPUTS, NOTICE, STATS = (len(CHAT_OUTPUT_NAMES), CHAT_OUTPUT_NAMES.index("notice"),
                               CHAT_OUTPUT_NAMES.index("stats"))


def chart(view: AnswerView, y_max: int) -> gr.BarPlot:
    """The chart's update: this answer's steps, and a legend of the kinds this mode can show."""
    return gr.BarPlot(value=view.frame() if view.rows else empty_frame(), y_lim=[0, y_max],
                      colors_in_legend=view.kinds(), x_lim=view.x_range())


class Handlers(ModelHandlers, BackendHandlers, ChatsHandlers):
    def __init__(self, manager: ModelManager, access: Access, adaptive: bool = True):
        self.manager = manager
        self.access = access
        # chat answers speculate where it measures faster (GenerationConfig.adaptive);
        # Side by side races the two modes as they are
        self.adaptive = adaptive
        self.tickets = Tickets()
        self._sends = itertools.count(1)  # the gates' counter: each request it lets go is a new value
        # each session's chat as its last Regenerate or edit read it (what it replaced: app.versions); read by the
        # page's versions_written after that Regenerate or edit, at most REGENERATED sessions kept
        self.regenerated: OrderedDict[str, tuple[list, int | None]] = OrderedDict()  # (chat, point)

    # ---- the queue: validators run when a request joins it --------------------------------
    # They guard the API (a refusal reaches a client as a validation error, HTTP 422). The page
    # asks the gates below first, so its requests that reach a validator pass it.
    def check_chat(self, message, history, system, temperature, top_p, max_new, spec, depth, top_k, tree_size,
                   highlight, seed=-1, request: gr.Request = None):
        return self._join(self._text_problem(message, system, request, EMPTY_MESSAGE), 12, request)

    def check_regenerate(self, history, system, temperature, top_p, max_new, spec, depth, top_k, tree_size,
                         highlight, seed=-1, request: gr.Request = None):
        return self._join(self._too_long(request, system=system) or self._busy(request), 11, request)

    check_continue = check_regenerate  # the same inputs and checks

    def check_edit(self, pending, box, history, system, temperature, top_p, max_new, spec, depth, top_k,
                   tree_size, highlight, seed=-1, request: gr.Request = None):
        text = (pending or {}).get("text")
        return self._join(self._text_problem(text, system, request, EMPTY_MESSAGE), 13, request)

    def check_compare(self, prompt, system, temperature, top_p, max_new, depth, top_k, tree_size, seed=-1,
                      request: gr.Request = None):
        return self._join(self._text_problem(prompt, system, request, EMPTY_PROMPT), 9, request)

    def _text_problem(self, text, system, request, empty: str) -> str:
        """Why this message (or prompt) cannot be sent now, or "". (Gradio passes the request only
        to named positional parameters, hence the validators' long lists.)"""
        return ("" if (text or "").strip() else empty) or self._too_long(request, text, system) or self._busy(request)

    def _join(self, problem: str, n_inputs: int, request):
        """The validators' answer: the problem shown on the first input, or the request joins the queue."""
        if not problem:
            self.tickets.join(request)
        return [gr.validate(not problem, problem)] + [gr.validate(True, "")] * (n_inputs - 1)

    # ---- the page's gates: the same checks, answered in place -------------------------------
    # Send (or Enter), Regenerate and Compare first call a gate outside the queue (answered at
    # once, even while another answer runs). A problem becomes the notice (the chat's, or the
    # race's summary) and nothing is sent: every box keeps its text. Otherwise the gate moves a
    # hidden counter, whose change sends the queued request (app.ui). A validator's refusal would
    # instead be a failed request (HTTP 422) in the browser's console.
    def gate_chat(self, message, system, request: gr.Request = None):
        return self._gate(self._text_problem(message, system, request, EMPTY_MESSAGE))

    def gate_regenerate(self, history, system, request: gr.Request = None):
        nothing = "" if any(m.get("role") == "user" for m in history or []) else NOTHING_TO_REGENERATE
        return self._gate(nothing or self._too_long(request, system=system) or self._busy(request))

    def gate_compare(self, prompt, system, request: gr.Request = None):
        return self._gate(self._text_problem(prompt, system, request, EMPTY_PROMPT))

    def gate_continue(self, history, system, request: gr.Request = None):
        nothing = "" if continuable(history) else NOTHING_TO_CONTINUE
        return self._gate(nothing or self._too_long(request, system=system) or self._busy(request))

    def gate_edit(self, box, history, system, edit: gr.EditData, request: gr.Request = None):
        """A message edited in the chat: (notice, pending edit, counter, box). The edit waits in
        `pending` (its index, role, new text and the text it replaces) for the queued event (`edit`),
        which answers an edited user message, or keeps an edited answer; a refused edit leaves the
        chat as it is and its text goes to the message box if that is empty."""
        history = list(history or [])
        index, text = edit.index, flatten(edit.value).strip()
        role = history[index].get("role") if isinstance(index, int) and 0 <= index < len(history) else None
        if role not in ("user", "assistant"):
            problem = NOT_EDITABLE
        elif role == "assistant":
            problem = ("" if text else EMPTY_ANSWER) or self._too_long(request, text) or self._busy(request)
        else:
            problem = self._text_problem(text, system, request, EMPTY_MESSAGE)
        notice, go = self._gate(problem)
        if problem:
            back = text and not (box or "").strip()
            return (f"{notice}{TEXT_IN_BOX}" if back else notice), gr.skip(), go, text if back else gr.skip()
        pending = {"index": index, "role": role, "text": text, "replaces": flatten(history[index]["content"])}
        return notice, pending, go, gr.skip()

    def _gate(self, problem: str) -> tuple:
        """(notice, counter): the problem and no request, or no new notice and the request."""
        if problem:
            log.warning("%s", problem)
            return problem, gr.skip()
        return gr.skip(), next(self._sends)

    def attach_file(self, file, box, request: gr.Request = None):
        """A file attached with the button beside Send: (message box, notice). Its text joins the
        message in the box (app.attach), to be read over and sent; a file that cannot be attached
        is refused with its reason, and the box keeps its text."""
        try:
            path = Path(file) if file else None
            if path is None or not path.is_file():
                raise UserError("No file arrived: choose the file again.")
            message = attach(box or "", path, self.access.message_chars(request), self._for_visitors(request))
        except UserError as e:
            return gr.skip(), user_error(str(e))
        note = f"Attached “{path.name}” to your message"
        engine = self.manager.engine
        if engine is not None and self.manager.backend is None:
            n = engine.count_tokens([{"role": "user", "content": message}])
            note += f" ({n:,} tokens of the model's {engine.max_context:,}-token context)"
            if n >= engine.max_context:
                return message, f"{note}: more than the model can read at once. Shorten it before sending."
        return message, f"{note}: read it over, then Send."

    def _for_visitors(self, request) -> str:
        return " for visitors through the public link" if self.access.limited(request) else ""

    def _too_long(self, request, message=None, system=None) -> str:
        """Why this message or system prompt is refused for its length, or ""."""
        limit, who = self.access.message_chars(request), self._for_visitors(request)
        for text, what in ((message, "This message"), (system, "The system prompt")):
            if text is not None and len(text) > limit:
                return (f"{what} is {len(text):,} characters long; the limit is {limit:,} characters{who}. "
                        "Shorten it (your chat is kept).")
        return ""

    def _busy(self, request, ticket: Ticket | None = None) -> str:
        """A limited visitor holds at most remote_max_queued answers, running or waiting: why this
        one is refused, or "". `ticket` is this request's own, not counted."""
        most = self.access.remote_max_queued
        if not self.access.limited(request) or self.tickets.held_by(visitor_of(request), ticket) < most:
            return ""
        return (f"Limit for visitors through the public link: {most} answer{'s' if most > 1 else ''} at a time, "
                "running or waiting. Wait for your answer to finish (or press Stop), then send this again.")

    def stop(self, request: gr.Request = None):
        """Runs outside the queue: stops this session's answer after its current step, and its
        requests still waiting in the queue before they start."""
        self.tickets.cancel(request)

    def clear(self, request: gr.Request = None):
        """Empty the chat; an answer still streaming stops and ends by showing the empty chat.
        The empty chat is returned once that answer has yielded its last update (within a step):
        an answer that was finishing as Clear arrived cannot show its full chat after this."""
        self.tickets.wait_running(self.tickets.cancel(request, clear_chat=True), CLEAR_WAIT_S)
        return self.cleared()

    def session_end(self, request: gr.Request = None):
        """The visitor's tab closed: free what this session held."""
        self.tickets.forget(request)
        self.regenerated.pop(session_of(request), None)

    @staticmethod
    def cleared():
        return [], [], "", empty_frame(), "", {}, "", ""

    # ---- chat -------------------------------------------------------------------------
    def respond(self, message, history, system, temperature, top_p, max_new, spec, depth, top_k,
                tree_size, highlight, seed=-1, request: gr.Request = None):
        message = (message or "").strip()
        history = list(history or [])
        turns = history + [{"role": "user", "content": message}]
        settings = ChatSettings(temperature, top_p, max_new, spec, depth, top_k, tree_size, highlight, seed)
        work = self._chat(history, turns, system, settings, request, restore=message)
        yield from self._run(work, request, CHAT_OUTPUTS, NOTICE, empty_first=not message)

    def regenerate(self, history, system, temperature, top_p, max_new, spec, depth, top_k,
                   tree_size, highlight, seed=-1, request: gr.Request = None):
        history = list(history or [])
        users = [i for i, m in enumerate(history) if m["role"] == "user"]
        settings = ChatSettings(temperature, top_p, max_new, spec, depth, top_k, tree_size, highlight, seed)
        self._turning(request, history, None)
        work = self._chat(history, history[:users[-1] + 1] if users else [], system, settings, request, restore=None)
        yield from self._run(work, request, CHAT_OUTPUTS, NOTICE,
                             empty_first=not users, empty_message=NOTHING_TO_REGENERATE)

    def _turning(self, request, history: list, at: int | None) -> None:
        """The chat as this Regenerate (`at` None: its last answer is replaced) or edit (of message `at`) reads it,
        queued behind any answer still being written, for the versions kept after it (app.versions; a handler
        outside the queue could read a chat mid-answer)."""
        session = session_of(request)
        self.regenerated[session] = (history, at)
        self.regenerated.move_to_end(session)
        while len(self.regenerated) > REGENERATED:
            self.regenerated.popitem(last=False)

    def continue_answer(self, history, system, temperature, top_p, max_new, spec, depth, top_k,
                        tree_size, highlight, seed=-1, request: gr.Request = None):
        """Write more of the chat's last answer (cut by its token limit, or stopped): the model reads
        the chat with that answer as it stands and goes on from its last token; the new text is
        appended to it. Up to the first new token the chat stays as it was."""
        history = list(history or [])
        settings = ChatSettings(temperature, top_p, max_new, spec, depth, top_k, tree_size, highlight, seed)
        work = self._chat(history, history, system, settings, request, restore=None, continues=True)
        yield from self._run(work, request, CHAT_OUTPUTS, NOTICE, empty_first=not continuable(history),
                             empty_message=NOTHING_TO_CONTINUE)

    def edit(self, pending, box, history, system, temperature, top_p, max_new, spec, depth, top_k,
             tree_size, highlight, seed=-1, request: gr.Request = None):
        """An edited message (gate_edit): the chat goes back to it and its later turns are dropped.
        An edited user message is answered; until the answer's first token the chat stays as it
        was, and a refusal puts the edited text in the message box if that is empty. An edited
        answer is kept as it is written, for Continue or the next message."""
        history = list(history or [])
        pending = pending or {}
        index, role, text = pending.get("index"), pending.get("role", "user"), (pending.get("text") or "").strip()
        same = (isinstance(index, int) and 0 <= index < len(history) and history[index].get("role") == role
                and flatten(history[index]["content"]) == pending.get("replaces"))
        if same and not (role == "assistant" and index == len(history) - 1):  # the last answer is edited in place
            self._turning(request, history, index)  # what the edit replaces is kept as a version
        if same and text and role == "assistant":
            kept = history[:index] + [{"role": "assistant", "content": text}]
            yield (kept, kept, *[gr.skip()] * (NOTICE - 2), EDITED_ANSWER)
            return
        turns = history[:index] + [{"role": "user", "content": text}] if same else []
        settings = ChatSettings(temperature, top_p, max_new, spec, depth, top_k, tree_size, highlight, seed)
        back = text if text and not (box or "").strip() else None
        work = self._chat(history, turns, system, settings, request, restore=back)
        outs = self._run(work, request, CHAT_OUTPUTS, NOTICE, empty_first=not (same and text),
                         empty_message=EDIT_CHANGED if text else EMPTY_MESSAGE)
        yield from self._text_back(outs, back)

    @staticmethod
    def _text_back(outs, text: str | None):
        """An edit refused before its answer showed anything: its text goes to the message box."""
        shown = False  # the answer has begun: the chat shows the edit
        for out in outs:
            refused = not shown and out[0] == gr.skip() and isinstance(out[NOTICE], str)
            put_back = out[2] == text and isinstance(out[NOTICE], str)  # _answer's way back, before its first token
            if text is not None and (refused or put_back):
                out = (*out[:2], text, *out[3:NOTICE], f"{out[NOTICE]}{TEXT_IN_BOX}", *out[NOTICE + 1:])
            shown = shown or (out[0] != gr.skip() and out[2] != text)
            yield out

    def _run(self, work, request, n_outputs: int, notice_at: int, *, empty_first=False,
             empty_message=EMPTY_MESSAGE):
        """Drive one queued request: its ticket, and every problem turned into a message."""
        ticket = self.tickets.ticket(request)
        ticket.running = True
        try:
            if empty_first:
                raise UserError(empty_message)
            if problem := self._busy(request, ticket):  # a call that bypassed the validator
                raise UserError(problem)
            if ticket.stop.is_set():
                yield self._cancelled(ticket, n_outputs, notice_at)
                return
            yield from work(ticket)
        except USER_ERRORS as e:
            yield refuse(user_error(str(e)), n_outputs, notice_at)
        except Exception as e:  # a bug: keep the page usable, keep the traceback for the console
            yield refuse(fault(e), n_outputs, notice_at)
        finally:
            self.tickets.done(request, ticket)

    def _cancelled(self, ticket: Ticket, n_outputs: int, notice_at: int):
        """Stop (or Clear) was pressed while this request waited in the queue."""
        if ticket.clear_chat and n_outputs == CHAT_OUTPUTS:
            return self.cleared()
        return refuse("Stopped before it started.", n_outputs, notice_at)

    def _engine(self):
        if self.manager.engine is None:
            raise UserError("No model is loaded: a switch failed and the previous model could not be loaded "
                            "again. Load one in the Models tab.")
        return self.manager.engine

    def _settings(self, settings: ChatSettings, request, notices: list[str]):
        """The controls -> (GenerationConfig, deadline in seconds or None), with the caps for
        visitors through the public link applied and said."""
        engine = self.manager.engine  # its default tree says whether to copy from the context
        default = engine.default_tree if engine is not None else None
        try:
            cfg = settings.config(default)  # core's rule (TreeConfig.override) puts the controls over it
        except ConfigError as e:
            raise UserError(f"Invalid setting: {e}") from e
        if not self.access.limited(request):
            return cfg, None
        cap = self.access.remote_max_new_tokens
        if cfg.max_new_tokens > cap:
            notices.append(f"Limit for visitors through the public link: at most {cap} new tokens per answer "
                           f"(you asked for {cfg.max_new_tokens}).")
            cfg = replace(cfg, max_new_tokens=cap)
        return cfg, self.access.remote_max_seconds

    def _prompt(self, engine, turns, system, cfg, notices: list[str], budget: int | None,
                continues: bool = False) -> tuple[list[dict], int]:
        """The chat-template messages for this answer, oldest turns trimmed to fit the context
        and, for a limited visitor, their prompt budget (`budget` tokens); and their length in tokens.
        `continues`: the turns end with the answer to continue."""
        count = functools.partial(engine.count_tokens, continue_final=continues)
        try:
            msgs, dropped = trim_to_context(engine_messages(turns, system), count, engine.max_context,
                                            cfg.max_new_tokens)
            msgs, over_budget = trim_to_context(msgs, count, budget, 0) if budget is not None else (msgs, 0)
            n_tokens = count(msgs)
            too_long = n_tokens >= engine.max_context
        except ValueError as e:  # e.g. a tokenizer without a chat template
            raise UserError(f"Cannot build the prompt: {e}") from e
        if budget is not None and n_tokens > budget:
            raise UserError(self._over_budget(n_tokens, budget))
        if over_budget:
            notices.append(f"Limit for visitors through the public link: prompts of at most {budget:,} tokens, so "
                           f"the oldest {over_budget} exchange(s) were left out of the prompt. Clear the chat to "
                           "start afresh.")
            gr.Warning(notices[-1], duration=TOAST_S)
        if too_long and continues:
            raise UserError(f"This answer already fills the model's whole context ({engine.max_context} tokens): "
                            "nothing more fits. Start a new chat (this one is kept in the list).")
        if too_long:
            raise UserError(f"This message is longer than the model's whole context ({engine.max_context} "
                            "tokens); shorten it.")
        if dropped:
            notices.append(f"Note: the conversation no longer fits the model's context ({engine.max_context} "
                           f"tokens): the oldest {dropped} exchange(s) were left out of the prompt.")
            gr.Warning(notices[-1], duration=TOAST_S)
        return msgs, n_tokens

    def _over_budget(self, n_tokens: int, budget: int) -> str:
        """The seconds cap is checked between steps and the prefill is one step: a limited
        visitor's prompt is capped in tokens so that the prefill, too, fits the time."""
        return (f"Limit for visitors through the public link: prompts of at most {budget:,} tokens, so that an "
                f"answer starts well within its {self.access.remote_max_seconds:g} s; this one is {n_tokens:,} "
                "tokens (your message with the system prompt). Shorten it (your chat is kept).")

    def _chat(self, before, turns, system, settings: ChatSettings, request, restore, continues: bool = False):
        """The work of one answer to `turns` (`continues`: more of the answer `turns` end with); on a
        failure before the first token, `before` is shown again and the message goes back into the box."""
        def work(ticket: Ticket):
            if problem := self._too_long(request, restore, system):
                raise UserError(problem)
            notices: list[str] = []
            cfg, seconds = self._settings(settings, request, notices)
            cfg = replace(cfg, adaptive=self.adaptive)
            if not cfg.sampling.greedy and cfg.seed is None:  # shown with the answer, to be typed in again
                cfg = replace(cfg, seed=new_seed())
            backend = self.manager.backend
            if backend is not None:  # the server queues its own requests: no local lane to hold
                yield from self._remote_answer(backend, engine_messages(turns, system), cfg, seconds, before,
                                               turns, ticket, notices, restore, continues)
                return
            with self.manager.lane:  # a model switch waits for this answer, and this for a switch
                engine = self._engine()
                # (a model without a head speculates by context lookup alone: the header and the box say so)
                if cfg.speculative and engine.has_head and (limit := tree_limit(cfg.tree.depth, cfg.tree.total_tokens)):
                    notices.append(f"Note: {limit}")
                msgs, n_tokens = self._prompt(engine, turns, system, cfg, notices, self.access.prompt_tokens(request),
                                              continues)
                long_chat = plan(cfg.tree, n_tokens, cfg.speculative, cfg.sampling.temperature, cfg.adaptive)
                notices.extend(long_chat.notes)
                yield from self._answer(engine, msgs, cfg, seconds, before, turns, settings.highlight, ticket,
                                        notices, restore, long_chat, continues)
        return work

    def _answer(self, engine, msgs, cfg, seconds, before, turns, highlight, ticket, notices, restore,
                long_chat: LongChat, continues: bool = False):
        """Stream the answer to `msgs` (`continues`: more of the answer `msgs` and `turns` end with;
        the new text is appended to it)."""
        view = AnswerView("speculative" if cfg.speculative else "plain", since=ticket.joined,
                          prompt_tokens=long_chat.prompt_tokens, max_context=engine.max_context,
                          long_chat=long_chat, seed=None if cfg.sampling.greedy else cfg.seed)
        shown, prefix = opening(turns, continues)
        y_max = cfg.tree.depth + 1 if cfg.speculative else 2
        # the box is emptied where it held this message (`restore`); Regenerate and Continue leave a draft in it
        yield self._render(shown, view, highlight, notices, y_max, box=None if restore is None else "")
        deadline = time.monotonic() + seconds if seconds else None
        gen = threads.engine_stream(engine.generate(msgs, cfg, on_step=view.on_step, should_stop=ticket.stop.is_set,
                                                    continue_final=continues))
        pace = Pace()
        try:
            first = yield from self._prefill(gen, long_chat.prompt_tokens, ticket)
            if first is None and ticket.stop.is_set() and not ticket.clear_chat:  # Stop while the prompt was read
                yield (before, before, gr.skip() if restore is None else restore, *refuse(STOPPED_READING, 5, 4))
                return
            for ev in itertools.chain([first] if first else [], gen):
                view.add(ev)
                shown[-1] = {"role": "assistant", "content": prefix + view.text}
                if ticket.stop.is_set() or (deadline and time.monotonic() > deadline and not ev.finished):
                    view.stopped = ticket.stop.is_set()
                    break
                if not ev.finished and (panel := pace.due()) is not None:
                    yield self._render(shown, view, highlight, notices, y_max, panel=panel)
        except Exception as e:
            message = user_error(str(e)) if isinstance(e, USER_ERRORS) else fault(e)
            if not view.rows:  # nothing answered: back to the conversation as it was
                yield (before, before, gr.skip() if restore is None else restore, *refuse(message, 5, 4))
                return
            notices.append(f"Note: the answer was cut short: {message}")
        finally:
            gen.close()
        if ticket.clear_chat:
            yield self.cleared()
            return
        notices.extend(self._endings(view, deadline, seconds))
        if continues and not view.text and view.finish_reason == "eos":
            notices.append(NOTHING_ADDED)
        view.clock_in()
        if view.total_tokens >= 8:  # a few tokens say little about speed
            self.manager.last_speed = view.tokens_per_s
        if hint := new_chat_hint(long_chat.prompt_tokens + view.total_tokens, view.first_token_s):
            notices.append(hint)
        if cfg.sampling.greedy and not continues and same_again(before, turns, shown):
            notices.append(SAME_AGAIN)
        yield self._render(shown, view, highlight, notices, y_max)

    @staticmethod
    def _prefill(gen, prompt_tokens: int, ticket: Ticket):
        """The answer's first step, which reads the whole prompt, in a worker thread: a long one is
        shown while it runs (the stats line counts its seconds). Returns the first event (None: none).
        The worker always ends before this does, so the generator is never closed while it runs."""
        started = time.monotonic()
        with ThreadPoolExecutor(1, thread_name_prefix="prefill") as pool:
            first = pool.submit(next, gen, None)
            while True:
                try:
                    return first.result(timeout=PREFILL_NOTE_S)
                except FutureTimeout:
                    note = reading(prompt_tokens, time.monotonic() - started)
                    if ticket.stop.is_set():
                        note += f" Stopping after the part being read (up to {prefill_chunk():,} tokens)."
                    yield refuse(note, CHAT_OUTPUTS, STATS)

    @staticmethod
    def _endings(view: AnswerView, deadline, seconds) -> list[str]:
        if view.stopped:
            return ["Stopped."]
        if view.finish_reason is None and deadline:
            return [f"Limit for visitors through the public link: the answer was cut after {seconds:g} s."]
        if view.finish_reason == "context":
            return ["Note: the context window is full: the answer was cut. Clear the chat to continue."]
        return []

    @staticmethod
    def _render(history, view: AnswerView, highlight, notices, y_max, box=None, panel=True):
        """The chat outputs; without `panel`, the chart, the raw numbers and the token view are left
        as they are (Pace: they are the page's costliest redraws)."""
        skip = gr.skip()
        return (history, history, skip if box is None else box, chart(view, y_max) if panel else skip,
                view.stats_markdown(), view.summary() if panel else skip,
                (view.highlight_html() if highlight else "") if panel else skip, "\n\n".join(notices))

    # ---- side by side -----------------------------------------------------------------
    def compare(self, prompt, system, temperature, top_p, max_new, depth, top_k, tree_size, seed=-1,
                request: gr.Request = None):
        prompt = (prompt or "").strip()
        settings = ChatSettings(temperature, top_p, max_new, True, depth, top_k, tree_size, highlight=False, seed=seed)

        def work(ticket: Ticket):
            if problem := self._too_long(request, prompt, system):
                raise UserError(problem)
            notices: list[str] = []
            if self.manager.backend is not None:
                raise UserError("Side by side needs the local engine: the chat goes to a remote server now. "
                                "Press “Use local engine” in the Models tab.")
            spec_cfg, seconds = self._settings(settings, request, notices)
            if limit := tree_limit(spec_cfg.tree.depth, spec_cfg.tree.total_tokens):
                notices.append(f"Note: {limit}")
            with self.manager.lane:
                engine = self._engine()
                msgs = engine_messages([{"role": "user", "content": prompt}], system)
                budget = self.access.prompt_tokens(request)
                if budget is not None and (n_tokens := engine.count_tokens(msgs)) > budget:
                    raise UserError(self._over_budget(n_tokens, budget))
                yield from self._race(engine, msgs, spec_cfg, seconds, ticket, notices)

        yield from self._run(work, request, 4, 2, empty_first=not prompt,
                             empty_message=EMPTY_PROMPT)

    @staticmethod
    def _race(engine, msgs, spec_cfg, seconds, ticket: Ticket, notices: list[str]):
        plain, spec = AnswerView("plain"), AnswerView("speculative")
        greedy = spec_cfg.sampling.greedy
        if spec_cfg.seed is None:  # one seed for both: sampled answers must agree too
            spec_cfg = replace(spec_cfg, seed=new_seed())
        seed = None if greedy else spec_cfg.seed
        deadline = time.monotonic() + seconds if seconds else None
        spec_cfg = replace(spec_cfg, reuse_prompt=False)  # both read the prompt from its start: a fair race
        stop = ticket.stop.is_set  # asked before each chunk of the prompt, too
        gens = (threads.engine_stream(engine.generate(msgs, replace(spec_cfg, speculative=False), should_stop=stop)),
                threads.engine_stream(engine.generate(msgs, spec_cfg, should_stop=stop)))
        pace = Pace()  # as the chat's: an update per step of either column (hundreds a second) loaded the page
        try:
            for _ in race(plain, gens[0], spec, gens[1]):
                if ticket.stop.is_set() or (deadline and time.monotonic() > deadline):
                    plain.stopped = spec.stopped = True
                    break
                if pace.due() is not None:
                    yield compare_outputs(plain, spec, greedy, notices, final=False, seed=seed)
        finally:
            for g in gens:
                g.close()
        if ticket.stop.is_set():
            notices.append("Stopped.")
        elif plain.stopped:
            notices.append(f"Limit for visitors through the public link: the race was cut after {seconds:g} s.")
        yield compare_outputs(plain, spec, greedy, notices, final=True, seed=seed)

    # ---- page ---------------------------------------------------------------------------
    def page_load(self, banner: str, request: gr.Request = None):
        """(status, banner, tree origin, the backend-dependent controls, the Models tab's access)."""
        return (self.manager.status_markdown(), banner, self.manager.tree_markdown(),
                *control_updates(self.manager), *self.models_access(request))


def continuable(history) -> bool:
    """Does the chat end with an answer that can be written on?"""
    return bool(history) and history[-1].get("role") == "assistant" and bool(flatten(history[-1]["content"]).strip())

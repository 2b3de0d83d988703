"""The chat list (new, pick, rename, delete, export, import) and the settings kept in the browser.

Both live in gr.BrowserState: the visitor's localStorage, encrypted with app.state.browser_secret.
The handlers here are pure functions of what the page sends (app.chats holds the operations); no
chat is kept on the server between requests, and nothing is sent anywhere else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr

from app import chats, versions
from app.errors import UserError, user_error
from app.lane import session_of
from app.state import ChatSettings, browser_secret

STORE_KEY, SETTINGS_KEY = "eagle-chat-chats", "eagle-chat-settings"
KEPT_HERE = "Chats and settings are kept in this browser only; nothing is sent anywhere."
BUSY = "An answer is being written: press Stop (or wait for it), then switch chats."
BUSY_FLIP = "An answer is being written: press Stop (or wait for it), then flip between answers."
FLIPPED = ("Showing {which}: Continue, Regenerate and your next message go on from it (the panel on the right "
           "describes the answer written last).")


def skip():
    return gr.skip()


@dataclass
class ChatsView:
    """The outputs of every chat-list event, by name; `outputs()` gives them in CHATS_VIEW order."""

    store: Any = field(default_factory=skip)
    chatbot: Any = field(default_factory=skip)
    history: Any = field(default_factory=skip)
    picker: Any = field(default_factory=skip)
    title: Any = field(default_factory=skip)
    export_md: Any = field(default_factory=skip)
    export_json: Any = field(default_factory=skip)
    export_all: Any = field(default_factory=skip)
    note: Any = field(default_factory=skip)
    system: Any = field(default_factory=skip)  # the System prompt box: the chat's own, where one is shown

    def outputs(self) -> tuple:
        return tuple(getattr(self, name) for name in CHATS_VIEW)


CHATS_VIEW = tuple(ChatsView.__dataclass_fields__)


def shown(store: dict, *, messages=True, note: str = "", system: bool | None = None) -> ChatsView:
    """Everything that follows from the store: the picker, the title box, the export files,
    how much room the browser has left for it (a toast and the note, when it is short) and,
    with `messages`, the current chat in the conversation and, with `system` (by default as `messages`), its system
    prompt in the box (where it keeps one: a chat kept before chats kept theirs takes the one shown)."""
    used = chats.stored_chars(store)
    if room := chats.storage_note(used):  # a toast too once nothing more is kept
        room = user_error(room) if used > chats.STORAGE_CHARS else room
        note = f"{note} {room}" if note else room
    chat = chats.current(store)
    md, js = chats.export_files(chat) if chat["messages"] else (None, None)
    every = chats.export_all_file(store)
    view = ChatsView(store=store, picker=gr.Dropdown(choices=chats.choices(store), value=store["current"]),
                     title=chat["title"] if chat["messages"] or chat.get("named") else "",
                     export_md=gr.DownloadButton(value=md, interactive=md is not None),
                     export_json=gr.DownloadButton(value=js, interactive=js is not None),
                     export_all=gr.DownloadButton(value=every, interactive=every is not None), note=note)
    if messages:
        view.chatbot = view.history = chat["messages"]
    if (messages if system is None else system) and chats.system_of(chat) is not None:
        view.system = chats.system_of(chat)
    return view


class ChatsHandlers:
    """Mixed into app.session.Handlers, which provides `tickets` (who has an answer running) and `regenerated` (the
    chat each session's last Regenerate or edit read, and the point it turned at)."""

    def chats_load(self, store, history):
        """Page load: the chat the visitor had open, as it was (unless a message was sent before
        this arrived: that conversation is not overwritten), and every chat's answer versions.
        -> (*CHATS_VIEW, versions)"""
        store = chats.normal(store)
        return (*shown(store, messages=not history).outputs(), chats.kept_versions(store))

    def chats_save(self, history, store, kept=None, system=None):
        """After an answer (or Clear): the current chat now holds the conversation shown, its
        answer versions (app.versions) and the system prompt shown."""
        store, history = chats.normal(store), history or []
        now = versions.current(kept, store["current"], history)  # those a new message left behind are not saved
        return shown(chats.save(store, history, now.as_json() if now else None, system), messages=False).outputs()

    # A switch keeps the system prompt shown with the chat it leaves (typed and not yet sent, it would be lost) and
    # shows the one the next chat keeps; a new chat starts with the one shown.
    def chats_new(self, store, system=None, request: gr.Request = None):
        return self._switch(lambda: chats.start_new(chats.keep_system(store, system), system), request)

    def chats_select(self, chat_id, store, system=None, request: gr.Request = None):
        if chat_id == chats.current_id(store):
            return ChatsView().outputs()  # the picker echoing a switch made elsewhere
        return self._switch(lambda: chats.select(chats.keep_system(store, system), chat_id), request)

    def chats_delete(self, store, request: gr.Request = None):
        return self._switch(lambda: chats.delete(store), request)

    def chats_rename(self, title, store):
        try:
            return shown(chats.rename(store, title), messages=False).outputs()
        except UserError as e:
            return ChatsView(note=user_error(str(e))).outputs()

    def chats_import(self, file, store, system=None, request: gr.Request = None):
        def imported():
            path = Path(file) if file else None
            if path is None or not path.is_file():
                raise UserError("No file arrived; choose a .json file saved with “Export JSON” or “Export all "
                                "chats”.")
            return chats.add_imported(chats.keep_system(store, system),
                                      chats.parse_import(path.read_bytes(), f"“{path.name}”"))

        return self._switch(imported, request)

    def _switch(self, change, request) -> tuple:
        """A change of the chat shown; refused while this tab has an answer running or waiting
        (its last update would land in the other chat)."""
        try:
            if session_of(request) in self.tickets.sessions():
                raise UserError(BUSY)
            return shown(change(), note="").outputs()
        except UserError as e:
            return ChatsView(note=user_error(str(e))).outputs()

    # ---- versions from the chat's latest turning point (app.versions) -------------------------
    def versions_written(self, kept, history, store, request: gr.Request = None):
        """After a Regenerate or an edit: what it replaced (in the chat it read, `regenerated`) and what it wrote are
        versions of the chat from that point on, the new one shown. -> (versions, *the flip controls)"""
        chat_id = chats.current_id(store)
        replaced = self.regenerated.pop(session_of(request), None)
        if replaced is not None:  # (none: an answer edited in place, which is what its version holds now)
            kept = versions.written(versions.replacing(kept, chat_id, *replaced), chat_id, history or [])
        return (kept, *versions_nav(kept, history, store))

    @staticmethod
    def versions_view(kept, history, store):
        """After anything that changes the chat shown: the flip controls, where its last answer has versions."""
        return versions_nav(kept, history, store)

    def versions_back(self, kept, history, store, request: gr.Request = None):
        return self._flip(-1, kept, history, store, request)

    def versions_forward(self, kept, history, store, request: gr.Request = None):
        return self._flip(1, kept, history, store, request)

    def _flip(self, step, kept, history, store, request) -> tuple:
        """-> (versions, notice, *the flip controls, *CHATS_VIEW): the version shown, and kept in the browser's
        chat store, in one update."""
        if session_of(request) in self.tickets.sessions():  # its last update would undo the flip
            return (gr.skip(), user_error(BUSY_FLIP), *(gr.skip(),) * 4, *ChatsView().outputs())
        store = chats.normal(store)
        flipped = versions.flip(kept, store["current"], history or [], step)
        if flipped is None:  # the chat changed since the controls were shown
            return (gr.skip(), "", *versions_nav(kept, history, store), *ChatsView().outputs())
        chat, kept = flipped
        now = versions.current(kept, store["current"], chat)
        which = versions.describe(now)
        notice = FLIPPED.format(which=which[:1].lower() + which[1:])  # "answer 2 of 3", "version 2 of 3"
        return (kept, notice, *versions_nav(kept, chat, store),
                *shown(chats.save(store, chat, now.as_json()), system=False).outputs())

    # ---- settings ---------------------------------------------------------------------------
    @staticmethod
    def settings_save(system, *values):
        """Any setting changed: keep them all (the order of ChatSettings.names())."""
        return {"system": system or "", **asdict(ChatSettings(*values))}

    def settings_load(self, stored, store, system, *values):
        """Page load: the settings kept in this browser, each checked as the chat would check it.
        Speculation stays off when this model cannot speculate. The system prompt is the open chat's own where it
        has messages and keeps one, else the one typed last in this browser."""
        spec_ok = self.manager.backend is None and self.manager.engine is not None  # a head, or context lookup
        spec_at = 1 + ChatSettings.names().index("spec")
        if not isinstance(stored, dict):  # nothing kept in this browser: leave the controls as they are now
            # (the values this event read are the page's first ones; a slider moved since would be undone)
            updates = [gr.skip()] * (1 + len(values))
            if not spec_ok:
                updates[spec_at] = False
            return tuple(updates)
        shown_now = ChatSettings(*values)
        kept = ChatSettings.stored(stored, shown_now)
        chat = chats.current(chats.normal(store))
        if chat["messages"] and chats.system_of(chat) is not None:  # chats_load showed it already
            kept_system = chats.system_of(chat)
        else:
            kept_system = stored.get("system") if isinstance(stored.get("system"), str) else system
        updates = [kept_system] + [getattr(kept, name) for name in ChatSettings.names()]
        updates[spec_at] = kept.spec and spec_ok
        return tuple(updates)


def versions_nav(kept, history, store) -> tuple:
    """(the flip controls' row, their label, back, forward) for the chat shown: hidden unless it has other versions
    from its latest turning point; back and forward greyed out at the first and the last."""
    chat_id, history = chats.current_id(store), history or []
    now = versions.current(kept, chat_id, history)
    text = versions.describe(now)
    if not text:
        return gr.update(visible=False), "", gr.update(interactive=False), gr.update(interactive=False)
    return (gr.update(visible=True), text, gr.update(interactive=now.shown > 0),
            gr.update(interactive=now.shown < len(now.answers) - 1))


def versions_row() -> list:
    """The flip controls under the chat: back, "Answer 2 of 3", forward; hidden until a Regenerate or an edit keeps a
    version."""
    with gr.Row(visible=False, elem_id="versions", equal_height=True) as row:
        back = gr.Button("◀ Previous", size="sm", scale=1, min_width=80, elem_id="versions-back", interactive=False)
        label = gr.Markdown(elem_id="versions-label")
        forward = gr.Button("Next ▶", size="sm", scale=1, min_width=80, elem_id="versions-forward", interactive=False)
    return [row, label, back, forward]


def stores() -> tuple[gr.BrowserState, gr.BrowserState]:
    secret = browser_secret()
    return (gr.BrowserState(None, storage_key=STORE_KEY, secret=secret),
            gr.BrowserState(None, storage_key=SETTINGS_KEY, secret=secret))


def chat_list() -> dict:
    """The chat picker row and the 'Manage chats' section; returns their components by name."""
    with gr.Row(elem_id="chats-bar", equal_height=True):
        picker = gr.Dropdown([], label="Chat", show_label=False, scale=4, elem_id="chat-pick",
                             info=None, container=False)
        new = gr.Button("New chat", scale=1, elem_id="new-chat", size="md")
    with gr.Accordion("Manage chats: rename, delete, export, import", open=False, elem_id="manage-chats"):
        with gr.Row():
            title = gr.Textbox(label="Title", scale=3, elem_id="chat-title", max_lines=1)
            rename = gr.Button("Rename", scale=1, elem_id="rename-chat")
            delete = gr.Button("Delete chat", scale=1, variant="stop", elem_id="delete-chat")
        with gr.Row():
            export_md = gr.DownloadButton("Export Markdown", elem_id="export-md", interactive=False)
            export_json = gr.DownloadButton("Export JSON", elem_id="export-json", interactive=False)
            export_all = gr.DownloadButton("Export all chats", elem_id="export-all", interactive=False)
            upload = gr.UploadButton("Import JSON", file_types=[".json"], elem_id="import-json")
        gr.Markdown(KEPT_HERE, elem_id="kept-here")
    note = gr.Markdown(elem_id="chats-note")
    return dict(picker=picker, new=new, title=title, rename=rename, delete=delete, export_md=export_md,
                export_json=export_json, export_all=export_all, upload=upload, note=note)

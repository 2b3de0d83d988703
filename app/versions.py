"""The answers a Regenerate replaced, kept to flip back to: the chat's last answer only, while it is last.

Each chat (by its id in the chat store) keeps at most one `Versions`: the messages before its last answer
(`turns`, as (role, text) pairs) and every answer written to them (`answers`, in the order written), one of
which is shown. They hold while the chat's messages before its last answer are `turns`; a new message, an
edited question or Clear leaves them behind (and they are dropped the next time the chat is regenerated).
Continuing or editing the shown answer changes what that version holds (it is read back from the chat
before each flip). The kept versions are a plain JSON value in the page's session (gr.State):
{chat_id: {"turns": [[role, text], ...], "answers": [text, ...], "shown": i}}, and each chat's is saved with it in
the browser's chat store (app.chats, "versions"); nothing here touches the engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from app.chat import flatten

MAX_VERSIONS = 20  # per chat; the oldest goes first


@dataclass(frozen=True)
class Versions:
    turns: tuple[tuple[str, str], ...]  # the messages before the answer: (role, text)
    answers: tuple[str, ...]
    shown: int

    def as_json(self) -> dict:
        return {**asdict(self), "turns": [list(t) for t in self.turns], "answers": list(self.answers)}

    @classmethod
    def from_json(cls, value) -> "Versions | None":
        try:
            turns = tuple((str(r), str(t)) for r, t in value["turns"])
            answers = tuple(str(a) for a in value["answers"])
            shown = int(value["shown"])
        except (KeyError, TypeError, ValueError):
            return None
        return cls(turns, answers, shown) if answers and 0 <= shown < len(answers) else None


def before_answer(history: list[dict]) -> tuple[tuple[str, str], ...] | None:
    """The (role, text) messages before the chat's last answer; None where it does not end with one."""
    if not history or history[-1].get("role") != "assistant":
        return None
    return tuple((m["role"], flatten(m.get("content"))) for m in history[:-1])


def current(kept, chat_id: str, history: list[dict]) -> Versions | None:
    """The versions kept for this chat, if they are its last answer's (else None)."""
    versions = Versions.from_json((kept or {}).get(chat_id)) if chat_id else None
    if versions is None or before_answer(history) != versions.turns:
        return None
    return versions


def _updated(versions: Versions, history: list[dict]) -> Versions:
    """The shown version as the chat now holds it (continued, or edited, since it was shown)."""
    answers = list(versions.answers)
    answers[versions.shown] = flatten(history[-1].get("content"))
    return Versions(versions.turns, tuple(answers), versions.shown)


def _store(kept, chat_id: str, versions: Versions | None) -> dict:
    kept = {k: v for k, v in (kept or {}).items() if k != chat_id}
    return kept if versions is None else {**kept, chat_id: versions.as_json()}


def replacing(kept, chat_id: str, history: list[dict]) -> dict:
    """As a Regenerate starts: the answer about to be replaced becomes a version (with those already kept
    for it, if they are this answer's)."""
    turns = before_answer(history)
    if turns is None or not chat_id:
        return dict(kept or {})
    versions = current(kept, chat_id, history)
    versions = _updated(versions, history) if versions else Versions(turns, (flatten(history[-1]["content"]),), 0)
    return _store(kept, chat_id, versions)


def written(kept, chat_id: str, history: list[dict]) -> dict:
    """After a Regenerate: its answer is the newest version and the one shown. An answer the same as a
    version kept (greedy decoding writes the same answer again; a refused Regenerate leaves the old one)
    shows that version instead of adding it twice."""
    versions = current(kept, chat_id, history)
    if versions is None:
        return dict(kept or {})
    text = flatten(history[-1].get("content"))
    if text in versions.answers:
        return _store(kept, chat_id, Versions(versions.turns, versions.answers, versions.answers.index(text)))
    answers = (versions.answers + (text,))[-MAX_VERSIONS:]
    return _store(kept, chat_id, Versions(versions.turns, answers, len(answers) - 1))


def flip(kept, chat_id: str, history: list[dict], step: int) -> tuple[list[dict], dict] | None:
    """(the chat with the version `step` away shown as its last answer, the versions kept), or None where
    the chat's last answer has no other version (then nothing changes)."""
    versions = current(kept, chat_id, history)
    if versions is None or len(versions.answers) < 2:
        return None
    versions = _updated(versions, history)
    shown = min(max(versions.shown + step, 0), len(versions.answers) - 1)
    versions = Versions(versions.turns, versions.answers, shown)
    chat = list(history[:-1]) + [{"role": "assistant", "content": versions.answers[shown]}]
    return chat, _store(kept, chat_id, versions)


def label(kept, chat_id: str, history: list[dict]) -> str:
    """"Answer 2 of 3" where the chat's last answer has other versions, else ""."""
    versions = current(kept, chat_id, history)
    if versions is None or len(versions.answers) < 2:
        return ""
    return f"Answer {versions.shown + 1} of {len(versions.answers)}"

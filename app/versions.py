"""What a Regenerate or an edit replaced, kept to flip back to: the chat's latest turning point only.

Each chat (by its id in the chat store) keeps at most one `Versions`: the messages before a point of the chat
(`turns`, as (role, text) pairs) and every tail written from there (`answers`, in the order written, each its
messages as (role, text) pairs), one of which is shown. A Regenerate's point is the last answer (each tail that
answer alone); an edited question's, the question (each tail the question and its answer; an edit of an earlier
message keeps the turns it drops in the tail it replaces). They hold while the chat's messages before the point are
`turns` and the chat has as many after it as the shown tail: a new message or Clear leaves them behind (and they
are dropped the next time the chat turns), while an edit before the point moves them back to it. Continuing or
editing the shown answer in place changes what that version holds (it is read back from the chat before each flip).
The kept versions are a plain JSON value in the page's session (gr.State): {chat_id: {"turns": [[role, text], ...],
"answers": [tail, ...], "shown": i}}, a tail being an answer's text or a list of [role, text], and each chat's is
saved with it in the browser's chat store (app.chats, "versions"); nothing here touches the engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from app.chat import flatten

MAX_VERSIONS = 20  # per chat; the oldest goes first


Tail = tuple[tuple[str, str], ...]  # messages as (role, text)


def pairs(messages: list[dict]) -> Tail:
    return tuple((m["role"], flatten(m.get("content"))) for m in messages)


@dataclass(frozen=True)
class Versions:
    turns: Tail  # the messages before the point
    answers: tuple[Tail, ...]  # every tail written from it
    shown: int

    def as_json(self) -> dict:
        answers = [t[0][1] if _answer_alone(t) else [list(m) for m in t] for t in self.answers]
        return {**asdict(self), "turns": [list(t) for t in self.turns], "answers": answers}

    @classmethod
    def from_json(cls, value) -> "Versions | None":
        try:
            turns = tuple((str(r), str(t)) for r, t in value["turns"])
            answers = tuple((("assistant", a),) if isinstance(a, str) else tuple((str(r), str(t)) for r, t in a)
                            for a in value["answers"])
            shown = int(value["shown"])
        except (KeyError, TypeError, ValueError):
            return None
        if not answers or not all(answers) or not 0 <= shown < len(answers):
            return None
        return cls(turns, answers, shown)


def _answer_alone(tail: Tail) -> bool:
    return len(tail) == 1 and tail[0][0] == "assistant"


def current(kept, chat_id: str, history: list[dict]) -> Versions | None:
    """The versions kept for this chat, if they still hold for it (else None): the messages before their point are
    the chat's, and the messages after it are as many as the shown tail's, in the same roles."""
    versions = Versions.from_json((kept or {}).get(chat_id)) if chat_id else None
    if versions is None:
        return None
    at, shown = len(versions.turns), versions.answers[versions.shown]
    if pairs(history[:at]) != versions.turns or [m.get("role") for m in history[at:]] != [r for r, _ in shown]:
        return None
    return versions


def _updated(versions: Versions, history: list[dict]) -> Versions:
    """The shown version as the chat now holds it (continued, or edited, since it was shown)."""
    answers = list(versions.answers)
    answers[versions.shown] = pairs(history[len(versions.turns):])
    return Versions(versions.turns, tuple(answers), versions.shown)


def _store(kept, chat_id: str, versions: Versions | None) -> dict:
    kept = {k: v for k, v in (kept or {}).items() if k != chat_id}
    return kept if versions is None else {**kept, chat_id: versions.as_json()}


def replacing(kept, chat_id: str, history: list[dict], at: int | None = None) -> dict:
    """As a Regenerate (the chat's last answer, `at` None) or an edit (of the message at `at`) starts: the chat's
    messages from there on become a version, beside those kept for it where they still hold. Kept versions from a
    later point are moved to this one, each with the messages between the two points before it."""
    if at is None:
        at = len(history) - 1 if history and history[-1].get("role") == "assistant" else -1
    if not chat_id or not 0 <= at < len(history):
        return dict(kept or {})
    versions = current(kept, chat_id, history)
    if versions is None:
        return _store(kept, chat_id, Versions(pairs(history[:at]), (pairs(history[at:]),), 0))
    versions = _updated(versions, history)
    point = len(versions.turns)
    if at < point:
        between = pairs(history[at:point])
        versions = Versions(pairs(history[:at]), tuple(between + t for t in versions.answers), versions.shown)
    return _store(kept, chat_id, versions)


def written(kept, chat_id: str, history: list[dict]) -> dict:
    """After a Regenerate or an edit: the chat's messages from the kept versions' point on are the newest version
    and the one shown. A tail the same as a version kept (greedy decoding writes the same answer again; a refused
    Regenerate or edit leaves the chat as it was) shows that version instead of adding it twice."""
    versions = Versions.from_json((kept or {}).get(chat_id)) if chat_id else None
    if versions is None or pairs(history[:len(versions.turns)]) != versions.turns \
            or len(history) <= len(versions.turns):
        return dict(kept or {})
    tail = pairs(history[len(versions.turns):])
    if tail in versions.answers:
        return _store(kept, chat_id, Versions(versions.turns, versions.answers, versions.answers.index(tail)))
    answers = (versions.answers + (tail,))[-MAX_VERSIONS:]
    return _store(kept, chat_id, Versions(versions.turns, answers, len(answers) - 1))


def flip(kept, chat_id: str, history: list[dict], step: int) -> tuple[list[dict], dict] | None:
    """(the chat with the version `step` away shown from the versions' point on, the versions kept), or None where
    the chat has no other version there (then nothing changes)."""
    versions = current(kept, chat_id, history)
    if versions is None or len(versions.answers) < 2:
        return None
    versions = _updated(versions, history)
    shown = min(max(versions.shown + step, 0), len(versions.answers) - 1)
    versions = Versions(versions.turns, versions.answers, shown)
    chat = list(history[:len(versions.turns)]) + [{"role": r, "content": t} for r, t in versions.answers[shown]]
    return chat, _store(kept, chat_id, versions)


def label(kept, chat_id: str, history: list[dict]) -> str:
    """"Answer 2 of 3" where the chat's last answer has other versions ("Version 2 of 3" where they begin at a
    question), else ""."""
    return describe(current(kept, chat_id, history))


def describe(versions: Versions | None) -> str:
    """label's text for versions that hold for the chat shown (`current`'s answer)."""
    if versions is None or len(versions.answers) < 2:
        return ""
    what = "Answer" if all(_answer_alone(t) for t in versions.answers) else "Version"
    return f"{what} {versions.shown + 1} of {len(versions.answers)}"

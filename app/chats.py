"""Past chats, kept in the visitor's browser: the store's pure operations and export / import.

The store lives in a gr.BrowserState (the browser's localStorage, encrypted); this server holds
no copy between requests and nothing leaves the machine. It is a plain JSON value:

    {"version": 1, "current": "<id>", "chats": [Chat, ...]}   Chat: {"id", "title", "named",
                                                                   "messages", "updated"[, "system"][, "versions"]}

`messages` are the chat's {"role", "content"} turns with text content; `named` is True once the
visitor renamed the chat (else the title follows its first message); `system`, the system prompt the
chat is written with (chats kept before it was kept have none: they take the one shown); `versions`,
where a Regenerate or an edit kept some, what they replaced (app.versions; exports leave them out).
Every operation returns a new store and leaves its argument unchanged.
"""

from __future__ import annotations

import copy
import json
import re
import tempfile
import time
import uuid
from pathlib import Path

from app.chat import flatten
from app.errors import UserError

VERSION = 1
FORMAT = "eagle-chat conversation"
FORMAT_ALL = "eagle-chat conversations"  # every chat of a browser in one file (export_all_file)
TITLE_CHARS = 48
UNTITLED = "New chat"
MAX_IMPORT_BYTES = 5_000_000  # a browser's localStorage holds about 5 MB per site in all
# What the store may take in the browser: Chromium's localStorage holds 5 MiB of UTF-16 code units per site (key and
# value lengths: 5,242,308 characters of one value measured; other browsers give about as much), less the settings'
# entry and some margin. Past it the browser refuses the write (Gradio logs it to the console and nothing else): the
# chat stays on the page but is not kept.
STORAGE_CHARS = 5 * 2**20 - 40_000
NEARLY_FULL = 0.9  # of STORAGE_CHARS: the visitor is told before it is full
ROLES = ("user", "assistant")


def empty_store() -> dict:
    chat = new_chat_record()
    return {"version": VERSION, "current": chat["id"], "chats": [chat]}


def new_chat_record(messages: list | None = None, title: str = "", named: bool = False,
                    system: str | None = None) -> dict:
    messages = clean_messages(messages or [])
    record = {"id": uuid.uuid4().hex[:12], "title": title or auto_title(messages), "named": named,
              "messages": messages, "updated": time.time()}
    if system is not None:
        record["system"] = system
    return record


def _records(store) -> list[dict]:
    """The chat records of whatever the browser held (none at first visit, or from an older shape)."""
    if not isinstance(store, dict) or not isinstance(store.get("chats"), list):
        return []
    return [c for c in store["chats"] if isinstance(c, dict) and isinstance(c.get("id"), str)]


def current_id(store) -> str | None:
    """The id of the chat `normal(store)` makes current, without copying the store; None where it holds no chat."""
    ids = [c["id"] for c in _records(store)]
    if not ids:
        return None
    return store.get("current") if store.get("current") in ids else ids[0]


def normal(store) -> dict:
    """A usable store from whatever the browser held (None at first visit, or an older shape)."""
    chats = _records(store)
    if not chats:
        return empty_store()
    return {"version": VERSION, "current": current_id(store), "chats": copy.deepcopy(chats)}


def current(store: dict) -> dict:
    return next(c for c in store["chats"] if c["id"] == store["current"])


def system_of(chat: dict) -> str | None:
    """The system prompt a chat is written with; None for a chat kept before chats kept theirs."""
    return chat["system"] if isinstance(chat.get("system"), str) else None


def keep_system(store, system: str | None) -> dict:
    """The current chat is now written with `system` (None: unchanged). Its place in the list stays: the
    prompt is a setting of the chat, not a new turn."""
    store = normal(store)
    if system is not None:
        current(store)["system"] = system
    return store


def clean_messages(messages: list) -> list[dict]:
    """The UI history -> stored turns: text content, user and assistant roles only."""
    return [{"role": m["role"], "content": flatten(m.get("content"))}
            for m in messages if isinstance(m, dict) and m.get("role") in ROLES]


def auto_title(messages: list[dict]) -> str:
    first = next((m["content"] for m in messages if m["role"] == "user"), "")
    words = " ".join(first.split())
    if not words:
        return UNTITLED
    return words if len(words) <= TITLE_CHARS else words[:TITLE_CHARS - 1].rstrip() + "…"


def save(store, messages: list, versions: dict | None = None, system: str | None = None) -> dict:
    """The current chat now holds `messages` (its title follows them unless renamed), `versions` (the JSON
    value app.versions keeps for it; None: none) and, unless None, the system prompt `system`."""
    store = keep_system(store, system)
    chat = current(store)
    chat["messages"] = clean_messages(messages)
    chat.pop("versions", None)
    if versions is not None:
        chat["versions"] = copy.deepcopy(versions)
    chat["updated"] = time.time()
    if not chat.get("named"):
        chat["title"] = auto_title(chat["messages"])
    return store


def kept_versions(store) -> dict:
    """Every chat's versions (app.versions' session value: {chat_id: versions}) as the store holds them."""
    return {c["id"]: copy.deepcopy(c["versions"]) for c in normal(store)["chats"] if c.get("versions") is not None}


def stored_chars(store) -> int:
    """The characters the store takes in localStorage as Gradio's BrowserState writes it: base64 of a 16-byte IV,
    ":", then CryptoJS's AES-CBC of the store's compact JSON (UTF-8, PKCS#7 padding) in OpenSSL's salted format,
    base64."""
    n = len(json.dumps(store, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    return 24 + 1 + 4 * -(-(16 + (n // 16 + 1) * 16) // 3)


def storage_note(used: int) -> str:
    """What the visitor should know about the room left for chats in this browser, the store taking `used`
    characters there (stored_chars): "" while there is plenty."""
    mb = f"{used / 1e6:.1f} of about {STORAGE_CHARS / 1e6:.1f} MB"
    fix = "Export the chats you want to keep (Manage chats → Export all chats), then delete old ones."
    if used > STORAGE_CHARS:
        return (f"This browser's room for chats is full ({mb}): the latest changes are shown but not kept, and a "
                f"reload would lose them. {fix}")
    if used > NEARLY_FULL * STORAGE_CHARS:
        return f"This browser's room for chats is nearly full ({mb}). {fix}"
    return ""


def start_new(store, system: str | None = None) -> dict:
    """A new empty chat, written with `system` (unless None), becomes current (an empty current chat is reused
    instead)."""
    store = normal(store)
    if not current(store)["messages"]:
        return keep_system(store, system)
    chat = new_chat_record(system=system)
    return {**store, "current": chat["id"], "chats": [chat] + store["chats"]}


def select(store, chat_id) -> dict:
    store = normal(store)
    if chat_id not in [c["id"] for c in store["chats"]]:
        raise UserError("That chat is no longer in this browser (deleted in another tab?); pick another one.")
    return {**store, "current": chat_id}


def rename(store, title) -> dict:
    title = " ".join((title or "").split())
    if not title:
        raise UserError("Type a title first, then press Rename.")
    store = normal(store)
    chat = current(store)
    chat["title"], chat["named"] = title[:200], True
    return store


def delete(store) -> dict:
    """Remove the current chat; the most recently updated other chat (or a new one) becomes current."""
    store = normal(store)
    rest = [c for c in store["chats"] if c["id"] != store["current"]]
    if not rest:
        return empty_store()
    latest = max(rest, key=lambda c: c.get("updated", 0))
    return {**store, "current": latest["id"], "chats": rest}


def choices(store: dict) -> list[tuple[str, str]]:
    """(label, id) for the chat picker, the most recently updated first."""
    ordered = sorted(store["chats"], key=lambda c: c.get("updated", 0), reverse=True)
    return [(c["title"], c["id"]) for c in ordered]


# ---- export / import ---------------------------------------------------------------------

def to_markdown(chat: dict) -> str:
    parts = [f"# {chat['title']}\n"]
    if system_of(chat):
        parts.append(f"**System prompt:**\n\n{chat['system']}\n")
    for m in chat["messages"]:
        parts.append(f"**{'You' if m['role'] == 'user' else 'Assistant'}:**\n\n{m['content']}\n")
    return "\n".join(parts)


def _exported(chat: dict) -> dict:
    """A chat as export files hold it: its title, its system prompt where it has one, its messages."""
    system = system_of(chat)
    return {"title": chat["title"], **({"system": system} if system is not None else {}), "messages": chat["messages"]}


def to_json(chat: dict) -> str:
    data = {"format": FORMAT, "version": VERSION, **_exported(chat)}
    return json.dumps(data, ensure_ascii=False, indent=2)


def export_files(chat: dict, folder: Path | None = None) -> tuple[str, str]:
    """Write the chat as Markdown and JSON for the download buttons; returns both paths."""
    folder = folder or Path(tempfile.gettempdir()) / "eagle-chat-exports" / chat["id"]
    folder.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^\w\-]+", "-", chat["title"]).strip("-")[:60] or "chat"
    md, js = folder / f"{stem}.md", folder / f"{stem}.json"
    md.write_text(to_markdown(chat), encoding="utf-8")
    js.write_text(to_json(chat), encoding="utf-8")
    return str(md), str(js)


def to_json_all(store: dict) -> str:
    """Every chat with messages, the most recently updated first, in one file (Import JSON reads it back)."""
    ordered = sorted((c for c in store["chats"] if c["messages"]), key=lambda c: c.get("updated", 0), reverse=True)
    data = {"format": FORMAT_ALL, "version": VERSION,
            "chats": [_exported(c) for c in ordered]}
    return json.dumps(data, ensure_ascii=False, indent=2)


def export_all_file(store: dict, folder: Path | None = None) -> str | None:
    """Write every chat of the store to one JSON file for the "Export all chats" button; None without any."""
    if not any(c["messages"] for c in store["chats"]):
        return None
    # one file per browser, rewritten: keyed by one of its chats (the least id: another only once that one is deleted)
    key = min(c["id"] for c in store["chats"])
    folder = folder or Path(tempfile.gettempdir()) / "eagle-chat-exports" / f"all-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "eagle-chat-chats.json"
    path.write_text(to_json_all(store), encoding="utf-8")
    return str(path)


def parse_import(raw: bytes, name: str = "the file") -> list[dict]:
    """An exported JSON file (one chat, or every chat: "Export all chats") -> new chat records, in the file's order
    (raises UserError naming the problem and the fix)."""
    fix = "Choose a .json file saved with “Export JSON” or “Export all chats”."
    if len(raw) > MAX_IMPORT_BYTES:
        raise UserError(f"{name} is {len(raw):,} bytes; chats of at most {MAX_IMPORT_BYTES:,} bytes fit in the "
                        "browser's storage. Import a shorter chat.")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{name} is not JSON ({e}). {fix}") from e
    if isinstance(data, dict) and isinstance(data.get("chats"), list):
        if not data["chats"]:
            raise UserError(f"{name} holds no chats. {fix}")
        records = [_chat_from(c, f"chat {i} of {name}", fix) for i, c in enumerate(data["chats"], 1)]
        for i, record in enumerate(records):  # the picker lists them in the file's order (the newest first)
            record["updated"] = records[0]["updated"] - i * 1e-3
        return records
    return [_chat_from(data, name, fix)]


def _chat_from(data, name: str, fix: str) -> dict:
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list):
        raise UserError(f"{name} has no \"messages\" list. {fix}")
    for i, m in enumerate(messages, 1):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise UserError(f"Message {i} of {name} is not {{\"role\": \"user\" or \"assistant\", \"content\": "
                            f"text}}. {fix}")
    title = data.get("title") if isinstance(data, dict) and isinstance(data.get("title"), str) else ""
    system = data.get("system") if isinstance(data, dict) else None
    if system is not None and not isinstance(system, str):
        raise UserError(f"The \"system\" prompt of {name} is not text. {fix}")
    return new_chat_record(messages, title=" ".join(title.split())[:200], named=bool(title.strip()), system=system)


def add_imported(store, imported: dict | list[dict]) -> dict:
    """The store with the imported chat(s) added, the first current; refused (UserError) where the store would not
    fit in the browser."""
    new = [imported] if isinstance(imported, dict) else list(imported)
    store = normal(store)
    chats = [c for c in store["chats"] if c["messages"] or c["id"] != store["current"]]  # drop an empty current
    added = {**store, "current": new[0]["id"], "chats": new + chats}
    if stored_chars(added) > STORAGE_CHARS:
        alone = stored_chars({**added, "chats": new})
        what = "This chat does" if len(new) == 1 else f"These {len(new)} chats do"
        raise UserError(f"{what} not fit in this browser's room for chats: {'it needs' if len(new) == 1 else 'they need'} "
                        f"{alone / 1e6:.1f} MB of about {STORAGE_CHARS / 1e6:.1f} MB, and the chats kept here use "
                        f"{stored_chars(store) / 1e6:.1f} MB. " + ("Delete or export old chats first, then import again."
                        if alone <= STORAGE_CHARS else "Import fewer or shorter chats."))
    return added

"""A text file attached to a message: its text goes into the message box, named and fenced, to be
read and edited before it is sent. The model reads text only, so a file is its text; nothing of it
is kept anywhere else (the chat keeps the message as sent)."""

from __future__ import annotations

import re
from pathlib import Path

from app.errors import UserError

# a fence's language tag by file suffix (the chat renders the block with its highlighting)
LANGUAGES = {".py": "python", ".js": "javascript", ".ts": "typescript", ".json": "json", ".md": "markdown",
             ".html": "html", ".css": "css", ".c": "c", ".h": "c", ".cpp": "cpp", ".hpp": "cpp", ".rs": "rust",
             ".go": "go", ".java": "java", ".kt": "kotlin", ".rb": "ruby", ".php": "php", ".sh": "bash",
             ".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".ini": "ini", ".sql": "sql", ".csv": "csv",
             ".tsv": "tsv", ".xml": "xml", ".tex": "latex", ".r": "r", ".swift": "swift", ".lua": "lua"}
SNIFF = 8192  # bytes looked at for a NUL, the mark of a binary file


def attach(box: str, path: Path, limit: int, who: str = "") -> str:
    """`box` with the text of the file at `path` appended as a named, fenced block; a UserError that
    names the file and the problem if it is not text or the message would pass `limit` characters."""
    name = path.name
    size = path.stat().st_size
    if size == 0:
        raise UserError(f"“{name}” is empty: nothing to attach.")
    if size > 4 * limit + 4:  # more bytes than `limit` characters can take in UTF-8: refused unread
        raise UserError(f"“{name}” is {size:,} bytes, more than a message may hold ({limit:,} characters{who}). "
                        "Attach a shorter file or paste the part you need (your message is kept).")
    data = path.read_bytes()
    if b"\x00" in data[:SNIFF]:
        raise UserError(f"“{name}” is not a text file (it holds binary data). The model reads text: attach a text "
                        "file (plain text, Markdown, code, CSV ...) or paste the text you need.")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"“{name}” is not UTF-8 text (byte {e.start:,} cannot be read). Save it as UTF-8 and "
                        "attach it again, or paste its text.") from None
    text = text.replace("\r\n", "\n").strip("\n")
    longest = max((len(run) for run in re.findall(r"`{3,}", text)), default=0)
    fence = "`" * max(3, longest + 1)  # longer than any fence inside, so the block holds the whole file
    block = f"{name}:\n{fence}{LANGUAGES.get(path.suffix.lower(), '')}\n{text}\n{fence}"
    message = f"{box.rstrip()}\n\n{block}" if (box or "").strip() else block
    if len(message) > limit:
        raise UserError(f"“{name}” holds {len(text):,} characters; with your message that makes {len(message):,}, "
                        f"more than the limit of {limit:,} characters{who}. Attach a shorter file or paste the "
                        "part you need (your message is kept).")
    return message

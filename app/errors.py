"""How a problem reaches the visitor and the console.

Never by raising gr.Error from a handler: Gradio then replaces every output of the event with
a red "Error" placeholder (the chat, the message box, the chart ...). A handler instead shows
the message as a toast and in its notice output, and skips every other output, which keeps
its content. The console gets one log line for a problem the visitor can fix and the
traceback only for a real fault.
"""

from __future__ import annotations

import logging
import re

import gradio as gr

log = logging.getLogger("eagle_chat")


class UserError(Exception):
    """A problem the visitor can fix (an empty message, a model that cannot be found, ...)."""


# what the operating system's connection errors mean, in words ("[Errno 111] Connection refused")
ERRNO_WORDS = {111: "nothing is listening at that address (connection refused)",
               110: "the connection timed out", 113: "no route to that host",
               -2: "that host name is unknown", -3: "that host name could not be looked up (offline?)",
               2: "no such file or folder", 13: "permission denied", 28: "the disk is full"}


def plain_reason(error: BaseException) -> str:
    """An exception's message for a person: no "[Errno N]" codes, no class names."""
    text = str(error).strip()
    errno = getattr(error, "errno", None)
    match = re.search(r"\[Errno (-?\d+)\]\s*", text)
    code = errno if isinstance(errno, int) else int(match[1]) if match else None
    if code in ERRNO_WORDS:
        return ERRNO_WORDS[code]
    return re.sub(r"\[Errno -?\d+\]\s*", "", text) or "no reason given"


def refuse(message: str, n_outputs: int, notice_at: int) -> tuple:
    """Outputs that change nothing but the notice."""
    return tuple(message if i == notice_at else gr.skip() for i in range(n_outputs))


TOAST_S = 6  # a toast repeats a message shown in place, so it need not stay long (Gradio: 10 s)


def user_error(message: str) -> str:
    log.warning("%s", message)
    gr.Warning(message, duration=TOAST_S)
    return message


def fault(error: BaseException) -> str:
    log.exception("internal error (a bug): %s: %s", type(error).__name__, error)
    message = f"Internal error ({type(error).__name__}: {error}); the details are on the console."
    gr.Warning(message)
    return message

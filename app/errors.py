"""How a problem reaches the visitor and the console.

Never by raising gr.Error from a handler: Gradio then replaces every output of the event with
a red "Error" placeholder (the chat, the message box, the chart ...). A handler instead shows
the message as a toast and in its notice output, and skips every other output, which keeps
its content. The console gets one log line for a problem the visitor can fix and the
traceback only for a real fault.
"""

from __future__ import annotations

import logging

import gradio as gr

log = logging.getLogger("eagle_chat")


class UserError(Exception):
    """A problem the visitor can fix (an empty message, a model that cannot be found, ...)."""


def refuse(message: str, n_outputs: int, notice_at: int) -> tuple:
    """Outputs that change nothing but the notice."""
    return tuple(message if i == notice_at else gr.skip() for i in range(n_outputs))


def user_error(message: str) -> str:
    log.warning("%s", message)
    gr.Warning(message)
    return message


def fault(error: BaseException) -> str:
    log.exception("internal error (a bug): %s: %s", type(error).__name__, error)
    message = f"Internal error ({type(error).__name__}: {error}); the details are on the console."
    gr.Warning(message)
    return message

"""The controls that only the local engine understands, enabled or disabled for the backend in use.

With a remote backend (app.backend) speculation, the draft tree, token highlighting, the per-step
chart and Side by side stay visible but disabled, each with a one-line reason; they come back
when the chat returns to the local engine.
"""

from __future__ import annotations

import gradio as gr

SPEC_LABEL, LOOKUP_LABEL = "Speculative decoding (EAGLE)", "Speculative decoding (context lookup)"
SPEC_INFO = "The EAGLE head drafts; where the text repeats, drafts are copied from it too. Lossless either way."
LOOKUP_INFO = ("This model has no EAGLE head: drafts are copied from the conversation where it repeats (context "
               "lookup); lossless, and a step with nothing to copy is a plain step.")
LOCAL_INFO = {"depth": "How many tokens ahead the head drafts; the tree size grows with it.",
              "top_k": "How many children each drafted token may get.",
              "tree_size": "Tokens verified per step, the root included.",
              "highlight": "Colours the answer below by where each token came from."}
CHART_TITLE = "Tokens committed per verification step"
SPEC_OFF_TREE = "Not used while speculative decoding is off."
NO_HEAD_TREE = "Not used: without an EAGLE head there is no draft tree, only text copied from the conversation."
REMOTE_SPEC = "Off here: the remote server decides whether and how it speculates."
REMOTE_TREE = "Not used: the remote server drafts with its own settings."
REMOTE_HIGHLIGHT = "Needs the local engine: a remote server does not say which tokens were drafted."
REMOTE_CHART = "Per-step chart: local engine only"  # a remote server reports totals
REMOTE_COMPARE = ("Side by side needs the local engine (it races plain and speculative decoding step by "
                  "step); press “Use local engine” in the Models tab.")
# the Chat and Side-by-side controls that depend on the backend, in this order
CONTROLS = ("spec", "depth", "top_k", "tree_size", "highlight", "chart", "compare", "compare_note")


def control_props(manager) -> dict[str, dict]:
    """Each backend-dependent control's interactive state and reason, for build and updates."""
    remote = manager.backend is not None
    local = not remote and manager.engine is not None
    has_head = local and manager.engine.has_head
    tree = tree_props(remote, local, has_head)  # context lookup alone has no tree to shape
    head_or_none = has_head or not local
    info = REMOTE_SPEC if remote else SPEC_INFO if head_or_none else LOOKUP_INFO
    label = SPEC_LABEL if head_or_none else LOOKUP_LABEL
    return {"spec": dict(value=local, interactive=local, info=info, label=label), **tree,
            "highlight": dict(interactive=not remote, info=REMOTE_HIGHLIGHT if remote else LOCAL_INFO["highlight"]),
            "chart": dict(title=REMOTE_CHART if remote else CHART_TITLE),
            "compare": dict(interactive=not remote),
            "compare_note": dict(value=REMOTE_COMPARE if remote else "", visible=remote)}


def tree_props(remote: bool, spec_on: bool, has_head: bool = True) -> dict[str, dict]:
    """The tree controls: greyed out, with the reason, while no head tree drafts (speculation off, a remote server,
    or a model without a head: context lookup alone)."""
    return {k: dict(interactive=spec_on and has_head and not remote,
                    info=REMOTE_TREE if remote else NO_HEAD_TREE if not has_head else LOCAL_INFO[k] if spec_on
                    else SPEC_OFF_TREE)
            for k in ("depth", "top_k", "tree_size")}


def tree_updates(manager, spec_on) -> tuple:
    """The speculation box changed: the depth, top-k and tree size follow it."""
    has_head = manager.engine is not None and manager.engine.has_head
    props = tree_props(manager.backend is not None, bool(spec_on), has_head)
    return tuple(gr.update(**props[k]) for k in ("depth", "top_k", "tree_size"))


def control_updates(manager) -> tuple:
    props = control_props(manager)
    return tuple(gr.update(**props[name]) for name in CONTROLS)

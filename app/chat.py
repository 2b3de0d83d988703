"""Engine step events -> what the UI shows. Pure rendering; no decoding happens here.

Words used below (the engine's): a *verification step* is one target forward over a draft
tree; it commits `len(token_ids)` tokens, of which the first `draft_tokens` are *accepted
draft* tokens and any remaining one is the *bonus* token the target adds itself. A plain
step (and the prefill step) commits one target token. tau is the mean number of tokens
committed per target forward.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field

import pandas as pd

MAX_CHART_STEPS = 60  # the chart shows the latest steps; the JSON keeps them all
DRAFT, BONUS, PLAIN = "accepted draft", "bonus (target)", "plain (target)"
FINISH_TEXT = {"eos": "end of answer", "stop": "stop string",
               "length": "max new tokens reached (Continue writes more)",
               "context": "context window full"}


def flatten(content) -> str:
    """Gradio gives message content as a string or a list of parts; the engine wants text."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, (list, tuple)):
        return "".join(flatten(part) for part in content)
    return "" if content is None else str(content)


def engine_messages(history: list[dict], system: str) -> list[dict]:
    """UI history -> chat-template messages (plain strings, optional system prompt first)."""
    msgs = [{"role": "system", "content": system.strip()}] if system and system.strip() else []
    return msgs + [{"role": m["role"], "content": flatten(m["content"])} for m in history]


SAME_AGAIN = ("The same answer again: at temperature 0 (greedy) the model writes the one answer it finds likeliest. "
              "For another, raise Sampling → Temperature (0.7, say), or edit your message.")


def same_again(before: list[dict], turns: list[dict], shown: list[dict]) -> bool:
    """Did the same prompt (a Regenerate) give the answer it replaces? `before`: the chat before this
    answer, `turns`: what was answered, `shown`: the chat with the new answer."""
    return before[:len(turns)] == turns and before[len(turns):] == shown[len(turns):]


def opening(turns: list[dict], continues: bool) -> tuple[list[dict], str]:
    """(the chat an answer streams into, the text it is appended to): `turns` and a new, empty answer, or
    (`continues`) `turns` ending with the answer being written on, and that answer's text."""
    if not continues:
        return turns + [{"role": "assistant", "content": ""}], ""
    prefix = flatten(turns[-1]["content"])
    return turns[:-1] + [{"role": "assistant", "content": prefix}], prefix


def trim_to_context(messages: list[dict], count_tokens, max_context: int, max_new_tokens: int):
    """Drop the oldest user/assistant turns until the prompt and the answer fit the context.

    Returns (messages, dropped_turns). The system prompt and the last user message (with the
    answer after it, if one is being continued) always stay; if even they do not fit the caller
    reports it (the engine would stop at once).
    """
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system):]
    dropped = 0
    while (any(m["role"] == "user" for m in turns[1:])
           and count_tokens(system + turns) + max_new_tokens > max_context):
        cut = 1
        while turns[cut]["role"] != "user":
            cut += 1  # drop a whole exchange so the history still alternates user/assistant
        turns = turns[cut:]
        dropped += 1
    return system + turns, dropped


@dataclass
class AnswerView:
    """Accumulates one answer's step events into text, per-step rows and running totals."""

    mode: str  # "speculative" | "plain"
    text: str = ""
    rows: list[dict] = field(default_factory=list)
    pieces: list[tuple[int, str, str]] = field(default_factory=list)  # (token id, text, kind)
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    total_tokens: int = 0
    target_forwards: int = 0
    elapsed_s: float = 0.0
    tree_size: int = 0
    finish_reason: str | None = None
    stopped: bool = False
    since: float | None = None          # time.monotonic() of the visitor's Send (None: not shown)
    first_token_s: float | None = None  # the visitor's wait for the first token, queue included
    wall_s: float = 0.0                 # the visitor's wait for the answer so far
    prompt_tokens: int = 0
    max_context: int = 0                # the model's context in tokens (0: not shown)
    long_chat: object = None            # app.longchat.LongChat: why plain steps ran (None: not known)
    head_nodes: int = 0                 # the last verified tree's nodes from the head, root included
    copied_steps: int = 0               # steps whose tree held text copied from the context
    copied_accepted: int = 0            # tokens accepted from copied text
    seed: int | None = None             # a sampled answer's seed (it gives this answer again, either mode)

    def on_step(self, tree, result) -> None:
        """The engine's per-step hook (Engine.generate's on_step), called before the step's event:
        a tree's nodes grafted from context lookup (core.decoding.lookup.graft) score -inf, the head's do not."""
        scores = tree.scores
        copied = int((scores == float("-inf")).sum()) if scores is not None else 0
        self.head_nodes = tree.size - copied
        if copied:
            self.copied_steps += 1
            self.copied_accepted += sum(1 for node in result.path[1:] if node >= self.head_nodes)

    def add(self, ev) -> None:
        assert len(ev.token_ids) == len(ev.token_texts), "token texts must align with token ids"
        extra_kind = BONUS if ev.tree_size > 0 else PLAIN
        for i, (tid, piece) in enumerate(zip(ev.token_ids, ev.token_texts)):
            self.pieces.append((int(tid), piece, DRAFT if i < ev.draft_tokens else extra_kind))
        self.text += ev.text
        self.rows.append({"step": len(self.rows) + 1, "tokens": len(ev.token_ids),
                          "draft": ev.draft_tokens, "tree_size": ev.tree_size,
                          "draft_ms": round(ev.draft_s * 1e3, 2), "verify_ms": round(ev.verify_s * 1e3, 2)})
        self.draft_s += ev.draft_s
        self.verify_s += ev.verify_s
        self.other_s += ev.other_s
        self.total_tokens, self.target_forwards, self.elapsed_s = ev.total_tokens, ev.target_forwards, ev.elapsed_s
        if ev.tree_size:
            self.tree_size = ev.tree_size
        if ev.finished:
            self.finish_reason = ev.finish_reason
        self.clock_in()

    def clock_in(self) -> None:
        """The visitor's clock: from Send to now (the engine's elapsed_s starts later, after the
        queue and the tokenizer, and knows nothing of the page)."""
        if self.since is None:
            return
        self.wall_s = time.monotonic() - self.since
        if self.first_token_s is None and self.total_tokens:
            self.first_token_s = self.wall_s

    def ran(self) -> str:
        """The mode that actually ran: a speculative answer decodes plain steps past the tree's
        long-context caps and near the end of the context window (a prefill is plain in every mode)."""
        steps = self.rows[1:]
        plain = [r["step"] for r in steps if r["tree_size"] == 0]
        if self.mode != "speculative" or not steps or not plain:
            return self.mode
        why = ""
        if self.long_chat is not None:
            reached = self.prompt_tokens + sum(r["tokens"] for r in self.rows if r["step"] < plain[0])
            why = f": {self.long_chat.pause_reason(reached)}"
            if self.long_chat.adaptive:  # plain and speculative steps may alternate
                if len(plain) == len(steps):
                    return f"plain: {self.long_chat.all_plain_reason}"
                return f"speculative on {len(steps) - len(plain)} of {len(steps)} steps, plain on the others{why}"
        if len(plain) == len(steps):
            return f"plain, speculation paused{why}"
        return f"speculative, plain from step {plain[0]}{why}"

    @property
    def tau(self) -> float:
        return self.total_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def own_tokens_per_s(self) -> float:
        """Tokens per second of this answer's own clock (see clock_s)."""
        return self.total_tokens / self.clock_s if self.clock_s > 0 else 0.0

    def shares(self) -> tuple[float, float, float]:
        """Fractions of the measured step time spent drafting, verifying, and elsewhere."""
        total = self.draft_s + self.verify_s + self.other_s
        if total <= 0:
            return 0.0, 0.0, 0.0
        return self.draft_s / total, self.verify_s / total, self.other_s / total

    @property
    def clock_s(self) -> float:
        """This answer's own clock: the compute time of its steps, not the time between them."""
        return self.draft_s + self.verify_s + self.other_s

    def token_ids(self) -> list[int]:
        return [tid for tid, _, _ in self.pieces]

    def frame(self) -> pd.DataFrame:
        """Long format for a stacked bar chart: per step, accepted-draft and target tokens. The
        step is a number, so the axis labels only every few steps instead of crowding them."""
        recs = []
        for r in self.rows[-MAX_CHART_STEPS:]:
            target_kind = BONUS if r["tree_size"] > 0 else PLAIN
            recs.append({"step": r["step"], "tokens": r["draft"], "kind": DRAFT})
            recs.append({"step": r["step"], "tokens": r["tokens"] - r["draft"], "kind": target_kind})
        shown = {rec["kind"] for rec in recs}
        last = recs[-1]["step"] if recs else 1
        # a legend entry whose kind has no bar in view loses its colour square: give it a zero-height one
        recs += [{"step": last, "tokens": 0, "kind": kind} for kind in self.kinds() if kind not in shown]
        return pd.DataFrame(recs, columns=["step", "tokens", "kind"])

    def x_range(self) -> list[float]:
        """The chart's step range, with half a step of room so the end bars are whole."""
        steps = [r["step"] for r in self.rows[-MAX_CHART_STEPS:]] or [1]
        return [steps[0] - 0.5, steps[-1] + 0.5]

    def kinds(self) -> list[str]:
        """The legend: what this mode's bars can be (a speculative answer's prefill is plain)."""
        return [DRAFT, BONUS, PLAIN] if self.mode == "speculative" else [PLAIN]

    def summary(self) -> dict:
        d, v, o = self.shares()
        return {"mode": self.mode, "ran": self.ran(), "steps": len(self.rows), "tokens": self.total_tokens,
                "target_forwards": self.target_forwards, "tau": round(self.tau, 3),
                "tokens_per_s": round(self.tokens_per_s, 2), "elapsed_s": round(self.elapsed_s, 3),
                "draft_share": round(d, 3), "verify_share": round(v, 3), "other_share": round(o, 3),
                "tree_size": self.tree_size, "head_nodes": self.head_nodes, "copied_steps": self.copied_steps,
                "copied_accepted": self.copied_accepted, "finish_reason": self.finish_reason, "stopped": self.stopped,
                **({"context_tokens": self.prompt_tokens + self.total_tokens, "max_context": self.max_context}
                   if self.max_context else {}),
                **({"seed": self.seed} if self.seed is not None else {}),
                **({"first_token_s": round(self.first_token_s, 3), "wall_s": round(self.wall_s, 3)}
                   if self.first_token_s is not None else {}),
                "per_step": self.rows}

    def stats_markdown(self) -> str:
        d, v, o = self.shares()
        end = "stopped by you" if self.stopped else FINISH_TEXT.get(self.finish_reason or "", "streaming…")
        tree = ""
        if self.mode == "speculative" and self.tree_size:
            # (context lookup alone: the root is the head tree's only node, so only the copies are said)
            tree = "" if self.copied_steps and self.head_nodes <= 1 else \
                f" · head tree {self.head_nodes or self.tree_size} nodes"
            if self.copied_steps:
                tree += (f" · copied from earlier text on {self.copied_steps} step"
                         f"{'s' if self.copied_steps > 1 else ''}, {self.copied_accepted} tokens accepted")
        waited = ""
        if self.first_token_s is not None:  # what the visitor saw, from their Send
            # from the figures the raw numbers hold (0.44996 s is 0.45 there, so 0.5 here too, not 0.4)
            waited = (f"**First token after {round(self.first_token_s, 3):.1f} s · {self.total_tokens} tokens in "
                      f"{round(self.wall_s, 3):.1f} s** (your wait, from Send)\n\n")
        context = (f" · context {self.prompt_tokens + self.total_tokens:,} of {self.max_context:,} tokens"
                   if self.max_context else "")
        seed = (f" · sampled with seed {self.seed} (type it into Sampling → Seed for this answer again, "
                "speculative or plain)" if self.seed is not None else "")
        return (f"{waited}engine: **{self.tokens_per_s:.1f} tok/s** ({self.total_tokens} tokens in its "
                f"{self.elapsed_s:.1f} s of generating) · **τ {self.tau:.2f}** tokens per model pass\n\n"
                f"time: draft {d:.0%} · verify {v:.0%} · other {o:.0%}{tree} · {self.ran()} · {end}{context}{seed}")

    def highlight_html(self) -> str:
        """The answer token by token, coloured by origin. A separate panel, so markdown and
        code in the chat are never broken; text is escaped and whitespace kept."""
        spans = []
        for tid, piece, kind in self.pieces:
            cls = {DRAFT: "tok-draft", BONUS: "tok-bonus"}.get(kind, "tok-plain")
            spans.append(f'<span class="{cls}" title="id {tid} · {kind}">{html.escape(piece)}</span>')
        legend = ('<div class="tok-legend"><span class="tok-draft">accepted draft</span> '
                  '<span class="tok-bonus">bonus token</span> <span class="tok-plain">plain decoding</span></div>')
        return f'{legend}<div class="tok-view">{"".join(spans)}</div>'


class Pace:
    """How often a streaming answer updates the page. Every update makes the browser re-render the
    chat's markdown (and, with the panel, redraw the chart and the token view); one per engine
    step (up to hundreds a second) kept the page busy, so clicks (Stop) and scripts waited seconds.
    The first step shows at once (the time to first token is the visitor's); later text at most
    every TEXT_S, the panel at most every PANEL_S; the end of an answer always shows in full.
    Side by side's race updates both columns at the text's pace."""

    TEXT_S = 0.1
    PANEL_S = 0.5

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.text_at = self.panel_at = None

    def due(self) -> bool | None:
        """None: no update now; else whether this update includes the panel."""
        now = self.clock()
        if self.text_at is not None and now - self.text_at < self.TEXT_S:
            return None
        self.text_at = now
        panel = self.panel_at is None or now - self.panel_at >= self.PANEL_S
        if panel:
            self.panel_at = now
        return panel


def empty_frame() -> pd.DataFrame:
    """A zero-height placeholder holding every kind: Gradio fixes the chart's colour legend
    from the first value it renders, so an empty first frame would draw no bars later."""
    return pd.DataFrame({"step": [1] * 3, "tokens": [0] * 3, "kind": [DRAFT, BONUS, PLAIN]})

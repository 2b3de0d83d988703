"""What a long chat changes, said in words: the tree's long-context caps (core.config.TreeConfig
`long_context`), the prefill every answer repeats, and when a new chat would be faster.

Every answer reads the whole conversation again first (the prefill), and every row of a draft
tree attends to all of it, so past a few thousand tokens the tuned tree shrinks or speculation
pauses (TreeConfig.at / speculates_at). The engine applies those caps; these functions only
explain them, from the same TreeConfig and the prompt's length.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import TreeConfig

NEW_CHAT_TOKENS = 2_000  # past this, every answer spends seconds re-reading the chat on a CPU
PREFILL_NOTE_S = 0.5     # a prefill longer than this is shown as it runs


@dataclass(frozen=True)
class LongChat:
    """How one answer's prompt length shapes it. `pause_at`: the context length from which the
    tree decodes plain (None: never); `notes`: what to tell the visitor before the answer."""

    prompt_tokens: int
    pause_at: int | None
    notes: tuple[str, ...]
    hot: float | None = None  # the sampling temperature that paused speculation (TreeConfig.plain_from_temperature)
    hot_start: bool = False   # adaptive: the answer starts plain because it samples that hot
    adaptive: bool = False    # GenerationConfig.adaptive: measured speed chooses each step's mode

    @property
    def all_plain_reason(self) -> str:
        """Why an adaptive answer ran no speculative step."""
        return ADAPTIVE_HOT if self.hot_start else ADAPTIVE_PLAIN

    def pause_reason(self, reached: int) -> str:
        """Why plain steps ran in a speculative answer whose context reached `reached` tokens."""
        if self.adaptive:
            return MEASURED
        if self.hot is not None:
            return (f"sampling at temperature {self.hot:g}, where plain decoding is faster here "
                    "(hot sampling accepts few drafted tokens)")
        if self.pause_at is not None and reached >= self.pause_at:
            return (f"the chat reached {self.pause_at:,} tokens, from which plain decoding is faster here "
                    "(every draft-tree row reads the whole chat)")
        return "the answer neared the end of the context window, where no draft tree fits"


def plan(tree: TreeConfig, prompt_tokens: int, speculative: bool, temperature: float = 0.0,
         adaptive: bool = False) -> LongChat:
    pause_at = next((c for c, d, _ in tree.long_context if d == 0), None)
    notes = []
    if speculative and adaptive:
        if not tree.speculates_hot(temperature):
            notes.append(f"Sampling at temperature {temperature:g}: from {tree.plain_from_temperature:g} on plain "
                         "decoding is usually faster on this machine (hot sampling accepts few drafted tokens), so "
                         "this answer starts plain and speculates only while it measures faster, as it can where "
                         "the answer copies from the chat. The answer is the same either way (one seed, one answer).")
            return LongChat(prompt_tokens, pause_at, tuple(notes), adaptive=True, hot_start=True)
        if not tree.speculates_at(prompt_tokens):
            notes.append(f"Long chat ({prompt_tokens:,} tokens): from {pause_at:,} tokens plain decoding is usually "
                         "faster on this machine (every draft-tree row reads the whole chat), so this answer starts "
                         "plain and speculates only while it measures faster, as it often does when the answer "
                         "quotes or edits what the chat holds. The answer is the same either way.")
        return LongChat(prompt_tokens, pause_at, tuple(notes), adaptive=True)
    if speculative and not tree.speculates_hot(temperature):
        notes.append(f"Speculation paused for this answer: sampling at temperature {temperature:g}, plain decoding "
                     f"is faster on this machine (measured from {tree.plain_from_temperature:g} on: hot sampling "
                     f"accepts few drafted tokens). The answer is the same either way (one seed, one answer); below temperature "
                     f"{tree.plain_from_temperature:g} speculation runs again.")
        return LongChat(prompt_tokens, pause_at, tuple(notes), hot=temperature)
    if speculative and not tree.speculates_at(prompt_tokens):
        notes.append(f"Speculation paused for this answer: the chat holds {prompt_tokens:,} tokens, and from "
                     f"{pause_at:,} on plain decoding is faster on this machine (every draft-tree row reads the "
                     "whole chat). The answer is the same; a New chat is fast again.")
    elif speculative and (capped := tree.at(prompt_tokens)) != tree:
        since = max(c for c, d, _ in tree.long_context if c <= prompt_tokens and d > 0)
        notes.append(f"Long chat ({prompt_tokens:,} tokens): from {since:,} tokens the draft tree is capped at "
                     f"depth {capped.depth} and {capped.total_tokens} nodes (every tree row reads the whole chat, "
                     "so big trees cost more than they save).")
    return LongChat(prompt_tokens, pause_at, tuple(notes))


MEASURED = "each step ran the mode measured faster in this answer, the other probed now and then"
ADAPTIVE_PLAIN = "a chat this long starts plain here, and speculation did not measure faster in this answer"
ADAPTIVE_HOT = "sampling this hot starts plain here, and speculation did not measure faster in this answer"


def new_chat_hint(prompt_tokens: int, first_token_s: float | None) -> str:
    """After an answer to a long chat: why answers are slow, and the fix."""
    if prompt_tokens < NEW_CHAT_TOKENS:
        return ""
    waited = f" (this one's first token came after {first_token_s:.1f} s)" if first_token_s else ""
    return (f"This chat is {prompt_tokens:,} tokens long and every answer first reads all of it again{waited}. "
            "For a new topic, start a New chat (above the conversation): its answers start at once.")


def reading(prompt_tokens: int, seconds: float) -> str:
    return f"Reading your prompt ({prompt_tokens:,} tokens) … {seconds:.0f} s; the answer starts after that."

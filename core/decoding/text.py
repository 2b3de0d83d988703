"""Token ids -> streamed text: incremental detokenizing and stop strings.

`TextStream.push(id)` returns the text that may be shown now. Two things are held back:
  - an incomplete UTF-8 sequence (the tokenizer decodes it to U+FFFD) until it completes (one
    still incomplete when the answer ends is dropped);
  - any tail that could still be the start of a stop string, until it cannot.
Decoding looks only at a small window of ids (from `prefix` on), so each token costs
O(window), not O(answer) (after the incremental detokenizers of vLLM and TGI: the window
starts one token early so a leading-space rule of the tokenizer cannot drop a space).
"""

from __future__ import annotations


def backend_decode(tokenizer):
    """The `tokenizers` decoder that `tokenizer.decode(ids, skip_special_tokens=True)` ends in, where
    transformers adds nothing to it (its TokenizersBackend's own decode, no clean-up of spaces), else
    None. transformers' wrapper costs ~20 us a call, and the stream decodes twice a token."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not TokenizersBackend._decode or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    backend = tokenizer._tokenizer
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """`context`: ids shown before this stream (a continued answer's own): the window starts with
    its last one, so the first new text keeps the space a tokenizer drops at the start of a decode."""

    def __init__(self, tokenizer, context: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context[-1:])
        self.prefix = 0  # window start: ids[prefix:read] were shown already
        self.read = len(self.ids)
        self._fast = backend_decode(tokenizer)

    def _decode(self, ids) -> str:
        if self._fast is not None:
            return self._fast(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        shown = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if len(full) <= len(shown) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or a UTF-8 sequence still incomplete
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(shown):]

    def flush(self) -> str:
        """At the end of the answer: whatever is left, less an incomplete trailing UTF-8
        sequence (an answer cut at max tokens inside a character would end in U+FFFD)."""
        shown = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return full[len(shown):].rstrip("\ufffd") if full.startswith(shown) else ""


class TextStream:
    """Detokenized text with stop strings applied; `stopped` once a stop string appears."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = (), context: tuple[int, ...] = ()):
        self.detok = Detokenizer(tokenizer, context)
        self.stops = tuple(stop_strings)
        self.pending = ""   # decoded but not yet shown (could begin a stop string)
        self.text = ""      # shown so far
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text that can be shown now."""
        self.pending += self.detok.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """The answer ended for another reason: show what was held back."""
        if not self.stopped:
            self.pending += self.detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        window = self.text[-max((len(s) for s in self.stops), default=0):] + self.pending
        offset = len(window) - len(self.pending)  # where pending starts inside window
        hits = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out = self.pending[:max(0, min(hits) - offset)]
        elif final:
            out = self.pending
        else:
            out = self.pending[:len(self.pending) - self._held_tail(window)]
        self.pending = self.pending[len(out):] if not self.stopped else ""
        self.text += out
        return out

    def _held_tail(self, window: str) -> int:
        """Length of the longest tail of `window` that is a proper prefix of a stop string,
        limited to the part not yet shown."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(window)), 0, -1):
                if window.endswith(s[:k]):
                    best = max(best, k)
                    break
        return min(best, len(self.pending))

"""Which self-written user prompts to keep, and a keyword categorisation of what they ask.

Glossary
- reject reason: why a generated user turn is dropped. `reject_reason` gives the first that
  applies, in this order: "empty"; "truncated" (cut at the token cap: a user stops
  mid-sentence only by accident); "foreign" (mostly non-ASCII: the target answers English
  best, and a 135M model at T 1.0 drifts into mixed scripts); "short" (too few words);
  "repetitive" (a degenerate loop); "template" (chat-template markup or the assistant's
  name, a sign the model wrote the wrong turn); "answer" (opens the way answers open:
  "Sure, ...", "Here is ..."); "not a request" (no question mark and no request word
  anywhere, e.g. a bare statement or a story fragment).
- near duplicate: a prompt whose word 3-grams overlap an earlier kept prompt's by Jaccard
  similarity >= `near_jaccard` (Magpie, arXiv 2406.08464, deduplicates by similarity too).
  0.7 refuses a prompt of 20 words that differs from a kept one in a word (0.71) and keeps
  "Can you help me write a poem?" beside "Can you help me write a story?" (0.67).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANSWER_OPENINGS = ("sure", "certainly", "of course", "absolutely", "here is", "here's", "here are",
                   "great question", "as an ai", "i'm sorry", "i am sorry", "i apologize", "i'd be happy",
                   "i would be happy", "i'd be glad", "hello! how can i", "hi! how can i", "you're welcome",
                   "in conclusion", "the answer is", "to summarize,", "in summary,")
REQUEST_WORDS = re.compile(
    r"\b(please|can you|could you|would you|will you|help|explain|write|tell|give|list|describe|create|make|"
    r"suggest|recommend|compare|summari[sz]e|summary|fix|debug|rewrite|translate|calculate|solve|find|how|what|"
    r"why|which|who|when|where|should|i need|i want|i'd like|i would like|looking for|generate|design|plan|"
    r"provide|show|convert|analy[sz]e|identify|classify|edit|improve|draft|compose|outline|imagine|pretend|"
    r"act as|let's|extract|reformat|sort|turn|format|correct|check|review|proofread|brainstorm|define|"
    r"is it|are there|do you|does|predict|estimate|evaluate|prove|simplify|implement|optimi[sz]e|organi[sz]e|"
    r"pull out|arrange|rank|rephrase|paraphrase|shorten|complete|split|debug)\b", re.I)
TEMPLATE_MARKS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "smollm", "hugging face")


@dataclass(frozen=True)
class FilterConfig:
    min_words: int = 3
    min_chars: int = 12
    max_non_ascii: float = 0.2  # share of characters
    min_distinct_3grams: float = 0.5  # of a text with >= 30 words
    require_request: bool = True
    near_jaccard: float = 0.7


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def shingles(text: str, n: int = 3) -> set[tuple[str, ...]]:
    """Word n-grams of a text (the words themselves when it is shorter than n)."""
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)} or {(x,) for x in w}


def reject_reason(text: str, truncated: bool = False, cfg: FilterConfig = FilterConfig()) -> str | None:
    """None if the generated user turn is kept, else why not (see the glossary)."""
    t = text.strip()
    if not t:
        return "empty"
    if truncated:
        return "truncated"
    if sum(not c.isascii() for c in t) > cfg.max_non_ascii * len(t):
        return "foreign"
    w = words(t)
    if len(w) < cfg.min_words or len(t) < cfg.min_chars:
        return "short"
    grams = [tuple(w[i:i + 3]) for i in range(len(w) - 2)]
    if len(w) >= 30 and len(set(grams)) < cfg.min_distinct_3grams * len(grams):
        return "repetitive"
    low = t.lower()
    if any(m in low for m in TEMPLATE_MARKS):
        return "template"
    if low.startswith(ANSWER_OPENINGS):
        return "answer"
    if cfg.require_request and "?" not in t and not REQUEST_WORDS.search(t):
        return "not a request"
    return None


def normalized(text: str) -> str:
    return " ".join(words(text))


class DedupIndex:
    """Kept prompts' exact (normalised) texts and 3-gram shingles, to refuse (near) repeats."""

    def __init__(self, near_jaccard: float = 0.7):
        self.near_jaccard = near_jaccard
        self.exact: set[str] = set()
        self.grams: list[set] = []
        self.postings: dict[tuple, list[int]] = {}  # shingle -> indices into self.grams

    def reason(self, text: str) -> str | None:
        """"duplicate", "near duplicate" or None (new)."""
        if normalized(text) in self.exact:
            return "duplicate"
        g = shingles(text)
        shared: dict[int, int] = {}
        for s in g:
            for i in self.postings.get(s, ()):
                shared[i] = shared.get(i, 0) + 1
        for i, n in shared.items():
            if n / (len(g) + len(self.grams[i]) - n) >= self.near_jaccard:
                return "near duplicate"
        return None

    def add(self, text: str) -> None:
        self.exact.add(normalized(text))
        g = shingles(text)
        for s in g:
            self.postings.setdefault(s, []).append(len(self.grams))
        self.grams.append(g)


# ----------------------------------------------------------------------------- categories

CATEGORIES = ("coding", "math", "extraction", "roleplay", "writing", "reasoning", "stem", "humanities", "general")
# The nine MT-bench categories the issue measures tau in; the first rule that matches wins.
CATEGORY_RULES = tuple((name, re.compile(pattern, re.I)) for name, pattern in (
    ("coding", r"```|\b(python|javascript|typescript|java|c\+\+|rust|golang|sql|html|css|bash|code|coding|function|"
               r"script|program(ming)?|algorithm|api|regex|compile[rd]?|debug|bug|variable|class|database|"
               r"json|git|linux|software|developer|implement(ation)?|recursi(ve|on)|array|excel)\b"),
    ("math", r"\b(calculate|equation|solve|integral|derivative|probability|percent(age)?|math(s|ematics)?|"
             r"algebra|geometry|triangle|fraction|arithmetic|statistics|average|sum of|multiply|divide|"
             r"theorem|prime number|solve for|word problem|per hour|how much (money|does|will|did))\b|"
             r"\d+\s*[-+*/^x]\s*\d+"),
    ("extraction", r"\b(summari[sz]e|summary|extract|key points|main points|main ideas|reformat|tl;dr|"
                   r"the following (text|passage|article|list|paragraph)|(into|as) a (table|list|json)|"
                   r"bullet points|pull out)\b"),
    ("roleplay", r"\b(pretend|act as|role ?play|imagine (you|that you) are|you are an?|in the role of|"
                 r"play the (role|part)|as if you were|in character)\b"),
    ("writing", r"\b(write|essay|poem|story|letter|e-?mail|blog|article|rewrite|draft|compose|slogan|speech|"
                r"lyrics|tweet|caption|paragraph|headline|novel|haiku|proofread|grammar|edit|rephrase|"
                r"paraphrase|passage|sentence)\b"),
    ("reasoning", r"\b(riddle|puzzle|logic(al)?|deduce|true or false|what comes next|paradox|reason(ing)?|"
                  r"which (one )?is (better|faster|larger|bigger|heavier)|(older|younger|taller|shorter) than|"
                  r"sequence|a farmer has|if .{1,60} then)\b"),
    ("stem", r"\b(physics|chemistry|biology|science|scientific|energy|climate|cell|quantum|engineering|"
             r"computer|technology|medicine|medical|disease|planet|space|atom|molecule|dna|evolution|"
             r"machine learning|ai|data|robot|electric(ity)?|ecosystem|species)\b"),
    ("humanities", r"\b(history|historical|philosophy|philosopher|literature|art|artist|culture|cultural|"
                   r"who was|in what year|what caused|"
                   r"religion|politic(s|al)|economics?|society|war|ancient|music|film|movie|language|"
                   r"ethics|moral|law|government|century|empire)\b"),
))


def categorize(text: str) -> str:
    """The MT-bench category a prompt reads as, by keyword (first matching rule; else general)."""
    return next((name for name, rule in CATEGORY_RULES if rule.search(text)), "general")

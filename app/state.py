"""Small pieces of app state that are not the model: who may do what (decided per request),
the last model used, and turning the UI's raw control values into a validated `GenerationConfig`.

Parsing only: every range check lives in core.config, so a bad value is refused with the
same message as in the CLI.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from app.lane import is_remote
from core.config import ConfigError, GenerationConfig, SamplingConfig, TreeConfig
from core.models import EMBEDDED, cache_home

LAST_MODEL_FILE = "last_model.json"
BROWSER_SECRET_FILE = "browser_secret"


@dataclass(frozen=True)
class Access:
    """What a visitor may do. Without a password, a visitor from another machine (through the
    public share link) may chat within a per-answer cap on new tokens and seconds, so no one
    holds the single generation lane for long, and may not switch models: that would let
    strangers make the server read local paths or fill its disk. Local visitors are not limited.

    The seconds cap is checked between the engine's steps, and the first step ends only after the
    whole prompt is prefilled, so a limited visitor's prompt is also capped in tokens: it keeps the
    prefill inside the time. Each of them holds at most `remote_max_queued` answers, running or
    waiting, so no one fills the queue. Every visitor's message has a length limit in characters
    (the tokenizer would otherwise read a pasted book before the context check could refuse it)."""

    authenticated: bool = False
    remote_max_new_tokens: int = 256
    remote_max_seconds: float = 60.0
    remote_max_prompt_tokens: int = 2048  # SmolLM2 on 2 CPU cores prefills this in a few seconds
    remote_max_queued: int = 1
    max_message_chars: int = 32_000
    remote_max_message_chars: int = 4_000

    def limited(self, request) -> bool:
        return not self.authenticated and is_remote(request)

    def message_chars(self, request) -> int:
        return self.remote_max_message_chars if self.limited(request) else self.max_message_chars

    def prompt_tokens(self, request) -> int | None:
        """The most prompt tokens one answer may prefill for this visitor (None: the context decides)."""
        return self.remote_max_prompt_tokens if self.limited(request) else None

    def can_manage_models(self, request) -> bool:
        return not self.limited(request)


@dataclass(frozen=True)
class ModelChoice:
    """Everything needed to (re)load a model; remembered between launches."""

    model: str = EMBEDDED
    head: str | None = "default"
    dtype: str = "auto"       # "auto": the engine picks (bf16 + exact kernels on CPU where its probe passes)
    device: str = "cpu"
    load_in_4bit: bool = False
    attention: str = "auto"   # "auto" | "exact" | "sdpa" | "eager" (core.decoding.engine.Engine.load)
    weights: str = "auto"     # what the native step reads: "auto" | "q4" | "bf16" (core.config.WEIGHTS)

    def describe(self) -> str:
        head = ("no head" if self.head is None else "its default head" if self.head == "default"
                else f"head `{self.head}`")
        numerics = "auto numerics" if self.dtype == "auto" else self.dtype
        attention = "" if self.attention == "auto" else f", {self.attention} attention"
        weights = "" if self.weights == "auto" else f", {self.weights} weights"
        quant = ", 4-bit" if self.load_in_4bit else ""
        return f"`{self.model}` with {head} ({numerics}{attention}{weights}, {self.device}{quant})"


def last_model_path() -> Path:
    return cache_home() / LAST_MODEL_FILE


def remember(choice: ModelChoice) -> None:
    """Best effort: a read-only cache dir must not stop the app."""
    path = last_model_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(choice), indent=2))
    except OSError:
        pass


def recall() -> ModelChoice | None:
    """The last model that loaded successfully, or None when unknown or unreadable. Files from
    before the numerics choice have no "attention" and keep their dtype (often "float32"); files
    from before the native step have no "weights"."""
    try:
        data = json.loads(last_model_path().read_text())
        return ModelChoice(model=str(data["model"]), head=data.get("head"),
                           dtype=str(data.get("dtype", "auto")), device=str(data.get("device", "cpu")),
                           load_in_4bit=bool(data.get("load_in_4bit", False)),
                           attention=str(data.get("attention", "auto")), weights=str(data.get("weights", "auto")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def browser_secret() -> str:
    """The key the page encrypts its stored chats with (gr.BrowserState). Kept in the cache folder,
    so chats saved in a browser can still be read after the app restarts; a random one per start
    (chats then last until the next start) if the folder cannot be written."""
    path = cache_home() / BROWSER_SECRET_FILE
    try:
        if path.exists() and len(key := path.read_text().strip()) >= 16:
            return key
        path.parent.mkdir(parents=True, exist_ok=True)
        key = secrets.token_urlsafe(24)
        path.write_text(key)
        path.chmod(0o600)
        return key
    except OSError:
        return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class ChatSettings:
    """The chat's generation controls, named. The UI builds its list of input components from
    `names()`, so the handlers' parameters, the page and the stored settings share one order."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new: int = 512
    spec: bool = True
    depth: int = 4
    top_k: int = 8
    tree_size: int = 10
    highlight: bool = True
    seed: int = -1  # sampling: -1 (any negative) = a new seed each answer, shown with it to be typed in again

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def stored(cls, data, defaults: "ChatSettings") -> "ChatSettings":
        """Settings kept in the browser -> valid settings; a value that is missing or does not
        parse as a setting (an older app, an edited storage) keeps its default."""
        values = {}
        for f in fields(cls):
            value = data.get(f.name) if isinstance(data, dict) else None
            if isinstance(value, bool) and f.type == "bool" or \
                    isinstance(value, (int, float)) and not isinstance(value, bool) and f.type != "bool":
                values[f.name] = value
        merged = cls(**{**asdict(defaults), **values})
        try:
            merged.config()
        except ConfigError:
            return defaults
        return merged

    def config(self, default: TreeConfig | None = None) -> GenerationConfig:
        """A GenerationConfig over the engine's `default` tree (raises ConfigError naming the
        setting); see generation_config."""
        return generation_config(max_new_tokens=self.max_new, temperature=self.temperature, top_p=self.top_p,
                                 speculative=self.spec, depth=self.depth, top_k=self.top_k,
                                 tree_size=self.tree_size, seed=self.seed, default=default)


def tree_limit(depth, tree_size) -> str:
    """What caps a tree of `depth` levels and `tree_size` nodes, or "" when the depth is reachable.

    The tree verifies the root plus the best tree_size - 1 drafted nodes, and a drafted token at
    depth d needs its d - 1 drafted ancestors in the tree too, so no chain is longer than
    tree_size - 1: drafting deeper only costs time."""
    depth, size = int(round(float(depth))), int(round(float(tree_size)))
    if depth <= size - 1:
        return ""
    return (f"Tree size {size} caps the tree at {size - 1} drafted token{'s' if size > 2 else ''} in a row, "
            f"so depth {depth} drafts {depth - size + 1} level{'s' if depth - size > 0 else ''} that cannot be used.")


# The browser's twin of tree_limit. The depth and tree-size events run in the page, in the order
# the visitor typed: a server reply that lands late cannot undo a newer size or clear a newer note
# (a browser test checks the JavaScript against tree_limit).
TREE_LIMIT_JS = """(depth, size) => {
  const d = Math.round(Number(depth)), s = Math.round(Number(size));
  if (d <= s - 1) return "";
  return `Tree size ${s} caps the tree at ${s - 1} drafted token${s > 2 ? "s" : ""} in a row, ` +
         `so depth ${d} drafts ${d - s + 1} level${d - s > 0 ? "s" : ""} that cannot be used.`;
}"""


def follow_depth_js(max_depth: int) -> str:
    """The page's handler for a new depth: (depth, size) -> [size, note]. The size only grows, to the
    smallest that lets a chain reach the depth. The depth is clamped to its slider's range first,
    as Gradio clamps the box when it loses focus (a typed 100 means 16)."""
    return f"""(depth, size) => {{
  const limit = {TREE_LIMIT_JS};
  const d = Math.min(Math.max(Math.round(Number(depth)), 1), {max_depth});
  const grown = Math.max(Math.round(Number(size)), d + 1);
  return [grown, limit(d, grown)];
}}"""


def generation_config(*, max_new_tokens, temperature, top_p, speculative, depth, top_k,
                      tree_size, seed=None, default: TreeConfig | None = None) -> GenerationConfig:
    """The chat controls -> a GenerationConfig (raises ConfigError with the setting's name).
    The tree is the engine's `default` tree (tuned, shipped or built in; None: no head, so no
    context lookup and no long-chat caps) with the controls over it by core's one rule,
    TreeConfig.override: the lookup and long-chat caps stay, and the smaller tree beside a
    lookup chain stays only while the shape is the default's.

    Sliders arrive as floats (or None from an API caller); integers are rounded, not truncated.
    """
    def as_int(v, name):
        if v is None:
            raise ConfigError(f"{name} is missing")
        try:
            return int(round(float(v)))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{name} must be a number, got {v!r}") from e

    if seed is not None:  # a negative seed: a new one each answer (None)
        if isinstance(seed, bool) or not isinstance(seed, (int, float)) or seed != int(seed) or seed >= 2**63:
            raise ConfigError(f"the seed must be a whole number below 2^63, or -1 for a new one each answer; "
                              f"got {seed!r}")
        seed = int(seed) if seed >= 0 else None
    base = default if default is not None else TreeConfig()  # no lookup, no long-chat caps
    tree = base.override(depth=as_int(depth, "tree depth"), top_k=as_int(top_k, "top-k"),
                         total_tokens=as_int(tree_size, "tree size"))
    try:
        sampling = SamplingConfig(temperature=float(temperature), top_p=float(top_p))
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"temperature and top-p must be numbers ({e})") from e
    return GenerationConfig(max_new_tokens=as_int(max_new_tokens, "max new tokens"),
                            speculative=bool(speculative), tree=tree, sampling=sampling, seed=seed)

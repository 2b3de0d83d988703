"""core.decoding.drafter: both head kinds are the written DraftModel, drafting asks nothing outside it, and a
new head kind is one class."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.config import TreeConfig
from core.decoding.drafter import OPTIONAL, DraftModel
from core.decoding.head import HeadCache, HeadConfig, TreeRows
from core.decoding.head3 import Drafter3, drafter_for, new_head3
from core.decoding.tree import Drafter, catch_up, catch_up_top, draft, log_probs, top_log_probs
from tests.tiny import random_head, tiny_target

CORE = Path(__file__).resolve().parents[1] / "core"
MEMBERS = {name for name in vars(DraftModel) if not name.startswith("_")}
METHODS = {name for name in MEMBERS if not isinstance(vars(DraftModel)[name], property)}


def test_the_protocol_names_the_members():
    assert MEMBERS == {"head", "feature_layers", "vocab", "feed", "log_probs", "top_log_probs", "to_target_ids"}
    assert METHODS == {"feed", "log_probs", "top_log_probs", "to_target_ids"}


def drafter_attributes(path: Path) -> set[str]:
    """Attributes read off anything called `drafter` (a name, or `x.drafter`) in a source file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "drafter") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "drafter"):
                out.add(node.attr)
    return out


def test_the_library_asks_a_drafter_only_for_protocol_members():
    """The loop, the tree builders and the commands: a new head kind needs nothing else."""
    used = {str(p.relative_to(CORE)): drafter_attributes(p) - MEMBERS - OPTIONAL for p in sorted(CORE.rglob("*.py"))}
    assert {name: extra for name, extra in used.items() if extra} == {}
    assert drafter_attributes(CORE / "decoding" / "tree.py") >= METHODS  # the scan sees what drafting calls


@pytest.fixture(scope="module")
def both_kinds():
    target = tiny_target()
    eagle = drafter_for(random_head(target), target.model)
    head3 = new_head3(target.model.config, torch.arange(4, 96, 2), seed=5).double().eval()
    return [eagle, Drafter3(head=head3, embed=target.model.get_input_embeddings())]


def test_both_head_kinds_are_draft_models_with_its_signatures(both_kinds):
    eagle, eagle3 = both_kinds
    assert isinstance(eagle, Drafter) and isinstance(eagle3, Drafter3)
    for drafter in both_kinds:
        assert isinstance(drafter, DraftModel)
        for name in METHODS:
            expected = list(inspect.signature(getattr(DraftModel, name)).parameters)
            assert list(inspect.signature(getattr(type(drafter), name)).parameters) == expected, (type(drafter), name)
    assert eagle.feature_layers is None and eagle.vocab is None
    assert eagle3.feature_layers == eagle3.head.config.layer_ids and eagle3.vocab.shape == (46,)


class Bigram:
    """A new head kind in one class: the head's output for token t is one-hot(t), and its draft
    logits put 8 on t + 1, 4 on t + 2 (mod V) and 0 elsewhere. It keeps the head-cache discipline
    (one key and value per input) without attending to anything."""

    V = 16
    feature_layers = None
    vocab = None

    def __init__(self):
        self.head = nn.Module()
        self.head.config = HeadConfig(hidden_size=self.V, intermediate_size=8, num_attention_heads=1,
                                      num_key_value_heads=1, vocab_size=self.V)

    def feed(self, cache: HeadCache, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
             allowed: torch.Tensor | TreeRows | None = None) -> torch.Tensor:
        zeros = torch.zeros(1, 1, tokens.shape[0], self.V)
        cache.write(zeros, zeros)
        return F.one_hot(tokens, self.V).float()  # (m, V)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return 8 * hidden.roll(1, dims=-1) + 4 * hidden.roll(2, dims=-1)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        return log_probs(self.logits(hidden))

    def top_log_probs(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return top_log_probs(self.logits(hidden), k)

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        return idx


@pytest.mark.parametrize("tree,tokens,parents", [
    (TreeConfig(depth=3, top_k=2, total_tokens=4), [5, 6, 7, 8], [-1, 0, 1, 2]),  # the best chain
    (TreeConfig(static_paths=((0,), (1,), (0, 0))), [5, 6, 7, 7], [-1, 0, 0, 1]),  # ranks 0, 1 and 0 of 0
])
def test_a_new_head_kind_is_one_class(tree, tokens, parents):
    drafter = Bigram()
    assert isinstance(drafter, DraftModel)
    cache = HeadCache(drafter.head.config, torch.float32, torch.device("cpu"))
    # the catch-up ends on the root (5): its output proposes the root's children (6 first)
    root_hidden = catch_up(drafter, cache, torch.tensor([3, 4, 5]), torch.zeros(3, Bigram.V))
    assert cache.length == 3 and drafter.top_log_probs(root_hidden[None], 1)[1].item() == 6
    out = draft(drafter, cache, 5, root_hidden, tree)
    assert out.tokens.tolist() == tokens and out.parents.tolist() == parents
    assert cache.length == 3, "draft entries are temporary"
    # without the optional fused member, catch_up_top is feed then top_log_probs
    other = HeadCache(drafter.head.config, torch.float32, torch.device("cpu"))
    hidden, (lp, idx) = catch_up_top(drafter, other, torch.tensor([3, 4, 5]), torch.zeros(3, Bigram.V), 2)
    assert other.length == 3 and torch.equal(hidden, root_hidden) and idx.tolist() == [[6, 7]]
    assert torch.equal(lp, drafter.top_log_probs(root_hidden[None], 2)[0])

"""core.decoding.rowcost: the row costs measured while answering, the draft-probability floor they
set, the pruning it applies (TreeConfig.row_floor), and that greedy answers stay plain decoding's."""

import math

import pytest

from core.config import ConfigError, GenerationConfig, TreeConfig
from core.decoding import rowcost
from core.decoding.engine import Engine
from core.decoding.rowcost import RowCosts
from core.decoding.tree import DraftTree
from tests.tiny import oracle_head, random_head, tiny_target


def test_the_floor_is_what_a_row_costs_in_accepted_tokens():
    assert rowcost.floor(RowCosts()) == rowcost.START_FLOOR  # nothing measured yet
    assert rowcost.floor(RowCosts(one=2.6e-3)) == rowcost.START_FLOOR  # one kind of forward only
    # (1 + p) tokens in h + T2 against 1 in h + T1: p > (T2 - T1) / (h + T1)
    assert rowcost.floor(RowCosts(one=2.6e-3, two=3.75e-3, head=0.6e-3)) == pytest.approx(1.15 / 3.2)
    assert rowcost.floor(RowCosts(one=5.6e-3, two=5.7e-3, head=0.6e-3)) == rowcost.MIN_FLOOR  # rows nearly free
    assert rowcost.floor(RowCosts(one=2e-3, two=6e-3, head=0.0)) == rowcost.MAX_FLOOR  # a bad minute, bounded


def test_record_keeps_exponential_means_per_forward_size():
    c = rowcost.record(RowCosts(), 2, 4e-3, 1e-3)
    assert c == RowCosts(one=None, two=4e-3, head=1e-3)  # the first of a kind is taken as it is
    c = rowcost.record(c, 1, 3e-3, 0.0)
    assert c.one == 3e-3 and c.two == 4e-3 and c.head == pytest.approx(1e-3 * (1 - rowcost.WEIGHT))
    c2 = rowcost.record(c, 2, 6e-3, 1e-3)
    assert c2.two == pytest.approx(4e-3 + rowcost.WEIGHT * 2e-3) and c2.one == c.one
    c3 = rowcost.record(c2, 11, 9e-3, 1e-3)  # a lookup chain's forward: not a 1- or 2-row cost
    assert (c3.one, c3.two) == (c2.one, c2.two)
    assert rowcost.record(c3, 1, 0.0, 1e-3) == c3  # an untimed forward (a coarse clock) is ignored
    c4 = rowcost.record(c3, 1, 2e-3, None)  # an adaptive answer's plain step: a 1-row forward, no head work
    assert c4.one == pytest.approx(c3.one + rowcost.WEIGHT * (2e-3 - c3.one)) and c4.head == c3.head


def tree_of(scores, parents):
    n = len(scores)
    return DraftTree.from_lists(list(range(100, 100 + n)), parents, [0] + [1] * (n - 1), scores)


def test_prune_drops_unlikely_nodes_and_their_descendants():
    lp = math.log
    #        root  a(0.6)   b(0.2)  a.a(0.5)  b.a(0.1)   a.b(0.25)
    scores = [0.0, lp(0.6), lp(0.2), lp(0.5), lp(0.1), lp(0.25)]
    parents = [-1, 0, 0, 1, 2, 1]
    tree = tree_of(scores, parents)
    kept = rowcost.prune(tree, 0.3)
    tokens, parents2, _ = kept.host
    assert tokens == [100, 101, 103] and parents2 == [-1, 0, 1]  # a, a.a kept and re-linked
    assert kept.host_scores == [scores[0], scores[1], scores[3]]
    assert rowcost.prune(tree, 0.05) is tree  # nothing under the floor: the same tree
    assert rowcost.prune(tree, 0.9).host[0] == [100]  # the root alone: a plain step
    assert rowcost.prune(DraftTree.from_lists([1, 2], [-1, 0], [0, 1]), 0.9).size == 2  # no scores: kept


def test_row_floor_is_a_checked_tree_setting():
    assert TreeConfig(row_floor=True).at(10_000).row_floor  # long-chat caps keep it
    t = TreeConfig(1, 8, 2, lookup=10, lookup_total_tokens=2, row_floor=True, long_context=((100, 1, 2),))
    assert t.at(500).row_floor and t.with_chain().row_floor
    with pytest.raises(ConfigError, match="row_floor must be true or false"):
        TreeConfig(row_floor="yes")


PROMPTS = [[5, 9, 17, 33, 40], [7], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71], [12, 4, 88, 23]]


def answer(engine, prompt, config, on_step=None):
    tokens, events = [], []
    for ev in engine.generate(prompt, config, on_step=on_step):
        tokens += ev.token_ids
        events.append(ev)
    return tokens, events


@pytest.mark.parametrize("costs", [RowCosts(), RowCosts(1e-3, 1.05e-3, 0.0), RowCosts(1e-3, 3e-3, 0.0)],
                         ids=["start", "cheap-rows", "dear-rows"])
@pytest.mark.parametrize("tree", [TreeConfig(1, 8, 2, row_floor=True), TreeConfig(3, 4, 10, row_floor=True),
                                  TreeConfig(1, 8, 2, lookup=6, lookup_total_tokens=2, row_floor=True)],
                         ids=["one-draft", "d3n10", "lookup"])
def test_greedy_answers_with_a_row_floor_are_plain_decodings(costs, tree, monkeypatch):
    """Whatever the floor prunes (the rarest drafts, the unlikely ones, half of them), greedy
    speculation writes plain decoding's tokens, and every head draft it verifies reaches the floor."""
    target = tiny_target(mix=0.3, seed=2)
    monkeypatch.setattr(rowcost, "record", lambda c, *a: c)  # hold the costs where the case puts them
    bar = math.log(rowcost.floor(costs))
    for kind, head in (("random", random_head(target)), ("oracle", oracle_head(target))):
        engine = Engine(target, head)
        engine.row_costs = costs
        drafted = []  # the head's draft scores of every verified tree (a lookup chain's nodes score -inf)
        on_step = lambda tree, result: drafted.append([x for x in tree.host_scores[1:] if x > -math.inf])  # noqa: E731
        for prompt in PROMPTS:
            spec, events = answer(engine, prompt, GenerationConfig(max_new_tokens=24, tree=tree), on_step)
            plain, _ = answer(engine, prompt, GenerationConfig(max_new_tokens=24, speculative=False))
            assert spec == plain
        assert all(x >= bar for step in drafted for x in step)
        if kind == "oracle" and costs.two == 3e-3 and not tree.lookup:
            # this oracle's first drafts range over p 0.24-0.98: at the top floor (0.6) some steps keep
            # their drafts, others verify the root alone (a plain step's row, through the tree code)
            assert any(drafted) and not all(drafted)


def test_the_engine_measures_row_costs_only_for_trees_with_a_row_floor(monkeypatch):
    target = tiny_target(mix=0.3, seed=2)
    engine = Engine(target, random_head(target))
    answer(engine, PROMPTS[0], GenerationConfig(max_new_tokens=24, tree=TreeConfig(1, 8, 2)))
    assert engine.row_costs == RowCosts()
    answer(engine, PROMPTS[0], GenerationConfig(max_new_tokens=24, tree=TreeConfig(1, 8, 2, row_floor=True)))
    assert engine.row_costs.head is not None and (engine.row_costs.one or engine.row_costs.two)
    # an adaptive answer's plain steps measure the 1-row forward too
    engine.row_costs = RowCosts()
    answer(engine, PROMPTS[0], GenerationConfig(max_new_tokens=24, speculative=False))
    assert engine.row_costs == RowCosts()  # plain decoding asked for: nothing of the tree's
    calls = []
    recorded = rowcost.record
    monkeypatch.setattr(rowcost, "record", lambda c, *a: calls.append(a) or recorded(c, *a))
    capped = TreeConfig(1, 8, 2, row_floor=True, long_context=((1, 0, 0),))  # an adaptive answer starts plain
    answer(engine, PROMPTS[0], GenerationConfig(max_new_tokens=24, tree=capped, adaptive=True))
    assert any(rows == 1 and head is None for rows, _, head in calls)  # its plain steps: T1, no head work

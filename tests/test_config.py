"""core/config.py: the one rule that puts a user's tree settings over the default tree
(TreeConfig.override) and the command-line options that feed it."""

from __future__ import annotations

import argparse

import pytest

from core.config import ConfigError, GenerationConfig, SamplingConfig, TreeConfig, add_tree_args, tree_changes

# the shape of the shipped tree: a smaller head tree beside a lookup chain, plain decoding deep in long chats
DEFAULT = TreeConfig(depth=3, top_k=8, total_tokens=10, lookup=24, lookup_total_tokens=6,
                     long_context=((2048, 0, 0),))


def test_no_change_is_the_default_tree():
    assert DEFAULT.override() == DEFAULT
    assert DEFAULT.override(depth=None, top_k=None, total_tokens=None, lookup=None) == DEFAULT
    assert DEFAULT.override(depth=3, total_tokens=10) == DEFAULT, "the default's own values change nothing"


def test_a_shape_by_hand_keeps_lookup_and_caps_and_its_own_size():
    tree = DEFAULT.override(total_tokens=4)
    assert (tree.depth, tree.top_k, tree.total_tokens) == (3, 8, 4)
    assert tree.lookup == 24 and tree.long_context == ((2048, 0, 0),), "lookup and long-chat caps stay"
    assert tree.lookup_total_tokens == 0 and tree.with_chain() == tree, "4 tokens on every step, chain or not"
    assert DEFAULT.override(depth=5).lookup_total_tokens == 0
    assert DEFAULT.override(static_paths=((0,), (1,))).lookup_total_tokens == 0
    assert not tree.speculates_at(4096) and tree.at(100) == tree


def test_settings_that_keep_the_shape_keep_the_tuned_chain_tree():
    tree = DEFAULT.override(lookup=0)
    assert tree.lookup == 0 and tree.lookup_total_tokens == 6 and tree.with_chain().total_tokens == 6
    assert DEFAULT.override(long_context=()).speculates_at(10_000)
    assert DEFAULT.override(total_tokens=16, lookup_total_tokens=8).lookup_total_tokens == 8, "asked for"


def test_unknown_or_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="unknown tree setting.*dept"):
        DEFAULT.override(dept=4)
    with pytest.raises(ConfigError, match="tree depth must be an integer in 1..32"):
        DEFAULT.override(depth=0)


def test_command_line_tree_settings():
    p = argparse.ArgumentParser()
    add_tree_args(p)
    a = p.parse_args(["--depth", "2", "--lookup", "0"])
    assert tree_changes(a) == {"depth": 2, "lookup": 0}
    assert tree_changes(p.parse_args([])) == {}
    with pytest.raises(ConfigError, match="tree total_tokens"):
        tree_changes(p.parse_args(["--total-tokens", "1"]))
    assert tree_changes(p.parse_args(["--plain-from-temperature", "0.9"])) == {"plain_from_temperature": 0.9}
    with pytest.raises(ConfigError, match=r"tree plain_from_temperature must be a number in 0..100 \(0 = speculate"):
        tree_changes(p.parse_args(["--plain-from-temperature", "-1"]))


def test_plain_from_temperature_pauses_hot_sampling_only():
    t = TreeConfig(depth=3, top_k=4, total_tokens=8, plain_from_temperature=0.9, long_context=((100, 2, 4),))
    assert t.speculates_hot(0.0) and t.speculates_hot(0.89) and not t.speculates_hot(0.9) and not t.speculates_hot(1.5)
    assert TreeConfig().speculates_hot(5.0), "0: speculate at every temperature"
    assert t.at(200).plain_from_temperature == 0.9, "a long-chat cap keeps it"
    assert t.override(depth=2).plain_from_temperature == 0.9 and t.override(plain_from_temperature=0).speculates_hot(2)
    with pytest.raises(ConfigError, match="plain_from_temperature"):
        TreeConfig(plain_from_temperature=True)
    hot = GenerationConfig(tree=t, sampling=SamplingConfig(temperature=1.0))
    assert hot.paused_hot and not GenerationConfig(tree=t, sampling=SamplingConfig(temperature=0.5)).paused_hot
    assert not GenerationConfig(tree=t, sampling=SamplingConfig(temperature=1.0), speculative=False).paused_hot

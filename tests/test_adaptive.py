"""Greedy speculation that follows measured speed (core.decoding.adaptive, GenerationConfig.adaptive):
the schedule on its own, then the engine on a fake clock that makes one mode slower: the answer
moves to the faster mode and its tokens are plain decoding's whichever mode wrote them."""

import pytest

import core.decoding.engine as engine_mod
from core.config import ConfigError, GenerationConfig, SamplingConfig, TreeConfig
from core.decoding import adaptive
from core.decoding.adaptive import Policy, record, start
from core.decoding.engine import Engine
from tests.test_engine import run as answer  # (tokens, events) of one answer
from tests.tiny import oracle_head, tiny_target

POLICY = Policy(first_probe=4, probe_steps=3, max_gap=16, decay=0.8, margin=0.05, give_up=0.5)


def steps(s, modes_and_rates):
    """Record one step per (speculative?, tokens per second) of the mode that runs; -> the modes run, in order."""
    ran = []
    for rate_spec, rate_plain in modes_and_rates:
        mode = s.speculative
        ran.append(mode)
        tokens = 2 if mode else 1
        s = record(s, POLICY, mode, tokens, tokens / (rate_spec if mode else rate_plain))
    return ran, s


def test_a_faster_plain_mode_takes_over_after_one_probe_and_is_probed_less_often():
    ran, s = steps(start(True, POLICY), [(100.0, 200.0)] * 40)
    assert ran[:4] == [True] * 4 and ran[4:7] == [False] * 3, "4 speculative steps, then a 3-step probe of plain"
    assert all(m is False for m in ran[7:11]), "plain measured faster: it stays"
    assert s.rate(True) == pytest.approx(100.0) and s.rate(False) == pytest.approx(200.0)
    probes = [i for i in range(1, 40) if ran[i] and not ran[i - 1]]  # speculation probed again
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes and all(g2 >= g1 for g1, g2 in zip(gaps, gaps[1:])), "confirmed probes come less often"


def test_speculation_keeps_its_place_and_a_hopeless_probe_ends_after_two_steps():
    ran, s = steps(start(True, POLICY), [(300.0, 100.0)] * 12)
    assert ran[:4] == [True] * 4 and ran[4:6] == [False, False] and ran[6] is True, \
        "plain at a third of the speed: its probe ends after 2 of 3 steps"
    ran, _ = steps(start(True, POLICY), [(100.0, 104.0)] * 12)
    assert ran[7:] == [True] * 5, "plain only 4% faster: inside the 5% margin, speculation stays"


def test_a_chat_past_the_plain_cap_starts_plain_and_probes_speculation():
    ran, s = steps(start(False, POLICY), [(300.0, 100.0)] * 12)
    assert ran[:4] == [False] * 4 and all(ran[4:11]), "speculation measured faster: it takes over"
    assert adaptive.Speeds(True).rate(True) is None, "a mode that never ran has no figure"


def test_a_repeat_in_the_context_probes_speculation_at_once_unless_it_just_failed():
    s = start(False, POLICY)
    assert adaptive.probe_now(s, POLICY) == s, "within 2 steps of the start (no probe yet)"
    _, s = steps(s, [(300.0, 100.0)] * 2)
    probed = adaptive.probe_now(s, POLICY)
    assert probed.speculative and probed.probing == POLICY.probe_steps
    ran, s = steps(probed, [(30.0, 100.0)] * 2)  # speculation far slower there: the probe ends after 2 steps
    assert ran == [True, True] and s.speculative is False and s.steps == 0 and s.gap == 2 * POLICY.first_probe
    _, s = steps(s, [(30.0, 100.0)] * 2)
    assert adaptive.probe_now(s, POLICY) == s, "it just measured under give_up: no probe before half the gap"
    _, s = steps(s, [(30.0, 100.0)] * (s.gap // 2 - 2))
    assert adaptive.probe_now(s, POLICY).speculative, "half the gap later a repeat may probe again"


def test_a_repeat_waits_where_speculation_last_measured_slower_even_a_little():
    """Past the margin, not only under give_up: a sampled answer that copies at 0.9x plain would
    otherwise probe at every repeat (measured: 0.85x plain on a 2,000-token edit at temperature 0.7)."""
    s = start(False, POLICY)
    _, s = steps(s, [(300.0, 100.0)] * 2)
    ran, s = steps(adaptive.probe_now(s, POLICY), [(90.0, 100.0)] * POLICY.probe_steps)  # 2 tokens at 90/s vs 1 at 100/s
    assert all(ran) and s.speculative is False, "0.9x plain: the probe hands back to plain"
    _, s = steps(s, [(90.0, 100.0)] * 2)
    assert adaptive.probe_now(s, POLICY) == s
    _, s = steps(s, [(90.0, 100.0)] * (s.gap // 2 - 2))
    assert adaptive.probe_now(s, POLICY).speculative


def test_a_hot_answer_keeps_plain_unless_speculation_beats_it_by_the_margin():
    """Past the tree's hot pause the answer starts plain (patient) and the margin turns round: speculation
    within 5% of plain, ahead or behind, hands back to plain; 10% ahead, it takes over. An answer that
    starts plain for another reason (a long chat) keeps speculation at the same figures."""
    for spec_rate, spec_wins in ((97.0, False), (104.0, False), (110.0, True)):  # tokens/s, plain at 100
        for hot in (True, False):
            s = adaptive.start(False, POLICY, patient=hot)
            assert s.hot is hot and s.gap == (POLICY.max_gap if hot else POLICY.first_probe)
            _, s = steps(s, [(spec_rate, 100.0)] * 2)
            ran, s = steps(adaptive.probe_now(s, POLICY), [(spec_rate, 100.0)] * POLICY.probe_steps)
            assert all(ran) and s.speculative is (spec_wins or not hot), (spec_rate, hot)
    s = adaptive.start(False, POLICY, patient=True)
    _, s = steps(s, [(100.0, 100.0)] * 2)
    _, s = steps(adaptive.probe_now(s, POLICY), [(103.0, 100.0)] * POLICY.probe_steps)
    _, s = steps(s, [(103.0, 100.0)] * 2)
    assert adaptive.probe_now(s, POLICY) == s, "hot: speculation 3% ahead did not win, so a repeat waits"


def test_the_setting_is_a_boolean():
    with pytest.raises(ConfigError, match="adaptive must be True or False, got 'yes'"):
        GenerationConfig(adaptive="yes")


class FakeClock:
    """core.decoding.engine's clock, advanced only by the target's forwards: `tree_s` per
    speculative verification, `plain_s` per plain step."""

    def __init__(self, monkeypatch, tree_s: float, plain_s: float):
        self.t = 0.0
        def timed(fn, cost):
            def call(*a, **k):
                self.t += cost
                return fn(*a, **k)
            return call
        monkeypatch.setattr(engine_mod, "now", lambda device=None: self.t)
        for name, cost in (("forward_tree", tree_s), ("forward_tree_greedy", tree_s), ("plain_forward", plain_s),
                           ("plain_forward_greedy", plain_s)):  # sampled answers, greedy ones
            monkeypatch.setattr(engine_mod, name, timed(getattr(engine_mod, name), cost))


@pytest.fixture(scope="module")
def bigram():
    target = tiny_target(mix=0.0, seed=4)  # the oracle head drafts it exactly: 4 drafts + bonus a step
    return Engine(target, oracle_head(target))


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("tree_s, plain_s, mostly", [(0.001, 0.001, "speculative"), (0.050, 0.001, "plain")])
def test_the_engine_moves_to_the_mode_the_clock_says_is_faster_with_plains_tokens(bigram, monkeypatch, tree_s,
                                                                                 plain_s, mostly, sampling):
    """Sampled answers too: a sampled token depends on the seed and its position, not on the mode."""
    monkeypatch.setattr(engine_mod, "POLICY", POLICY)
    plain, _ = answer(bigram, [5, 6], GenerationConfig(max_new_tokens=120, speculative=False, sampling=sampling, seed=3))
    FakeClock(monkeypatch, tree_s, plain_s)
    tree = TreeConfig(4, 1, 5)
    tokens, events = answer(bigram, [5, 6], GenerationConfig(max_new_tokens=120, tree=tree, adaptive=True,
                                                             sampling=sampling, seed=3))
    assert tokens == plain, "the same tokens whichever mode wrote them"
    spec = [ev.tree_size > 0 for ev in events[1:]]
    if mostly == "speculative":  # 5 tokens a step at one forward's cost: plain's probes end early
        assert sum(spec) > 0.7 * len(spec) and not all(spec), "plain was probed, speculation kept"
    else:  # a verification costs 50 plain steps: after the first probe, plain decoding runs
        assert spec[:4] == [True] * 4 and sum(spec[4:]) < 0.3 * len(spec[4:])
    # the same answer, the caps alone: speculation throughout
    fixed, events = answer(bigram, [5, 6], GenerationConfig(max_new_tokens=120, tree=tree, sampling=sampling, seed=3))
    assert fixed == plain and all(ev.tree_size > 0 for ev in events[1:])


def test_sampling_past_the_hot_pause_starts_plain_and_speculates_where_it_measures_faster(bigram, monkeypatch):
    """The tree's plain_from_temperature is a start, as the long-context caps are: an adaptive answer
    sampled that hot starts plain and probes; where speculation measures faster it takes over (the
    same tokens: one seed, one answer). Without adaptive the pause holds for the whole answer."""
    monkeypatch.setattr(engine_mod, "POLICY", POLICY)
    hot, tree = SamplingConfig(temperature=1.2), TreeConfig(4, 1, 5, plain_from_temperature=0.9)
    plain, _ = answer(bigram, [5, 6], GenerationConfig(max_new_tokens=80, speculative=False, sampling=hot, seed=2))
    paused, events = answer(bigram, [5, 6], GenerationConfig(max_new_tokens=80, tree=tree, sampling=hot, seed=2))
    assert paused == plain and not any(ev.tree_size for ev in events)
    FakeClock(monkeypatch, 0.001, 0.004)  # a verified tree costs a quarter of a plain step
    tokens, events = answer(bigram, [5, 6], GenerationConfig(max_new_tokens=80, tree=tree, sampling=hot, seed=2,
                                                             adaptive=True))
    assert tokens == plain
    spec = [ev.tree_size > 0 for ev in events[1:]]
    first = spec.index(True)  # patient: the longest gap, or sooner where the context repeats
    assert first >= POLICY.first_probe, "plain first (the hot pause), then a probe of speculation"
    assert sum(spec[first:]) > 0.7 * len(spec[first:]), "and speculation keeps the answer (plain probed now and then)"
    assert adaptive.start(False, POLICY, patient=True).gap == POLICY.max_gap


def test_a_prompt_past_the_plain_cap_starts_plain_and_the_head_catches_up_when_probed(bigram, monkeypatch):
    """Past a plain cap the head has not read the prompt; the first speculative probe catches it up
    (on the prompt's end, engine.HEAD_WINDOW tokens) together with the plain steps before it."""
    monkeypatch.setattr(engine_mod, "POLICY", POLICY)
    monkeypatch.setattr(engine_mod, "HEAD_WINDOW", 3)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    plain, _ = answer(bigram, prompt, GenerationConfig(max_new_tokens=60, speculative=False))
    FakeClock(monkeypatch, 0.001, 0.004)  # a verified tree costs a quarter of a plain step: speculation wins
    tree = TreeConfig(4, 1, 5, long_context=((4, 0, 0),))
    tokens, events = answer(bigram, prompt, GenerationConfig(max_new_tokens=60, tree=tree, adaptive=True))
    assert tokens == plain
    spec = [ev.tree_size > 0 for ev in events[1:]]
    assert spec[:4] == [False] * 4 and spec[4] is True, "plain first (the cap), then a probe of speculation"
    assert sum(ev.accepted_length for ev in events[5:8]) >= 3 * 4, "the caught-up head drafts what the target says"
    assert sum(spec[4:]) > 0.7 * len(spec[4:]), "and speculation keeps the answer"


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8)], ids=["greedy", "sampled"])
def test_beside_a_head_the_other_mode_copies_where_the_context_repeats(bigram, monkeypatch, sampling):
    """With a head and a tree that copies, an adaptive answer's mode beside speculation is context lookup alone (a
    plain step where nothing repeats), not plain decoding: where the head's work measures slower (its drafting made
    dear here), the answer copies the loop the target falls into without the head, and writes plain's tokens."""
    monkeypatch.setattr(engine_mod, "POLICY", POLICY)
    plain, _ = answer(bigram, [5, 6], GenerationConfig(max_new_tokens=120, speculative=False, sampling=sampling, seed=3))
    clock = FakeClock(monkeypatch, 0.001, 0.001)
    drafts, copying = [], []
    real_draft, real_lookup = engine_mod.draft, engine_mod._Run.lookup_step

    def dear_draft(*a, **k):  # the head's work: twenty forwards' time
        clock.t += 0.02
        drafts.append(1)
        return real_draft(*a, **k)

    def lookup_step(self):
        event = real_lookup(self)
        copying.append(len(event.token_ids) if event.tree_size else 0)  # tokens a copied chain wrote
        return event

    monkeypatch.setattr(engine_mod, "draft", dear_draft)
    monkeypatch.setattr(engine_mod._Run, "lookup_step", lookup_step)
    tree = TreeConfig(4, 1, 5, lookup=8)
    tokens, events = answer(bigram, [5, 6], GenerationConfig(max_new_tokens=120, tree=tree, adaptive=True,
                                                             sampling=sampling, seed=3))
    assert tokens == plain, "the same tokens whichever mode wrote them"
    assert drafts, "the head ran (the answer starts speculating, and probes it)"
    assert len(copying) > 0.5 * (len(events) - 1), "most steps ran in the copying mode"
    if sampling.greedy:  # (a sampled answer leaves the loop now and then: less to copy)
        assert sum(copying) > 0.6 * len(tokens), "copying wrote most of the answer, without the head"
    # without lookup in the tree, the other mode is plain decoding, as before
    copying.clear()
    no_copy, events = answer(bigram, [5, 6], GenerationConfig(max_new_tokens=120, tree=TreeConfig(4, 1, 5),
                                                              adaptive=True, sampling=sampling, seed=3))
    assert no_copy == plain and not any(copying)


def test_copied_steps_leave_the_head_the_features_plain_steps_would(monkeypatch):
    """What an adaptive answer copied without the head, the head catches up on when speculation next runs: the
    copied rows' tokens and features wait for it exactly as plain steps' would (the same positions, the same
    values), and past a plain cap the other mode is plain decoding."""
    from dataclasses import replace

    import torch

    from tests.tiny import random_head

    target = tiny_target(mix=0.05, seed=4, vocab=24)  # nearly a bigram: it loops, and features see the context
    eng = Engine(target, random_head(target))
    prompt, tree = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8], TreeConfig(1, 1, 2, lookup=8)
    monkeypatch.setattr(adaptive, "probe_now", lambda s, policy: s)  # no probe of speculation: one mode throughout

    def waiting(copies: bool):
        """The head's pending (tokens, features) after 40 tokens in the mode beside speculation."""
        run = engine_mod._Run(eng, prompt, GenerationConfig(max_new_tokens=60, tree=tree, adaptive=True))
        if not copies:
            monkeypatch.setattr(run, "copies", lambda: False)
        run.first_step()
        run.speeds = replace(run.speeds, speculative=False, gap=10**6)  # that mode throughout
        events = []
        while run.n_out < 40:
            events.append(run.next_step())
        tokens, features = (torch.cat(x) for x in zip(*run.pending))
        return tokens, features, events

    copied_tokens, copied_features, events = waiting(True)
    plain_tokens, plain_features, plain_events = waiting(False)
    assert any(ev.tree_size > 2 for ev in events) and not any(ev.tree_size for ev in plain_events)
    n = min(len(copied_tokens), len(plain_tokens))
    assert n >= 39 and torch.equal(copied_tokens[:n], plain_tokens[:n])
    torch.testing.assert_close(copied_features[:n], plain_features[:n], rtol=1e-9, atol=1e-9)
    capped = engine_mod._Run(eng, prompt, GenerationConfig(max_new_tokens=60, adaptive=True,
                                                            tree=replace(tree, long_context=((8, 0, 0),))))
    capped.first_step()
    assert not capped.copies() and engine_mod._Run(eng, prompt, GenerationConfig(max_new_tokens=60, tree=tree,
                                                                                  adaptive=True)).copies()


def test_the_cli_and_the_benchmark_turn_it_on_by_flag():
    from core.bench import parse_args as bench_args
    from core.generate import check_args, parse_args

    assert check_args(parse_args(["hi", "--adaptive"]))[2].adaptive is True
    assert check_args(parse_args(["hi"]))[2].adaptive is False
    assert bench_args(["--adaptive"]).adaptive is True and bench_args([]).adaptive is False
    from core.serve import check_args as serve_check, parse_args as serve_args

    assert serve_check(serve_args(["--adaptive"])).adaptive is True and serve_check(serve_args([])).adaptive is False


def test_the_api_server_passes_it_to_every_request(bigram):
    from core.serve import ServeConfig, parse

    body = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4, "temperature": 0}
    assert parse(body, bigram, "tiny", True, ServeConfig(adaptive=True)).config.adaptive is True
    assert parse(body, bigram, "tiny", True).config.adaptive is False

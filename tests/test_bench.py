"""The benchmark on tiny Llama targets: JSON schema, exactness flags, multi-turn history,
fair ordering, forward counting, and clear errors for bad input."""

import json

import pytest

import core.bench as bench
from core.bench import (BUILTIN_PROMPTS, BenchError, BenchSettings, Prompt, format_table, load_prompts, main,
                        mode_order, run_benchmark)
from core.config import SamplingConfig, TreeConfig
from core.decoding.engine import Engine
from core.decoding.lookup import DEFAULT_TOKENS
from tests.tiny import oracle_head, random_head, tiny_target

TWO_PROMPTS = [{"id": "two-turn", "category": "math", "turns": ["w5 w6 w7", "w9 w10"]},
               {"id": "one-turn", "category": "coding", "turns": ["w20 w21 w22"]}]
TREE = TreeConfig(depth=3, top_k=3, total_tokens=8)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def prompts():
    return [Prompt(p["id"], p["category"], tuple(p["turns"])) for p in TWO_PROMPTS]


@pytest.fixture(scope="module")
def engine():
    target = tiny_target()
    return Engine(target, random_head(target))


@pytest.fixture(scope="module")
def cli_result(tmp_path_factory):
    """`python -m core.bench` end to end on a tiny model saved as a folder, random head."""
    tmp = tmp_path_factory.mktemp("bench")
    target = tiny_target()
    target.model.save_pretrained(tmp / "model")
    target.tokenizer.save_pretrained(tmp / "model")
    args = ["--model", str(tmp / "model"), "--head", "random", "--dtype", "float64", "--modes", "plain,eagle",
            "--prompts", str(write_jsonl(tmp / "p.jsonl", TWO_PROMPTS)), "--max-new-tokens", "12",
            "--depth", "3", "--top-k", "3", "--total-tokens", "8", "--out", str(tmp / "out" / "r.json"),
            "--plot", str(tmp / "out" / "r.png")]
    assert main(args) == 0
    return json.loads((tmp / "out" / "r.json").read_text()), tmp / "out" / "r.png"


def test_cli_json_schema_complete(cli_result):
    r, _ = cli_result
    assert {"model", "head", "device", "dtype", "threads", "settings", "modes", "speedup_vs_plain",
            "speedup_vs_hf", "identical_to_plain"} <= r.keys()
    assert r["dtype"] == "float64" and r["device"] == "cpu" and r["threads"] >= 1
    assert r["head"].startswith("random")
    s = r["settings"]
    assert (s["max_new_tokens"], s["temperature"], s["tree"]["depth"], s["tree"]["total_tokens"]) == (12, 0.0, 3, 8)
    assert s["tree_source"] == "manual" and s["prompts"] == 2 and s["turns"] == 3
    assert list(r["modes"]) == ["plain", "eagle"]
    for mode, m in r["modes"].items():
        assert {"tokens", "seconds", "tokens_per_s", "target_forwards", "tau", "per_prompt"} <= m.keys()
        assert [p["id"] for p in m["per_prompt"]] == ["two-turn", "one-turn"]
        for p in m["per_prompt"]:
            assert {"id", "tokens", "seconds", "target_forwards", "output_ids"} <= p.keys()
            assert p["tokens"] == sum(len(ids) for ids in p["output_ids"])
        assert [len(p["output_ids"]) for p in m["per_prompt"]] == [2, 1]  # one id list per turn
        assert m["tokens"] == sum(p["tokens"] for p in m["per_prompt"]) == 36  # 3 turns x 12, no eos here
        assert m["target_forwards"] == sum(p["target_forwards"] for p in m["per_prompt"])
        assert m["tau"] == pytest.approx(m["tokens"] / m["target_forwards"])
        assert m["tokens_per_s"] == pytest.approx(m["tokens"] / m["seconds"])
        assert set(m["time_split"]) == {"draft_s", "verify_s", "other_s"}
    assert r["modes"]["plain"]["target_forwards"] == 36 and r["modes"]["plain"]["time_split"]["draft_s"] == 0
    eagle = r["modes"]["eagle"]
    hist = {int(k): v for k, v in eagle["accepted_length_histogram"].items()}
    # every token comes from a speculative step, except the first token of each turn (prefill)
    assert sum(n * c for n, c in hist.items()) + 3 == eagle["tokens"]
    assert sum(hist.values()) + 3 == eagle["target_forwards"]
    assert eagle["time_split"]["draft_s"] > 0
    assert r["speedup_vs_plain"]["plain"] == 1.0 and r["speedup_vs_hf"] == {}
    assert r["speedup_vs_plain"]["eagle"] == pytest.approx(eagle["tokens_per_s"] / r["modes"]["plain"]["tokens_per_s"])
    assert r["identical_to_plain"]["eagle"] is True
    memory = r["memory_after_load"]  # the process's resident memory right after loading (Linux: VmRSS, VmHWM)
    assert 0 < memory["resident_mb"] <= memory["peak_mb"]


def test_the_table_reports_the_memory_after_loading():
    result = {"modes": {}, "head": "default", "memory_after_load": {"resident_mb": 613, "peak_mb": 1180}}
    line = "memory after loading the model and head: 613 MB resident (peak 1,180 MB while loading)"
    assert line in format_table(result)
    alone = {"modes": {}, "head": None, "memory_after_load": {"resident_mb": 598, "peak_mb": 1100}}
    assert "memory after loading the model: 598 MB resident (peak 1,100 MB while loading)" in format_table(alone)
    assert "memory after loading" not in format_table({"modes": {}, "memory_after_load": None})


def test_cli_plot_is_a_png(cli_result):
    _, png = cli_result
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_hf_modes_exact_in_greedy_and_forwards_are_counted():
    target = tiny_target(mix=0.0, seed=4)  # a bigram model: answers repeat, so lookup finds matches
    eng = Engine(target)
    r = run_benchmark(eng, prompts(), "plain,hf,hf-lookup", BenchSettings(max_new_tokens=40, warmup=False))
    assert r["identical_to_plain"] == {"plain": True, "hf": True, "hf-lookup": True}
    hf, lookup = r["modes"]["hf"], r["modes"]["hf-lookup"]
    assert hf["target_forwards"] == hf["tokens"] == r["modes"]["plain"]["target_forwards"]
    assert lookup["target_forwards"] < lookup["tokens"]  # the hook counts calls, not tokens
    assert r["speedup_vs_hf"]["hf"] == 1.0 and set(r["speedup_vs_plain"]) == {"plain", "hf", "hf-lookup"}


def test_eagle_head_mode_runs_the_tree_without_context_lookup():
    target = tiny_target(mix=0.0, seed=4)  # a bigram model: answers loop, so lookup finds matches
    eng = Engine(target, oracle_head(target))
    settings = BenchSettings(max_new_tokens=40, warmup=False, tree=TreeConfig(2, 2, 4, lookup=8))
    r = run_benchmark(eng, prompts(), "plain,eagle,eagle-head", settings)
    assert r["identical_to_plain"] == {"plain": True, "eagle": True, "eagle-head": True}
    assert r["settings"]["tree"]["lookup"] == 8
    longest = {m: max(int(k) for k in r["modes"][m]["accepted_length_histogram"]) for m in ("eagle", "eagle-head")}
    assert longest["eagle-head"] <= 3 < longest["eagle"]  # depth 2 + bonus; only the copied chain goes past
    assert r["modes"]["eagle"]["tau"] > r["modes"]["eagle-head"]["tau"]


def test_lookup_mode_speculates_by_context_lookup_alone_with_or_without_a_head():
    target = tiny_target(mix=0.0, seed=4)  # a bigram model: answers loop, so lookup finds matches
    for eng in (Engine(target), Engine(target, oracle_head(target))):
        r = run_benchmark(eng, prompts(), "plain,lookup", BenchSettings(max_new_tokens=40, warmup=False))
        assert r["identical_to_plain"] == {"plain": True, "lookup": True}
        lookup = r["modes"]["lookup"]
        assert lookup["tau"] > 1.5 and max(int(k) for k in lookup["accepted_length_histogram"]) > 3
        assert lookup["time_split"]["draft_s"] >= 0
    # beside a head, the lookup mode copies what a model without one copies, not the head's tree's chain; --lookup sets it
    eng = Engine(target, oracle_head(target))
    head_tree = TreeConfig(1, 1, 2, lookup=3)
    r = run_benchmark(eng, prompts(), "lookup", BenchSettings(max_new_tokens=40, warmup=False, tree=head_tree))
    assert r["settings"]["lookup_alone"] == DEFAULT_TOKENS and r["settings"]["tree"]["lookup"] == 3
    assert max(int(k) for k in r["modes"]["lookup"]["accepted_length_histogram"]) > 3 + 1
    r = run_benchmark(eng, prompts(), "lookup", BenchSettings(max_new_tokens=40, warmup=False, tree=head_tree,
                                                              copy_tokens=2))
    assert r["settings"]["lookup_alone"] == 2
    assert max(int(k) for k in r["modes"]["lookup"]["accepted_length_histogram"]) == 2 + 1


def test_multi_turn_feeds_each_modes_own_answer_and_modes_interleave(engine, monkeypatch):
    calls = []
    for mode, runner in list(bench.MODES.items()):
        def spy(e, ids, s, seed, mode=mode, runner=runner):
            out = runner(e, ids, s, seed)
            calls.append((mode, list(ids), s.max_new_tokens, out.output_ids))
            return out
        monkeypatch.setitem(bench.MODES, mode, spy)
    modes = ["plain", "eagle", "hf"]
    settings = BenchSettings(max_new_tokens=20, tree=TREE, sampling=SamplingConfig(temperature=1.0))
    r = run_benchmark(engine, prompts(), modes, settings)
    # sampled: our modes draw from the seed and the position, so eagle's answers are plain's; hf samples its own way
    assert r["identical_to_plain"] == {"plain": True, "eagle": True}
    warmups, measured = calls[:3], calls[3:]
    assert [c[0] for c in warmups] == modes and all(c[2] == bench.WARMUP_TOKENS == 16 for c in warmups)
    assert all(c[2] == 20 for c in measured)
    # prompt 0 (two turns) in order plain, eagle, hf; prompt 1 rotated: eagle, hf, plain
    assert [c[0] for c in measured] == ["plain", "plain", "eagle", "eagle", "hf", "hf", "eagle", "hf", "plain"]
    decode = engine.target.tokenizer.decode
    first_answers = set()
    for i in (0, 2, 4):
        mode, ids1, _, answer = measured[i]
        assert measured[i + 1][0] == mode
        history = [{"role": "user", "content": "w5 w6 w7"},
                   {"role": "assistant", "content": decode(list(answer), skip_special_tokens=True)},
                   {"role": "user", "content": "w9 w10"}]
        assert measured[i + 1][1] == engine.encode(history)
        assert r["modes"][mode]["per_prompt"][0]["output_ids"][0] == list(answer)
        first_answers.add(answer)
    # plain and eagle sample differently (hf may match plain: same sampler, same seed), so the
    # history check above distinguishes a mode's own answer from another mode's
    assert len(first_answers) >= 2


def test_builtin_prompts_cover_the_categories():
    ps = load_prompts(BUILTIN_PROMPTS)
    cats = [p.category for p in ps]
    for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"):
        assert cats.count(c) >= 2, c
    assert 16 <= len(ps) <= 24 and any(len(p.turns) > 1 for p in ps)


def test_mode_order_rotates():
    assert [mode_order(["a", "b", "c"], i) for i in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


GOOD = json.dumps(TWO_PROMPTS[1])


@pytest.mark.parametrize("rows, message", [
    ([GOOD, "{not json"], "line 2: not valid JSON"),
    ([GOOD, "", '{"id": "x", "category": "c"}'], "line 3: missing field(s) turns"),
    (['{"id": "x", "category": "c", "turns": []}'], "line 1: \"turns\" must be a non-empty list"),
    (['{"id": "x", "category": "c", "turns": ["hi", 3]}'], "line 1: every turn must be a non-empty string"),
    (['["hi"]'], "line 1: expected a JSON object"),
    ([GOOD, GOOD], "line 2: duplicate prompt id 'one-turn'"),
    ([""], "holds no prompts"),
])
def test_bad_prompt_file_errors_name_the_line(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(BenchError) as e:
        load_prompts(path)
    assert message in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["--modes", "plain,bogus"],
     "unknown mode(s) 'bogus'; choose from plain, eagle, eagle-head, lookup, hf, hf-fp32, hf-lookup"),
    (["--modes", "plain,plain"], "listed twice"),
    (["--prompts", "/nonexistent/p.jsonl"], "does not exist"),
    (["--tree", "auto", "--depth", "3"], "--tree auto chooses the tree itself"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
    (["--temperature", "-1"], "temperature must be >= 0"),
])
def test_cli_refuses_bad_input_before_loading_a_model(args, message, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded for bad input")
    monkeypatch.setattr(bench.Engine, "load", no_load)
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_eagle_without_a_head_is_refused(engine):
    with pytest.raises(BenchError, match="needs a draft head"):
        run_benchmark(Engine(engine.target), prompts(), "plain,eagle", BenchSettings(warmup=False))


def test_auto_tree_is_the_apps_tree_and_tunes_only_without_one(tmp_path, monkeypatch):
    """--tree auto drafts with the tree the app uses (tuned here, else shipped beside the head);
    only an engine with neither tunes, with the end-to-end check."""
    import core.autotune as autotune
    from core.decoding.treestore import BUILT_IN, TreeChoice

    target = tiny_target()
    eng = Engine(target, random_head(target))
    shipped = TreeConfig(depth=2, top_k=3, total_tokens=5, lookup=4)
    eng.tree_choice = TreeChoice(shipped, "shipped with the head")
    tuned = []
    monkeypatch.setattr(autotune, "choose_tree", lambda e, **kw: tuned.append(kw) or TreeConfig(depth=1, top_k=2, total_tokens=2))
    assert bench.auto_tree(eng) == (shipped, "auto (shipped with the head)") and tuned == []
    eng.tree_choice = TreeChoice(TreeConfig(), BUILT_IN)
    assert bench.auto_tree(eng) == (TreeConfig(depth=1, top_k=2, total_tokens=2), "auto (tuned now)")
    assert tuned == [{"confirm_top": 4}]


def test_tree_settings_go_over_the_default_tree_keeping_lookup_and_long_chat_caps():
    """TreeConfig.override, the rule every entry point uses: a tree by hand keeps the default's
    lookup and caps (the bench built it from scratch before, without them)."""
    from core.decoding.treestore import TreeChoice

    target = tiny_target()
    eng = Engine(target, random_head(target))
    shipped = TreeConfig(depth=3, top_k=8, total_tokens=10, lookup=24, lookup_total_tokens=6,
                         long_context=((2048, 0, 0),))
    eng.tree_choice = TreeChoice(shipped, "shipped with the head")
    manual, given = bench._tree_choice(bench.parse_args(["--total-tokens", "4"]))
    tree, source = bench.bench_tree(eng, manual, given, spec=True)
    assert manual and source == "manual"
    assert tree == TreeConfig(depth=3, top_k=8, total_tokens=4, lookup=24, long_context=((2048, 0, 0),))
    manual, given = bench._tree_choice(bench.parse_args(["--lookup", "0"]))
    assert not manual, "--lookup alone keeps the auto tree"
    assert bench.bench_tree(eng, manual, given, spec=True) == (
        shipped.override(lookup=0), "auto (shipped with the head), lookup 0 (--lookup)")
    manual, given = bench._tree_choice(bench.parse_args(["--tree", "manual"]))
    assert bench.bench_tree(eng, manual, given, spec=True) == (shipped, "manual")

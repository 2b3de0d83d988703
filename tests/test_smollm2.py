"""The real embedded model: SmolLM2-135M-Instruct from the PyPI wheel, fp32, on CPU."""

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from core.config import GenerationConfig, TreeConfig
from core.decoding.engine import Engine
from core.decoding.head import new_head, save_head
from core.models import DEFAULT_HEAD_DIR

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Give me three tips for staying focused while studying."]


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(2)
    eng = Engine.load()  # the shipped head when present
    if not eng.has_head:  # before a head is trained: a random one still must be exact
        eng = Engine(eng.target, new_head(eng.target.model.config, seed=0).eval())
    yield eng
    torch.set_num_threads(1)


def tokens(engine, prompt, **kw):
    cfg = GenerationConfig(max_new_tokens=40, **kw)
    return [t for ev in engine.generate(prompt, cfg) for t in ev.token_ids]


@pytest.mark.slow
def test_greedy_identical_to_plain_and_generate(engine):
    for prompt in PROMPTS:
        plain = tokens(engine, prompt, speculative=False)
        assert tokens(engine, prompt) == plain
        assert tokens(engine, prompt, tree=TreeConfig(depth=3, top_k=4, total_tokens=8)) == plain
    # Against transformers' own forward: its kernels (sdpa for a prompt, oneDNN where ours do not
    # serve) sum in other orders, so equal greedy tokens there would hold only by luck at a near
    # tie. Teacher-forced over our answer: each of our tokens is transformers' best at its position,
    # or within bf16 noise of it.
    ids = engine.encode(PROMPTS[0])
    ours = tokens(engine, PROMPTS[0], speculative=False)
    with torch.inference_mode():
        ref = engine.target.model(torch.tensor([ids + ours])).logits[0, len(ids) - 1:-1].float()
    gap = ref.max(-1).values - ref.gather(1, torch.tensor(ours)[:, None])[:, 0]
    noise = 0.02 * float(ref.abs().max())  # a few bf16 roundings through the layers
    assert float(gap.max()) <= noise, gap.tolist()
    assert float((gap == 0).float().mean()) >= 0.9


@pytest.mark.slow
def test_headless_cli_both_modes_same_text(engine, tmp_path):
    head = []
    if not DEFAULT_HEAD_DIR.is_dir():  # before a head is trained, use the fixture's random one
        save_head(engine.head, tmp_path / "head")
        head = ["--head", str(tmp_path / "head")]
    (tmp_path / "prompt.txt").write_text("What is 2 + 2?")
    run = lambda *a, **kw: subprocess.run([sys.executable, "-m", "core.generate", "--max-new-tokens", "24", *a],
                                          capture_output=True, text=True, timeout=300, **kw)
    # a long prompt can come from standard input or a file (no OS argument-length limit)
    plain = run("-", "--plain", input="What is 2 + 2?")
    spec = run("--prompt-file", str(tmp_path / "prompt.txt"), *head)
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    # both processes serve the same numerics (the probe runs for --plain too), whatever the
    # machine's load gave each at start; the text can only be compared if they do
    numerics = lambda err: [part.strip() for part in next(line for line in err.splitlines() if line.startswith(
        "[numerics] ")).split(";") if not part.strip().startswith(("exact", "tree"))]
    assert numerics(plain.stderr) == numerics(spec.stderr), plain.stderr + spec.stderr
    assert "exact: verified" in plain.stderr, plain.stderr
    # stdout holds the answer alone (`> answer.txt` keeps only it); statistics go to stderr
    assert plain.stdout == spec.stdout and plain.stdout.strip() and "tokens=" not in plain.stdout
    assert "[plain] tokens=" in plain.stderr and "tau=1.00" in plain.stderr
    assert "[eagle] tokens=" in spec.stderr and "tokens/s=" in spec.stderr
    assert "[numerics] " in spec.stderr and "exact: " in spec.stderr
    # sampled without --seed: the seed drawn is printed, and --seed with it repeats the answer, plain too
    hot = run("--prompt-file", str(tmp_path / "prompt.txt"), "--temperature", "0.6", "--plain-from-temperature", "0",
              *head)
    seed = re.search(r"sampled with seed (\d+): --seed \1 gives this answer again", hot.stderr)
    assert hot.returncode == 0 and seed, hot.stderr
    again = run("-", "--plain", "--temperature", "0.6", "--seed", seed.group(1), input="What is 2 + 2?")
    if numerics(again.stderr) == numerics(hot.stderr):
        assert again.stdout == hot.stdout and hot.stdout.strip()


def test_cli_bad_input_is_one_clear_line():
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "core.generate", "hi", "--depth", "0", "--plain"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == "error: tree depth must be an integer in 1..32, got 0"
    assert time.perf_counter() - start < 3  # refused before torch and the model load
    out = subprocess.run([sys.executable, "-m", "core.generate", "hi", "--lookup", "40"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: tree lookup must be an integer in 0..32")
    out = subprocess.run([sys.executable, "-m", "core.generate", "--prompt-file", "/no/such/file"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot read --prompt-file /no/such/file" in out.stderr
    out = subprocess.run([sys.executable, "-m", "core.generate", "  ", "--plain", "--max-new-tokens", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "the prompt is empty" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_ab_script_compares_trees_and_checks_identity(capsys, tmp_path):
    """scripts/ab.py: contenders interleaved on real prompts, answers checked against the shipped one."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "scripts" / "ab.py"
    spec = importlib.util.spec_from_file_location("ab_script", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": c, "turns": [t]}) + "\n"
                               for i, (c, t) in enumerate([("chat", PROMPTS[0]), ("coding", PROMPTS[1])])))
    skip = tmp_path / "skip.jsonl"
    skip.write_text(json.dumps({"id": "p0", "category": "chat", "turns": [PROMPTS[0]]}) + "\n")
    rc = ab.main([str(prompts), "--tree", "2,2,3", "--exclude", str(skip), "--max-new-tokens", "12", "--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "identical to the shipped contender: 1 / 1" in out
    assert "tree 2,2,3: tau" in out and "coding" in out and "chat" not in out
    with pytest.raises(SystemExit):
        ab.main([str(prompts), "--tree", "3-8-12", "--threads", "1"])
    assert "--tree '3-8-12': expected DEPTH,TOP_K,TOTAL_TOKENS" in capsys.readouterr().err
    # plain decoding as a contender, a lookup length in the tree, the figures as JSON
    out_json = tmp_path / "ab.json"
    rc = ab.main([str(prompts), "--tree", "2,2,3,0", "--plain", "--exclude", str(skip), "--max-new-tokens", "12",
                  "--threads", "1", "--out", str(out_json)])
    res = json.loads(out_json.read_text())
    assert rc == 0 and res["identical"] == 1 and res["prompts"] == 1 and res["temperature"] == 0.0
    c = res["contenders"]
    assert set(c) == {"shipped", "tree 2,2,3,0", "plain"} and c["plain"]["tau"] == 1.0
    assert c["plain"]["speedup_vs_plain"] == pytest.approx(1.0) and c["shipped"]["speedup_vs_plain"] > 0
    assert len(c["shipped"]["accept_at_least"]) == ab.DEPTHS and set(c["shipped"]["tau_per_category"]) == {"coding"}
    assert "x plain)" in capsys.readouterr().out
    # sampled: a token is a function of the seed and its position, so every contender writes the
    # same answer, run after run
    runs = []
    for i in range(2):
        out_json = tmp_path / f"ab_t{i}.json"
        rc = ab.main([str(prompts), "--temperature", "0.9", "--seed", "3", "--plain", "--exclude", str(skip),
                      "--max-new-tokens", "12", "--threads", "1", "--out", str(out_json)])
        runs.append(json.loads(out_json.read_text()))
        assert rc == 0 and runs[-1]["identical"] == runs[-1]["prompts"] and runs[-1]["temperature"] == 0.9
    assert "(sampled at temperature 0.9, seed 3 + the prompt's index)" in capsys.readouterr().out
    assert {k: v["tau"] for k, v in runs[0]["contenders"].items()} == {k: v["tau"] for k, v in runs[1]["contenders"].items()}


@pytest.mark.slow
def test_extra_layers_lab_starts_at_the_shipped_head_and_trains_only_what_its_arm_names(tmp_path, capsys):
    """scripts/extra_layers_lab.py: fc_extra starts at zero, so its first held-out figure is the shipped
    head's own teacher-forced top-1 (the trainer's evaluate_features on the same conversations' last
    hidden state, hit for hit); the `extra` arm moves fc_extra and leaves the head as shipped."""
    import importlib.util
    import pathlib

    from core.decoding.head import load_head
    from core.models import load_target
    from core.train.features import FeatureConfig, build_features, load_sequences
    from core.train.trainer import Frozen, evaluate_features

    path = pathlib.Path(__file__).parent.parent / "scripts" / "extra_layers_lab.py"
    spec = importlib.util.spec_from_file_location("extra_layers_lab", path)
    lab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab)
    answers = ["The capital of France is Paris, a city on the Seine known for the Eiffel Tower.",
               "def reverse(s):\n    return s[::-1]\n\nThis slices the string with a step of -1.",
               "1. Put your phone in another room. 2. Work in 25-minute blocks. 3. Take short breaks outside."]
    convs = [[{"role": "user", "content": p}, {"role": "assistant", "content": a}] for p, a in zip(PROMPTS, answers)]
    target = load_target("smollm2")
    cfg = FeatureConfig(layer_ids=(2, 15, 27))
    build_features(target, convs[:2], tmp_path / "tr" / "features_eagle3" / "a", cfg)
    build_features(target, convs, tmp_path / "va" / "features_eagle3" / "a", cfg)
    head, vocab = load_head(DEFAULT_HEAD_DIR, target.model.config)
    fz = Frozen.from_target(target.model, vocab)
    shipped = evaluate_features(head.float(), fz, load_sequences(tmp_path / "va" / "features_eagle3" / "a",
                                                                 last_only=True), depth=1)
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng():  # the script seeds torch and sets its threads: this process's stay as they were
            lab.main(["--train", str(tmp_path / "tr"), "--val", str(tmp_path / "va"), "--arm", "extra", "--epochs", "2",
                      "--batch-size", "1", "--threads", str(threads), "--out", str(out)])
            lab.main(["--train", str(tmp_path / "tr"), "--val", str(tmp_path / "va"), "--arm", "extra", "--epochs", "1",
                      "--batch-size", "1", "--threads", str(threads), "--use", "0", "--shift", "1",
                      "--out", str(tmp_path / "shifted")])
            with pytest.raises(SystemExit, match="no EAGLE-3 features under"):
                lab.main(["--train", str(tmp_path / "nothing"), "--val", str(tmp_path / "va"), "--arm", "both",
                          "--threads", str(threads)])
    finally:
        torch.set_num_threads(threads)
    evals = json.loads((out / "log.json").read_text())["evals"]
    assert evals[0]["top1"] == shipped.top1[0] and evals[-1]["step"] == 4
    assert "step 0: held-out top-1" in capsys.readouterr().out
    weights = torch.load(out / "weights.pt", weights_only=True)
    assert float(weights["fc_extra"].abs().max()) > 0
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in weights["head"].items())
    # one stored layer, read at the embedded token's own position: a (H, H) map, from the shipped head too
    shifted = torch.load(tmp_path / "shifted" / "weights.pt", weights_only=True)["fc_extra"]
    assert shifted.shape == (576, 576) and float(shifted.abs().max()) > 0
    assert json.loads((tmp_path / "shifted" / "log.json").read_text())["evals"][0]["top1"] == shipped.top1[0]


@pytest.mark.slow
def test_forward_cost_script_times_every_row_count_at_every_context(capsys):
    """scripts/forward_cost.py: one line per context, one positive time per row count; a context
    past the model's window is refused by name."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "scripts" / "forward_cost.py"
    spec = importlib.util.spec_from_file_location("forward_cost_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--contexts", "16,40", "--rows", "1,3", "--reps", "1", "--threads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["context", "1", "3"] and len(lines) == 3
    for line, ctx in zip(lines[1:], (16, 40)):
        fields = line.split()
        assert int(fields[0]) == ctx and len(fields) == 3 and all(float(f) > 0 for f in fields[1:])
    with pytest.raises(SystemExit):
        script.main(["--contexts", "9000", "--rows", "1", "--threads", "1"])
    assert "context + rows must stay under the model's 8192 tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_rotary_tables_are_the_same_bits_in_every_process():
    """On the Intel AMX VM the first parallel cos of 30% of processes was off by up to 1.5e-4,
    so the native step's bf16 rotary table, and every answer, depended on the process (plain
    and speculative alike). Fresh processes, as the app starts: each table equals its module's
    values, and every process builds the same bits."""
    from core.kernels import native

    if not native.status().available:
        pytest.skip(f"no native step here (its tables are what is checked): {native.status().reason}")
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "tests.rotary_child"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "target" in runs[0] and "head" in runs[0], runs[0]
    for run in runs:
        for name, table in run.items():
            assert table["same_as_module"], (name, run)
    assert runs[0] == runs[1]

"""llama.cpp beside our modes in the benchmark (core.llamacpp, core.bench's llama.cpp mode and
--prefill-tokens), against a fake `llama-server` written here: CI never needs llama.cpp.
Also the --weights flag of every CLI."""

import json
import stat
import sys
import textwrap
from dataclasses import replace

import pytest

import core.bench as bench
from core.bench import BenchSettings, Prompt, main, measure_prefill, run_benchmark
from core.config import TreeConfig
from core.decoding.engine import Engine
from core.llamacpp import LlamaCppError, LlamaServer, find_server, parse_completion
from tests.tiny import random_head, tiny_target

PROMPT_MS_PER_TOKEN, STEP_MS = 2.0, 5.0
ANSWER = [7, 8, 9, 10, 11, 12, 13, 14]  # cycled; no eos (0) in it

# A stand-in for llama.cpp's llama-server: the same arguments, /health, /props and /completion
# with `tokens` and `timings` as llama.cpp's server reports them (tools/server/server-common.cpp);
# it logs each request's body, and `--die` / `--sigill` end it while "loading".
FAKE_SERVER = textwrap.dedent(f"""\
    #!{sys.executable}
    import json, os, signal, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    args = sys.argv[1:]
    if "--die" in args:
        print("llama_model_load: error loading model: tensor 'blk.0' has invalid type", flush=True)
        sys.exit(1)
    if "--sigill" in args:
        print("load_model: loading model", flush=True)
        os.kill(os.getpid(), signal.SIGILL)
    log = os.environ["FAKE_LLAMA_LOG"]
    with open(log + ".argv", "w") as f:
        json.dump(args, f)
    port = int(args[args.index("--port") + 1])

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply({{"status": "ok"}} if self.path == "/health" else {{"build_info": "b1-fake"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(log, "a") as f:
                f.write(json.dumps(body) + "\\n")
            n, prompt = body["n_predict"], body["prompt"]
            answer = {ANSWER!r}
            tokens = [answer[i % len(answer)] for i in range(n)]
            self.reply({{"content": "", "tokens": tokens, "stop": True, "timings": {{
                "cache_n": 0, "prompt_n": len(prompt), "prompt_ms": {PROMPT_MS_PER_TOKEN} * len(prompt),
                "predicted_n": n, "predicted_ms": {STEP_MS} * (n - 1)}}}})

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """)

TWO_PROMPTS = [Prompt("two-turn", "math", ("w5 w6 w7", "w9 w10")), Prompt("one-turn", "coding", ("w20 w21 w22",))]


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A llama.cpp 'bin folder' holding the fake llama-server; returns (folder, request log)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    exe = folder / "llama-server"
    exe.write_text(FAKE_SERVER)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    return folder, log


def requests(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_parse_completion_reads_llama_servers_reply():
    reply = {"index": 0, "content": "La femme", "tokens": [15319, 2849], "stop": True, "stop_type": "limit",
             "timings": {"cache_n": 0, "prompt_n": 37, "prompt_ms": 603.383, "prompt_per_token_ms": 16.3,
                         "prompt_per_second": 61.3, "predicted_n": 2, "predicted_ms": 27.5,
                         "predicted_per_token_ms": 27.5, "predicted_per_second": 36.3}}  # a real reply, cut short
    c = parse_completion(reply)
    assert (c.tokens, c.prompt_n, c.prompt_ms, c.predicted_n, c.predicted_ms) == ((15319, 2849), 37, 603.383, 2, 27.5)
    with pytest.raises(LlamaCppError, match="lacks its tokens or timings"):
        parse_completion({"content": "x", "tokens": [1]})


def test_a_folder_without_llama_server_is_refused_with_how_to_build_it(tmp_path):
    with pytest.raises(LlamaCppError, match="does not exist"):
        find_server(tmp_path / "nowhere")
    (tmp_path / "llama-server").write_text("not executable")
    with pytest.raises(LlamaCppError) as e:
        find_server(tmp_path)
    assert f"{tmp_path} holds no executable llama-server" in str(e.value)
    assert "Comparing with llama.cpp" in str(e.value) and "EAGLE_CHAT_LLAMA_CPP" in str(e.value)


def test_llama_cpp_runs_interleaved_with_our_modes_on_our_token_ids(fake_build, monkeypatch):
    folder, log = fake_build
    target = tiny_target()
    engine = Engine(target)
    calls = []
    for mode in ("plain", "llama.cpp"):
        def spy(*a, mode=mode, runner=bench.MODES[mode], **kw):
            calls.append(mode)
            return runner(*a, **kw)
        monkeypatch.setitem(bench.MODES, mode, spy)
    settings = BenchSettings(max_new_tokens=6)
    with LlamaServer(find_server(folder), "/models/x.gguf", 1, engine.max_context) as server:
        r = run_benchmark(engine, TWO_PROMPTS, "plain,llama.cpp", settings, llama=server)
    # one warm-up each, then prompt 0 (two turns) plain first, prompt 1 rotated: llama.cpp first
    assert calls == ["plain", "llama.cpp", "plain", "plain", "llama.cpp", "llama.cpp", "llama.cpp", "plain"]
    sent = requests(log)
    assert len(sent) == 4 and all(b["n_predict"] == 6 for b in sent)  # warm-up: min(16, 6)
    assert all(b["temperature"] == 0 and b["cache_prompt"] is False and b["return_tokens"] for b in sent)
    answer = target.tokenizer.decode(ANSWER[:6], skip_special_tokens=True)
    turn1 = [{"role": "user", "content": "w5 w6 w7"}]
    assert sent[1]["prompt"] == engine.encode(turn1)  # our chat template's ids
    assert sent[2]["prompt"] == engine.encode(turn1 + [{"role": "assistant", "content": answer},
                                                       {"role": "user", "content": "w9 w10"}]), "its own answer"
    m = r["modes"]["llama.cpp"]
    assert m["per_prompt"][0]["output_ids"] == [ANSWER[:6], ANSWER[:6]] and m["tokens"] == 18
    prompt_tokens = sum(len(b["prompt"]) for b in sent[1:])
    assert m["seconds"] == pytest.approx((PROMPT_MS_PER_TOKEN * prompt_tokens + 3 * 5 * STEP_MS) / 1e3)
    assert m["first_token_s"] == pytest.approx(PROMPT_MS_PER_TOKEN * prompt_tokens / 3 / 1e3)
    assert m["decode_tokens_per_s"] == pytest.approx(1e3 / STEP_MS)  # prompt processing excluded
    assert m["target_forwards"] == 18
    plain = r["modes"]["plain"]
    assert r["decode_speedup_vs_llama_cpp"]["plain"] == pytest.approx(plain["decode_tokens_per_s"] * STEP_MS / 1e3)
    assert r["identical_to_plain"]["llama.cpp"] is False  # the fake answers what it likes
    assert r["llama_cpp"]["build"] == "b1-fake" and r["llama_cpp"]["gguf"] == "/models/x.gguf"
    argv = json.loads((log.parent / "requests.jsonl.argv").read_text())
    assert argv[argv.index("-t") + 1] == argv[argv.index("-tb") + 1] == "1"
    assert argv[argv.index("-c") + 1] == str(engine.max_context) and argv[argv.index("-m") + 1] == "/models/x.gguf"
    assert "decode tok/s over llama.cpp's: plain" in bench.format_table(r)
    # the results say which machine they come from, with the instruction sets the kernels use
    with open("/proc/cpuinfo") as f:
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        f.seek(0)
        flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    assert r["machine"]["cpu"] == cpu and r["machine"]["cores"] >= 1 and r["machine"]["memory_gib"] > 0
    assert r["machine"]["features"] == [x for x in bench.FEATURES if x in flags]
    assert f"machine: {cpu}, " in bench.format_table(r)


def test_our_modes_time_their_first_token_apart_from_decoding():
    target = tiny_target(mix=0.0, seed=4)
    engine = Engine(target, random_head(target))
    settings = BenchSettings(max_new_tokens=12, warmup=False, tree=TreeConfig(2, 2, 4))
    r = run_benchmark(engine, TWO_PROMPTS, "plain,eagle,hf,hf-lookup", settings)
    for mode, m in r["modes"].items():
        assert 0 < m["first_token_s"] < m["seconds"] / 3, mode  # 3 turns
        assert m["decode_tokens_per_s"] > 0, mode
    assert "llama_cpp" not in r and r["decode_speedup_vs_llama_cpp"] == {}


def test_time_to_first_token_beside_llama_cpps_prompt_processing(fake_build):
    folder, log = fake_build
    target = tiny_target()
    engine = Engine(target, random_head(target))
    settings = BenchSettings(tree=TreeConfig(2, 2, 4))
    with LlamaServer(find_server(folder), "x.gguf", 1, engine.max_context) as server:
        out = measure_prefill(engine, [60, 120], ["plain", "eagle"], settings, server, reps=2)
    rows = out["rows"]
    assert [r["asked_tokens"] for r in rows] == [60, 120] and rows[0]["prompt_tokens"] < rows[1]["prompt_tokens"]
    for row in rows:
        assert set(row["first_token_s"]) == {"plain", "eagle", "llama.cpp"}
        assert row["first_token_s"]["llama.cpp"] == pytest.approx(PROMPT_MS_PER_TOKEN * row["prompt_tokens"] / 1e3)
        assert all(len(t) == 2 for t in row["runs_s"].values())
    sent = requests(log)
    assert len(sent) == 1 + 2 * 2 and all(b["n_predict"] == 1 for b in sent)  # one warm-up, at the first length


def test_decode_after_long_prompts_beside_llama_cpp_with_eagle_checked_against_plain(fake_build):
    """--long-decode-tokens: each long prompt's answer goes on, the rows give decode tok/s after
    the first token for every mode (llama.cpp's from its own timings) and whether eagle's
    answers equal plain's; the printed table says both."""
    folder, log = fake_build
    target = tiny_target()
    engine = Engine(target, random_head(target))
    settings = BenchSettings(tree=TreeConfig(2, 2, 4), warmup=False)
    with LlamaServer(find_server(folder), "x.gguf", 1, engine.max_context) as server:
        out = measure_prefill(engine, [60, 120], ["plain", "eagle"], settings, server, reps=2, decode_tokens=6)
    for row in out["rows"]:
        assert row["decode_tokens"] == 6 and set(row["decode_tokens_per_s"]) == {"plain", "eagle", "llama.cpp"}
        assert row["decode_tokens_per_s"]["llama.cpp"] == pytest.approx(1e3 / STEP_MS)
        assert all(v > 0 for v in row["decode_tokens_per_s"].values())
        assert row["eagle_identical"] is True and row["eagle_tree_there"] == "depth 2, 4 tokens"
    assert all(b["n_predict"] == 6 for b in requests(log))
    table = "\n".join(bench._prefill_lines({"prefill": out}))
    assert "then 6 tokens: plain " in table and "eagle's tree there: depth 2, 4 tokens, its answers identical to " \
        "plain's" in table
    # a long-context cap makes eagle decode plainly there: the row says so
    capped = replace(settings, tree=TreeConfig(2, 2, 4, long_context=((100, 0, 0),)))
    rows = measure_prefill(engine, [60, 120], ["plain", "eagle"], capped, None, reps=1, decode_tokens=4)["rows"]
    assert [r["eagle_tree_there"] for r in rows] == ["depth 2, 4 tokens", "plain decoding (long-context cap)"]
    assert all(r["eagle_identical"] for r in rows)
    adaptive = replace(capped, adaptive=True)  # --adaptive: past the cap it starts plain, answers unchanged
    rows = measure_prefill(engine, [120], ["plain", "eagle"], adaptive, None, reps=1, decode_tokens=12)["rows"]
    assert rows[0]["eagle_tree_there"] == "starts plain (long-context cap), speculates where measured faster"
    assert rows[0]["eagle_identical"]


def test_cli_runs_llama_cpp_from_the_environment_and_reports_prefill(fake_build, tmp_path, monkeypatch):
    folder, log = fake_build
    target = tiny_target()
    target.model.save_pretrained(tmp_path / "model")
    target.tokenizer.save_pretrained(tmp_path / "model")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "c", "turns": ["w5 w6"]}) + "\n")
    monkeypatch.setenv("EAGLE_CHAT_LLAMA_CPP", str(folder))
    args = ["--model", str(tmp_path / "model"), "--dtype", "float64", "--modes", "plain,llama.cpp",
            "--prompts", str(prompts), "--max-new-tokens", "5", "--threads", "1", "--gguf", str(gguf),
            "--prefill-tokens", "50", "--out", str(tmp_path / "r.json")]
    assert main(args) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert list(r["modes"]) == ["plain", "llama.cpp"] and r["settings"]["weights"] == "auto"
    assert r["modes"]["llama.cpp"]["decode_tokens_per_s"] == pytest.approx(1e3 / STEP_MS)
    assert set(r["prefill"]["rows"][0]["first_token_s"]) == {"plain", "llama.cpp"}


def test_default_modes_add_llama_cpp_only_with_a_build(fake_build, monkeypatch):
    folder, _ = fake_build
    chosen = []

    def stop(a, modes, lengths):
        chosen.append(modes)
        raise bench.BenchError("stop here")
    monkeypatch.setattr(bench, "llama_cpp_choice", stop)
    monkeypatch.delenv("EAGLE_CHAT_LLAMA_CPP", raising=False)
    assert main([]) == 2 and chosen[-1] == ["plain", "eagle", "hf", "hf-lookup"]
    assert main(["--llama-cpp", str(folder)]) == 2 and chosen[-1][-1] == "llama.cpp"
    monkeypatch.setenv("EAGLE_CHAT_LLAMA_CPP", str(folder))
    assert main([]) == 2 and chosen[-1] == ["plain", "eagle", "hf", "hf-lookup", "llama.cpp"]


@pytest.mark.parametrize("args, env, message", [
    (["--modes", "plain,llama.cpp"], None, "mode 'llama.cpp' needs a llama.cpp build: --llama-cpp DIR"),
    (["--llama-cpp", "/nonexistent/bin"], None, "llama.cpp build folder /nonexistent/bin does not exist"),
    ([], "empty", "holds no executable llama-server"),
    (["--llama-cpp", "BIN", "--gguf", "/nonexistent.gguf"], None, "--gguf /nonexistent.gguf is not a file"),
    (["--prefill-tokens", "1000,lots"], None, "--prefill-tokens wants prompt lengths like 1000,4000"),
    (["--long-decode-tokens", "64"], None, "--long-decode-tokens 64: give a number of tokens >= 0, with --prefill-tokens"),
    (["--llama-cpp", "BIN", "--llama-cpp-args=--alias 'open"], None, "--llama-cpp-args \"--alias 'open\": No closing"),
])
def test_cli_refuses_a_bad_llama_cpp_setup_before_loading_a_model(args, env, message, fake_build, tmp_path,
                                                                   capsys, monkeypatch):
    folder, _ = fake_build
    (tmp_path / "empty").mkdir()
    monkeypatch.delenv("EAGLE_CHAT_LLAMA_CPP", raising=False)
    if env:
        monkeypatch.setenv("EAGLE_CHAT_LLAMA_CPP", str(tmp_path / env))

    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded for bad input")
    monkeypatch.setattr(bench.Engine, "load", no_load)
    assert main([str(folder) if x == "BIN" else x for x in args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag, message", [("--die", "exited with status 1 while loading"),
                                           ("--sigill", "try --llama-cpp-args=--no-repack")])
def test_a_server_that_dies_while_loading_says_why(flag, message, fake_build):
    folder, _ = fake_build
    with pytest.raises(LlamaCppError) as e:
        with LlamaServer(find_server(folder), "x.gguf", 1, 512, [flag]):
            pass
    assert message in str(e.value)
    if flag == "--die":
        assert "tensor 'blk.0' has invalid type" in str(e.value), "the server's own log is shown"


# ---------------------------------------------------------------------------- --weights

class _Loaded(Exception):
    """Raised by a stand-in Engine.load, carrying its keyword arguments."""


def _capture_load(monkeypatch):
    def load(*a, **kw):
        raise _Loaded(kw)
    monkeypatch.setattr(Engine, "load", load)


@pytest.mark.parametrize("cli", ["core.bench", "core.generate", "core.autotune", "core.serve"])
def test_every_cli_passes_weights_to_engine_load(cli, monkeypatch, capsys):
    import importlib

    main_of = importlib.import_module(cli).main
    _capture_load(monkeypatch)
    args = {"core.generate": ["hi"], "core.bench": ["--modes", "plain"]}.get(cli, [])
    with pytest.raises(_Loaded) as e:
        main_of(args + ["--weights", "bf16", "--threads", "1"])
    assert e.value.args[0]["weights"] == "bf16"
    with pytest.raises(SystemExit):
        main_of(args + ["--weights", "q8"])
    assert "invalid choice: 'q8'" in capsys.readouterr().err


def test_launcher_remembers_and_passes_weights(tmp_path, monkeypatch):
    import launcher
    from app.manager import ModelManager
    from app.state import ModelChoice, recall, remember

    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path))
    assert launcher.choose(launcher.parse_args([])).weights == "auto"
    choice = launcher.choose(launcher.parse_args(["--weights", "bf16"]))
    assert choice.weights == "bf16" and "bf16 weights" in choice.describe()
    remember(choice)
    assert recall() == choice and launcher.choose(launcher.parse_args([])).weights == "bf16"
    seen = []
    ModelManager(lambda **kw: seen.append(kw) or object(), ModelChoice(weights="q4"))
    assert seen[0]["weights"] == "q4"
    with pytest.raises(SystemExit):
        launcher.parse_args(["--weights", "int3"])

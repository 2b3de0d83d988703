"""core.gpucheck end to end on the tiny shape (CPU), its clear errors, the shapes, and the
projection math (core.projection) on literal numbers."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from core import gpucheck
from core.autotune import expected_tokens
from core.config import TreeConfig
from core.projection import (REFERENCE_TREE, CostCurve, plain_rate, project, solve_acceptance, step_overheads,
                             synthetic_steps)
from core.shapes import shape_config


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpucheck")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-m", "core.gpucheck", "--shape", "tiny", "--device", "cpu",
                           "--out", str(out), "--prompts", "2", "--new-tokens", "24", "--reps", "2",
                           "--warmup", "1", "--taus", "3"], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stdout


def test_tiny_cpu_run_writes_json_and_prints_the_table(tiny_run):
    out, stdout = tiny_run
    report = json.loads((out / "gpucheck.json").read_text())
    assert report["target"] == "tiny" and report["random_weights"] and report["device"] == "cpu"
    (result,) = report["results"]
    assert result["quant"] == "fp32"
    c = result["correctness"]
    assert c["error"] is None
    assert c["identical"] is True and c["agreement_rate"] == 1.0 and c["mean_prefix_fraction"] == 1.0
    assert len(c["prompts"]) == 2 and all(p["tokens_before_divergence"] == p["plain_tokens"] for p in c["prompts"])
    assert c["tau"] >= 1.0 and c["plain_tokens_per_s"] > 0 and c["spec_tokens_per_s"] > 0
    assert [g["context"] for g in result["logits"]] == [64, 256]
    assert all(g["argmax_agreement"] == 1.0 and g["max_abs_diff"] < 1e-3 for g in result["logits"])
    for curve in result["curves"]:
        assert list(curve["verify_s"]) == ["1", "2", "4", "8", "16", "32", "64", "128"]
        assert all(s > 0 for s in curve["verify_s"].values())
        assert list(curve["draft_s"]) == [str(d) for d in range(1, 9)]
        assert curve["head_step_s"] > 0 and curve["draft_lm_head_s"] > 0
    assert result["peak_memory_gb"] > 0
    assert [(p["tau"], p["context"]) for p in result["projections"]] == [(3.0, 64), (3.0, 256)]
    assert all(p["speedup"] > 0 and p["tree"]["top_k"] == 8 for p in result["projections"])
    markdown = (out / "gpucheck.md").read_text()
    assert markdown in stdout and "| target call, new tokens | ms at context 64 | ms at context 256 |" in markdown
    assert "Projection, not a measurement" in markdown


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_device_is_a_clear_error(tmp_path, capsys):
    assert gpucheck.main(["--shape", "tiny", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "gpucheck.json").exists()


def test_nf4_without_bitsandbytes_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    missing = lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    monkeypatch.setattr(importlib.util, "find_spec", missing)
    with pytest.raises(gpucheck.GpuCheckError, match="nf4 needs bitsandbytes"):
        gpucheck.check_nf4("cpu")


def test_arguments():
    a = gpucheck.parse_args(["--shape", "vicuna-7b", "--device", "cpu", "--quant", "all,fp32", "--tree", "5,4,20"])
    assert a.quants == ("fp16", "nf4", "fp32") and a.tree == TreeConfig(5, 4, 20) and a.taus == (2, 3, 4, 5)
    assert gpucheck.parse_args(["--device", "cpu"]).quants == ("fp32",)
    with pytest.raises(SystemExit):
        gpucheck.parse_args(["--quant", "int3", "--device", "cpu"])
    assert gpucheck.clamp_contexts((512, 2048), max_context=1024) == (512, 895)  # room for 128 new tokens
    assert gpucheck.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and gpucheck.common_prefix([1, 2], [1, 2]) == 2


@pytest.mark.parametrize("shape, billions, kv_heads, vocab", [("llama-2-7b", 6.74, 32, 32000),
                                                               ("vicuna-7b", 6.74, 32, 32000),
                                                               ("llama-3-8b", 8.03, 8, 128256)])
def test_shapes_are_the_real_architectures(shape, billions, kv_heads, vocab):
    from transformers import LlamaForCausalLM

    config = shape_config(shape)
    assert (config.num_key_value_heads, config.vocab_size) == (kv_heads, vocab)
    with torch.device("meta"):  # parameter count without allocating 7B weights
        model = LlamaForCausalLM(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions
    if shape == "llama-3-8b":
        assert config.rope_parameters["rope_theta"] == 500000.0 and config.max_position_embeddings == 8192


# ---------------------------------------------------------------- projection math, literal numbers

def _curve(verify: dict, draft: dict | None = None) -> CostCurve:
    return CostCurve(context=512, verify_s=verify, head_step_s=0.001, draft_lm_head_s=0.001,
                     draft_s=draft or {d: 0.0 for d in range(1, 9)})


def test_plain_rate_is_one_token_per_one_token_call():
    assert plain_rate(_curve({1: 0.010}), plain_other_s=0.0025) == pytest.approx(80.0)


def test_synthetic_steps_grow_like_eagle2_and_accept_the_top_rank_at_p_1():
    steps = synthetic_steps(1.0, top_k=2, depth=3, n=4)
    depths, scores, path = steps[0]
    assert depths == (0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)  # 2 children of the root, then 2 x 2 per level
    assert path == (0, 1, 3, 7)  # rank 0 at every level: the whole chain
    assert all(s == steps[0] for s in steps)
    assert expected_tokens(steps, depth=3, size=4) == 4  # 3 drafts + the bonus token
    assert expected_tokens(steps, depth=1, size=2) == 2
    assert expected_tokens(synthetic_steps(0.001, top_k=2, depth=3, n=64), depth=3, size=4) < 1.1


def test_solved_acceptance_gives_tau_on_the_reference_tree():
    for tau in (2.0, 4.0):
        p = solve_acceptance(tau, 8)
        got = expected_tokens(synthetic_steps(p, 8), REFERENCE_TREE.depth, REFERENCE_TREE.total_tokens)
        assert got == pytest.approx(tau, abs=0.05)
    assert solve_acceptance(2.0, 8) < solve_acceptance(4.0, 8)
    assert solve_acceptance(50.0, 8) is None  # more than depth 6 + bonus can give


def test_projection_with_flat_costs_speeds_up_by_tau():
    flat = _curve({n: 0.010 for n in (1, 2, 4, 8, 16, 32, 64, 128)})
    p = project(flat, tau=3.0, top_k=8, other_s=0.0, plain_other_s=0.0, bandwidth_ratio=5.0)
    assert p.plain_tokens_per_s == pytest.approx(100.0)
    assert p.reference_speedup == pytest.approx(3.0, abs=0.05)  # every step costs one plain step
    assert p.tokens_per_s == pytest.approx(p.expected_tokens / 0.010)
    assert p.speedup >= p.reference_speedup  # the chooser can only do better than a fixed tree
    assert p.other_gpu_tokens_per_s == pytest.approx(p.tokens_per_s / 5.0)
    assert project(flat, tau=50.0, top_k=8, other_s=0.0, plain_other_s=0.0) is None


def test_projection_prefers_small_trees_when_verification_grows():
    steep = _curve({1: 0.010, 2: 0.020, 4: 0.040, 8: 0.080, 16: 0.160, 32: 0.320, 64: 0.640, 128: 1.280})
    p = project(steep, tau=3.0, top_k=8, other_s=0.0, plain_other_s=0.0)
    assert p.tree.total_tokens == 2 and p.speedup < 1.0  # each extra node costs a whole plain step


def test_step_overheads_subtract_the_modelled_costs():
    curve = _curve({1: 0.010, 16: 0.020, 32: 0.030}, draft={6: 0.005})
    spec, plain = step_overheads(curve, spec_step_s=0.040, tree_size=24, depth=6, plain_step_s=0.012)
    assert spec == pytest.approx(0.040 - 0.005 - 0.025)  # verify(24) interpolates to 25 ms
    assert plain == pytest.approx(0.002)
    assert step_overheads(curve, 0.001, 24, 6, 0.001) == (0.0, 0.0)  # never below zero

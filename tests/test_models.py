"""Loading: local folders, dtype, 4-bit nf4 on CPU through the same loader and engine, errors."""

import time

import pytest
import torch

from core.config import GenerationConfig, TreeConfig
from core.decoding.engine import Engine
from core.models import ModelLoadError, load_target, resolve
from tests.tiny import random_head, tiny_target


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    t = tiny_target(dtype=torch.float32, hidden=128, layers=2, vocab=96, seed=7)
    t.model.save_pretrained(folder)
    t.tokenizer.save_pretrained(folder)
    return folder


def test_local_folder_loads_with_dtype(tiny_folder):
    fp32 = load_target(str(tiny_folder))
    bf16 = load_target(str(tiny_folder), dtype="bfloat16")
    assert fp32.model.dtype == torch.float32 and bf16.model.dtype == torch.bfloat16
    assert fp32.max_context == 512 and fp32.eos_ids == (0,)
    ids = torch.tensor([[5, 6, 7]])
    assert torch.allclose(fp32.model(ids).logits, bf16.model(ids).logits.float(), atol=0.5)


def greedy(engine, prompt, speculative, n=24):
    cfg = GenerationConfig(max_new_tokens=n, speculative=speculative, tree=TreeConfig(4, 4, 12))
    return [t for ev in engine.generate(prompt, cfg) for t in ev.token_ids]


def test_nf4_runs_through_loader_and_engine(tiny_folder):
    """4-bit nf4 on CPU: same loader, same engine. Tree and single-token forwards round
    differently in 4-bit, so greedy agreement with plain 4-bit decoding is measured, not assumed."""
    target = load_target(str(tiny_folder), load_in_4bit=True)
    assert target.quantized
    assert any("4bit" in type(m).__name__ for m in target.model.modules())
    engine = Engine(target, random_head(target))
    prompts = [[5, 9, 17, 33, 40], [7, 8], [60, 61, 62, 63], [12, 4, 88, 23], [30, 31]]
    agree = total = 0
    for p in prompts:
        plain, spec = greedy(engine, p, False), greedy(engine, p, True)
        assert len(plain) == len(spec) or 0 in plain or 0 in spec
        first_diff = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
        agree += first_diff
        total += min(len(plain), len(spec))
    rate = agree / total
    print(f"nf4 greedy agreement with plain 4-bit decoding (tokens before first divergence): {rate:.3f}")
    assert rate > 0.5


def test_unsupported_and_missing_models_refused(tmp_path, tiny_folder):
    with pytest.raises(ModelLoadError, match="neither an existing folder nor a hub id"):
        resolve("./no/such/folder")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_embd": 8}')
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        load_target(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_target(str(empty))
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_target(str(tiny_folder), dtype="float8")


def test_unreachable_hub_fails_fast_with_clear_message():
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match="cannot reach the Hugging Face hub|not found on the hub"):
        resolve("eagle-chat-tests/definitely-not-a-model", allow_patterns=["config.json"])
    assert time.perf_counter() - start < 30


def save_family_model(folder, cls, cfg_cls, seed: int, **extra) -> None:
    """A tiny random model of another Llama-family architecture, saved with the tiny tokenizer."""
    torch.manual_seed(seed)
    cfg = cfg_cls(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False, eos_token_id=0, **extra)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(folder)
    tiny_target().tokenizer.save_pretrained(folder)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_llama_family_targets_exact(tmp_path, family):
    """Qwen2 (attention biases) and Mistral load through the same loader and stay exact."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls, cfg_cls = {"qwen2": (Qwen2ForCausalLM, Qwen2Config), "mistral": (MistralForCausalLM, MistralConfig)}[family]
    save_family_model(tmp_path, cls, cfg_cls, seed=0)
    target = load_target(str(tmp_path), dtype="float64")
    assert target.model.config.model_type == family
    engine = Engine(target, random_head(target))
    for prompt in ([5, 9, 17, 33], [7, 8, 9]):
        ref = target.model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                    eos_token_id=0)[0, len(prompt):].tolist()
        assert greedy(engine, prompt, False, 20) == ref
        assert greedy(engine, prompt, True, 20) == ref


@pytest.mark.parametrize("numerics", ["float64-sdpa", "bf16-exact"])
def test_sliding_window_models_stay_lossless(tmp_path, numerics):
    """A Mistral with a sliding window of 8: verification must apply the window too
    (a 4D tree mask is used as given, so the window is built into it), else speculative
    output drifts from plain decoding and from generate() once the answer passes 8 tokens."""
    from transformers import MistralConfig, MistralForCausalLM

    from core.kernels.invariant import make_invariant

    save_family_model(tmp_path, MistralForCausalLM, MistralConfig, seed=1, sliding_window=8)
    target = load_target(str(tmp_path), dtype="float64" if numerics == "float64-sdpa" else "bfloat16")
    if numerics == "bf16-exact":
        make_invariant(target.model)
    engine = Engine(target, random_head(target))
    windowless = 0
    for prompt in ([5, 9, 17, 33, 4, 8, 12, 60, 61, 62], [7, 8, 9]):
        plain = greedy(engine, prompt, False, 24)
        assert greedy(engine, prompt, True, 24) == plain
        if numerics == "float64-sdpa":
            ref = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                        eos_token_id=0)[0, len(prompt):].tolist()
            assert plain == ref
            target.model.config.sliding_window = None  # the same weights without the window
            windowless += plain != target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                                         eos_token_id=0)[0, len(prompt):].tolist()
            target.model.config.sliding_window = 8
    assert numerics != "float64-sdpa" or windowless > 0  # the window really changes the answer

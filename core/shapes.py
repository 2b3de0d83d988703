"""Real Llama architectures with random weights: no download, built straight on the device.

For measuring (core.gpucheck): cost depends on the shapes, not the weights. The tiny shape
gets peaky logits so fp32 rounding cannot flip a greedy choice; the 7B shapes keep
transformers' init (std 0.02), whose near-flat logits are the hardest case for exact
agreement in fp16 / nf4 (trained models have larger logit gaps).
"""

from __future__ import annotations

import gc
import tempfile
from dataclasses import replace

import torch

from core.models import LoadedModel, load_target

_LLAMA2 = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
               intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
               bos_token_id=1, eos_token_id=2)
SHAPES = {
    "llama-2-7b": _LLAMA2,
    "vicuna-7b": {**_LLAMA2, "rms_norm_eps": 1e-6},
    "llama-3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=1024, bos_token_id=None,
                 eos_token_id=0),  # peaky logits: see _make_peaky
}


def shape_config(name: str):
    from transformers import LlamaConfig

    return LlamaConfig(tie_word_embeddings=False, pad_token_id=None, **SHAPES[name])


def random_tokenizer(vocab: int, eos_id: int):
    """A word-level tokenizer over `vocab` ids ("w17" ...); prompts here are ids, never text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    words["<eos>"] = words.pop(f"w{eos_id}")
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>")


def build_random(shape: str, dtype: torch.dtype, device: str, seed: int) -> LoadedModel:
    """The shape's architecture with random weights, built directly on `device` in `dtype`."""
    from transformers import LlamaForCausalLM

    config = shape_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    if shape == "tiny":
        _make_peaky(model)
    model.generation_config.eos_token_id = config.eos_token_id
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=random_tokenizer(config.vocab_size, config.eos_token_id),
                       name=shape, device=torch.device(device), dtype=dtype, quantized=False,
                       max_context=config.max_position_embeddings)


@torch.no_grad()
def _make_peaky(model) -> None:
    """Large logit gaps, so fp32 tree-vs-sequential rounding (~5e-7) never flips an argmax."""
    model.model.embed_tokens.weight.normal_(0, 1.0)
    model.lm_head.weight.normal_(0, 0.5)
    for layer in model.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                    layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            lin.weight.normal_(0, 0.3)


def random_nf4(shape: str, device: str, seed: int) -> LoadedModel:
    """nf4 through the product's own loader: the random fp16 model is saved to a temporary
    folder and loaded back with load_in_4bit (bitsandbytes nf4, fp16 compute)."""
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as folder:
        fp16 = build_random(shape, torch.float16, device, seed)
        fp16.model.save_pretrained(folder)
        fp16.tokenizer.save_pretrained(folder)
        del fp16
        free_memory()
        loaded = load_target(folder, dtype="float16", device=device, load_in_4bit=True)
    return replace(loaded, name=shape)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

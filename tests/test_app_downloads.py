"""The model manager against a real local HTTP server speaking the hub's routes: byte-level
progress, resume after a dropped connection, gated / missing / unreachable errors, and a
switch to the downloaded model that frees the old engine."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import weakref
from pathlib import Path

import gradio as gr
import pytest

from app.manager import CUSTOM, ModelManager, download_with_progress
from app.session import Handlers
from app.state import Access, ModelChoice, recall
from core.models import ModelLoadError
from tests.hubserver_local import HubServer
from tests.app_server import free_port

MIB = 2**20


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    """A private hub cache and app home, so downloads start from nothing and leave no trace."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "hub"


def test_download_reports_bytes_and_resumes_a_dropped_connection(hub_cache):
    # huggingface_hub writes 10 MiB chunks; 24 MiB cut after 12 MiB forces a Range resume at 10 MiB
    weights = os.urandom(24 * MIB)
    repo = {"config.json": b'{"model_type": "llama"}', "model.safetensors": weights}
    with HubServer({"org/big": repo}, delay_s=0.004,
                   drop_after={"org/big/model.safetensors": 12 * MIB}) as hub:
        seen = []
        folder = download_with_progress("org/big", lambda n, t: seen.append((n, t)), endpoint=hub.url)
        ranges = [r for method, path, r in hub.log if method == "GET" and path.endswith("model.safetensors")]
    total = len(weights) + len(repo["config.json"])
    assert hashlib.sha256((folder / "model.safetensors").read_bytes()).digest() == hashlib.sha256(weights).digest()
    assert ranges == [None, f"bytes={10 * MIB}-"], "the second request must resume, not restart"
    done = [n for n, t in seen if t == total]
    assert done[-1] == total and done == sorted(done), "progress is cumulative bytes of the whole repo"
    assert any(0 < n < total for n in done), "progress is observed while the download runs"
    assert len(set(done)) >= 3


def test_gated_missing_and_unreachable_hub_fail_fast_with_clear_messages(hub_cache, monkeypatch):
    with HubServer({"org/ok": {"config.json": b"{}"}}, gated=("meta-llama/Llama-2-7b-chat-hf",)) as hub:
        with pytest.raises(ModelLoadError, match="gated.*HF_TOKEN"):
            download_with_progress("meta-llama/Llama-2-7b-chat-hf", lambda n, t: None, endpoint=hub.url)
        with pytest.raises(ModelLoadError, match="not found"):
            download_with_progress("org/nothing", lambda n, t: None, endpoint=hub.url)
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the hub is unreachable
    # a 7B download is refused first where the disk cannot hold it (test_app_handlers checks that message):
    # this machine's free space must not decide which error this test sees
    import app.manager as manager_mod

    usage = shutil.disk_usage
    monkeypatch.setattr(manager_mod.shutil, "disk_usage", lambda path: usage(path)._replace(free=10**15))
    handlers = Handlers(ModelManager(loader=None, choice=ModelChoice(), engine=object(), endpoint=closed), Access())
    start = time.monotonic()
    with pytest.warns(UserWarning, match="cannot reach the Hugging Face hub.*current model keeps serving"):
        message, table = handlers.download(CUSTOM, "lmsys/vicuna-7b-v1.3", "", "float32", "cpu", False,
                                           progress=lambda *a, **k: None)
    assert "cannot reach the Hugging Face hub" in message and table == gr.skip(), "the catalogue keeps its content"
    assert time.monotonic() - start < 5


def tiny_llama(folder: Path) -> Path:
    """A 1-layer random Llama with a word-level tokenizer: a real model folder that loads in a second."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny import tiny_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=0, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer(96).save_pretrained(folder)
    return folder


def files_of(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


def test_one_click_download_and_switch_frees_the_old_engine(hub_cache, tmp_path, monkeypatch):
    from huggingface_hub import constants
    from transformers import AutoConfig

    from core.config import GenerationConfig, TreeConfig
    from core.decoding.engine import Engine
    from core.decoding.head import new_head, save_head

    local = tiny_llama(tmp_path / "tiny")
    head = save_head(new_head(AutoConfig.from_pretrained(local), seed=0), tmp_path / "tiny-head")
    repos = {"org/tiny-llama": files_of(local), "org/tiny-head": files_of(head)}
    manager = ModelManager(Engine.load, ModelChoice(str(local), None))
    old = weakref.ref(manager.engine)
    assert not manager.engine.has_head
    handlers = Handlers(manager, Access())
    calls = []
    with HubServer(repos) as hub:
        manager.endpoint = hub.url
        # the hub stays reachable only for the download: loading must then work from the cache
        loader = manager.loader

        def offline_loader(**kw):
            monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
            return loader(**kw)

        manager.loader = offline_loader
        message, status, _table, _tree, spec_box, *_controls = handlers.load(
            CUSTOM, "org/tiny-llama", "org/tiny-head", "float32", "cpu", False,
            progress=lambda *a, **k: calls.append((a, k)))
    byte_calls = [(a[0], k["desc"]) for a, k in calls if a and isinstance(a[0], tuple)]
    assert {d.split(":")[0] for _, d in byte_calls} == {"org/tiny-llama", "org/tiny-head"}
    assert all(k.get("unit") == "B" for a, k in calls if a and isinstance(a[0], tuple))
    assert byte_calls[-1][0][0] == byte_calls[-1][0][1] == sum(map(len, repos["org/tiny-head"].values()))
    assert "Now serving `org/tiny-llama`" in message and "speculation available" in status
    assert spec_box["interactive"] is True and "Numerics: fp32" in message
    new = manager.engine
    assert new.has_head and old() is None, "the old engine is freed after the switch"
    assert recall() == ModelChoice("org/tiny-llama", "org/tiny-head", "float32")
    events = list(new.generate("w5 w6", GenerationConfig(max_new_tokens=3, tree=TreeConfig(depth=2, top_k=2,
                                                                                        total_tokens=4))))
    assert sum(len(e.token_ids) for e in events) == 3

    serving = new
    with pytest.warns(UserWarning, match="There is no folder"):
        message, *kept = handlers.load(CUSTOM, str(tmp_path / "missing"), "", "float32", "cpu", False,
                                       progress=lambda *a, **k: None)
    assert message.startswith(f"There is no folder `{tmp_path / 'missing'}` on this machine") and \
        "the current model keeps serving" in message and kept == [gr.skip()] * 11
    assert manager.engine is serving, "a missing folder is refused before the serving model is unloaded"
    with pytest.warns(UserWarning, match="Nothing to download|There is no folder"):
        assert handlers.download(CUSTOM, str(tmp_path / "missing"), "", "float32", "cpu", False,
                                 progress=lambda *a, **k: None)[0].startswith("There is no folder")
    (tmp_path / "empty").mkdir()
    new = weakref.ref(new)
    del serving
    with pytest.warns(UserWarning, match="Loading failed: .*previous model is serving again"):
        message, *kept = handlers.load(CUSTOM, str(tmp_path / "empty"), "", "float32", "cpu", False,
                                       progress=lambda *a, **k: None)
    assert message.startswith("Loading failed: ") and "Error" not in message.split(".")[0] and kept == [gr.skip()] * 11
    assert new() is None, "one model in memory at a time: the old one is freed before loading the next"
    assert manager.engine.has_head and recall() == ModelChoice("org/tiny-llama", "org/tiny-head", "float32"), \
        "after a failed load the previous model is loaded again"

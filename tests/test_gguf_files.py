"""A local GGUF file as the model: converted once, served from its own blocks by the native step (other
tensor types converted and named: Q4_K and Q5_K as their own super-blocks, Q5_0 as Q5_1, Q6_K as 6-bit blocks,
the rest requantized to Q8_0), greedy speculation still equal to plain decoding, and clear errors for files that
are not what they claim."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants

from app.manager import CUSTOM, Request, download_with_progress
from core.config import GenerationConfig
from core.decoding.engine import Engine
from core.kernels import native, quant
from core.kernels.step import NativeStep
from core.models import DEFAULT_HEAD_DIR, ModelLoadError, download, embedded_gguf_path, load_target, resolve
from tests.hubserver_local import HubServer
from tests.test_step import layer_tensors, quantize, tiny_config, write_gguf  # noqa: I001  (test_step's GGUF helpers)


def smaller_smollm2(path, layers: int = 2, retype: dict | None = None, arch: str = "llama") -> None:
    """The embedded GGUF cut to its first `layers` layers (its metadata, tokenizer and chat template
    kept); retype: tensor name -> another type, its values re-encoded by gguf."""
    reader = GGUFReader(str(embedded_gguf_path()))
    w = GGUFWriter(str(path), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = layers if field.name == "llama.block_count" else field.contents()
        kind = field.types[0]
        w.add_key_value(field.name.replace("llama.", f"{arch}."), value, kind,
                        sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        data, kind = np.array(t.data), T(t.tensor_type)
        if t.name in (retype or {}):
            values = quants.dequantize(data, kind)
            kind = retype[t.name]
            data = values.astype(np.float16) if kind == T.F16 else quantize(values, kind)
        w.add_tensor(t.name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "smol-2layers.gguf"
    smaller_smollm2(path, retype={"blk.1.ffn_up.weight": T.Q5_0, "blk.0.attn_k.weight": T.F16,
                                  "blk.1.ffn_down.weight": T.Q6_K})
    return path


@pytest.mark.slow
def test_a_gguf_file_is_converted_once_and_serves_from_its_own_blocks(small_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path / "home"))
    target = load_target(str(small_gguf))
    assert target.gguf == small_gguf and target.model.config.num_hidden_layers == 2
    assert capsys.readouterr().out.count("Converting smol-2layers.gguf") == 1
    assert load_target(str(small_gguf)).gguf == small_gguf
    assert "Converting" not in capsys.readouterr().out, "the converted copy is kept and read the next time"
    monkeypatch.setattr("core.models.download", lambda name, **kw: small_gguf)  # owner/name:TAG -> its file
    assert load_target("org/smol-GGUF:Q4_1").gguf == small_gguf and "Converting" not in capsys.readouterr().out
    if native.kernel_isa() is None:
        pytest.skip("no native kernels on this CPU")
    plain = Engine.load(str(small_gguf), None)
    eagle = Engine.load(str(small_gguf), str(DEFAULT_HEAD_DIR))
    bf16 = Engine.load(str(small_gguf), None, weights="bf16")
    for engine in (plain, eagle):
        assert isinstance(engine.forwarder, NativeStep)
        text = engine.numerics.describe()
        assert "4/5/6/8-bit weights x 8-bit activations" in text and "from smol-2layers.gguf" in text  # Q5_0, Q6_K, F16
        assert ("3 tensors of other types: F16 (1) requantized to Q8_0, Q5_0 (1) as Q5_1 (exactly), Q6_K (1) as 6-bit "
                "blocks (exactly)") in text
    assert "requantized" not in bf16.numerics.describe()
    prompt = [{"role": "user", "content": "Name three rivers in Europe."}]

    def answer(engine, speculative):
        cfg = GenerationConfig(max_new_tokens=24, speculative=speculative, tree=eagle.default_tree)
        return [t for ev in engine.generate(prompt, cfg) for t in ev.token_ids]

    assert answer(eagle, True) == answer(plain, False), "greedy speculation on a GGUF file's blocks == plain"
    # the file's blocks (and the requantized ones) stay close to the same weights in bf16: teacher-forced,
    # the logits of the two numerics point the same way at every position (a q / k row order or a
    # requantization gone wrong scatters them)
    ids = torch.tensor(plain.encode("The sun warms the sea, and water rises into the air as vapour."))
    from core.decoding import cache as kv
    from core.decoding.forward import plain_forward, prefill

    logits = {}
    with torch.inference_mode():
        for name, engine in (("w4a8", plain), ("bf16", bf16)):
            cache = kv.new_cache(engine.step.hf)
            prefill(engine.step, ids[:1], cache)
            logits[name] = torch.stack([plain_forward(engine.step, int(ids[i]), cache, i)[1].float()
                                        for i in range(1, len(ids))])
    cos = torch.nn.functional.cosine_similarity(logits["w4a8"], logits["bf16"], dim=-1)
    assert cos.min() > 0.999, cos  # measured 0.99998; with one layer's k rows left in the file's order, 0.960


def test_tensors_of_other_types_reach_the_kernels_where_asked(tmp_path):
    """F16 (and any type without a repacking) requantized to Q8_0: within about half a Q8_0 step of the
    file's values; Q5_0 repacked as Q5_1 with its own scale and codes (m = -16 d): the file's values exactly; q
    rows put back in transformers' order either way."""
    gen = np.random.default_rng(5)
    tensors = layer_tensors(gen, {"attn_q": T.Q5_0, "ffn_up": T.F16})
    write_gguf(tmp_path / "m.gguf", tensors)
    with pytest.raises(quant.QuantWeightError, match=r"blk\.0\.attn_q\.weight has type Q5_0"):
        quant.load_llama_blocks(tmp_path / "m.gguf", tiny_config())
    blocks = quant.load_llama_blocks(tmp_path / "m.gguf", tiny_config(), requantize=True)
    up, q = blocks["model.layers.0.mlp.up_proj.weight"], blocks["model.layers.0.self_attn.q_proj.weight"]
    gate = blocks["model.layers.0.mlp.gate_proj.weight"]
    assert (up.type_name, up.source, q.type_name, q.source, gate.type_name, gate.source) == \
        ("Q8_0", "F16", "Q5_1", "Q5_0", "Q4_1", "")
    values = tensors["blk.0.ffn_up.weight"][0].astype(np.float32)
    ours = quants.dequantize(up.data.numpy(), T.Q8_0)
    half = np.abs(values).reshape(values.shape[0], -1, 32).max(-1).repeat(32, -1) / 254  # half a Q8_0 step
    # plus the step's own fp16 rounding, up to 127 codes x 2^-11 of it: 1.124 half steps at most
    assert np.all(np.abs(ours - values) <= half * 1.125) and not np.array_equal(ours, values)
    hd = 32  # the file's q rows in llama.cpp's order (test_step's rotary test): row 2i + j -> j * hd/2 + i
    stored = quants.dequantize(tensors["blk.0.attn_q.weight"][0], T.Q5_0)
    assert np.array_equal(quants.dequantize(q.data.numpy(), T.Q5_1),
                          stored.reshape(2, hd // 2, 2, -1).transpose(0, 2, 1, 3).reshape(stored.shape))
    raw = tensors["blk.0.attn_q.weight"][0].copy()  # scales whose -16 d overflows fp16: Q8_0 blocks, exactly
    raw.reshape(-1, 22)[:, 0:2] = np.full((raw.size // 22, 1), 5000, np.float16).view(np.uint8)
    big = quant.read_blocks(quant.GGUFTensor("w", int(T.Q5_0), (64, 64), raw.reshape(-1)), 64, 64, requantize=True)
    assert (big.type_name, big.source) == ("Q8_0", "Q5_0")
    assert np.array_equal(quants.dequantize(big.data.numpy(), T.Q8_0), quants.dequantize(raw, T.Q5_0))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_k_quants_reach_the_kernels_as_their_own_super_blocks_exactly(kind):
    """Q4_K and Q5_K: kept as the file's super-blocks and packed with their own d, dmin, six-bit scales and
    minimums (WT_Q4K_X8, WT_Q5K_X8), so their values are gguf's dequantization exactly (no scale rounded to fp16),
    in the file's bytes plus 4 per 256 values; the test's encoder (tests/test_step.k_quantize) writes what gguf
    reads."""
    kt, size, bits = T[kind], quant.K_SUPER[int(T[kind])], 4 if kind == "Q4_K" else 5
    gen = np.random.default_rng(8)
    raw = gen.integers(0, 256, (32 * 512 // 256, size), dtype=np.uint8)  # any bytes with finite d, dmin are one
    raw[:, 0:4] = gen.uniform(1e-4, 2e-2, (len(raw), 2)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(32, -1)
    tensor = quant.GGUFTensor("blk.0.ffn_down.weight", int(kt), (512, 32), raw.reshape(-1))
    with pytest.raises(quant.QuantWeightError, match=f"has type {kind}"):
        quant.read_blocks(tensor, 32, 512)
    b = quant.read_blocks(tensor, 32, 512, requantize=True)
    assert (b.type_name, b.source, tuple(b.data.shape)) == (kind, kind, (32, 512 // 256 * size))
    assert np.array_equal(b.data.numpy(), raw)
    sb = raw.reshape(32, 2, size)                              # the codes, decoded here on their own: sub-block s
    qs = sb[..., -128:].reshape(32, 2, 4, 32)                  # of a super-block: nibble s % 2 of chunk s // 2 ...
    codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(32, 2, 8, 32)
    if kind == "Q5_K":                                         # ... and Q5_K's bit s of qh[l]
        codes |= ((sb[..., 16:48][:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1) << 4
    assert np.array_equal(quant.k_quant_codes(sb), codes)
    ref = quants.dequantize(raw, kt)                          # d sc u - dmin m, fp32 (llama.cpp's formula)
    packed = quant.pack_x8(b)  # kept: the wmat points into its bytes
    assert (packed.type_name, packed.nbytes) == (f"Q{bits}Kx8", 32 * 512 // 256 * (size + 4))
    assert torch.equal(native.dequantize(native.wmat(blocks=packed)), torch.from_numpy(ref).bfloat16())
    # a damaged tensor (a d that is not finite) is refused by name
    raw.reshape(-1, size)[:, 0:2] = np.full((len(raw) * 2, 1), np.inf, np.float16).view(np.uint8)
    with pytest.raises(quant.QuantWeightError, match="GGUF tensor w holds values that are not finite"), \
            np.errstate(invalid="ignore"):
        quant.read_blocks(quant.GGUFTensor("w", int(kt), (512, 32), raw.reshape(-1)), 32, 512, requantize=True)
    values = gen.normal(size=(32, 512)).astype(np.float32)
    back = quants.dequantize(quantize(values, kt), kt)
    v = values.reshape(32, -1, 32)
    step = (v.max(-1) - np.minimum(v.min(-1), 0)) / (2 ** bits - 1)  # the encoder's step per 32 values
    assert np.all(np.abs(back - values).reshape(32, -1, 32) <= step[..., None] * 0.75), np.abs(back - values).max()


def test_q5_1_reaches_the_kernels_as_it_is():
    gen = np.random.default_rng(9)
    five = quants.quantize(gen.normal(size=(32, 512)).astype(np.float32), T.Q5_1)
    same = quant.read_blocks(quant.GGUFTensor("w", int(T.Q5_1), (512, 32), five.reshape(-1)), 32, 512, requantize=True)
    assert (same.type_name, same.source) == ("Q5_1", "Q5_1") and np.array_equal(same.data.numpy(), five)
    packed = quant.pack_x8(same)  # kept: the wmat points into its bytes
    assert torch.equal(native.dequantize(native.wmat(blocks=packed)),
                       torch.from_numpy(quants.dequantize(five, T.Q5_1)).bfloat16())


def test_q6_k_reaches_the_kernels_as_6_bit_blocks_exactly():
    """Q6_K: each 32 values (two 16-value sub-blocks d sc (u - 32)) become a Q6_HALVES block holding the same d,
    codes and two scales, so its values are gguf's dequantization exactly, packed (WT_Q6_X8) in the file's bytes; the
    test's encoder (tests/test_step.q6_k_quantize) writes what gguf reads back."""
    gen = np.random.default_rng(10)
    raw = gen.integers(0, 256, (32 * 512 // 256, 210), dtype=np.uint8)  # any bytes with a finite d are Q6_K
    raw[:, 208:210] = gen.uniform(1e-5, 1e-3, (len(raw), 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(32, -1)
    tensor = quant.GGUFTensor("blk.0.ffn_down.weight", int(T.Q6_K), (512, 32), raw.reshape(-1))
    with pytest.raises(quant.QuantWeightError, match="has type Q6_K"):
        quant.read_blocks(tensor, 32, 512)
    b = quant.read_blocks(tensor, 32, 512, requantize=True)
    assert (b.type_name, b.source, tuple(b.data.shape)) == ("Q6_K", "Q6_K", (32, 512 // 32 * 28))
    ref = quants.dequantize(raw, T.Q6_K)                          # llama.cpp's formula, fp32 (exact here)
    h = b.data.numpy().reshape(32, -1, 28)
    d = h[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)[..., None]
    scales = np.repeat(h[..., 2:4].view(np.int8).astype(np.float64), 16, axis=-1)
    ours = d * scales * (quant.q6_halves_codes(h).astype(np.float64) - 32)
    assert np.array_equal(ours.reshape(32, 512), ref.astype(np.float64))
    packed = quant.pack_x8(b)  # kept: the wmat points into its bytes
    assert (packed.type_name, packed.nbytes) == ("Q6x8", 32 * 512 // 256 * 210)  # the file's 6.5625 bits a weight
    assert torch.equal(native.dequantize(native.wmat(blocks=packed)), torch.from_numpy(ref).bfloat16())
    values = gen.normal(size=(32, 512)).astype(np.float32)
    ours = quantize(values, T.Q6_K)
    back = quants.dequantize(ours, T.Q6_K)
    step = np.abs(values).reshape(32, -1, 16).max(-1).repeat(16, -1) / 31  # the encoder's 16-value scale
    assert np.all(np.abs(back - values) <= step * 0.6), np.abs(back - values).max()


def test_gguf_files_that_cannot_serve_say_why_and_leave_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path / "home"))
    (tmp_path / "notes.gguf").write_text("not a model")
    with pytest.raises(ModelLoadError, match="notes.gguf is not a readable GGUF file"):
        resolve(str(tmp_path / "notes.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match=r"is a file; give the folder that holds config\.json, or a \.gguf file"):
        resolve(str(tmp_path / "weights.bin"))
    w = GGUFWriter(str(tmp_path / "m.gguf"), "bert")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"m\.gguf holds a 'bert' model; eagle-chat runs Llama-family GGUF files"):
        resolve(str(tmp_path / "m.gguf"))
    smaller_smollm2(tmp_path / "ok.gguf", layers=1)
    data = (tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 5000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf is truncated: tensor blk\.0\.\w+\.weight ends early"):
        resolve(str(tmp_path / "cut.gguf"))
    monkeypatch.setattr("core.models.available_memory", lambda: 10_000_000)
    with pytest.raises(ModelLoadError, match=r"ok\.gguf needs about 0\.\d GB of memory to load \(the file's blocks and "
                                             r"its other weights in bf16; 0\.\d GB to convert them to fp32\) and "
                                             r"0\.0 GB is available"):
        resolve(str(tmp_path / "ok.gguf"))
    home = tmp_path / "home" / "models" / "gguf"
    assert not home.exists() or not any(home.iterdir()), "nothing converted, nothing half-written"


@pytest.mark.slow
def test_a_gguf_file_whose_fp32_copy_does_not_fit_loads_from_the_file_itself(tmp_path, monkeypatch, capsys):
    """Where the fp32 copy would not fit in memory (a 7B file's is 28 GB), the cached folder holds the config and
    tokenizer alone and every load reads the weights from the file: a Llama file in bf16 without its layers'
    linear weights (the native step serves them from the file's blocks), the rest the converted copy's values;
    with_layer_weights reads the linears as a full load does (q / k rows put back in transformers' order), and
    the answers on either path equal the converted copy's."""
    from core.kernels import quant as q
    from core.models import GGUF_DIRECT, gguf_model_dir, reads_gguf_directly, with_layer_weights

    path = tmp_path / "ok.gguf"
    smaller_smollm2(path, layers=1)
    weights = sum(int(np.prod(t.shape)) for t in q.open_gguf(path))
    others = sum(int(np.prod(t.shape)) for t in q.open_gguf(path) if not t.name.startswith("blk."))
    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path / "converted"))
    converted = load_target(str(path), dtype="bfloat16")
    monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path / "direct"))
    lean = 2 * path.stat().st_size + 2 * others  # the file's blocks and the embedding in bf16 fit, fp32 does not
    room = (lean + 4 * weights) // 2
    assert lean < room < 4 * weights
    monkeypatch.setattr("core.models.available_memory", lambda: room)
    capsys.readouterr()
    folder = gguf_model_dir(path)
    assert reads_gguf_directly(folder) and (folder / GGUF_DIRECT).is_file()
    assert not list(folder.glob("*.safetensors")), "no copy of the weights"
    assert (f"Reading ok.gguf's weights from the file at every load (its fp32 copy, {4 * weights / 1e9:.1f} GB, "
            "would not fit in memory)") in capsys.readouterr().out
    direct = load_target(str(path), dtype="bfloat16")
    assert "Reading" not in capsys.readouterr().out, "the folder is kept"
    assert direct.lean and direct.gguf == path and direct.dtype == torch.bfloat16
    a, b = direct.model.state_dict(), converted.model.state_dict()
    linears = {k for k in b if ".layers." in k and k.endswith("proj.weight")}
    assert a.keys() == b.keys() and len(linears) == 7 and all(a[k].is_meta for k in linears)
    assert all(torch.equal(a[k], b[k]) for k in a if k not in linears)
    bf16 = 2 * sum(b[k].numel() for k in linears)
    monkeypatch.setattr("core.models.available_memory", lambda: bf16 - 1)
    with pytest.raises(ModelLoadError, match=r"ok\.gguf's layers need about 0\.0 GB of memory in bf16 where the native "
                                             r"step does not serve its blocks"):
        with_layer_weights(direct)
    monkeypatch.setattr("core.models.available_memory", lambda: room)
    full = with_layer_weights(direct)
    a = full.model.state_dict()
    assert not full.lean and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ModelLoadError, match=r"ok\.gguf is too large for its fp32 copy here, and is read from the file "
                                             r"only on the CPU without --load-in-4bit"):
        load_target(str(path), dtype="bfloat16", load_in_4bit=True)
    with pytest.raises(ModelLoadError, match=r"ok\.gguf needs about 0\.1 GB of memory in torch\.float32 and 0\.1 GB is "
                                             r"available: load it in bf16"):
        load_target(str(path), dtype="float32")  # fp32 is what did not fit
    if native.kernel_isa() is None:
        pytest.skip("no native kernels on this CPU")
    prompt = [{"role": "user", "content": "Name three rivers in Europe."}]
    cfg = GenerationConfig(max_new_tokens=16, speculative=False)
    answers = {}
    for home, weights in (("converted", "auto"), ("direct", "auto"), ("converted", "bf16"), ("direct", "bf16")):
        monkeypatch.setenv("EAGLE_CHAT_HOME", str(tmp_path / home))
        engine = Engine.load(str(path), None, weights=weights)
        assert isinstance(engine.forwarder, NativeStep), (home, weights)
        assert ("read from the file alone: its fp32 copy would not fit here" in engine.numerics.describe()) == (
            (home, weights) == ("direct", "auto"))
        answers[home, weights] = [t for ev in engine.generate(prompt, cfg) for t in ev.token_ids]
    assert answers["direct", "auto"] == answers["converted", "auto"] and len(answers["direct", "auto"]) == 16
    assert answers["direct", "bf16"] == answers["converted", "bf16"]


def test_the_models_tab_takes_a_gguf_file_as_the_target(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    found = Request.parse(CUSTOM, str(tmp_path / "m.gguf"), "", "float32", "cpu", False)
    assert found.missing_folders() == [] and found.hub_ids() == []
    gone = Request.parse(CUSTOM, str(tmp_path / "gone.gguf"), "", "float32", "cpu", False)
    assert gone.missing_folders() == [str(tmp_path / "gone.gguf")]
    for head in (str(tmp_path / "m.gguf"), "org/smol-GGUF:Q4_K_M"):  # refused before anything is fetched
        with pytest.raises(ModelLoadError, match="is a GGUF model file: the head field takes an EAGLE head's"):
            Request.parse(CUSTOM, str(tmp_path), head, "float32", "cpu", False)


def test_a_hub_repos_gguf_file_is_named_by_its_quantization(tmp_path, monkeypatch):
    """`owner/name:TAG` fetches that repo's `*-TAG.gguf` alone (any case), as llama.cpp's -hf does."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    names = ["smol-Q4_0.gguf", "smol-Q4_K_M.gguf", "smol-Q4_K_S.gguf", "smol-q8_0.gguf", "big-Q8_0.gguf"]
    files = {name: bytes([i + 1]) * 1000 for i, name in enumerate(names)} | {"README.md": b"# smol"}
    with HubServer({"org/smol-GGUF": files}) as hub:
        path = download("org/smol-GGUF:Q4_K_M", endpoint=hub.url)
        assert path.name == "smol-Q4_K_M.gguf" and path.read_bytes() == files["smol-Q4_K_M.gguf"]
        seen = []  # the Models tab's download: the same file, its bytes reported as it comes
        path = download_with_progress("org/smol-GGUF:q4_0", lambda n, t: seen.append((n, t)), endpoint=hub.url)
        assert path.name == "smol-Q4_0.gguf" and seen[-1] == (1000, 1000)
        fetched = {p.rsplit("/", 1)[-1] for m, p, _ in hub.log if m == "GET" and "/resolve/" in p}
        assert fetched == {"smol-Q4_K_M.gguf", "smol-Q4_0.gguf"}, "only the named files are fetched"
        with pytest.raises(ModelLoadError, match=r"org/smol-GGUF has no \.gguf file named like \*-Q5_K\.gguf"):
            download("org/smol-GGUF:Q5_K", endpoint=hub.url)
        with pytest.raises(ModelLoadError, match=r"has 2 \.gguf files \(big-Q8_0\.gguf, smol-q8_0\.gguf\)"):
            download("org/smol-GGUF:Q8_0", endpoint=hub.url)
        with pytest.raises(ModelLoadError, match="not found"):
            download("org/nothing:Q4_0", endpoint=hub.url)
    request = Request.parse(CUSTOM, "org/smol-GGUF:Q4_K_M", "", "float32", "cpu", False)
    assert request.hub_ids() == ["org/smol-GGUF:Q4_K_M"] and request.missing_folders() == []


def test_a_gguf_file_given_as_the_head_is_refused_before_anything_is_fetched(tmp_path, monkeypatch):
    from core.decoding.head import HeadLoadError

    monkeypatch.setattr("core.models.download", lambda *a, **k: pytest.fail("nothing is downloaded for a head"))
    for head in (str(tmp_path / "m.gguf"), "org/smol-GGUF:Q4_K_M"):
        with pytest.raises(HeadLoadError, match="names a GGUF model file; an EAGLE head is a folder or a hub repo"):
            Engine.load("smollm2", head)

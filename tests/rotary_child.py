"""Child process for tests/test_smollm2.py::test_rotary_tables_are_the_same_bits_in_every_process:
a fresh process (the first vectorised cos of a process is what went wrong) loads the embedded
model as the app does and prints a digest of the native step's rotary table, of the native
head's, and whether they equal the modules' values recomputed afterwards on one thread."""

import hashlib
import json

import torch

from core.decoding.engine import Engine
from core.threads import one_torch_thread

torch.set_num_threads(2)
engine = Engine.load()
out = {}
for name, step, rotary, probe in (
        ("target", engine.forwarder, lambda p, pos: engine.forwarder.hf.model.rotary_emb(p, pos),
         engine.target.model.get_input_embeddings().weight[:0]),
        ("head", getattr(engine.drafter, "native", None), lambda p, pos: engine.head.rotary(p, pos), None)):
    if step is None or not hasattr(step, "_cos"):
        continue
    probe = step._cos[:0] if probe is None else probe
    with one_torch_thread(), torch.inference_mode():
        cos, sin = rotary(probe, torch.arange(step._cos.shape[0])[None])
    out[name] = {"digest": hashlib.md5(step._cos.float().numpy().tobytes() + step._sin.float().numpy().tobytes()).hexdigest(),
                 "same_as_module": bool(torch.equal(step._cos, cos[0]) and torch.equal(step._sin, sin[0]))}
print(json.dumps(out))

"""The numerics a target computes in, chosen once at load: its dtype, its attention kernels, the
native step that runs its decoding forwards, and the probe's verdict on whether a tree row
verifies bit for bit what a plain step computes on this machine (core.decoding.probe).

"auto" asks for bf16 with the batch-invariant kernels on the CPU (core.kernels.invariant): greedy
speculation then equals plain decoding by construction. Where the probe finds otherwise, the
target falls back to fp32 + sdpa, and `Numerics.note` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from core.kernels import invariant, native
from core.config import ATTENTIONS, EngineError
from core.models import LoadedModel, load_target, with_layer_weights
from core.decoding.batched import calibration_hidden
from core.decoding.probe import ProbeResult, probe
from core.kernels.quant import QuantWeightError
from core.kernels.step import WEIGHTS, NativeStep, StepError, load_step, unsupported, warm_math


@dataclass(frozen=True)
class Numerics:
    """How the target computes, and whether tree rows are verified bit-identical to plain steps."""

    dtype: str                  # "bfloat16", "float32", ...
    attention: str              # "exact" (batch-invariant kernels), "sdpa" or "eager"
    probe: ProbeResult | None   # None: not probed (e.g. no head, nothing to compare)
    note: str = ""              # why these numerics were chosen (e.g. a failed probe's fallback)
    step: str = ""              # what runs decoding steps: the native step and its weights, or why not

    @property
    def exact(self) -> bool:
        return self.probe is not None and self.probe.exact

    def describe(self) -> str:
        dt = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "float64": "fp64"}.get(self.dtype, self.dtype)
        kernels = (f"batch-invariant kernels, {native.status().describe()}" if self.attention == "exact"
                   else f"{self.attention} attention")
        if self.probe is None:
            verdict = "exactness not checked"
        elif self.probe.exact:
            verdict = f"exact: verified on this machine ({self.probe.checked_at})"
        else:
            verdict = f"exact: not guaranteed ({self.probe.reason})"
        return (f"{dt}, {kernels}; {verdict}" + (f"; {self.step}" if self.step else "")
                + (f"; {self.note}" if self.note else ""))


def _auto_numerics(device: str, load_in_4bit: bool, dtype: str, attention: str) -> tuple[str, str]:
    """"auto" resolved: bf16 on the CPU (fp32 under 4-bit loading), fp16 on CUDA; the exact kernels
    for bf16 on the CPU, else sdpa."""
    if dtype == "auto":
        dtype = "bfloat16" if torch.device(device).type == "cpu" and not load_in_4bit else (
            "float16" if torch.device(device).type == "cuda" else "float32")
    if attention == "auto":
        attention = "exact" if dtype in ("bfloat16", "bf16") and torch.device(device).type == "cpu" else "sdpa"
    return dtype, attention


def set_numerics(target: LoadedModel, attention: str) -> None:
    """Swap core.kernels.invariant's kernels into the target ("exact") or out of it (another attention)."""
    if attention == "exact":
        invariant.make_invariant(target.model)
    else:
        invariant.undo_invariant(target.model, attention)


def load_numerics(model: str, *, dtype: str, attention: str, device: str, load_in_4bit: bool,
                  check: bool, weights: str = "auto") -> tuple[LoadedModel, Numerics, NativeStep | None]:
    """Load the target in the requested numerics ("auto": bf16 + exact kernels on CPU when the
    probe passes, else fp32 + sdpa with the probe's reason kept), and the native step that runs
    its decoding forwards where it can (core.kernels.step; `weights`: one of core.config.WEIGHTS)."""
    if attention not in ATTENTIONS:
        raise EngineError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
    if weights not in WEIGHTS:
        raise EngineError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
    auto = dtype == "auto" and attention == "auto"
    dtype, attention = _auto_numerics(device, load_in_4bit, dtype, attention)
    target = load_target(model, dtype=dtype, device=device, load_in_4bit=load_in_4bit)
    warm_math()  # the first vectorised cos / sin on one thread (core.threads.one_torch_thread)
    set_numerics(target, attention)
    if target.lean and (weights == "bf16" or unsupported(target.model)):  # the step will not read the file's blocks
        target = with_layer_weights(target)
    try:
        step, step_text = load_step(target, weights, calibrate=calibration_hidden)
    except (StepError, QuantWeightError) as e:  # only where q4 was asked for by name (or a lean target's file)
        raise EngineError(str(e)) from e
    result = probe(step or target.model, target.dtype, attention, device) if check else None
    # (a lean target stays: its fp32 copy is what did not fit, and the numerics line says the probe failed)
    if auto and result is not None and not result.exact and attention == "exact" and not target.lean:
        target.model.float()
        target = replace(target, dtype=torch.float32)
        set_numerics(target, "sdpa")
        fallback = probe(target.model, target.dtype, "sdpa", device)
        return target, Numerics("float32", "sdpa", fallback,
                                note=f"bf16 exact kernels failed the probe here ({result.reason}), so fp32 runs"), None
    if step is not None:
        step.drop_bf16_layers()  # q4: the layers' bf16 copies go (nothing to drop for bf16 weights)
    return target, Numerics(str(target.dtype).removeprefix("torch."), attention, result, step=step_text), step

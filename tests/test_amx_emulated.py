"""The AMX tile code paths, run on any AVX-512 machine: EAGLE_CHAT_KERNELS=amx-emulated builds the kernels with every
tile instruction a C function (core/kernels/csrc/amx_emulate.h), and the tests that need tiles run on it in a process
of their own. Without it those tests skip wherever the CPU lacks AMX (every AMD machine), and a change to the tile
paths would reach Intel users untested: reverting the twenty-seventh session's mend (the prompt's tiles reading the
Q4_0 / Q4_K layouts) fails two of them here, and so does a C tile left unzeroed in the AMX-INT8 GEMM."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from core.kernels import native

ROOT = Path(__file__).resolve().parent.parent

# every test that skips without AMX tiles, or runs its AMX half only where they serve
TILE_TESTS = [
    "tests/test_native.py::test_amx_and_avx512_gemms_are_each_row_invariant_and_agree",
    "tests/test_native.py::test_a_prompt_sized_call_runs_on_tiles_with_each_row_as_in_a_decoding_call",
    "tests/test_native.py::test_the_amx_attention_serves_only_head_dim_64_and_stays_close_to_the_vector_kernel",
    "tests/test_screen.py::test_the_split_head_computes_the_unsplit_heads_bits_on_vnni_and_amx",
    "tests/test_step.py::test_block_weights_dequantize_to_the_bf16_copy_and_multiply_the_same",
    "tests/test_step.py::test_a_prompt_multiplies_block_weights_on_tiles_as_their_bf16_copy",
    "tests/test_w4a8.py::test_rows_compute_the_same_bits_alone_in_any_batch_and_on_amx_or_vnni",
]

needs_avx512 = pytest.mark.skipif(not native.status().available or native.status().isa != "avx512",
                                  reason="the emulated tiles sit in the AVX-512 build, which does not serve here")


def emulated(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, native.OFF_ENV: native.AMX_EMULATED}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@needs_avx512
def test_emulated_tiles_serve_and_say_so():
    done = emulated("-c", "from core.kernels import native; s = native.status(); "
                          "print(s.amx, s.amx_attention, native.set_x8_amx(True)); print(s.describe())")
    assert done.returncode == 0, done.stderr[-2000:]
    flags, described = done.stdout.splitlines()[-2:]
    assert flags == "True True True"
    assert described.startswith("tiles emulated in C (EAGLE_CHAT_KERNELS=amx-emulated") and "AMX bf16 GEMM" in described
    if not native.amx_emulated():  # this process (unless the whole suite runs emulated): the machine's own kernels
        assert "emulated" not in native.status().describe()


@needs_avx512
def test_the_tile_tests_pass_on_emulated_tiles():
    done = emulated("-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *TILE_TESTS)
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 14 and "skipped" not in summary, summary  # every case ran on the tiles

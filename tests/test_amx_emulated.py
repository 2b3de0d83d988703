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

# the files holding the tests marked `tiles` (skipped without AMX, or running their AMX half only where tiles serve;
# tests/conftest.py refuses a test that skips without AMX and lacks the mark)
TILE_FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                    if "pytest.mark.tiles" in p.read_text(encoding="utf-8"))

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
    assert len(TILE_FILES) >= 4, TILE_FILES
    done = emulated("-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-m", "tiles", *TILE_FILES)
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 60 and "skipped" not in summary, summary  # every case ran on the tiles


def test_a_test_skipping_without_amx_must_be_marked_tiles():
    """tests/conftest.py refuses to collect a test that skips without AMX unless it is marked `tiles` (else it would
    skip on every AMD machine and never run on the emulated tiles)."""
    from tests.conftest import pytest_collection_modifyitems

    class Item:
        def __init__(self, nodeid, reason, marked):
            self.nodeid, self.marks = nodeid, [pytest.mark.skipif(True, reason=reason).mark]
            self.marks += [pytest.mark.tiles.mark] if marked else []

        def iter_markers(self, name):
            return (m for m in self.marks if m.name == name)

        def get_closest_marker(self, name):
            return next(self.iter_markers(name), None)

    fine = [Item("t.py::marked", "no AMX tiles here", True), Item("t.py::other", "no GPU here", False)]
    pytest_collection_modifyitems(None, fine)
    with pytest.raises(pytest.UsageError, match=r"t\.py::unmarked skips without AMX tiles .* @pytest\.mark\.tiles"):
        pytest_collection_modifyitems(None, fine + [Item("t.py::unmarked", "no AMX attention on this machine", False)])

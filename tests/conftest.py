import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Gradio's files (uploads, exports it serves) in a folder of this test run: the browser tests failed
# whenever /tmp/gradio held an earlier run's files (the tree-size test, every time on the second run
# in a row, passing again once the folder was moved aside). Set before anything imports gradio,
# which reads it at import.
os.environ["GRADIO_TEMP_DIR"] = tempfile.mkdtemp(prefix="eagle-chat-tests-gradio-")
atexit.register(shutil.rmtree, os.environ["GRADIO_TEMP_DIR"], ignore_errors=True)

# Tiny test models gain nothing from threads, and on a busy 2-core machine extra threads
# spin against each other; tests on the real model raise this themselves.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """A test that skips without AMX tiles must be marked `tiles`, so tests/test_amx_emulated.py runs it on emulated
    tiles wherever the AVX-512 build serves: unmarked, it would skip on every AMD machine and leave its tile path
    untested (as a hand-kept list of such tests did for four of them)."""
    for item in items:
        for mark in item.iter_markers("skipif"):
            reason = str(mark.kwargs.get("reason", ""))
            if "AMX" in reason and item.get_closest_marker("tiles") is None:
                raise pytest.UsageError(f"{item.nodeid} skips without AMX tiles ({reason!r}) but is not marked "
                                        "@pytest.mark.tiles: mark it, so tests/test_amx_emulated.py runs it on "
                                        "emulated tiles")

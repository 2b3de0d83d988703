import atexit
import os
import shutil
import tempfile

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

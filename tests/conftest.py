import torch

# Tiny test models gain nothing from threads, and on a busy 2-core machine extra threads
# spin against each other; tests on the real model raise this themselves.
torch.set_num_threads(1)

"""The kernels: the native C library (csrc/) and its ctypes binding, the batch-invariant torch
layers, the native decode step and draft head, GGUF weight blocks."""

"""eagle-chat's core: the decoding library (engine, tree, verify, heads, cache), its kernels and
the commands built on it. Importing it does nothing but import; a command chooses the CPU
threading policy itself, before torch loads (`core.threads.start()`)."""

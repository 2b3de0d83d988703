"""The decoding library: the engine and its loop, target forwards, numerics, draft heads and
trees, verification, context lookup, the KV cache, the exactness probe, stored trees, text."""

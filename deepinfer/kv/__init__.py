"""KV cache: per-layer specs, block pools, storage tensors."""

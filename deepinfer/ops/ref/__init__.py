"""Plain-PyTorch reference of every op: the specification, runnable on CPU."""

"""Triton kernels; each beside its reference in ops/ref with the same signature; imported only on CUDA."""

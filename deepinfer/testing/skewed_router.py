"""A checkpoint whose routed layers favour some experts (a router bias added to theirs): skewed expert
load for expert-parallel load balancing tests. The bias only changes which experts are selected, not their
weights, so the model stays a valid V4 model."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file


def skew_router(model_dir: str | Path, experts: tuple[int, ...], boost: float) -> None:
    """Add ``boost`` to the selection bias of ``experts`` in every bias-routed layer of ``model_dir``'s
    single-file native checkpoint (hash-routed layers have no bias; the MTP layer is left alone)."""
    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(path)
    for name, t in tensors.items():
        if name.startswith("layers.") and name.endswith(".ffn.gate.bias"):
            t[list(experts)] += boost
    save_file(tensors, path, metadata={"format": "pt"})

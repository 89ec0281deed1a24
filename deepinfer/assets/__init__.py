"""Files shipped inside the package: the bundled demo model (native quantized checkpoint + tokenizer)."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def demo_model_dir() -> Path:
    return _HERE / "demo"


def shapes_dir(name: str) -> Path:
    """``config.json``-only directories with published model shapes (``v4-flash``, ``v4-pro``, ``v41-flash``):
    for memory plans and dummy-weight runs at full size (V4 and V4.1)."""
    path = _HERE / "shapes" / name
    if not (path / "config.json").is_file():
        known = sorted(p.name for p in (_HERE / "shapes").iterdir() if (p / "config.json").is_file())
        raise ValueError(f"shape: unknown {name!r}; known: {', '.join(known)}")
    return path

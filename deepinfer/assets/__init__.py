"""Files shipped inside the package: the bundled demo model (native quantized checkpoint + tokenizer)."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def demo_model_dir() -> Path:
    return _HERE / "demo"

"""Every ``DEEPINFER_*`` environment variable is read here and only here.

Other modules call the functions below; none of them touches ``os.environ`` directly, so a reader can
see in one place which switches exist, what values they take and what the default is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SUPPORTED_ACCELERATORS = ("cpu", "cuda")


def _read(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def _bool(name: str, default: bool) -> bool:
    value = _read(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


def accelerator() -> str:
    """``DEEPINFER_ACCELERATOR``: ``cpu`` or ``cuda``; default cuda when available, else cpu."""
    value = _read("DEEPINFER_ACCELERATOR")
    if value is None:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    lowered = value.lower()
    if lowered not in SUPPORTED_ACCELERATORS:
        raise ValueError(
            f"DEEPINFER_ACCELERATOR={value!r} is not supported by this build; "
            f"supported values: {', '.join(SUPPORTED_ACCELERATORS)}"
        )
    if lowered == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("DEEPINFER_ACCELERATOR=cuda but no CUDA device is visible to torch")
    return lowered


def batch_invariant() -> bool:
    """``DEEPINFER_BATCH_INVARIANT``: select batch-invariant kernels (default off)."""
    return _bool("DEEPINFER_BATCH_INVARIANT", False)


def enable_mtp_varlen() -> bool:
    """``DEEPINFER_ENABLE_MTP_VARLEN``: allow a variable number of draft tokens per request (default off)."""
    return _bool("DEEPINFER_ENABLE_MTP_VARLEN", False)


@dataclass(frozen=True, slots=True)
class EnvSnapshot:
    """All switches read once at start-up; components receive this, never ``os.environ``."""

    accelerator: str
    batch_invariant: bool
    enable_mtp_varlen: bool


def snapshot() -> EnvSnapshot:
    return EnvSnapshot(
        accelerator=accelerator(),
        batch_invariant=batch_invariant(),
        enable_mtp_varlen=enable_mtp_varlen(),
    )

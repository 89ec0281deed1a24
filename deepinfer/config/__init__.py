"""The one frozen config tree. Each component takes only its own sub-config."""

from deepinfer.config.model import (
    CSA,
    HASH_MOE,
    HCA,
    ROUTED_MOE,
    SWA,
    ModelConfig,
    QuantConfig,
    RopeConfig,
)

__all__ = ["CSA", "HCA", "SWA", "HASH_MOE", "ROUTED_MOE", "ModelConfig", "QuantConfig", "RopeConfig"]

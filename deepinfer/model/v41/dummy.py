"""``load_format="dummy"`` for DeepSeek-V4.1: random weights in the checkpoint's native formats, from a config alone.

V4's dummy loader (``model/dummy.py``) with V4.1's storage formats (``names.storage_format``): the dense
projections as FP8 e4m3 codes with one UE8M0 scale per 32x32 block (``weight_block_size``), the routed experts
as packed FP4 e2m1 with one UE8M0 scale per 32 (or FP8, per ``expert_dtype``), the Engram tables as FP8 with one
scale per row and 32 columns; the rest unquantized. Codes and scales go through the same dequantization as a
checkpoint tensor (``loader.dequantize``), so the model holds exactly what a checkpoint of those codes would
give it; nothing is read from disk, which is how the full V4.1-Flash shapes (``assets/shapes/v41-flash``, with
``hf_overrides`` for fewer layers) run without a download.

Values are a function of (seed, native tensor name) only (``model/dummy.tensor_generator``), so a backbone
tensor is the same with the DSpark drafter built or not; magnitudes are V4's (``model/dummy.py``), with the
V4.1-only unquantized tensors placed by role: the Engram gates' query / key norms around 1, the vision
routing bias small.
"""

from __future__ import annotations

import torch

from deepinfer.config.v41 import V41Config
from deepinfer.model.dummy import plain_value, quantized_codes, tensor_generator
from deepinfer.model.v41.loader import dequantize
from deepinfer.model.v41.model import DeepseekV41
from deepinfer.model.v41.names import storage_format


def dummy_v41_tensor(name: str, shape: tuple[int, ...], cfg: V41Config, seed: int,
                     device: torch.device | str = "cpu") -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """(format, data, scale) of one native tensor as a V4.1 checkpoint stores it (scale None when unquantized)."""
    device = torch.device(device)
    g = tensor_generator(name, seed, device)
    fmt, block = storage_format(name, cfg)
    if fmt != "float":
        return (fmt, *quantized_codes(g, fmt, shape, block, device))  # type: ignore[arg-type]
    if name.endswith(("engram.q_weight", "engram.k_weight")):  # per-head RMSNorm weights of the Engram gate
        return fmt, 1.0 + 0.1 * torch.randn(shape, generator=g, device=device), None
    if name.endswith("gate.bias_vl"):  # the routing bias of image tokens: a bias, not a norm
        return fmt, 0.1 * torch.randn(shape, generator=g, device=device), None
    return fmt, plain_value(name, shape, g, device), None


def dummy_v41_value(name: str, shape: tuple[int, ...], cfg: V41Config, seed: int) -> torch.Tensor:
    """The fp32 value the plain model holds for ``name`` (quantized tensors dequantized as the loader does)."""
    fmt, data, scale = dummy_v41_tensor(name, shape, cfg, seed)
    if scale is None:
        return data
    return dequantize(fmt, data, scale, storage_format(name, cfg)[1])  # type: ignore[arg-type]


def load_dummy_v41(cfg: V41Config, dtype: torch.dtype, *, tokenizer=None, cache_qdq: bool = True,
                   dspark: bool = False, seed: int = 0) -> DeepseekV41:
    """A ``DeepseekV41`` of ``cfg`` with dummy weights (``tokenizer``: Engram's, as ``load_v41_model`` takes it)."""
    model = DeepseekV41(cfg, dtype, tokenizer=tokenizer, cache_qdq=cache_qdq, dspark=dspark)
    with torch.no_grad():
        for name, param in model.state_dict().items():
            param.copy_(dummy_v41_value(name, tuple(param.shape), cfg, seed).to(param.dtype))
    return model.eval()

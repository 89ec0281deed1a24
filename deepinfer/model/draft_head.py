"""An FP8 copy of the LM head for the MTP chain's drafts.

Each chained MTP pass ends in the LM head: at batch 1 on V4-Flash that is the pass's largest read (129,280 x 4,096
bf16, 1.06 GB, against ~0.3 GB for the MTP layer's weights a token touches). Drafts only decide how many positions a
verify step covers (the target's own logits decide every emitted token, greedy or seeded), so the drafts may come
from an approximation of the head: an e4m3 copy with power-of-two 128x128 block scales (``quant_fp8_block``, the
checkpoints' own format) halves the bytes and runs on the FP8 decode kernel. The target's logits (verification,
logprobs) keep the model's head. A near-tie between two tokens can change a draft, hence the acceptance rate, never
the output (tests/e2e: speculative outputs equal the plain ones with either head).
"""

from __future__ import annotations

import torch

from deepinfer.model.device import FP8Linear
from deepinfer.model.linear import Linear
from deepinfer.model.quant import QuantizedWeight, quant_fp8_block
from deepinfer.ops.table import OpTable

# Rows quantized per pass (whole 128-row scale blocks): bounds the fp32 temporaries to ~130 MB at V4's width.
_CHUNK_ROWS = 8192


def fp8_copy(head: Linear, ops: OpTable) -> FP8Linear:
    """``head``'s weight as FP8 codes + UE8M0 128x128 block scales, on its device, read through ``ops``."""
    w = head.weight.detach()
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty(-(-n // 128), -(-k // 128), dtype=torch.float8_e8m0fnu, device=w.device)
    for r0 in range(0, n, _CHUNK_ROWS):
        q, s = quant_fp8_block(w[r0 : r0 + _CHUNK_ROWS].float())
        codes[r0 : r0 + len(q)] = q
        scales[r0 // 128 : r0 // 128 + len(s)] = s
    return FP8Linear(QuantizedWeight("fp8", codes, scales, (128, 128)), ops)


def attach_draft_head(model: torch.nn.Module, ops: OpTable) -> None:
    """Give ``model`` (a DeepseekV4 with an MTP layer) its FP8 draft head, read by ``mtp_logits``."""
    model.draft_head = fp8_copy(model.head, ops)

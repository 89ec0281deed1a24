"""The MTP drafts' FP8 head (``model/draft_head.py``): the LM head's weight quantized in row chunks is the
checkpoint quantizer's result for the whole weight, and its logits follow the head's within e4m3 rounding. That
drafts from it never change outputs is tested with the engine (tests/e2e/test_speculative.py)."""

from __future__ import annotations

import torch

from deepinfer.model import draft_head
from deepinfer.model.device import FP8Linear
from deepinfer.model.linear import Linear
from deepinfer.model.quant import quant_fp8_block, ue8m0_to_float
from deepinfer.ops.table import REF


def test_fp8_copy_is_the_block_quantization_of_the_head(monkeypatch) -> None:
    monkeypatch.setattr(draft_head, "_CHUNK_ROWS", 256)  # several chunks, one partial scale block at the end
    head = Linear(320, 700, bias=False, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(torch.randn(700, 320, generator=torch.Generator().manual_seed(0)) * 0.05)
    copy = draft_head.fp8_copy(head, REF)
    assert isinstance(copy, FP8Linear) and copy.pow2_scales
    q, s = quant_fp8_block(head.weight.detach())
    assert torch.equal(copy.weight_fp8.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(copy.weight_scale, ue8m0_to_float(s))
    x = torch.randn(64, 320, generator=torch.Generator().manual_seed(1))
    want, got = head(x), copy(x)
    assert ((got - want).norm() / want.norm()).item() < 0.05  # e4m3: 3 mantissa bits, errors average out
    # a draft can differ only where the head's top two logits are closer than the copy's errors
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (got - want).abs().amax(-1)
    assert clear.any() and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])

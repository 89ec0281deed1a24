"""V4.1's mHC coefficients in one Triton launch (``ops/triton/mhc_v41.py``) vs ``ops/ref/mhc_v41.mix_finish``.

Logits as a V4.1 site produces them (O(1) pre/post logits; comb logits scaled up to 8: peaked rows before the
Sinkhorn). The kernel's softmax and sigmoid use the GPU's exp, its divisions are correctly rounded like
torch's, so pre/post/comb agree to fp32 rounding: rel_err <= 1e-6 each (the interpreter computes in numpy).
Each token is computed alone: a token's result in a batch equals its result alone, bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.ops.ref import mhc_v41 as ref  # noqa: E402
from deepinfer.ops.triton import mhc_v41 as tri  # noqa: E402
from tests.gpu.conftest import rel_err  # noqa: E402


def _logits(t: int, n: int, comb_scale: float, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(t * 31 + n)
    x = torch.randn(t, (2 + n) * n, generator=g)
    x[:, 2 * n:] *= comb_scale
    return x.to(device)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("t,n,scale", [(1, 4, 1.0), (5, 4, 8.0), (37, 4, 3.0), (3, 3, 8.0), (2, 1, 1.0)])
def test_matches_the_reference(device, t, n, scale) -> None:
    logits = _logits(t, n, scale, device)
    got = tri.mix_finish(logits, n, 20, 1e-6)
    want = ref.mix_finish(logits, n, 20, 1e-6)
    for name, a, b in zip(("pre", "post", "comb"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert rel_err(a, b) <= 1e-6, (name, rel_err(a, b))


@pytest.mark.interpret_ok
def test_a_wrong_round_count_is_caught(device) -> None:
    """The check is sharp: one Sinkhorn round fewer is far outside the bound."""
    logits = _logits(5, 4, 8.0, device)
    comb = tri.mix_finish(logits, 4, 19, 1e-6)[2]
    assert rel_err(comb, ref.mix_finish(logits, 4, 20, 1e-6)[2]) > 1e-4


@pytest.mark.interpret_ok
def test_a_token_alone_equals_the_token_in_a_batch(device) -> None:
    logits = _logits(9, 4, 8.0, device)
    batch = tri.mix_finish(logits, 4, 20, 1e-6)
    for i in (0, 4, 8):
        alone = tri.mix_finish(logits[i:i + 1], 4, 20, 1e-6)
        for a, b in zip(alone, batch):
            assert torch.equal(a[0], b[i])

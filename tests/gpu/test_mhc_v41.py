"""V4.1's mHC coefficients in one Triton launch (``ops/triton/mhc_v41.py``) vs ``ops/ref/mhc_v41.mix_finish``.

Logits as a V4.1 site produces them (O(1) pre/post logits; comb logits scaled up to 8: peaked rows before the
Sinkhorn). The kernel's softmax and sigmoid use the GPU's exp, its divisions are correctly rounded like
torch's, so pre/post/comb agree to fp32 rounding: rel_err <= 1e-6 each (the interpreter computes in numpy).
Each token is computed alone: a token's result in a batch equals its result alone, bit for bit.

The site's collapse and expansion (``collapse``, ``expand``): the same fp32 products summed in stream order
without FMA contraction, so fp32 streams agree to ~1e-7 relative (the reference's sum over N may pair terms
in another order) and bf16 outputs to one rounding on a few elements; checked with streams of very different
scales per stream (a wrong coefficient index moves them by O(1)), the first layer's expanded (stride-0)
streams, and V4.1-Flash's width."""

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


def _streams(t: int, n: int, h: int, dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    streams = (torch.randn(t, n, h, generator=g) * torch.tensor([1.0, 10.0, 0.1, 3.0][:n]).view(1, n, 1)).to(dtype)
    pre = torch.rand(t, n, generator=g) + 0.1
    out = torch.randn(t, h, generator=g).to(dtype)
    post = 2 * torch.rand(t, n, generator=g)
    comb = torch.rand(t, n, n, generator=g)
    return [v.to(device) for v in (streams, pre, out, post, comb)]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype == torch.float32:
        assert rel_err(a, b) <= 1e-6, rel_err(a, b)
    else:
        assert (a != b).float().mean().item() <= 1e-2 and rel_err(a, b) <= 4e-3, rel_err(a, b)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,n,h", [(1, 4, 64), (6, 4, 1500), (3, 3, 96)])
def test_collapse_and_expand_match_the_reference(device, t, n, h, dtype) -> None:
    streams, pre, out, post, comb = _streams(t, n, h, dtype, device, seed=t + h)
    _close(tri.collapse(streams, pre), ref.collapse(streams, pre))
    _close(tri.expand(out, streams, post, comb), ref.expand(out, streams, post, comb))
    first = streams[:, :1].expand(-1, n, -1)  # layer 0's streams: one row seen N times
    _close(tri.collapse(first, pre), ref.collapse(first, pre))
    _close(tri.expand(out, first, post, comb), ref.expand(out, first, post, comb))


@pytest.mark.parametrize("t", [1, 32, 4096])
def test_collapse_and_expand_v41_flash_width(device, t) -> None:
    streams, pre, out, post, comb = _streams(t, 4, 5120, torch.bfloat16, device, seed=t)
    _close(tri.collapse(streams, pre), ref.collapse(streams, pre))
    _close(tri.expand(out, streams, post, comb), ref.expand(out, streams, post, comb))


@pytest.mark.interpret_ok
def test_a_transposed_comb_is_caught(device) -> None:
    """The check is sharp: comb applied untransposed (stream k into j) is far outside the bound."""
    streams, pre, out, post, comb = _streams(2, 4, 64, torch.float32, device, seed=9)
    got = tri.expand(out, streams, post, comb)
    assert rel_err(got, ref.expand(out, streams, post, comb.transpose(1, 2))) > 1e-2


def _site(t: int, n: int, h: int, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    streams = (torch.randn(t, n, h, generator=g) * 2).to(torch.bfloat16)
    fn = torch.randn((2 + n) * n, n * h, generator=g) * 0.02
    base, scale = torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g) + 0.5
    return [v.to(device) for v in (streams, fn, base, scale)]


@pytest.mark.interpret_ok
@pytest.mark.parametrize("t,n,h", [(1, 4, 96), (5, 4, 200), (3, 3, 64)])
def test_mix_logits_match_the_reference(device, t, n, h) -> None:
    """The site's logits (projection, inverse RMS, scales): fp32 sums in other orders, within 1e-5."""
    streams, fn, base, scale = _site(t, n, h, device, seed=t * h)
    got = tri.mix_logits(streams, fn, base, scale, 1e-6)
    want = ref.mix_logits(streams, fn, base, scale, 1e-6)
    assert got.shape == want.shape == (t, (2 + n) * n) and got.dtype == torch.float32
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)
    first = streams[:, :1].expand(-1, n, -1)  # layer 0's streams (stride 0 over N)
    assert rel_err(tri.mix_logits(first, fn, base, scale, 1e-6), ref.mix_logits(first, fn, base, scale, 1e-6)) <= 1e-5


@pytest.mark.parametrize("t", [1, 8, 64, 65, 512])
def test_mix_logits_v41_flash(device, t) -> None:
    """V4.1-Flash's site (4 streams of 5120): the two-kernel path up to 64 tokens, the GEMM above."""
    streams, fn, base, scale = _site(t, 4, 5120, device, seed=t)
    got = tri.mix_logits(streams, fn, base, scale, 1e-6)
    assert rel_err(got, ref.mix_logits(streams, fn, base, scale, 1e-6)) <= 1e-5


@pytest.mark.interpret_ok
def test_mix_logits_of_a_token_do_not_depend_on_the_batch(device) -> None:
    streams, fn, base, scale = _site(7, 4, 96, device, seed=3)
    alone = tri.mix_logits(streams[4:5], fn, base, scale, 1e-6)
    assert torch.equal(alone[0], tri.mix_logits(streams, fn, base, scale, 1e-6)[4])

"""Off CUDA the layer branches run inline: same order, no streams; overlap is refused on the CPU."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.branches import INLINE, Branches
from deepinfer.ops import lanes


def test_inline_branch_runs_its_body_in_place() -> None:
    ran = []
    b = Branches(torch.device("cpu"))
    assert not b.enabled and not INLINE.enabled
    with b.side():
        ran.append(lanes.current())
    b.join()
    b.join()
    assert ran == [0]  # no side stream, so no side lane either


def test_lane_is_scoped() -> None:
    assert lanes.current() == 0
    with lanes.lane(1):
        assert lanes.current() == 1
        with lanes.lane(2):
            assert lanes.current() == 2
        assert lanes.current() == 1
    assert lanes.current() == 0


def test_overlap_needs_cuda() -> None:
    from deepinfer.assets import demo_model_dir
    from deepinfer.model.device import prepare_for_device
    from deepinfer.model.loader import load_model
    from deepinfer.ops.table import REF

    model = load_model(demo_model_dir(), dtype=torch.float32, progress=False, keep_quantized=True)
    with pytest.raises(ValueError, match="overlap needs a CUDA device"):
        prepare_for_device(model, REF, overlap=True)
    assert prepare_for_device(model, REF).layers[0].ffn.branches is INLINE
    with pytest.raises(ValueError, match="overlap needs a CUDA device"):  # the quantized-first build too
        load_model(demo_model_dir(), dtype=torch.float32, progress=False, ops=REF, overlap=True)

"""The per-device kernel choices: validated, frozen, and what the op table carries."""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer.ops.table import REF
from deepinfer.ops.tuning import H200, KernelTuning


def test_defaults_are_the_measured_h200_choices() -> None:
    assert H200.num_sms == 132 and H200.split_target == 264
    assert H200.fp8_tile(1) == (16, (16, 64, 4, 4))
    assert H200.fp8_tile(17) == (64, (32, 64, 4, 4))
    assert H200.fp8_tile(200) == (256, (64, 64, 4, 3))
    assert H200.fp8_tile(5000) == (None, (128, 128, 8, 3))
    assert H200.fp8_decode_tile(20) == (32, 4, 3)
    assert KernelTuning(num_sms=78).split_target == 156  # the SM count decides the split-K target
    assert KernelTuning(num_sms=78, fp8_split_target=100).split_target == 100


def test_choices_are_frozen_and_replaced_not_patched() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        H200.attention_small_split = 0  # type: ignore[misc]
    t = H200.with_fp8_tile(64, (64, 64, 4, 3)).with_fp8_decode_tile(16, (16, 4, 2))
    assert t.fp8_tile(40)[1] == (64, 64, 4, 3) and t.fp8_tile(1)[1] == H200.fp8_tile(1)[1]
    assert t.fp8_decode_tile(1) == (16, 4, 2)
    assert H200.fp8_tile(40)[1] == (32, 64, 4, 4)  # the original is untouched
    assert hash(t) != hash(H200)  # usable as a key (one compiled variant set per choice)


@pytest.mark.parametrize("field, value, match", [
    ("num_sms", 0, "num_sms"),
    ("attention_small_split", -1, "attention_small_split"),
    ("fp8_decode_max_m", 128, "fp8_decode_max_m"),
    ("fp8_tiles", ((16, (16, 64, 4, 4)),), "fp8_tiles"),
])
def test_bad_choices_name_the_field(field, value, match) -> None:
    with pytest.raises(ValueError, match=match):
        KernelTuning(**{field: value})


def test_reference_table_carries_no_kernel_choices() -> None:
    assert REF.tuning is None

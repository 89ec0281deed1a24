"""The FP4 expert kernels' compiled main loop streams weights the way their design says (no GPU needed).

Compiles the decode tile config for sm_90 with Triton's bundled ptxas (``deepinfer/testing/sass.py``) and
checks the SASS: each thread's packed weights arrive as 16-byte async copies and 16-byte shared loads
(the K order of ``ops/triton/moe_experts.py``), never as byte-wide shared loads or 4-byte copies, the
loop spills nothing; in the checkpoint and the tile-major weight layouts (codes as bytes or placed words),
and for the K-chunk option. The placed codes must also keep their point: fewer loop instructions than
the same tile reading unplaced codes.
Skipped where Triton is not installed or runs interpreted.
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles real kernels (the interpreter replaces triton.jit)", allow_module_level=True)

from deepinfer.testing.sass import compile_sm90, expert_kernels, fp8_kernels, loop_mix  # noqa: E402


def test_expert_decode_loops_use_wide_copies(tmp_path) -> None:
    decode = [k for k in expert_kernels() if " m16 " in k[0]]
    labels = {label for label, *_ in decode}
    for kernel in ("gate_up", "down"):
        for variant in ("", " tiled", " tiled placed"):  # checkpoint layout, tile-major, + placed codes
            assert any(lb.startswith(f"experts {kernel} m16 ") and lb.endswith(f" s4{variant}") for lb in labels), \
                f"no {kernel}{variant} decode kernel among {sorted(labels)}"
    counts = {}
    for label, fn, sig, consts, div, warps, stages, _ in decode:
        mix = loop_mix(compile_sm90(fn, sig, consts, div, warps, stages), tmp_path)
        counts[label] = mix.instructions
        c = mix.classes
        assert c.get("LDGSTS.E.BYPASS.128", 0) > 0, f"{label}: no 16-byte async copies in the loop: {c}"
        assert c.get("LDGSTS.E", 0) == 0, f"{label}: 4-byte async copies in the loop: {c}"
        assert c.get("LDS.U8", 0) == 0, f"{label}: byte-wide shared loads in the loop: {c}"
        assert c.get("LDS.128", 0) > 0, f"{label}: no 16-byte shared loads in the loop: {c}"
        assert c.get("HGMMA.64", 0) > 0, f"{label}: no wgmma in the loop: {c}"
        assert not c.get("LDL", 0) and not c.get("STL", 0), f"{label}: register spills in the loop: {c}"
    for label, n in counts.items():
        if label.endswith(" placed"):  # 8 integer ops per word of codes instead of 15: ~100 fewer per K step
            assert n < counts[label[: -len(" placed")]] - 80, f"{label}: {n} vs {counts[label[: -len(' placed')]]}"


def test_fp8_prefill_tile_copies_activations_as_they_are_in_kernel_order(tmp_path) -> None:
    """The batch-invariant FP8 kernel at 128 tokens: on weights in its K order (``ops/fp8_layout.py``) x goes from
    global to shared memory by 16-byte async copies and nowhere else (no shared-memory stores in the loop, which
    the checkpoint order needs to permute x), in fewer instructions per K step."""
    mixes = {label: loop_mix(compile_sm90(fn, sig, consts, div, warps, stages), tmp_path)
             for label, fn, sig, consts, div, warps, stages, _ in fp8_kernels() if label.endswith(" order")}
    kernel, checkpoint = (next(m for lb, m in mixes.items() if lb.endswith(f" {o} order"))
                          for o in ("kernel", "checkpoint"))
    assert checkpoint.classes.get("STS", 0) > 0, f"checkpoint order: x no longer permuted in the loop? {checkpoint}"
    assert not any(op.startswith("STS") for op in kernel.classes), f"kernel order: x stored in the loop: {kernel}"
    assert kernel.classes.get("LDGSTS.E.BYPASS.128", 0) > 0 and kernel.classes.get("HGMMA.64", 0) > 0
    assert not any(op.startswith(("LDL", "STL")) for op in kernel.classes), f"spills: {kernel.classes}"
    assert kernel.instructions < checkpoint.instructions - 30, (kernel.instructions, checkpoint.instructions)

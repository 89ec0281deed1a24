"""A speculative step reads the device once: its emitted tokens and next drafts come back in one packed copy.

Counted on the CPU over verify steps of the demo model (k = 3, a greedy and a seeded sampled request in one
batch, so the chain and the sampled draft pick run), with the synchronous loop and with async scheduling
(whose verify steps are planned on the placeholder drafts of the step in flight and moved on the device): every Python-level read of a tensor's values
(``tolist``, ``item``, ``numpy``, ``cpu``, ``bool``/``int``/``float``/``index``) and every operator whose
result shape depends on tensor values (``nonzero``, boolean indexing, ``unique``, ...: on the GPU each waits
for the device), made by the runner, the sampler or the engine. The model's forward is left out: on the
GPU it replays CUDA graphs (any read there would break capture), while its CPU reference ops read values
the fused kernels do not.
"""

from __future__ import annotations

import sys
import traceback
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer import LLMEngine, SamplingParams

_READS = ("tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
_SHAPE_FROM_VALUES = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
                      "repeat_interleave", "_local_scalar_dense"}
_EXEMPT = ("/deepinfer/model/", "/deepinfer/ops/")  # the forward: graphs and fused kernels on the GPU


def _caller() -> str | None:
    """Where in deepinfer (outside the forward) the current read comes from; None: not from there."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/deepinfer/" in frame.filename:
            if any(e in frame.filename for e in _EXEMPT):
                return None
            return f"{frame.filename.split('/deepinfer/')[-1]}:{frame.lineno}"
    return None


class _ShapeFromValues(TorchDispatchMode):
    def __init__(self, reads: Counter) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                             for i in (args[1] if len(args) > 1 else ()) if i is not None)
        if name in _SHAPE_FROM_VALUES or bool_index:
            where = _caller()
            if where is not None:
                self.reads[f"{name} at {where}"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request):
    eng = LLMEngine.from_engine_args(device="cpu", load_progress=False, block_size=128, max_num_seqs=4,
                                     max_model_len=1024, async_scheduling=request.param,
                                     speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    eng.add_request("greedy", "def fib(n):", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    eng.add_request("sampled", "import os\n", SamplingParams(temperature=0.8, seed=3, max_tokens=64, ignore_eos=True))
    for _ in range(3):  # prefill, then verify steps with drafts
        eng.step()
    return eng


def test_a_speculative_step_reads_the_device_once(engine, monkeypatch) -> None:
    reads: Counter = Counter()
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            where = _caller()
            if where is not None:
                reads[f"{_name} at {where}"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    submit, overlapped = engine.runner.submit, []

    def counted(plan, *args, **kwargs):  # verify works planned on a step in flight's drafts (async)
        overlapped.extend(w for w in plan.work if w.num_placeholders > 1)
        return submit(plan, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "submit", counted)
    per_step = []
    for _ in range(3):
        drafts_before = engine.spec_stats.num_drafts
        reads.clear()
        with _ShapeFromValues(reads):
            engine.step()
        assert engine.spec_stats.num_drafts > drafts_before  # a verify step
        per_step.append(dict(reads))
    monkeypatch.undo()
    assert bool(overlapped) == engine.async_scheduling
    print("device reads per speculative step:", per_step, file=sys.stderr)
    for step in per_step:
        assert sum(step.values()) == 1, step
        assert all(k.startswith("tolist at runner/model_runner.py") for k in step), step

"""V4.1's decoder-side bounded replay in the plain model (``model/v41/replay.py``, spec §3.1 and §8.3 item 2).

Tiny random V4.1 checkpoints (``tests/e2e/v41_tiny.py``: 10 layers, the last KV source is layer 5, so the
decoder is layers 6-9) in float32 with the cache quantization off, with the tiny window of 16 and with the
released window of 128:

  * the dependency halo ``W + (n - 1)(W - 1)`` is exactly what the last row depends on (bitwise, off path);
  * ``exact`` equals ``off`` (last logits and every cache row a later step reads, |d| <= 1e-5: the decoder
    layers run GEMMs of fewer rows) for one-shot and chunked prompts;
  * ``v41`` equals ``off`` bitwise while no chunk is longer than the window, and beyond it differs only in
    the decoder: the encoder's caches are bitwise those of ``off``; the last row's logits move. Measured
    (max |dlogit| of the last row / its max |logit| ~4.5, KL(off || v41), seed-1 checkpoint, random prompts):
    W = 16: 17 tokens 0.051 (KL 1.2e-4, the argmax flips), 32: 0.125 (5.6e-4), 64: 0.055, 600: 0.057;
    W = 128: 129 tokens 0.022 (KL 1.7e-5), 256: 0.098 (3.1e-4), 512: 0.085, 600: 0.032. ``exact``: at most
    1.4e-6 on the same prompts. (Random weights: the released model's error is not measured here.)
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.model.v41.loader import load_v41_model
from deepinfer.model.v41.replay import DecoderReplay
from tests.e2e.v41_tiny import write_tiny_v41

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
TOL = 1e-5


@pytest.fixture(scope="module", params=[16, 128], ids=["window16", "window128"])
def model(request, tmp_path_factory, one_thread):
    path = write_tiny_v41(tmp_path_factory.mktemp(f"w{request.param}"), seed=1, sliding_window=request.param)
    m, _ = load_v41_model(path, torch.float32, cache_qdq=False)
    return m


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    rng = random.Random(seed * 7919 + n)
    return torch.tensor([rng.randrange(3, 4096) for _ in range(n)])


def _run(m, ids: torch.Tensor, chunks: list[int], replay: str):
    """The last row's logits after feeding ``ids`` in ``chunks`` (sizes), and the cache."""
    cache, lo = m.new_cache(), 0
    for n in chunks + [ids.numel() - sum(chunks)]:
        if n:
            logits = m(ids[lo : lo + n], cache, replay)
            lo += n
    return logits[-1], cache


def _read_rows(m, cache, what: str = "all") -> dict[str, torch.Tensor]:
    """Every cache row a later step reads: the last W window rows of each layer (``what``: "encoder" = the
    layers up to the last KV source only), the compressed entries and index keys."""
    w, first = m.cfg.sliding_window, DecoderReplay.of(m.cfg, "v41").first_layer
    out = {}
    for i, lc in enumerate(cache.layers):
        if what == "all" or i < first:
            out[f"{i}.window"] = lc.window[-w:]
            for name in ("entries", "index_keys"):
                if getattr(lc, name) is not None:
                    out[f"{i}.{name}"] = getattr(lc, name)
    return out


def test_halo_is_the_dependency_bound(model) -> None:
    """Off path, bitwise: the last row's logits do not depend on the first decoder layer's input rows before
    L - keep (the exact mode's halo) and do depend on row L - keep."""
    replay = DecoderReplay.of(model.cfg, "exact")
    w, n = model.cfg.sliding_window, model.cfg.num_hidden_layers - replay.first_layer
    assert replay.keep == w + (n - 1) * (w - 1)
    ids = _ids(replay.keep + 20)
    base = model(ids)[-1]

    def last_logits_with_row_changed(row: int) -> torch.Tensor:
        def nudge(_module, args):
            streams = args[0].clone()
            streams[row] += 0.5
            return (streams, *args[1:])

        hook = model.layers[replay.first_layer].register_forward_pre_hook(nudge)
        try:
            return model(ids)[-1]
        finally:
            hook.remove()

    cut = ids.numel() - replay.keep
    assert torch.equal(last_logits_with_row_changed(cut - 1), base)
    assert not torch.equal(last_logits_with_row_changed(cut), base)


@pytest.mark.parametrize("n,chunks", [(70, []), (200, []), (200, [90]), (700, [300, 5, 250])])
def test_exact_equals_off(model, n, chunks) -> None:
    ids = _ids(n)
    want, want_cache = _run(model, ids, [], "off")
    got, cache = _run(model, ids, chunks, "exact")
    assert (got - want).abs().max() <= TOL
    rows, want_rows = _read_rows(model, cache), _read_rows(model, want_cache)
    for name, t in want_rows.items():
        assert (rows[name] - t).abs().max() <= TOL, name
    assert model.greedy(ids, 6, replay="exact") == model.greedy(ids, 6)


def test_v41_equals_off_up_to_the_window(model) -> None:
    """No chunk longer than the window: nothing is narrowed, the same ops as ``off`` on the same chunks run
    (bitwise)."""
    w = model.cfg.sliding_window
    for n, chunks in ((w, []), (1, []), (3 * w, [w, w])):
        ids = _ids(n, seed=1)
        want, want_cache = _run(model, ids, chunks, "off")
        got, cache = _run(model, ids, chunks, "v41")
        assert torch.equal(got, want), (n, chunks)
        assert all(torch.equal(t, _read_rows(model, cache)[k]) for k, t in _read_rows(model, want_cache).items())


def test_v41_differs_beyond_the_window_in_the_decoder_only(model) -> None:
    """A chunk of W + 1 tokens or more: the encoder's cache rows are bitwise those of ``off`` (spec §8.3 2c),
    the last logits differ (the measured errors are in the module docstring)."""
    w = model.cfg.sliding_window
    for n in (w + 1, 4 * w):
        ids = _ids(n, seed=2)
        want, want_cache = _run(model, ids, [], "off")
        got, cache = _run(model, ids, [], "v41")
        want_rows = _read_rows(model, want_cache, "encoder")
        assert all(torch.equal(t, _read_rows(model, cache, "encoder")[k]) for k, t in want_rows.items())
        assert 1e-3 < (got - want).abs().max() < 1.0, n


def test_v41_reads_no_window_row_below_the_kept_rows(model) -> None:
    """A narrowed chunk after a short one gives what the one-shot narrowed prefill gives, although the short
    chunk's decoder window rows are in the cache and within a window of the kept rows (a chunk shorter than
    2W - 1): the kept rows' window starts at the first kept row. A short chunk after a narrowed one reads the
    rows the narrowed one kept, so that does depend on the chunking (spec §3.1 item 4)."""
    w = model.cfg.sliding_window
    ids = _ids(2 * w, seed=3)
    one_shot, _ = _run(model, ids, [], "v41")
    after_short, _ = _run(model, ids, [w // 2], "v41")
    assert (after_short - one_shot).abs().max() <= TOL
    short_last, _ = _run(model, ids, [2 * w - w // 2], "v41")
    assert (short_last - one_shot).abs().max() > 1e-3


def test_unknown_mode_is_refused(model) -> None:
    with pytest.raises(ValueError, match=r"v41_decoder_replay: 'on' .*allowed: off, v41, exact"):
        model(_ids(5), None, "on")

"""Decoder-side bounded replay of V4.1 prefills (spec §3.1): which rows of a long prefill chunk the decoder
layers compute.

V4.1 is a "causal encoder-decoder": the layers up to the last KV source (Flash: 0-20, the *encoder*) own the
global state (compressed entries, index keys, candidates), the layers after it (21-39, the *decoder*) own only
their sliding-window KV. After a prefill chunk [S, L) the rest of the forward and the cache need, from the
decoder layers, only the last row (its logits) and the window KV of the last ``sliding_window`` rows (what
the next positions read). So the encoder runs on every row and the decoder on a tail of ``keep`` rows only:

  * ``v41`` (the released model's behaviour, vLLM PR #56752): ``keep = sliding_window``; the kept rows'
    window attention is bounded at ``kv_start = L - keep`` (row p sees [max(kv_start, p - W + 1), p]), so
    the last token's state differs from a full prefill (the long range still reaches it through the
    compressed KV). Deliberately not bit-identical, and results depend on chunk boundaries: a chunk of at
    most ``keep`` rows is not narrowed and reads the window rows an earlier narrowed chunk left.
  * ``exact`` (vLLM PR #57281): ``keep = W + (n - 1)(W - 1)`` for n decoder layers (Flash: 2414), the
    dependency halo. Decoder layer d's output at row p needs its inputs at [p - W + 1, p], so each layer
    loses W - 1 exact rows from the front of the kept range: after n layers the last row is exact, and every
    decoder layer's inputs at the trailing W rows (its window KV, the DSpark taps) are too. Equals ``off``
    up to GEMM-shape rounding (the layers run on fewer rows).
  * ``off``: every layer on every row.

``kv_start = max(replay_start, L - keep)`` in the spec: ``replay_start`` is the encoder-side replay's start
(§3.2, ``v41_prefix_replay="v41"``), never above S, so the narrowed bound ``L - keep`` (above S) is the max.

A narrowed chunk has the logits of its last row only (the released model computes no other) and the
decoder layers' window KV, and the DSpark context, of its kept rows only; rows [S, L - keep) of those are
left unwritten. Nothing reads them later (every later query sees at most W - 1 positions back), except an
exact prefix-cache hit at a block boundary inside that range, which is why the engine takes hits with the
encoder-side replay (``v41_prefix_replay="v41"``: the window behind the boundary is recomputed, no cached
window row is read) when prefix caching is on with this replay (``config/v41_engine.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.config.v41 import V41Config
from deepinfer.config.v41_engine import check_decoder_replay


@dataclass(frozen=True, slots=True)
class DecoderReplay:
    """The narrowing of one model: decoder layers are ``first_layer`` ..; a chunk of more than ``keep`` rows
    runs them on its last ``keep`` rows only (``keep`` None: never)."""

    mode: str
    first_layer: int  # the first decoder layer: the one after the last KV source
    keep: int | None

    @classmethod
    def of(cls, cfg: V41Config, mode: str) -> "DecoderReplay":
        check_decoder_replay(mode)
        n = cfg.num_hidden_layers
        first = max((s + 1 for s in cfg.kv_source_layer_ids if s < n), default=0)
        w, decoders = cfg.sliding_window, n - first
        if mode == "off" or decoders == 0:
            return cls(mode, first, None)
        return cls(mode, first, w if mode == "v41" else w + (decoders - 1) * (w - 1))

    def kept(self, rows: int) -> int:
        """How many trailing rows of a chunk of ``rows`` the decoder layers compute (``rows``: all)."""
        return rows if self.keep is None or rows <= self.keep else self.keep

"""Device transformation: run the loaded model with its weights in checkpoint formats and the chosen op table.

Applied after loading (gpt-fast style), never inside the model math:
  * every dense FP8 linear becomes ``FP8Linear`` (e4m3 weight + fp32 block scales, ``ops.fp8_linear``);
  * each MoE layer's FP4 routed experts become one stacked ``FusedFP4Experts`` (``ops.moe_experts_fp4``),
    codes and scales in the op table's layout (``ops.fp4_expert_layout``: for the Triton kernels tile-major,
    each word's bits pre-placed for decoding; the same bits reordered), and the dequantized per-expert
    copies are released;
  * with ``overlap`` (on CUDA by default), each layer's independent chains share the GPU on two streams
    (``model/branches.py``: the compressors beside the query path, the shared expert beside the routed);
  * the model runs the batched step path (``model/attention_indexed.py``: row lists built once per step,
    index-list kernels, no host syncs; what CUDA graphs capture), with the projections that share an
    input stacked into one GEMM each (``model/fused.py``).
With ``ops=REF`` on the CPU this is the specification of what the GPU path computes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import nn

from deepinfer.model.branches import INLINE, Branches
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.fused import fuse_projections
from deepinfer.model.linear import flat_grouped
from deepinfer.model.moe import MoE
from deepinfer.model.quant import FP4_GROUP, QuantizedWeight, scale_to_float
from deepinfer.model.shard import Shard
from deepinfer.ops import fp8_layout
from deepinfer.ops.table import OpTable


class FP8Linear(nn.Module):
    """e4m3 codes [N, K] with their K columns as ``ops.fp8_k_order`` stores them (``k_order``: ``ops/fp8_layout.py``;
    ``use_op_table`` re-arranges them for a table that stores them otherwise) and fp32 128x128 block scales."""

    k_order: str

    def __init__(self, qw: QuantizedWeight, ops: OpTable) -> None:
        super().__init__()
        assert qw.format == "fp8" and qw.block == (128, 128), f"FP8Linear needs 128x128 blocks, got {qw.block}"
        self.register_buffer("weight_fp8", fp8_layout.arrange(qw.data.contiguous(), ops.fp8_k_order))
        self.register_buffer("weight_scale", scale_to_float(qw.scale).float().contiguous())
        self.ops, self.k_order = ops, ops.fp8_k_order
        self.refresh()

    @classmethod
    def empty(cls, out_features: int, in_features: int, ops: OpTable, device: torch.device | str = "meta"
              ) -> "FP8Linear":
        """Unfilled buffers of the final layout, for a quantized-first load (``load``, then ``refresh``)."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.register_buffer("weight_fp8", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                      device=device))
        out.register_buffer("weight_scale", torch.empty(-(-out_features // 128), -(-in_features // 128),
                                                        dtype=torch.float32, device=device))
        out.ops, out.pow2_scales, out.k_order = ops, True, ops.fp8_k_order
        return out

    @property
    def out_features(self) -> int:
        return self.weight_fp8.shape[0]

    def load(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        """Weight loader: e4m3 codes (checkpoint order) and their stored 128x128 block scales (of this module's
        rows, when sharded) into the buffers, the codes in ``k_order``; the scales are decoded to fp32 multipliers
        once, here."""
        if tuple(data.shape) != tuple(self.weight_fp8.shape) or tuple(scale.shape) != tuple(self.weight_scale.shape):
            raise ValueError(f"FP8Linear.load: codes {tuple(data.shape)} / scales {tuple(scale.shape)} do not fit "
                             f"{tuple(self.weight_fp8.shape)} / {tuple(self.weight_scale.shape)}")
        self.weight_fp8.copy_(fp8_layout.arrange(data, self.k_order))
        self.weight_scale.copy_(scale_to_float(scale.to(self.weight_scale.device)))

    def refresh(self) -> None:
        """UE8M0 scales are powers of two: a kernel may then scale the weight itself exactly (fp8_linear)."""
        mantissa, _ = torch.frexp(self.weight_scale)
        self.pow2_scales = bool((mantissa == 0.5).all())

    @classmethod
    def stacked(cls, parts: list["FP8Linear"]) -> "FP8Linear":
        """One linear of the parts' rows (each a whole number of 128-row scale blocks); the parts become views."""
        for p in parts:
            if p.weight_fp8.shape[0] % 128:
                raise ValueError(f"cannot stack {p.weight_fp8.shape[0]} rows: not whole 128-row scale blocks")
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.register_buffer("weight_fp8", torch.cat([p.weight_fp8 for p in parts]))
        out.register_buffer("weight_scale", torch.cat([p.weight_scale for p in parts]))
        if len({p.k_order for p in parts}) != 1:
            raise ValueError(f"cannot stack FP8 weights in different K orders: {sorted({p.k_order for p in parts})}")
        out.ops, out.pow2_scales, out.k_order = parts[0].ops, all(p.pow2_scales for p in parts), parts[0].k_order
        row = 0
        for p in parts:
            n = p.weight_fp8.shape[0]
            p.weight_fp8, p.weight_scale = out.weight_fp8[row : row + n], out.weight_scale[row // 128 : (row + n) // 128]
            row += n
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.ops.fp8_linear(x.reshape(-1, shape[-1]).contiguous(), self.weight_fp8, self.weight_scale,
                                pow2_scales=self.pow2_scales)
        return y.reshape(*shape[:-1], y.shape[-1])

    def grouped_flat(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        """x [T, G*in] -> [T, G*r] in one launch (rows of a group are whole 128-row scale blocks)."""
        if (self.weight_fp8.shape[0] // groups) % 128:
            return flat_grouped(self.grouped, x, groups)
        return self.ops.fp8_linear_grouped(x.contiguous(), self.weight_fp8, self.weight_scale, groups,
                                           pow2_scales=self.pow2_scales)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [G, T, in] -> [G, T, out/G]: group g uses weight rows [g*r, (g+1)*r)."""
        g = x.shape[0]
        r = self.weight_fp8.shape[0] // g
        outs = []
        for i in range(g):
            if r % 128 == 0:
                w, s = self.weight_fp8[i * r : (i + 1) * r], self.weight_scale[i * r // 128 : (i + 1) * r // 128]
                outs.append(self.ops.fp8_linear(x[i].contiguous(), w, s, pow2_scales=self.pow2_scales))
            else:  # group rows straddle a scale block: dequantize this group's rows (small models only)
                codes = fp8_layout.checkpoint(self.weight_fp8[i * r : (i + 1) * r], self.k_order)
                w = codes.float() * self.weight_scale.repeat_interleave(128, 0)[
                    i * r : (i + 1) * r].repeat_interleave(128, 1)[:, : x.shape[-1]]
                outs.append(self.ops.dense(x[i].float(), w).to(x.dtype))
        return torch.stack(outs)


# Codes bytes of the arrived experts laid out per layout call while loading: a few calls per layer instead of
# one per expert, with the layout's temporaries (about three times this, on the device) bounded.
_LAYOUT_BYTES = 64 << 20


class FusedFP4Experts(nn.Module):
    owned: range  # the expert ids whose weights this module holds, in order (all of them unless sharded)
    shards: dict[str, Shard]  # w1 / w3 / w2 -> the slice of each expert held (tensor parallel); none: whole

    def __init__(self, prefix: str, n_experts: int, quantized: dict[str, QuantizedWeight], limit: float,
                 ops: OpTable) -> None:
        super().__init__()
        self.owned, self.shards = range(n_experts), {}
        w13, s13, w2, s2 = [], [], [], []
        first = quantized[f"{prefix}.experts.0.w1.weight"].scale
        # UE8M0 scales stay as their bytes (the kernels read the biased exponent): 1 byte per 32 weights
        # instead of 4 — a fifth of an expert's decode traffic. Other scale formats are decoded to fp32.
        raw = first.dtype in (torch.uint8, torch.float8_e8m0fnu)

        def scales(q: QuantizedWeight) -> torch.Tensor:
            assert (q.scale.dtype in (torch.uint8, torch.float8_e8m0fnu)) == raw, f"{prefix}: mixed scale formats"
            return q.scale.view(torch.uint8) if raw else scale_to_float(q.scale).float()

        for e in range(n_experts):
            q1, q3, q2 = (quantized[f"{prefix}.experts.{e}.{w}.weight"] for w in ("w1", "w3", "w2"))
            w13.append(torch.cat([q1.data, q3.data]))
            s13.append(torch.cat([scales(q1), scales(q3)]))
            w2.append(q2.data)
            s2.append(scales(q2))
        parts = {"w13": w13, "s13": s13, "w2": w2, "s2": s2}
        for codes, scale in (("w13", "s13"), ("w2", "s2")):
            stacked = torch.stack(parts[codes]), torch.stack(parts[scale])
            parts[codes].clear()  # drop the per-expert copies before the layout pass copies once more
            parts[scale].clear()
            for name, t in zip((codes, scale), ops.fp4_expert_layout(*stacked)):
                self.register_buffer(name, t.contiguous())
        self.limit, self.ops, self.raw_scales = limit, ops, raw

    @classmethod
    def empty(cls, n_experts: int, hidden: int, inter: int, raw_scales: bool, limit: float, ops: OpTable,
              device: torch.device | str, owned: range | None = None, shards: dict[str, Shard] | None = None
              ) -> "FusedFP4Experts":
        """Unfilled stacked buffers in the op table's layout for experts ``owned`` (default: all), to be filled
        one checkpoint tensor at a time by ``load``. ``raw_scales``: UE8M0 scale bytes kept as bytes (else
        fp32 multipliers), as the checkpoint stores them. The buffers are created on ``device`` (``meta``
        for a model not yet materialized); the layout's shapes come from one zero expert on the CPU.
        ``inter``: the intermediate size held, with ``shards`` saying which slice of w1 / w3 / w2 that is
        (tensor parallel: w1/w3 rows, w2 columns); the loader reads only that slice of each expert.
        ``forward`` takes ids into ``owned`` (0 is ``owned.start``): an expert-parallel MoE dispatches by
        local id."""
        owned = range(n_experts) if owned is None else owned
        if owned.step != 1 or not 0 <= owned.start <= owned.stop <= n_experts:
            raise ValueError(f"owned: expected a range of expert ids within [0, {n_experts}), got {owned}")
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        sdtype = torch.uint8 if raw_scales else torch.float32
        out._stored_shape = {}
        for codes, scale, rows, cols in (("w13", "s13", 2 * inter, hidden), ("w2", "s2", hidden, inter)):
            laid = _expert_layout(ops, rows, cols, sdtype)
            stored = ((rows, cols // 2), torch.int8), ((rows, -(-cols // FP4_GROUP)), sdtype)
            for name, (shape, dtype), (want, want_dtype) in zip((codes, scale), laid, stored):
                got = math.prod(shape) * dtype.itemsize
                if got != math.prod(want) * want_dtype.itemsize:
                    raise ValueError(f"fp4_expert_layout of the {ops.name} op table: an expert's {name} take {got} "
                                     f"bytes in its layout, {math.prod(want) * want_dtype.itemsize} as stored; "
                                     "experts are laid out in place, which needs the same bytes")
                out.register_buffer(name, torch.empty(len(owned), *shape, dtype=dtype, device=device))
            out._stored_shape[codes] = (rows, cols)
        out.limit, out.ops, out.owned, out.raw_scales = limit, ops, owned, raw_scales
        out.shards = dict(shards or {})
        out._halves = {}
        out._unlaid = {"w13": [], "w2": []}
        return out

    def load(self, expert: int, which: str, data: torch.Tensor, scale: torch.Tensor) -> None:
        """Weight loader: expert ``expert``'s ``which`` (w1 / w3 / w2) packed codes and scales as stored.

        They are copied into the expert's slot of the stacked buffers as stored (the slot viewed in the
        checkpoint's layout: w1 the first rows of w13, w3 the last); once the experts that have arrived
        hold about ``_LAYOUT_BYTES`` of codes, they are laid out together, in place, by one call of the
        layout transform (separable over experts: the same bits as one expert at a time, far fewer
        launches). ``lay_out_arrived`` lays out the rest once the checkpoint is read."""
        if expert not in self.owned:
            raise ValueError(f"expert {expert} is not among this module's experts {self.owned}")
        if (scale.dtype in (torch.uint8, torch.float8_e8m0fnu)) != self.raw_scales:
            raise ValueError(f"expert {expert} {which}: scale dtype {scale.dtype} differs from the other experts' "
                             "(mixed scale formats)")
        device = self.w13.device
        scale = scale.to(device).view(torch.uint8) if self.raw_scales else scale_to_float(scale.to(device)).float()
        local = expert - self.owned.start
        codes = "w2" if which == "w2" else "w13"
        stored_codes, stored_scales = self._stored(codes)
        rows = slice(None)
        if which != "w2":
            half = stored_codes.shape[1] // 2
            rows = slice(0, half) if which == "w1" else slice(half, 2 * half)
        dst_codes, dst_scales = stored_codes[local, rows], stored_scales[local, rows]
        if data.shape != dst_codes.shape or scale.shape != dst_scales.shape:
            raise ValueError(f"expert {expert} {which}: codes {tuple(data.shape)} / scales {tuple(scale.shape)} do "
                             f"not fit {tuple(dst_codes.shape)} / {tuple(dst_scales.shape)}")
        dst_codes.copy_(data.view(torch.int8))  # int8 or uint8 as stored: the same bytes
        dst_scales.copy_(scale)
        if which != "w2":
            halves = self._halves.setdefault(local, set())
            halves.add(which)
            if len(halves) < 2:
                return  # w1 waits for w3 (or the reverse): an expert is laid out whole
            del self._halves[local]
        self._unlaid[codes].append(local)
        expert_rows, expert_cols = self._stored_shape[codes]
        if len(self._unlaid[codes]) * expert_rows * expert_cols // 2 >= _LAYOUT_BYTES:
            self._lay_out(codes)

    def _stored(self, codes: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes buffer (w13 / w2) and its scales viewed in the checkpoint's layout: int8 [E, rows, cols/2]
        and [E, rows, cols/32] (the same bytes as the layout's, checked by ``empty``)."""
        rows, cols = self._stored_shape[codes]
        c, s = getattr(self, codes), getattr(self, "s13" if codes == "w13" else "s2")
        return c.view(torch.int8).view(len(c), rows, cols // 2), s.view(len(s), rows, -(-cols // FP4_GROUP))

    def _lay_out(self, codes: str) -> None:
        """The experts of ``codes`` that arrived since the last call: from the checkpoint's layout to the op
        table's, one layout call per run of consecutive experts."""
        experts, self._unlaid[codes] = sorted(self._unlaid[codes]), []
        stored_codes, stored_scales = self._stored(codes)
        names = (codes, "s13" if codes == "w13" else "s2")
        for lo, hi in _runs(experts):
            stored = stored_codes[lo:hi], stored_scales[lo:hi]
            for name, t in zip(names, self.ops.fp4_expert_layout(*stored)):
                dst = getattr(self, name)[lo:hi]
                if t.is_contiguous() and t.data_ptr() == dst.data_ptr():
                    continue  # a layout that keeps the stored one (REF's): already in place
                dst.copy_(t)

    def lay_out_arrived(self) -> None:
        """Lay out every expert that arrived whole and is still in the checkpoint's layout (after the last
        checkpoint tensor; ``load`` lays them out in batches as they come)."""
        for codes in getattr(self, "_unlaid", {}):
            if self._unlaid[codes]:
                self._lay_out(codes)

    def pending(self) -> list[int]:
        """Experts whose w1 or w3 arrived without the other (a complete load leaves none)."""
        return sorted(self.owned.start + e for e in getattr(self, "_halves", {}))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                add: torch.Tensor | None = None, before_add: Callable[[], None] | None = None) -> torch.Tensor:
        """Routed experts' output, plus ``add`` (the shared expert's output) when given; ``before_add`` runs
        right before ``add`` is read (a stream join when the shared expert runs beside the routed ones)."""
        return self.ops.moe_experts_fp4(x.contiguous(), ids.long(), weights, self.w13, self.s13, self.w2,
                                        self.s2, self.limit, add=add, before_add=before_add)


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids -> [lo, hi) ranges of consecutive ids."""
    out: list[tuple[int, int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


@functools.lru_cache(maxsize=16)
def _expert_layout(ops: OpTable, rows: int, cols: int, scale_dtype: torch.dtype
                   ) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """(shape, dtype) of one expert's codes and scales in ``ops``' layout: the layout of a zero expert."""
    laid = ops.fp4_expert_layout(torch.zeros(1, rows, cols // 2, dtype=torch.int8),
                                 torch.zeros(1, rows, -(-cols // 32), dtype=scale_dtype))
    return tuple((tuple(t.shape[1:]), t.dtype) for t in laid)


def _parent(model: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, leaf = dotted.split(".")
    module = model
    for p in path:
        module = getattr(module, p) if not p.isdigit() else module[int(p)]
    return module, leaf


def prepare_for_device(model: DeepseekV4, ops: OpTable, overlap: bool | None = None) -> DeepseekV4:
    """Transform a model loaded with its quantized weights kept (``load_model(..., keep_quantized=True)``).
    The engine loads quantized-first instead (``load_model(..., ops=ops)``: the same modules, built empty and
    filled from the checkpoint); this is the transform that path is checked against.
    ``overlap``: run each layer's independent chains on two streams (``model/branches.py``); default: on
    when the model lives on a CUDA device."""
    branches = _branches(next(model.buffers()).device, overlap)
    quantized: dict[str, QuantizedWeight] = getattr(model, "quantized", {}) or {}
    if model.cfg.quant is not None and not quantized:
        raise ValueError("prepare_for_device: the model holds no quantized weights; load it with "
                         "load_model(..., ops=ops) (quantized-first) or load_model(..., keep_quantized=True)")
    for name, qw in quantized.items():
        if qw.format == "fp8" and ".experts." not in name and name.endswith(".weight"):
            parent, leaf = _parent(model, name[: -len(".weight")])
            setattr(parent, leaf, FP8Linear(qw, ops))
    for name, module in model.named_modules():
        if isinstance(module, MoE) and f"{name}.experts.0.w1.weight" in quantized:
            if quantized[f"{name}.experts.0.w1.weight"].format == "fp4":
                module.routed = FusedFP4Experts(name, len(module.experts), quantized, module.cfg.swiglu_limit, ops)
                module.experts = nn.ModuleList()  # the dequantized copies are no longer read
    model.quantized = {}
    return finish_transform(model, ops, branches)


def _branches(device: torch.device, overlap: bool | None) -> Branches:
    if overlap is None:
        overlap = device.type == "cuda"
    if overlap and device.type != "cuda":
        raise ValueError(f"overlap needs a CUDA device, the model is on {device}")
    return Branches(device) if overlap else INLINE


def finish_transform(model: DeepseekV4, ops: OpTable, overlap: bool | None | Branches = None) -> DeepseekV4:
    """The part of the transform after the quantized modules are in place: stacked projections, the op table
    and the streams (``overlap``, or the ``Branches`` to use) on every module."""
    branches = overlap if isinstance(overlap, Branches) else _branches(next(model.buffers()).device, overlap)
    fuse_projections(model)
    use_op_table(model, ops)  # after stacking: the stacks take the op table too
    for module in model.modules():
        if hasattr(module, "branches"):
            module.branches = branches
    return model


def use_op_table(model: nn.Module, ops: OpTable) -> nn.Module:
    """Point every module that calls the op table at ``ops`` (the reference model's modules default to
    ``REF``): what the device transform does, and alone what the CPU's batch-invariant mode needs. FP8 weights
    stored in another K order than ``ops`` reads are re-arranged in place (``_rearrange_fp8``)."""
    _rearrange_fp8(model, ops.fp8_k_order)
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
    model.ops = ops
    return model


def _rearrange_fp8(model: nn.Module, order: str) -> None:
    """Every ``FP8Linear`` of ``model`` to K order ``order``, in place. Stacked projections' parts are row views of
    their stack's buffer (and may appear as modules of their own): the layout is per row, so each byte range is
    re-arranged once, by the largest module holding it, and every module over it takes the new order."""
    todo = sorted((m for m in model.modules() if isinstance(m, FP8Linear) and m.k_order != order),
                  key=lambda m: -m.weight_fp8.numel())
    done: list[tuple[int, int]] = []
    for m in todo:
        w = m.weight_fp8
        start = w.data_ptr()
        end = start + w.numel() * w.element_size()
        if not any(a <= start and end <= b for a, b in done):
            assert w.is_contiguous(), "FP8 codes are contiguous row ranges"
            w.copy_(fp8_layout.arrange(fp8_layout.checkpoint(w, m.k_order), order))
            done.append((start, end))
        m.k_order = order

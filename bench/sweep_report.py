"""Markdown table and PNG plot from a layer-sweep JSON (``bench/layer_sweep.py``).

    python bench/sweep_report.py bench/results/layer_sweep.json     # -> layer_sweep.md, layer_sweep.png beside it

Ratios are read against the ceilings measured in the same run (copy bandwidth, bf16 GEMM rate) and against
the HF transformers peer timed in the same run. The PNG is skipped (with a note) where matplotlib is absent.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _fmt(x, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def report(data: dict) -> str:
    meta, rows = data["meta"], data["rows"]
    bw, gemm = meta.get("copy_bytes_per_s"), meta.get("bf16_gemm_flops_per_s")
    floor_ms = meta["weight_bytes_per_layer_b1"] / bw * 1e3 if bw else None
    hf_dec = {(r["context"], r["batch"]): r["ms_per_layer"] for r in rows if r["kind"] == "hf_decode"}
    hf_pre = {r["tokens"]: r["ms_per_layer"] for r in rows if r["kind"] == "hf_prefill"}
    first = meta.get("first_layer", 0)
    out = [f"# Layer sweep: V4-Flash shapes, {meta['layers']} layers (its layers {first}..{first + meta['layers'] - 1}), "
           "random native-format weights on the device",
           "", f"{meta['date']}, {meta['device']}, torch {meta.get('torch', '?')}, commit {meta['commit'] or '?'}, HF peer: "
           f"transformers {meta.get('hf_transformers', '?')} (bf16, eager attention, same shapes and random weights). "
           f"Measured in the same run: copy bandwidth {_fmt(bw and bw / 1e12, '.2f')} TB/s, bf16 GEMM "
           f"{_fmt(gemm and gemm / 1e12, '.0f')} TFLOP/s; batch-1 decode reads "
           f"{meta['weight_bytes_per_layer_b1'] / 1e6:.0f} MB of weights per layer -> floor {_fmt(floor_ms)} ms.",
           *(["", meta["note"]] if meta.get("note") else []),
           "", "## Decode (ms per layer; 43-layer model tokens/s)", "",
           "Per layer = a 43-layer step / 43 = (43 x (replay - LM head - preamble) / layers + LM head + preamble"
           " + host work per step) / 43, the preamble being the step's row lists, RoPE tables and embedding (where"
           " timed); eager = the same batched path launched from Python.", "",
           "| context | batch | ms/layer | bare replay | eager | TPOT 43 layers (ms) | tok/s (43 layers) "
           "| MB read/layer (model) | % of measured bw | HF | vs HF |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["kind"] == "decode"):
        hf = hf_dec.get((r["context"], r["batch"]))
        nbytes = r.get("bytes_per_layer") or (meta["weight_bytes_per_layer_b1"] if r["batch"] == 1 else None)
        pct = nbytes and bw and 100 * nbytes / (r["ms_per_layer"] / 1e3) / bw
        out.append(f"| {r['context']} | {r['batch']} | {_fmt(r['ms_per_layer'])} | {_fmt(r.get('replay_ms_per_layer'))} "
                   f"| {_fmt(r.get('eager_ms_per_layer'))} | {r['ms_per_layer'] * 43:.1f} | {r['tok_s_43_layers']:.0f} "
                   f"| {_fmt(nbytes and nbytes / 1e6, '.0f')} | {_fmt(pct, '.0f')}% | {_fmt(hf)} | "
                   f"{_fmt(hf and hf / r['ms_per_layer'], '.1f')}x |")
    out += ["", "## Prefill (ms per layer; TTFT for 43 layers)", "",
            "| tokens | chunk | ms/layer | TTFT 43 layers (s) | TFLOP/s | MFU vs measured bf16 GEMM | HF | vs HF |",
            "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["kind"] == "prefill"):
        rate = r.get("flops_per_layer") and r["flops_per_layer"] / (r["ms_per_layer"] / 1e3)
        hf = hf_pre.get(r["tokens"])
        out.append(f"| {r['tokens']} | {r.get('chunk', '—')} | {_fmt(r['ms_per_layer'])} | {r['ttft_43_layers_ms'] / 1e3:.2f} "
                   f"| {_fmt(rate and rate / 1e12, '.0f')} | {_fmt(rate and gemm and 100 * rate / gemm, '.0f')}% "
                   f"| {_fmt(hf)} | {_fmt(hf and hf / r['ms_per_layer'], '.1f')}x |")
    out += ["", "## Targets (issue 4)", "", "| target | measured | |", "|---|---|---|"]
    dec = {(r["context"], r["batch"]): r["ms_per_layer"] for r in rows if r["kind"] == "decode"}
    pre = {r["tokens"]: r for r in rows if r["kind"] == "prefill"}
    ctx = min((c for c, _ in dec), default=None)

    def line(name: str, value, goal: float, fmt: str) -> None:
        verdict = "—" if value is None else ("met" if value >= goal else f"missed ({value / goal:.0%} of it)")
        out.append(f"| {name} | {_fmt(value, fmt)} | {verdict} |")

    b1 = dec.get((ctx, 1))
    line("decode batch 1 >= 50% of the bandwidth floor (%)", b1 and floor_ms and 100 * floor_ms / b1, 50, ".0f")
    line("decode batch 1 >= 20x HF", b1 and hf_dec.get((ctx, 1)) and hf_dec[(ctx, 1)] / b1, 20, ".1f")
    b32 = dec.get((ctx, 32))
    line("decode batch 32 >= 10x HF", b32 and hf_dec.get((ctx, 32)) and hf_dec[(ctx, 32)] / b32, 10, ".1f")
    r4 = pre.get(4096)
    mfu = r4 and gemm and r4.get("flops_per_layer") and 100 * r4["flops_per_layer"] / (r4["ms_per_layer"] / 1e3) / gemm
    line("prefill 4K >= 30% MFU (%)", mfu, 30, ".0f")
    return "\n".join(out) + "\n"


def plot(data: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = data["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for ctx in sorted({r["context"] for r in rows if r["kind"] == "decode"}):
        pts = sorted((r["batch"], r["tok_s_43_layers"]) for r in rows if r["kind"] == "decode" and r["context"] == ctx)
        ax1.plot(*zip(*pts), marker="o", label=f"deepinfer ctx {ctx}")
    hf = sorted((r["batch"], r["batch"] / (r["ms_per_layer"] * 43 / 1e3)) for r in rows
                if r["kind"] == "hf_decode" and r.get("ms_per_layer"))
    if hf:
        ax1.plot(*zip(*hf), marker="x", linestyle="--", label="HF transformers")
    ax1.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s (43 layers)", title="Decode")
    ax1.legend(fontsize=8)
    pre = sorted((r["tokens"], r["tokens"] / (r["ttft_43_layers_ms"] / 1e3)) for r in rows if r["kind"] == "prefill")
    hfp = sorted((r["tokens"], r["tokens"] / (r["ms_per_layer"] * 43 / 1e3)) for r in rows if r["kind"] == "hf_prefill")
    ax2.plot(*zip(*pre), marker="o", label="deepinfer")
    if hfp:
        ax2.plot(*zip(*hfp), marker="x", linestyle="--", label="HF transformers")
    ax2.set(xscale="log", xlabel="prompt tokens", ylabel="prefill tokens/s (43 layers)", title="Prefill")
    ax2.legend(fontsize=8)
    meta = data["meta"]
    fig.suptitle(f"V4-Flash layer sweep, {meta['device']}, {meta['date']}, commit {meta['commit'] or '?'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "layer_sweep.json")
    data = json.loads(src.read_text())
    md = report(data)
    if not plot(data, src.with_suffix(".png")):
        md += "\n(PNG not drawn here: matplotlib is not installed; run this script where it is.)\n"
    else:
        md += f"\n![sweep]({src.with_suffix('.png').name})\n"
    src.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

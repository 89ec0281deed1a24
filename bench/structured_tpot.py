"""Decode cost of structured outputs: TPOT with a JSON-schema constraint on every request vs none, same run.

    python bench/structured_tpot.py [--device cuda|cpu] [--batches 1 32 128] [--tokens 128] [--rounds 2]
                                    [--model DIR --load-format dummy --hf-overrides JSON]

For each batch size B one engine serves B requests at a time, alternating unconstrained and constrained
rounds (a warm-up pair first, so every step shape is compiled and every CUDA graph captured before timing).
Every request has ``ignore_eos`` and --tokens tokens to go; the schema (an object holding an array of at
least 1,000 small records) cannot complete sooner, so the batch stays full and both kinds of rounds time the
same steps. TPOT is the median wall time of the decode steps in which all B sequences draw (each such step
emits one token per sequence), synchronous loop, one host sync per step. Also reported, per timed
constrained step: the host time of the grammar masks (``GrammarBackend.fill_rows``, which the runner overlaps
with the forward on the GPU), the host time of the matcher advance (``LLMEngine._advance_grammars``, on the
step's critical path) and the device time of the mask upload and apply (CUDA events around
``ModelRunner._apply_grammar_masks``; host time on the CPU).
The goal on the GPU is a constrained TPOT at most 5% above the unconstrained one.
Writes ``structured_tpot_{device}.{json,md}`` into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.assets import demo_model_dir

RECORD = {"type": "object", "additionalProperties": False, "required": ["id", "name", "tags"],
          "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                         "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 3}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
          "properties": {"items": {"type": "array", "minItems": 1000, "items": RECORD}}}


def _full_decode(engine: LLMEngine, batch: int) -> bool:
    """Whether the coming step draws one token for each of ``batch`` running sequences."""
    s = engine.scheduler
    return (not s.waiting and len(s.running) == batch
            and all(q.num_tokens - q.num_computed == 1 for q in s.running))


class _Split:
    """Per timed step, where a constrained step's extra time goes: the host's mask fill
    (``GrammarBackend.fill_rows``, overlapping the forward on the GPU), the host's matcher advance
    (``LLMEngine._advance_grammars``, after the step's result) and the device's mask upload and apply
    (``ModelRunner._apply_grammar_masks``, CUDA events: no sync added to the step). Instance attributes
    wrap the three for one round."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.cuda = engine, engine.config.device == "cuda"
        self.step = {"fill": 0.0, "advance": 0.0, "apply": 0.0}
        self.total = dict(self.step)
        self.events: list = []  # (start, end) CUDA events of the timed steps' applies
        self._step_events: list = []
        self._wrapped: list = []

    def _host(self, key: str, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            self.step[key] += time.perf_counter() - t
            return out
        return timed

    def _device(self, fn):
        def timed(*a, **k):
            if not self.cuda:
                return self._host("apply", fn)(*a, **k)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*a, **k)
            end.record()
            self._step_events.append((start, end))
            return out
        return timed

    def wrap(self) -> None:
        backend = self.engine.intake.grammars
        if backend is not None:
            self._wrap(backend, "fill_rows", self._host("fill", backend.fill_rows))
        self._wrap(self.engine, "_advance_grammars", self._host("advance", self.engine._advance_grammars))
        runner = self.engine.runner
        self._wrap(runner, "_apply_grammar_masks", self._device(runner._apply_grammar_masks))

    def _wrap(self, obj, name: str, fn) -> None:
        setattr(obj, name, fn)
        self._wrapped.append((obj, name))

    def end_step(self, timed: bool) -> None:
        if timed:
            for k, v in self.step.items():
                self.total[k] += v
            self.events += self._step_events
        self.step = dict.fromkeys(self.step, 0.0)
        self._step_events = []

    def finish(self) -> dict:
        for obj, name in self._wrapped:
            delattr(obj, name)
        if self.events:
            torch.cuda.synchronize()
            self.total["apply"] += sum(s.elapsed_time(e) for s, e in self.events) / 1e3
        return self.total


def run_round(engine: LLMEngine, tag: str, batch: int, tokens: int, constrained: bool) -> dict:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                            structured_outputs={"json": SCHEMA} if constrained else None)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", f"# record {i}\nrecords = ", params)
    split = _Split(engine)
    split.wrap()
    steps: list[float] = []
    while engine.has_unfinished_requests():
        full = _full_decode(engine, batch)
        t = time.perf_counter()
        engine.step()
        if full:
            steps.append(time.perf_counter() - t)
        split.end_step(full)
    total = split.finish()
    return {"steps": steps, "mask_s": total["fill"], "advance_s": total["advance"], "apply_s": total["apply"]}


def run(args, batch: int) -> dict:
    kw = {"cache_memory_gb": 8.0} if args.device == "cuda" else {}
    if args.model:
        # A shapes directory has no tokenizer: the bundled demo model's (same vocabulary size as V4).
        kw.update(model=args.model, load_format=args.load_format, tokenizer=str(demo_model_dir()))
        if args.hf_overrides:
            kw["hf_overrides"] = json.loads(args.hf_overrides)
    engine = LLMEngine.from_engine_args(device=args.device, load_progress=False, block_size=128,
                                        max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * 64),
                                        max_model_len=args.tokens + 256, **kw)
    run_round(engine, "warm-none", batch, args.tokens, False)
    run_round(engine, "warm-json", batch, args.tokens, True)
    got = {False: [], True: []}
    split = dict.fromkeys(("mask_s", "advance_s", "apply_s"), 0.0)
    for r in range(args.rounds):
        for constrained in (False, True):
            out = run_round(engine, f"r{r}-{constrained}", batch, args.tokens, constrained)
            got[constrained] += out["steps"]
            if constrained:
                for k in split:
                    split[k] += out[k]
    none_ms, json_ms = (1e3 * statistics.median(got[c]) for c in (False, True))
    per_step = {f"{k[:-2]}_ms_per_step": 1e3 * v / max(len(got[True]), 1) for k, v in split.items()}
    return {"batch": batch, "steps": len(got[True]), "tpot_none_ms": none_ms, "tpot_json_ms": json_ms,
            "ratio": json_ms / none_ms, **per_step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--hf-overrides", default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args()
    rows = []
    for b in a.batches:
        rows.append(run(a, b))
        print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    # The demo model's files keep their names; a --model run is named after its directory.
    stem = f"structured_tpot_{Path(a.model).name + '_' if a.model else ''}{a.device}"
    model_args = (f" --model {a.model} --load-format {a.load_format}"
                  + (f" --hf-overrides '{a.hf_overrides}'" if a.hf_overrides else "")) if a.model else ""
    (out / f"{stem}.json").write_text(json.dumps({"device": name, "rows": rows}, indent=2))
    lines = [f"# Structured outputs: TPOT with a JSON schema on every request vs none, {a.model or 'demo model'}, "
             f"{name}", "",
             f"`python bench/structured_tpot.py --device {a.device}{model_args} --batches {' '.join(map(str, a.batches))} "
             f"--tokens {a.tokens} --rounds {a.rounds}`", "",
             "| batch | timed steps | TPOT none ms | TPOT json ms | ratio | mask fill host ms/step | "
             "matcher advance host ms/step | mask apply device ms/step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['steps']} | {r['tpot_none_ms']:.2f} | {r['tpot_json_ms']:.2f} | "
                     f"{r['ratio']:.3f} | {r['mask_ms_per_step']:.3f} | {r['advance_ms_per_step']:.3f} | "
                     f"{r['apply_ms_per_step']:.3f} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

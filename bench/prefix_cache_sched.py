"""The multi-turn trace of ``bench/prefix_cache.py`` through the engine's own scheduling on the CPU, no model.

    python bench/prefix_cache_sched.py [--model deepinfer/assets/shapes/v4-flash --layers 4] [--conversations 64]
        [--max-num-seqs 16] [--turns 8] [--first 2048] [--user 1900] [--output 32] [--cache-gb 0.8]
        [--kv-host-cache-gb 16]

The real ``Scheduler``, ``CacheManager`` and host tier (``TierLink``) with the pools the engine would get from
the same arguments (``engine/sizing.py``), and a stand-in step: the planned tokens count as computed and every
draw is a token derived from the request and its position. Hit rates depend on scheduling alone, so they come
out as the GPU run's (the same trace, the same pools, a warm-up pass of another seed first), in seconds. The
stored rows are narrower than the model's (``--row-divisor``) and the host tier is scaled by the same factor,
so it holds as many blocks (up to the blob headers).

Per turn: hits / reusable tokens (as in ``bench/prefix_cache.py``), the best a block-granular cache can do (the
previous turn's computed positions rounded down to a block, less a bounded replay's positions), the hit tokens
whose history came from the tier, and the blocks written down and brought back.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import torch

from deepinfer.assets import demo_model_dir
from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.engine.sequence import RequestState, Sequence, Status
from deepinfer.engine.sizing import build_prefix_hasher, cache_layout, pool_blocks
from deepinfer.kv.manager import CacheManager
from deepinfer.kv.offload import TierLink, move_blocks
from deepinfer.kv.spec import WINDOW, CacheLayout
from deepinfer.kv.storage import KVStorage
from deepinfer.sampling import SamplingParams
from deepinfer.sched.scheduler import Scheduler


def narrow(layout: CacheLayout, divisor: int) -> CacheLayout:
    """The layout with every row ``divisor`` times narrower (the same tails and replay: the same scheduling)."""
    return dataclasses.replace(layout, layers=tuple(
        dataclasses.replace(s, tensors=tuple(dataclasses.replace(t, width=max(1, t.width // divisor)) for t in s.tensors))
        for s in layout.layers))


class SchedOnly:
    """Scheduler, cache manager and tier link as ``LLMEngine`` wires them, stepped without a model."""

    def __init__(self, a) -> None:
        kw = dict(tokenizer=str(demo_model_dir()), device="cpu", dtype="bfloat16", block_size=a.block_size,
                  max_num_seqs=a.max_num_seqs or a.conversations, max_num_batched_tokens=a.batched_tokens,
                  max_model_len=a.max_model_len, cache_memory_gb=a.cache_gb, kv_host_cache_gb=a.kv_host_cache_gb)
        if a.model:
            kw.update(model=a.model, load_format="dummy")
        if a.layers:
            kw["hf_overrides"] = {"num_hidden_layers": a.layers}
        config = EngineConfig.create(EngineArgs.from_kwargs(**kw))
        full = cache_layout(config)
        self.num_blocks = pool_blocks(config, full)
        layout = narrow(full, a.row_divisor)
        self.cache = CacheManager(layout, self.num_blocks)
        self.storage = KVStorage(layout, self.num_blocks, config.dtype)
        tiers = config.cache.tiers
        if tiers.host_bytes:  # as many blocks as the model's rows would fill
            scale = layout.bytes_per_block(WINDOW, 2) / full.bytes_per_block(WINDOW, 2)
            tiers = dataclasses.replace(tiers, host_bytes=int(tiers.host_bytes * scale))
        self.tiers = TierLink.open(tiers, build_prefix_hasher(config), self.storage, replay=self.cache.replay > 0)
        self.scheduler = Scheduler(config.scheduler, self.cache, (config.model.eos_token_id,),
                                   prefix=build_prefix_hasher(config), tiers=self.tiers)
        self.vocab = config.model.vocab_size
        self._arrivals = 0

    def run(self, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, tuple[int, list[int]]]:
        """Submit every prompt at once, step until all have answered: request id -> (cached tokens, output)."""
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        reqs = []
        for rid, ids in prompts.items():
            req = RequestState(rid, None, tuple(ids), params)
            req.seqs.append(Sequence(f"{rid}#0", 0, req, list(ids), len(ids), 0, self._arrivals, None, max_tokens))
            self._arrivals += 1
            self.scheduler.add(req.seqs[0])
            reqs.append(req)
        while self.scheduler.has_work:
            self.step()
        return {r.request_id: (r.num_cached_tokens, r.seqs[0].output_ids) for r in reqs}

    def step(self) -> None:
        """``LLMEngine.step`` without the model: tier saves, replay copies and loads, commit, then the draws."""
        s = self.scheduler.schedule()
        if s.unschedulable:
            raise RuntimeError(f"{len(s.unschedulable)} sequences fit in no cache of these pools")
        move_blocks(self.storage, self.tiers, list(s.saves), s.copies, list(s.loads))
        self.scheduler.commit(s)
        done = []
        for seq, w in zip(s.seqs, s.plan.work):
            seq.num_pending -= w.num_samples
            for _ in range(w.num_samples):
                seq.token_ids.append(random.Random(f"{seq.seq_id}/{seq.num_tokens}").randrange(10, self.vocab))
                if seq.num_output >= seq.max_output:
                    seq.status = Status.FINISHED
                    done.append(seq)
        for seq in sorted(done, key=lambda q: q.arrival):  # the engine removes finished requests in arrival order
            self.scheduler.remove(seq)


def run_trace(a, sim: SchedOnly, seed: int) -> list[dict]:
    """``bench/prefix_cache.py``'s trace (the same prompts for the same seed and vocabulary)."""
    rng = random.Random(seed)
    conv = {f"c{i}": [rng.randrange(10, sim.vocab) for _ in range(a.first)] for i in range(a.conversations)}
    computed = dict.fromkeys(conv, 0)
    rows = []
    sc, link = sim.scheduler, sim.tiers
    for t in range(a.turns):
        before = (sc.prefix_tier_hits, link.saved if link else 0, link.loaded if link else 0)
        out = sim.run({f"{c}-t{t}": ids for c, ids in conv.items()}, a.output)
        row = {"turn": t, "cached": 0, "reusable": 0, "best": 0}
        for c in conv:
            cached, toks = out[f"{c}-t{t}"]
            row["cached"] += cached
            row["reusable"] += computed[c]
            if computed[c] >= a.block_size:
                row["best"] += computed[c] // a.block_size * a.block_size - sim.cache.replay
            computed[c] = len(conv[c]) + len(toks) - 1
            conv[c] = conv[c] + toks + [rng.randrange(10, sim.vocab) for _ in range(a.user)]
        after = (sc.prefix_tier_hits, link.saved if link else 0, link.loaded if link else 0)
        row.update(zip(("tier_hits", "saved", "loaded"), (x - y for x, y in zip(after, before))))
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (its config.json only; default: the demo model)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first", type=int, default=512)
    p.add_argument("--user", type=int, default=256)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--cache-gb", type=float, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --conversations (all at once)")
    p.add_argument("--kv-host-cache-gb", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--row-divisor", type=int, default=64, help="stored rows this many times narrower than the model's")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up pass of another seed")
    a = p.parse_args()
    t0 = time.perf_counter()
    sim = SchedOnly(a)
    if not a.no_warmup:
        run_trace(a, sim, a.seed + 1)
    rows = run_trace(a, sim, a.seed)
    print(f"pool blocks {sim.num_blocks}; {time.perf_counter() - t0:.1f} s")
    print("| turn | hit / reusable | best (block-rounded) | hit tokens | of them from the tier | blocks saved | loaded |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rate = f"{r['cached'] / r['reusable']:.1%}" if r["reusable"] else "-"
        best = f"{r['best'] / r['reusable']:.1%}" if r["reusable"] else "-"
        print(f"| {r['turn']} | {rate} | {best} | {r['cached']} | {r['tier_hits']} | {r['saved']} | {r['loaded']} |")


if __name__ == "__main__":
    main()

"""Scheduler: one token-count abstraction for prefill chunks and decode steps.

Each step has a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``).
Running sequences are served first, decodes before unfinished prefills, then waiting sequences in
arrival order (FCFS, no skipping ahead). A sequence whose next tokens do not fit in the cache triggers
preemption by recompute of the most recently arrived running sequence not already planned this step;
a preempted sequence keeps its generated tokens and is recomputed later, so with seeded sampling its
output is unchanged. The cache is never overcommitted, so a full cache never crashes the engine.

With async scheduling the scheduler plans step N+1 before step N's tokens reach the host: a sequence's
``num_pending`` tokens are drawn on the device but not yet known here. They count as known tokens for
planning (the runner feeds them forward itself as placeholders), and a sequence whose generated plus
pending tokens already reach its limit is not planned again.

With speculative decoding (``speculative``) a decoding sequence also feeds the drafts the MTP layer proposed
in its previous step: its work is its last token plus up to k drafts, drawn at every position (the
runner verifies), and asks for the next step's drafts. The blocks it allocates also cover the positions
the MTP chain writes past the step (DSpark writes none: its context rows are the step's own positions).
After the step the engine rolls the rejected drafts back (``rollback``: the cache is position-addressed,
so that is "set the length").

Both together (async scheduling with speculation): a sequence whose verify step is in flight is planned as
if all of its drafts were accepted: its inputs are placeholders (the step's last emitted token and the
``pending_drafts`` it proposed, which the runner takes from the device) at the positions full acceptance
gives; the runner moves them back by the rejected drafts on the device, and the engine's ``rollback`` of
the step in flight moves the host's lengths back once its results arrive. The cache's rollback slack covers
two such steps (``engine/sizing.py``).

With prefix caching (``prefix``, a ``BlockHasher``) a sequence admitted from the queue first looks up the
longest cached prefix of its known tokens (leaving at least one to compute) and starts there; each
commit names the sequence's newly completed full blocks so that they stay cached after release. Requests
asking for prompt logprobs skip the lookup (the cached positions would have none). The later samples of an
``n > 1`` request wait in the queue until the first sample has computed the prompt's full blocks, then hit.
With cache tiers (``tiers``) the lookup also finds blocks in host memory or on disk: their payloads are
fetched (and checked) at admission, and the schedule carries them (``loads``) with the cached blocks its
allocations evicted (``saves``), for the engine to apply before the step. Those evicted blocks reach the tiers
only then, so a lookup later in the same plan counts them as held and its admission waits for the next plan
(``sched/evictions.py``: under lockstep multi-turn traffic LRU evicts exactly the next conversations' blocks,
often in the plan that admits them). A hit whose boundary kept its window blocks but not its compressor
state is a bounded replay: the sequence starts a few positions early
(``PrefixHit.start``), its first step emits no compressed entry before the boundary (``SeqWork.emit_from``),
and the block it rewrites is private: a copy of a device block (``copies``, applied by the engine before
the step) or a block loaded from a tier. With replay the tiers hold no state blocks at all (``TierLink.pools``),
so a boundary whose state block left the device comes back from a tier as a replay.

``schedule()`` returns a ``Schedule``: the self-contained ``StepPlan`` for the runner (``sched/plan.py``)
plus the live sequences it covers, for the engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from deepinfer.config.engine import SchedulerConfig
from deepinfer.config.speculative import SpeculativeConfig
from deepinfer.engine.sequence import Sequence, Status
from deepinfer.frozen_init import fast_init
from deepinfer.kv.manager import CacheManager, PrefixHit
from deepinfer.kv.offload import TierLink
from deepinfer.kv.prefix_hash import BlockHasher
from deepinfer.kv.spec import HISTORY
from deepinfer.sched.draft_length import draft_length
from deepinfer.sched.evictions import PlanEvictions
from deepinfer.sched.plan import JoinedSeq, PromptLogprobJob, SeqSampling, SeqWork, StepPlan, TableEdit


@fast_init  # deepinfer/frozen_init.py (one a step)
@dataclass(frozen=True, slots=True)
class Schedule:
    plan: StepPlan
    seqs: tuple[Sequence, ...]  # seqs[i] is the sequence of plan.work[i]
    preempted: tuple[Sequence, ...] = ()
    # Sequences that cannot fit even in an otherwise empty cache; the engine ends them ("length").
    unschedulable: tuple[Sequence, ...] = ()
    # Cache tiers (``kv/offload.py``), both applied before the step runs, saves first: cached blocks this
    # plan evicts (pool, block, hash) and blocks of prefix hits to fill from a tier (pool, block, payload).
    saves: tuple[tuple[str, int, bytes], ...] = ()
    loads: tuple[tuple[str, int, bytes], ...] = ()
    # Bounded replay of prefix hits: (pool, source block, new block) to copy before the step (after saves).
    copies: tuple[tuple[str, int, int], ...] = ()

    @property
    def empty(self) -> bool:
        return self.plan.empty


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager, eos_token_ids: tuple[int, ...] = (),
                 speculative: SpeculativeConfig | None = None, prefix: BlockHasher | None = None,
                 tiers: TierLink | None = None) -> None:
        self.config = config
        self.prefix = prefix
        self.tiers = tiers  # a TierLink; with several ranks, its stand-in executor/remote_tiers.py's RemoteTiers
        if tiers is not None:
            cache.record_evictions()
        self._loads: list[tuple[str, int, bytes]] = []
        self._copies: list[tuple[str, int, int]] = []
        self.speculative = speculative
        self.cache = cache
        self.eos_token_ids = tuple(eos_token_ids)
        cache.track_edits()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # lifetime counter (metrics, tests)
        # Prefix-cache lifetime counters, in tokens: looked up at admission, and found cached.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prefix_tier_hits = 0  # of those, tokens whose history blocks came from a lower tier
        self.prefix_replayed = 0  # positions recomputed by bounded replays (not counted as hits)
        self._left: list[str] = []  # sequences that left the runner's batch since the last plan

    # ---- membership -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        if self.tiers is not None and seq.index == 0 and seq.request.params.prompt_logprobs is None:
            # While it waits, warm host memory with the prompt's blocks the disk holds (background reads).
            self.tiers.prefetch(self._chain(seq, seq.num_tokens - 1))

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and release its cache blocks immediately."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.cache:
            self.cache.free(seq.seq_id)
            self._left.append(seq.seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning -------------------------------------------------------------------------------------
    def schedule(self) -> Schedule:
        budget = self.config.max_num_batched_tokens
        planned: list[Sequence] = []
        work: list[SeqWork] = []
        joined: list[JoinedSeq] = []
        preempted: list[Sequence] = []
        # Without an MTP chain writing past the step a sequence's extent is its token count, and a decode
        # step's blocks usually cover it already: both checked inline (once per running sequence per step).
        plain = self.speculative is None or not self.speculative.writes_past_step
        covers, can_allocate = self.cache.covers, self.cache.can_allocate
        for seq, wanted in self._running_order():
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(wanted, budget)
            extent = n if plain else self._extent(seq, n)
            # Covered (the usual decode step): nothing to check, and nothing for ``_take`` to allocate.
            covered = covers(seq.seq_id, extent)
            if covered or can_allocate(seq.seq_id, extent) or self._make_room(seq, extent, planned, preempted):
                work.append(self._take(seq, n, covered))
                planned.append(seq)
                budget -= n
        evicted = PlanEvictions(self.cache, self.tiers)
        while budget and self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted with a token still in flight: resumable once that token is known
            if self._sibling_computing(seq):
                break  # its prompt's blocks are being computed by sample 0: hit them next step
            hit = self._lookup(seq, evicted)
            if hit is not None and evicted.needed_by(hit):
                break  # its blocks reach the tiers with this plan's saves: it hits them there next step
            seq.num_computed = hit.start if hit else 0
            n = min(seq.num_tokens - seq.num_computed, budget)
            extent = self._extent(seq, n)
            if not (self.cache.can_admit(hit, extent) if hit else self.cache.can_allocate(seq.seq_id, extent)):
                seq.num_computed = 0
                break  # FCFS: a later, smaller request does not overtake
            payloads = self._fetch(hit) if hit and hit.loads else {}
            if payloads is None:  # an object went missing or failed its check (now deleted): look up again
                seq.num_computed = 0
                continue
            self._count_hit(seq, hit)
            if hit:
                admission = self.cache.admit(seq.seq_id, hit, extent)
                self._loads += [(p, b, payloads[(p, h)]) for p, b, h in admission.fills]
                self._copies += admission.copies
                seq.emit_from = hit.num_tokens if hit.replay else 0
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            joined.append(self._joined(seq))
            work.append(self._take(seq, n))
            planned.append(seq)
            budget -= n
        stuck: tuple[Sequence, ...] = ()
        if not planned and not self.running and self.waiting and not self.waiting[0].num_pending:
            stuck = (self.waiting.popleft(),)
        left, self._left = tuple(self._left), []
        edits = tuple(TableEdit(*e) for e in self.cache.drain_edits())
        plan = StepPlan(tuple(work), tuple(joined), left, edits)
        saves = evicted.drain()
        loads, self._loads = tuple(self._loads), []
        copies, self._copies = tuple(self._copies), []
        return Schedule(plan, tuple(planned), tuple(preempted), stuck, saves, loads, copies)

    # ---- prefix cache ---------------------------------------------------------------------------------
    def _chain(self, seq: Sequence, num_tokens: int) -> tuple[bytes, ...]:
        """The hash chain of the sequence's first ``num_tokens // block_size`` blocks (extended as needed)."""
        nb = num_tokens // self.prefix.block_size
        if nb > len(seq.block_hashes):
            seq.block_hashes = self.prefix.chain(seq.token_ids[: nb * self.prefix.block_size],
                                                 seq.request.cache_salt, known=seq.block_hashes)
        return seq.block_hashes[:nb]

    def _lookup(self, seq: Sequence, evicted: PlanEvictions | None = None) -> PrefixHit | None:
        """The longest usable hit for the sequence. ``evicted``: blocks the plan being made has evicted so far
        count as held by the tiers, which they reach with the plan's saves (``PlanEvictions``)."""
        if self.prefix is None or seq.request.params.prompt_logprobs is not None:
            return None
        # At least one token is computed: the step that brings the sequence up to date draws from its logits.
        limit = seq.num_tokens - 1
        chain = self._chain(seq, limit)
        in_tier = None
        if self.tiers is not None:
            in_tier = self.tiers.probe(chain)
            if evicted is not None:
                in_tier = evicted.probe(in_tier)
        return self.cache.match_prefix(chain, limit, in_tier)

    def _fetch(self, hit: PrefixHit) -> dict[tuple[str, bytes], bytes] | None:
        """Payloads of the hit's blocks in a lower tier; None when one is gone or unusable. (With several
        ranks, ``executor/remote_tiers.py``: the payloads stay in the ranks and these are their keys.)"""
        return self.tiers.fetch_all([(pool, h) for pool, _, h in hit.loads])

    def cached_prefix(self, seq: Sequence) -> int:
        """Tokens of the sequence a lookup in this scheduler's cache would find now (routing across ranks)."""
        hit = self._lookup(seq)
        return hit.num_tokens if hit else 0

    def _count_hit(self, seq: Sequence, hit: PrefixHit | None) -> None:
        if self.prefix is None:
            return
        cached = hit.start if hit else 0
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += cached
        self.prefix_replayed += hit.replay if hit else 0
        if hit:
            self.prefix_tier_hits += sum(self.prefix.block_size for p, _, _ in hit.loads if p == HISTORY)
        if seq.index == 0 and seq.request.num_cached_tokens is None:  # the request's first admission
            seq.request.num_cached_tokens = cached

    def _sibling_computing(self, seq: Sequence) -> bool:
        """A later sample of an n > 1 request whose first sample is still computing full prompt blocks."""
        if self.prefix is None or seq.index == 0 or seq.num_output or seq.request.params.prompt_logprobs is not None:
            return False
        first = seq.request.seqs[0]
        shared = (seq.num_prompt - 1) // self.prefix.block_size * self.prefix.block_size
        return first.status is Status.RUNNING and first.num_computed < shared

    def _wanted(self, seq: Sequence) -> int:
        """New tokens the sequence could compute now: 0 when its in-flight tokens already reach its limit."""
        known = len(seq.token_ids)
        if seq.num_pending and known - seq.num_prompt + seq.num_pending >= seq.max_output:
            return 0
        return known + seq.num_pending - seq.num_computed + len(self._drafts(seq)) + self._pending_drafts(seq)

    # Drafts are verified and proposed up to the output limit and past it: a sequence near its limit keeps
    # the k drafts of every other one, so each sequence of a verify step has k + 1 inputs and the step replays
    # a CUDA graph (a step with a shorter sequence runs eagerly, several times slower). Tokens past the limit
    # are drawn and dropped (``append_token`` ends the sequence at its max_output-th); the ones before it are
    # the same, since a position's draw reads only the positions before it.

    def _drafts(self, seq: Sequence) -> tuple[int, ...]:
        """The drafts a decoding sequence verifies this step (all it has)."""
        if not seq.drafts or seq.num_pending or seq.num_computed != seq.num_tokens - 1:
            return ()
        return seq.drafts

    def _pending_drafts(self, seq: Sequence) -> int:
        """The drafts a sequence whose verify step is in flight verifies this step: those the step proposes,
        still on the device."""
        if (self.speculative is None or not seq.num_pending
                or seq.num_computed != seq.num_tokens + seq.num_pending - 1):
            return 0
        return seq.pending_drafts

    def _proposals(self, seq: Sequence, n: int, draws: int) -> int:
        """Drafts the MTP layer proposes after a step of ``n`` inputs that draws ``draws`` tokens."""
        spec = self.speculative
        if spec is None or not draws:
            return 0
        want = draft_length(seq.draft_acceptance, spec.num_speculative_tokens) if spec.length_by_rate else \
            spec.num_speculative_tokens
        # The next verify step feeds the drawn token at first + n and the drafts after it, so the last draft's
        # position first + n + proposals stays inside the model length, as a slot's block table holds no more
        # (past the output limit they are proposed all the same: see above). The MTP chain's rows, up to
        # first + n + proposals - 2, are inside it then too.
        room = self.config.max_model_len - 1 - (seq.num_computed + n)
        return max(0, min(want, room))

    def _extent(self, seq: Sequence, n: int) -> int:
        """Positions to allocate for a step of ``n`` inputs: those plus the MTP chain's rows past them."""
        if self.speculative is None or not self.speculative.writes_past_step:
            return n
        draws = self._num_draws(seq, n)
        return n + max(0, self._proposals(seq, n, draws) - 1)

    @staticmethod
    def _num_draws(seq: Sequence, n: int) -> int:
        known = seq.num_tokens + seq.num_pending
        first = seq.num_computed
        if first + n < known:
            return 0
        return 1 + first + n - known  # the last token's draw plus one per draft

    def _running_order(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens it wants): decodes first, then unfinished prefills."""
        if self.speculative is None:
            # ``_wanted`` inline (no drafts without speculation): this runs for every running sequence every step.
            decodes, prefills = [], []
            for s in self.running:
                known, pending = len(s.token_ids), s.num_pending
                if pending and known - s.num_prompt + pending >= s.max_output:
                    continue  # its in-flight tokens reach its limit: it wants nothing
                n = known + pending - s.num_computed
                if n == 1:
                    decodes.append((s, 1))
                elif n:
                    prefills.append((s, n))
            return decodes + prefills
        wanted = [(s, self._wanted(s), s.num_tokens + s.num_pending - s.num_computed == 1) for s in self.running]
        return [(s, n) for s, n, decode in wanted if decode and n] + [(s, n) for s, n, decode in wanted
                                                                       if not decode and n]

    def _joined(self, seq: Sequence) -> JoinedSeq:
        sampling = SeqSampling.of(seq.params, seq.seed, self.eos_token_ids)
        prompt = tuple(seq.token_ids[: seq.num_prompt]) if sampling.repetition_penalty != 1.0 else ()
        return JoinedSeq(seq.seq_id, sampling, seq.num_prompt, prompt, tuple(seq.output_ids))

    def _take(self, seq: Sequence, n: int, covered: bool = False) -> SeqWork:
        """The sequence's work item for ``n`` new tokens, with its blocks allocated (``covered``: the caller found
        them allocated already: the allocation is ``_extent(seq, n)`` positions)."""
        first, known = seq.num_computed, seq.num_tokens
        tokens = tuple(seq.token_ids[first : min(first + n, known)])
        emit_from = seq.emit_from if first < seq.emit_from else 0
        if self.speculative is None:
            if not covered:
                self.cache.allocate(seq.seq_id, n)
            samples = 1 if first + n == known + seq.num_pending else 0
            job = None if seq.request.params.prompt_logprobs is None else self._prompt_job(seq, first, n)
            # Every field in order (no keyword): built for every running sequence of every step.
            return SeqWork(seq.seq_id, first, tokens, n - len(tokens), samples, job, (), 0, 0, -1, emit_from)
        if seq.num_pending:  # its step in flight drew every input: the last emitted token, then the drafts
            drafts, num_drafts = (), min(self._pending_drafts(seq), n - 1)
        else:
            drafts = self._drafts(seq)[: max(0, first + n - known)]  # the budget may cut drafts off
            num_drafts = len(drafts)
        samples = self._num_draws(seq, n)
        proposals = self._proposals(seq, n, samples)
        chain = max(0, proposals - 1) if self.speculative.writes_past_step else 0  # the MTP chain's rows
        if not covered:
            self.cache.allocate(seq.seq_id, n + chain)  # n + chain == _extent(seq, n)
        nxt = -1 if samples else seq.token_ids[first + n]
        return SeqWork(seq.seq_id, first, tokens + drafts, n - len(tokens) - len(drafts), samples,
                       self._prompt_job(seq, first, n), num_drafts=num_drafts, num_proposals=proposals,
                       next_token=nxt, emit_from=emit_from)

    def _prompt_job(self, seq: Sequence, first: int, n: int) -> PromptLogprobJob | None:
        req = seq.request
        if req.params.prompt_logprobs is None or seq.index != 0:
            return None
        # Position p predicts prompt token p + 1; only positions not already planned (preemption).
        lo = max(first, req.prompt_logprobs_planned)
        hi = min(first + n, seq.num_prompt - 1)
        if lo >= hi:
            return None
        req.prompt_logprobs_planned = hi
        return PromptLogprobJob(lo - first, lo + 1, tuple(seq.token_ids[lo + 1 : hi + 1]), req.params.prompt_logprobs)

    def _make_room(self, seq: Sequence, n: int, planned: list[Sequence], preempted: list[Sequence]) -> bool:
        while not self.cache.can_allocate(seq.seq_id, n):
            planned_seqs = set(planned)
            victims = [s for s in self.running if s not in planned_seqs]
            victim = max(victims, key=lambda s: s.arrival)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        self._left.append(seq.seq_id)
        seq.num_computed = 0
        seq.drafts = ()
        seq.emit_from = 0
        seq.status = Status.WAITING
        # Back to the head of the queue in arrival order, ahead of everything that arrived later.
        items = sorted([*self.waiting, seq], key=lambda s: s.arrival)
        self.waiting = deque(items)

    def rollback(self, seq: Sequence, num_rejected: int) -> None:
        """Forget the cache rows of a step's last ``num_rejected`` inputs (rejected drafts): every pool is
        position-addressed, so the rows past the new length are simply rewritten later. A sequence preempted
        while the step was in flight (async scheduling) holds no cache to roll back."""
        if num_rejected and seq.status is Status.RUNNING:
            seq.num_computed -= num_rejected
            self.cache.truncate(seq.seq_id, seq.num_computed)

    # ---- after the step -------------------------------------------------------------------------------
    def commit(self, schedule: Schedule) -> None:
        """The planned tokens are computed (or queued on the device, which computes them in order): advance
        each sequence, settle its cache length, and count the tokens it draws as pending until applied."""
        prefix, commit = self.prefix, self.cache.commit
        block_size = prefix.block_size if prefix is not None else 0
        for seq, w in zip(schedule.seqs, schedule.plan.work):
            seq.num_computed += len(w.token_ids) + w.num_placeholders  # w.num_tokens, inline
            seq.num_pending += w.num_samples
            if w.num_samples:
                seq.pending_drafts = w.num_proposals
            # Name the full blocks whose tokens are final (drafts and in-flight draws are not in token_ids).
            if prefix is None:
                hashes = ()
            else:
                hashes = seq.block_hashes
                if min(seq.num_computed, len(seq.token_ids)) // block_size != len(hashes):
                    # (Equal, the usual decode step: ``_chain`` would return the chain as it is.)
                    hashes = self._chain(seq, min(seq.num_computed, len(seq.token_ids)))
            commit(seq.seq_id, seq.num_computed, hashes)

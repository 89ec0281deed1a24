"""LLMEngine: the request lifecycle around one model. ``step()`` is the whole loop body:

    schedule N -> runner.submit(plan N) -> commit N -> apply the results of N (sync) or of N-1 (async)

With async scheduling (``async_scheduling=True``) the host plans and submits step N+1 before reading step N's tokens, so
the device never waits for detokenization, stop checks or streaming: a sequence's token from step N is a
placeholder in step N+1 that the device fills itself. Draws are keyed by (seed, position), so the tokens
are those of the synchronous loop; a stop found one step late costs one discarded token of that sequence
(it is freed, and the extra draw's result is ignored).

With speculative decoding (``speculative_config``) a step verifies each decoding sequence's drafts and
returns its accepted tokens plus the next drafts; applying it rolls the rejected drafts back
(``Scheduler.rollback``) before the tokens go through the usual stop checks one by one, so a stop or
``max_tokens`` reached mid-draft ends the sequence there and the rest is dropped.

Both together (one device): step N+1 is planned while verify step N runs, as if N's drafts were all
accepted: a decoding sequence's inputs are placeholders (N's last emitted token and the drafts N proposes,
filled on the device) at the positions full acceptance gives, and the device moves that step back by N's
rejected drafts (``runner/step_shift.py``); applying N then rolls the host's lengths back by as much. So the
host's work on N's results overlaps N+1's verification, and the tokens are the synchronous loop's. A step
whose sequences need N's tokens to be planned exactly (grammars, penalties, a pending ``min_tokens``) takes
the synchronous order (``_apply_first``): N is applied before N+1 is planned.

Structured outputs: the runner asks for the step's grammar masks once its forward is launched
(``_StepGrammar.masks``); under async scheduling a constrained batch's step N-1 is applied right there,
before N's masks, since they need its tokens. The matchers take the accepted tokens as they are applied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.config.v41 import V41Config
from deepinfer.engine.intake import Intake
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.progress import abort, append_token, build_output, finish, to_position_logprobs
from deepinfer.engine.sequence import RequestState, Status
from deepinfer.engine.sizing import build_cache, build_prefix_hasher
from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.engine.warm_up import warm_up
from deepinfer.kv.block_budget import cdiv
from deepinfer.kv.offload import TierLink, move_blocks
from deepinfer.model.loader import load_model
from deepinfer.model.device import use_op_table
from deepinfer.model.draft_head import attach_draft_head
from deepinfer.ops.table import REF
from deepinfer.ops.table import select as select_ops
from deepinfer.runner.cuda_graphs import DecodeGraphs, default_sizes
from deepinfer.runner.input_batch import InputBatch
from deepinfer.runner.model_runner import ModelRunner, StepHandle
from deepinfer.runner.mtp_graphs import MTPGraphs
from deepinfer.sched.draft_length import update_rate
from deepinfer.sched.scheduler import Schedule, Scheduler
from deepinfer.structured.step_masks import mask_source, with_plan_masks
from deepinfer.tokenizer import Tokenizer

log = logging.getLogger("deepinfer")
FINISHED = Status.FINISHED


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.tokenizer_dir)
        # CUDA: quantized-first, straight into the Triton kernels' layout; the CPU runs the reference ops (the
        # batch-invariant ones with DEEPINFER_BATCH_INVARIANT=1), on the reference model's dequantized weights.
        ops = select_ops(config.device, config.batch_invariant)
        cuda = config.device == "cuda"
        if isinstance(config.model, V41Config):
            # DeepSeek-V4.1: its own batched step over the same paged cache (model/v41/paged.py); on CUDA built
            # quantized-first there (model/v41/device.py).
            self.model = load_v41_step(config, ops if cuda else None)
        else:
            self.model = load_model(config.model_dir, dtype=config.dtype, device=config.device, strict_mtp=False,
                                    progress=config.load_progress, ops=ops if cuda else None, cfg=config.model,
                                    load_format=config.load_format, seed=config.seed)
        if not cuda and ops is not REF:
            use_op_table(self.model, ops)
        if config.speculative is not None and config.speculative.fp8_draft_head(config.device):
            attach_draft_head(self.model, ops)  # before the cache takes what memory is left, and before graphs
        log.info("%s", mode_line(config, ops))
        self.cache, self.storage, self.facts = build_cache(config, self.model)
        mc, sc = config.model, config.scheduler
        prefix = build_prefix_hasher(config)
        # Host-memory / disk tiers below the device pools (None when not asked for). A step allocates, hence
        # evicts, about a block per budgeted block of tokens plus one per sequence: the staging ring's unit.
        step_blocks = cdiv(sc.max_num_batched_tokens, config.cache.block_size) + sc.max_num_seqs
        self.tiers = TierLink.open(config.cache.tiers, prefix, self.storage, replay=self.cache.replay > 0,
                                   step_blocks=step_blocks)
        self.scheduler = Scheduler(sc, self.cache, (mc.eos_token_id,), config.speculative, prefix, self.tiers)
        graphs = mtp_graphs = None
        if config.device == "cuda" and not config.enforce_eager:
            sizes = default_sizes(sc.max_num_seqs)
            if config.speculative is None:
                graphs = DecodeGraphs(self.model, self.storage, sc.max_model_len, sizes)
                graphs.capture()
            else:  # verify steps of k drafts per sequence, and the MTP layer's passes
                graphs = DecodeGraphs(self.model, self.storage, sc.max_model_len, sizes,
                                      tokens_per_seq=config.speculative.num_speculative_tokens + 1, keep_streams=True)
                graphs.capture()
                mtp_graphs = MTPGraphs(self.model, self.storage, graphs, sc.max_model_len, sizes)
                mtp_graphs.capture()
        # Async speculation: the batch keeps each slot's drafts and shift for the step planned behind it.
        async_drafts = config.speculative.num_speculative_tokens if config.speculative and config.async_scheduling \
            else 0
        self.input_batch = InputBatch(sc.max_num_seqs, cdiv(sc.max_model_len, config.cache.block_size),
                                      mc.vocab_size, config.device, max_drafts=async_drafts)
        drafter = None
        if config.speculative is not None and config.speculative.method == "dspark":
            from deepinfer.runner.dspark import DSparkDrafter

            drafter = DSparkDrafter(self.model, self.storage, self.input_batch, config.speculative.varlen)
        self.runner = ModelRunner(self.model, self.storage, self.input_batch, graphs,
                                  speculative=config.speculative is not None, mtp_graphs=mtp_graphs, drafter=drafter)
        self.spec_stats = SpecDecodeStats(config.speculative.num_speculative_tokens if config.speculative else 0)
        self.async_scheduling = config.async_scheduling
        self._inflight: tuple[Schedule, StepHandle] | None = None  # async: submitted, results not applied
        max_cached = self.facts.num_blocks["history"] * config.cache.block_size
        image_id = mc.image_token_id if isinstance(mc, V41Config) else None  # text only: no vision encoder yet
        self.intake = Intake(self.tokenizer, mc.vocab_size, config.scheduler.max_model_len, max_cached, mc.eos_token_id,
                             refused_token_id=image_id, pin_masks=cuda)
        self.requests: dict[str, RequestState] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        # What step() returns per request it touched: cumulative RequestOutputs by default; the server's engine
        # core installs a builder of deltas (server/output_wire.DeltaBuilder) and sends those as they are.
        self.build_output = build_output
        if config.warm_up:
            warm_up(self)

    @classmethod
    def from_engine_args(cls, args: EngineArgs | None = None, **kwargs: Any) -> "LLMEngine":
        return cls.from_config(EngineConfig.create(args or EngineArgs.from_kwargs(**kwargs)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        """The engine for ``config``: this class on one device, the executor's over a world of ranks."""
        if not config.parallel.is_single:  # one worker process per device (deepinfer/executor/)
            from deepinfer.executor.engine import launch_engine

            return launch_engine(config)
        return cls(config)

    def close(self) -> None:
        """Release what the engine holds beyond memory: the cache tiers (written down to the disk tier, so a
        restart finds them) and the parallel engine's worker processes."""
        if self.tiers is not None:
            self.tiers.close(self.cache.cached_blocks())
            self.tiers = None

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Any, sampling_params: Any = None) -> None:
        """Queue a request. Raises ValueError (naming the field) for invalid input; the engine is unaffected."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        req = self.intake.build(request_id, prompt, sampling_params)
        self.requests[request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their cache blocks; a final output with finish_reason 'abort' follows."""
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            req = self.requests.pop(rid, None)
            if req is not None:
                self._pending.append(abort(req, self.scheduler.remove, self.build_output))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the loop body --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        touched: set[str] = set()
        late = None
        if self._inflight is not None and self.config.speculative is not None and self._apply_first():
            # The synchronous order for this step: the step in flight is applied before the next is planned.
            current, self._inflight = self._inflight, None
            applied = self._apply(*current)
            touched |= applied
            for rid in applied:
                for seq in self.requests[rid].seqs if rid in self.requests else ():
                    if seq.finished:
                        self.scheduler.remove(seq)
        # No structured request yet (no grammar backend): no sequence has a grammar, none is looked for.
        constrained = self.intake.grammars is not None
        if self._inflight is not None and constrained and any(s.grammar is not None for s in self.scheduler.running):
            # A grammar's next mask needs the token in flight: that step is applied once this one's forward is
            # launched, just before the masks are computed (the device runs the forward meanwhile).
            late, self._inflight = self._inflight, None
        schedule = self.scheduler.schedule()
        for seq in schedule.unschedulable:
            finish(seq, "length")
        touched |= {seq.request.request_id for seq in schedule.unschedulable}
        move_blocks(self.storage, self.tiers, list(schedule.saves), schedule.copies, list(schedule.loads))
        grammar = _StepGrammar(self, schedule, late)
        # An empty plan still carries departures; grammar masks are computed once the forward is launched.
        handle = self.runner.submit(schedule.plan, grammar.masks if grammar.needed else None)
        touched |= grammar.settle()
        self.scheduler.commit(schedule)
        current = None if schedule.empty else (schedule, handle)
        if self.async_scheduling:
            current, self._inflight = self._inflight, current
        if current is not None:
            touched |= self._apply(*current)
        build, remove = self.build_output, self.scheduler.remove
        for rid, req in [item for item in self.requests.items() if item[0] in touched]:  # arrival order
            done = True  # req.finished, read in the same pass
            for seq in req.seqs:
                if seq.status is FINISHED:
                    remove(seq)
                else:
                    done = False
            outputs.append(build(req))
            if done:
                del self.requests[rid]
        return outputs

    def _apply_first(self) -> bool:
        """Async speculation: whether the step in flight must be applied before the next step is planned,
        because a sequence's next step depends on its tokens in a way the device cannot fix up by moving
        positions: a grammar's masks (per draft, and computed while a step is being submitted, too late to
        roll back), penalties (the counts include the drafts before each draw), a pending ``min_tokens``
        (its mask depends on the draw's output index)."""
        for seq in self.scheduler.running:
            if seq.grammar is not None:
                return True
            if seq.num_pending:
                p = seq.params
                if (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                        or seq.num_output < p.min_tokens):
                    return True
        return False

    def _with_grammar_masks(self, schedule: Schedule) -> Schedule:
        """The schedule with each constrained draw's allowed-token mask in its work item (the parallel engine:
        its plans cross to the ranks whole)."""
        return with_plan_masks(self.intake.grammars, schedule)

    def _apply(self, schedule: Schedule, handle: StepHandle) -> set[str]:
        """Fold a finished step's results into its sequences (waits for them to reach the host)."""
        result = handle.result()
        touched: set[str] = set()
        eos = self.config.model.eos_token_id
        speculative = self.config.speculative is not None
        decode_one = self._decode_one
        # seq_id -> (sequence, its work item): one lookup per sampled sequence.
        planned = {w.seq_id: (seq, w) for seq, w in zip(schedule.seqs, schedule.plan.work)}
        for chunk in result.prompt_logprobs:
            req = planned[chunk.seq_id][0].request
            if req.request_id in self.requests:
                req.prompt_logprobs.extend(self._position_logprobs(chunk.values))
        advance = []  # (sequence, token): a single accepted token each, fed to the grammars in one call below
        if result.plain is not None:  # a plain decode step: what the loop below does for one token, no drafts
            for seq_id, token in zip(*result.plain):
                seq, w = planned[seq_id]
                seq.num_pending -= w.num_samples
                if seq.status is FINISHED:  # a stop found after this step was planned (async): its draw is dropped
                    continue
                if speculative and w.num_samples:
                    seq.draft_acceptance = update_rate(seq.draft_acceptance, 0, 0)
                seq.drafts = ()
                append_token(seq, token, None, eos, decode_one)
                touched.add(seq.request.request_id)
                if seq.grammar is not None and not seq.finished:
                    if seq.grammar_after is None:
                        advance.append((seq, token))
                    elif token == seq.grammar_after:
                        seq.grammar_after = None
        for s in result.sampled:
            seq, w = planned[s.seq_id]
            seq.num_pending -= w.num_samples
            if seq.finished:  # a stop found after this step was planned (async): its draws are dropped
                continue
            if w.num_drafts:
                accepted = len(s.token_ids) - 1
                self.spec_stats.observe(w.num_drafts, accepted)
                seq.draft_acceptance = update_rate(seq.draft_acceptance, w.num_drafts, accepted)
                self._rollback(seq, w.num_drafts - accepted)  # rejected drafts leave the cache
            elif speculative and w.num_samples:
                seq.draft_acceptance = update_rate(seq.draft_acceptance, 0, 0)
            seq.drafts = s.drafts
            for token, lp in zip(s.token_ids, s.logprobs):
                if seq.status is FINISHED:  # a stop mid-draft: the rest is dropped
                    break
                append_token(seq, token, lp, eos, decode_one)
                touched.add(seq.request.request_id)
                if seq.grammar is not None and not seq.finished:
                    if seq.grammar_after is None:
                        advance.append((seq, token))
                        if len(s.token_ids) > 1:  # the next token's stop check needs this one's grammar state
                            self._advance_grammars(advance)
                            advance = []
                    elif token == seq.grammar_after:  # the reasoning ended: the answer is constrained
                        seq.grammar_after = None
        if advance:  # sequences are independent: advancing them together changes no token
            self._advance_grammars(advance)
        return touched

    def _rollback(self, seq, num_rejected: int) -> None:
        """Drop a sequence's rejected drafts from its cache (the parallel engine: on its DP rank's scheduler)."""
        self.scheduler.rollback(seq, num_rejected)

    def _advance_grammars(self, advance: list) -> None:
        """Feed each sequence's grammar its accepted token (``advance``: (sequence, token), distinct sequences;
        several in one call on llguidance's thread pool); end a sequence when its grammar allows nothing more."""
        ok = self.intake.grammars.consume([seq.grammar for seq, _ in advance], [t for _, t in advance])
        for (seq, token), good in zip(advance, ok):
            g = seq.grammar
            if not good or g.is_error():
                # Only reachable when another mask (min_tokens) left no token the grammar allows.
                log.warning("%s: token %d breaks its output constraint (%s); stopping", seq.seq_id, token,
                            g.get_error())
                finish(seq, "stop")
            elif g.is_stopped():
                finish(seq, "stop")

    def _position_logprobs(self, values):
        return [to_position_logprobs(v, self._decode_one) for v in values]

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def load_v41_step(config: EngineConfig, ops=None, keep=None):
    """The engine's DeepSeek-V4.1 model (``model/v41/paged.PagedV41``) as ``config`` asks for it; ``ops``: built
    quantized-first on the device with that op table; ``keep``: a rank's share (``model/v41/parallel.shard_v41``)."""
    from deepinfer.model.v41.paged import load_paged_v41

    return load_paged_v41(config.model_dir, config.model, config.dtype, config.cache.released_formats,
                          dspark=config.speculative is not None, decoder_replay=config.v41_decoder_replay,
                          load_format=config.load_format, seed=config.seed, tokenizer_dir=config.tokenizer_dir,
                          batch_invariant=config.batch_invariant, device=config.device, ops=ops, keep=keep)


def mode_line(config: EngineConfig, ops) -> str:
    """The start-up line stating the op table and what it promises (README "Batch invariance")."""
    labels = config.mode_labels()
    head = f"engine mode: device={labels['device']} dtype={labels['dtype']} ops={ops.name} "
    if config.batch_invariant:
        return head + ("batch_invariant=1: a request's tokens and logprobs do not depend on the batch, its order "
                       "or the schedule (chunking, prefix hits, preemption, speculation)")
    return head + ("batch_invariant=0: a request's logits may move in their last bits with the batch "
                   "(DEEPINFER_BATCH_INVARIANT=1 makes them invariant)")


class _StepGrammar:
    """A step's grammar masks, computed when the runner asks (its forward launched). With async scheduling a
    constrained sequence's previous token is still in flight when the step is planned: that step is applied
    first (``late``), here, or at ``settle`` when the runner asked for no masks (the step draws nothing)."""

    def __init__(self, engine: LLMEngine, schedule: Schedule, late) -> None:
        self.engine, self.schedule, self.late = engine, schedule, late
        self.touched: set[str] = set()
        # (No grammar backend: no structured request yet, so no sequence has a grammar to look for.)
        self.needed = late is not None or (engine.intake.grammars is not None and any(
            seq.grammar is not None and w.num_samples for seq, w in zip(schedule.seqs, schedule.plan.work)))

    def masks(self):
        self._apply_late()
        source = mask_source(self.engine.intake.grammars, self.schedule.seqs, self.schedule.plan.work)
        return source() if source is not None else None

    def settle(self) -> set[str]:
        self._apply_late()
        return self.touched

    def _apply_late(self) -> None:
        if self.late is not None:
            self.touched |= self.engine._apply(*self.late)
            self.late = None

"""LLMEngine: the request lifecycle around one model. ``step()`` is the whole loop body:

    plan = scheduler.schedule() -> result = runner.execute(plan) -> scheduler.commit(plan) -> outputs
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.engine.intake import Intake
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.progress import append_token, build_output, finish, to_position_logprobs
from deepinfer.engine.sequence import RequestState
from deepinfer.engine.sizing import build_cache
from deepinfer.model.device import prepare_for_device
from deepinfer.model.loader import load_model
from deepinfer.ops.table import select as select_ops
from deepinfer.runner.cuda_graphs import DecodeGraphs, default_sizes
from deepinfer.runner.model_runner import ModelRunner, StepResult
from deepinfer.sched.scheduler import Scheduler, StepPlan
from deepinfer.tokenizer import Tokenizer

log = logging.getLogger("deepinfer")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.tokenizer_dir)
        self.model = load_model(config.model_dir, dtype=config.dtype, device=config.device,
                                strict_mtp=False, progress=config.load_progress)
        if config.device == "cuda":  # quantized weights + Triton kernels; the CPU path stays pure PyTorch
            prepare_for_device(self.model, select_ops(config.device))
        self.cache, self.storage, self.facts = build_cache(config, self.model)
        self.scheduler = Scheduler(config.scheduler, self.cache)
        mc = config.model
        graphs = None
        if config.device == "cuda" and not config.enforce_eager:
            sc = config.scheduler
            graphs = DecodeGraphs(self.model, self.storage, sc.max_model_len, default_sizes(sc.max_num_seqs))
            graphs.capture()
        self.runner = ModelRunner(self.model, self.storage, self.cache, mc.eos_token_id, graphs)
        max_cached = self.facts.num_blocks["history"] * config.cache.block_size
        self.intake = Intake(self.tokenizer, mc.vocab_size, config.scheduler.max_model_len, max_cached)
        self.requests: dict[str, RequestState] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)

    @classmethod
    def from_engine_args(cls, args: EngineArgs | None = None, **kwargs: Any) -> "LLMEngine":
        return cls(EngineConfig.create(args or EngineArgs.from_kwargs(**kwargs)))

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
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.finished:
                    finish(seq, "abort")
                self.scheduler.remove(seq)
            self._pending.append(build_output(req))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the loop body --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        for seq in plan.unschedulable:
            finish(seq, "length")
        touched = {seq.request.request_id for seq in plan.unschedulable}
        if not plan.empty:
            result = self.runner.execute(plan)
            self.scheduler.commit(plan)
            touched |= self._apply(plan, result)
        for rid in [r for r in self.requests if r in touched]:  # arrival order
            req = self.requests[rid]
            for seq in req.seqs:
                if seq.finished:
                    self.scheduler.remove(seq)
            outputs.append(build_output(req))
            if req.finished:
                del self.requests[rid]
        return outputs

    def _apply(self, plan: StepPlan, result: StepResult) -> set[str]:
        touched: set[str] = set()
        limit = self.config.scheduler.max_model_len
        for chunk in result.prompt_logprobs:
            req = chunk.seq.request
            req.prompt_logprobs.extend(self._position_logprobs(chunk.values))
            req.prompt_logprobs_done = chunk.first_target - 1 + len(chunk.values)
        for s in result.sampled:
            append_token(s.seq, s.token_id, s.logprobs, self.config.model.eos_token_id, limit, self._decode_one)
            touched.add(s.seq.request.request_id)
        return touched

    def _position_logprobs(self, values):
        return [to_position_logprobs(v, self._decode_one) for v in values]

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

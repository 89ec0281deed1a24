"""Offline API, vLLM-shaped: ``from deepinfer import LLM, SamplingParams``.

    llm = LLM()                                  # the bundled demo model
    outs = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tqdm.auto import tqdm

from deepinfer.chat import chat_prompt, parse_assistant_output
from deepinfer.chat.parsing import ToolCall
from deepinfer.config.engine import EngineArgs
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class ChatCompletion:
    """One sample of a chat turn: the raw completion plus its reasoning / answer / tool calls."""

    completion: CompletionOutput
    reasoning: str | None
    content: str
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class ChatOutput:
    request: RequestOutput
    choices: tuple[ChatCompletion, ...]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Write the cache tiers down (a later LLM with the same ``kv_cache_dir`` finds them) and stop any
        worker processes. The object is not usable afterwards."""
        self.engine.close()

    def generate(
        self,
        prompts: str | dict | Sequence[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(sampling_params)} for {len(prompts)} prompts; pass one or one per prompt"
                )
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, params in zip(ids, prompts, params_list):
                self.engine.add_request(rid, prompt, params)
        except ValueError:
            self.engine.abort_request(ids)
            self.engine.step()  # drain the abort outputs
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [final[r] for r in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        thinking: bool = False,
        tools: list[dict] | None = None,
        reasoning_effort: str | None = None,
        use_tqdm: bool = True,
    ) -> list[ChatOutput]:
        """Render DeepSeek-V4 chat prompts, generate, and split each answer into reasoning / content / tools."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [chat_prompt(self.engine.tokenizer, conv, thinking=thinking, tools=tools,
                               reasoning_effort=reasoning_effort) for conv in conversations]
        params = sampling_params or SamplingParams()
        if params.skip_special_tokens:  # the parser needs </think> and DSML markers in the text
            params = replace(params, skip_special_tokens=False)
        results = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [self._parse(r, thinking) for r in results]

    @staticmethod
    def _parse(result: RequestOutput, thinking: bool) -> ChatOutput:
        choices = []
        for c in result.outputs:
            parsed = parse_assistant_output(c.text, thinking=thinking)
            choices.append(ChatCompletion(c, parsed.reasoning, parsed.content, tuple(parsed.tool_calls)))
        return ChatOutput(result, tuple(choices))

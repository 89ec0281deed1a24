"""OpenAI request models (pydantic v2, strict types) and their translation into engine inputs.

Field names are OpenAI's. deepinfer extras (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, ...)
are plain top-level fields, which is where the official client's ``extra_body`` puts them. Unknown fields
are ignored, as OpenAI-compatible servers commonly do, so newer clients keep working; fields whose meaning
we cannot honour (suffix, logit_bias, best_of != n, tool_choice "required") are refused by name rather
than silently ignored.

Types are checked strictly (``"5"`` is not an int, ``true`` is not a number); ranges are checked by
``SamplingParams`` and the chat encoder, whose ValueErrors name the field (see ``errors.bad_request``).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.chat import StreamingChatParser, ToolCall, parse_assistant_output
from deepinfer.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from deepinfer.sampling import SamplingParams
from deepinfer.server.errors import ApiError, bad_request

SYSTEM_FINGERPRINT = "deepinfer-0.1.0"
MAX_N = 128  # samples per prompt: a guard against one request occupying the whole batch for good

class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # accepted, not implemented: usage comes in the final chunk only


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # optional: the one served model is the default
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # deepinfer extras (extra_body in the openai client)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # {json | json_object | regex | choice | grammar} (vLLM's spelling), enforced by deepinfer.structured
    structured_outputs: dict[str, Any] | None = None
    # Prefix-cache tenancy (vLLM's field): requests with different salts never share cached blocks.
    cache_salt: str | None = Field(None, min_length=1)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_kwargs(self, max_tokens: int | None) -> dict[str, Any]:
        if self.logit_bias:
            raise ApiError(400, "logit_bias: not supported by this server", param="logit_bias",
                           code="unsupported_parameter")
        kw: dict[str, Any] = {
            "n": self.n, "max_tokens": max_tokens, "stop": self.stop, "seed": self.seed,
            "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens, "stop_token_ids": self.stop_token_ids,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "structured_outputs": self.constraint(),
        }
        # null means "the default" in the OpenAI API, so only forward what was given.
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                     "repetition_penalty"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return kw

    def constraint(self) -> dict[str, Any] | None:
        return self.structured_outputs


def _prompt_count(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        return [prompt]  # one prompt given as token ids
    return list(prompt)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    skip_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per engine request: text, or token ids as given."""
        for name, bad in (("suffix", self.suffix is not None), ("best_of", self.best_of not in (None, self.n))):
            if bad:
                raise ApiError(400, f"{name}: not supported by this server", param=name, code="unsupported_parameter")
        return _prompt_count(self.prompt)

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: score the prompt and generate nothing. The engine always generates at
        least one token, so it runs with one and the response leaves that token out."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        max_tokens = 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default
        if self.max_tokens == 0:
            if not self.echo:
                raise ApiError(400, "max_tokens: must be >= 1, got 0 (0 is allowed only with echo: true, which "
                                    "returns the prompt and generates nothing)", param="max_tokens",
                               code="invalid_value")
            if self.min_tokens > 0:
                raise ApiError(400, f"min_tokens must be <= max_tokens (0), got {self.min_tokens}",
                               param="min_tokens", code="invalid_value")
            max_tokens = 1
        kw = self._sampling_kwargs(max_tokens)
        # echo with logprobs reports the prompt's tokens too: the engine scores them with the same top-N.
        prompt_logprobs = self.logprobs if self.echo else None
        kw.update(logprobs=self.logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens)
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise bad_request(e, {"seq_seed": "seed", "prompt_logprobs": "logprobs"}) from None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[Any]  # validated (with field paths) by the chat encoder
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted; the model decides how many calls it makes
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def thinking(self) -> bool:
        """Thinking mode: chat_template_kwargs.thinking (or enable_thinking) wins; otherwise on exactly when
        a reasoning_effort other than "none" is given."""
        kw = self.chat_template_kwargs or {}
        unknown = sorted(set(kw) - {"thinking", "enable_thinking"})
        if unknown:
            raise ApiError(400, f"chat_template_kwargs.{unknown[0]}: unknown key; allowed: thinking, enable_thinking",
                           param=f"chat_template_kwargs.{unknown[0]}", code="invalid_value")
        for key in ("thinking", "enable_thinking"):
            if key in kw:
                if not isinstance(kw[key], bool):
                    raise ApiError(400, f"chat_template_kwargs.{key}: must be a bool, got {kw[key]!r}",
                                   param=f"chat_template_kwargs.{key}", code="invalid_type")
                return kw[key]
        return self.reasoning_effort is not None and self.reasoning_effort != "none"

    def effort(self) -> str | None:
        """OpenAI's effort names onto DeepSeek-V4's two thinking levels ("high" and "max")."""
        e = self.reasoning_effort
        if e is None or e == "none":
            return None
        if e in ("minimal", "low", "medium", "high"):
            return "high"
        if e in ("max", "xhigh"):
            return "max"
        raise ApiError(400, f"reasoning_effort: {e!r} is not one of none, minimal, low, medium, high, xhigh, max",
                       param="reasoning_effort", code="invalid_value")

    def active_tools(self) -> list[Any] | None:
        """The tools to render: all of them unless tool_choice is "none"."""
        self.forced_functions()  # validates tool_choice
        return None if self.tool_choice == "none" else (self.tools or None)

    def forced_functions(self) -> list[dict[str, Any]] | None:
        """The functions a forced call may use: all tools for "required", the named one for
        {"type": "function", "function": {"name": ...}}; None when the model decides ("auto", "none")."""
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return None
        functions = [t.get("function") for t in self.tools or () if isinstance(t, dict)]
        functions = [f for f in functions if isinstance(f, dict) and isinstance(f.get("name"), str)]
        if choice == "required":
            if not functions:
                raise ApiError(400, "tool_choice: \"required\" needs tools", param="tool_choice",
                               code="invalid_value")
            return functions
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(name, str):
            raise ApiError(400, f"tool_choice: expected \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                                f"\"function\": {{\"name\": ...}}}}, got {json.dumps(choice)}", param="tool_choice",
                           code="invalid_value")
        named = [f for f in functions if f["name"] == name]
        if not named:
            raise ApiError(400, f"tool_choice: no tool named {name!r}", param="tool_choice", code="invalid_value")
        return named

    def constraint(self) -> dict[str, Any] | None:
        """The output constraint: response_format (json_object, json_schema; "strict" or not, the schema is
        enforced) or structured_outputs, not both. In thinking mode it binds the answer after </think> only
        (the engine defers it while the prompt's thinking block is open)."""
        schema = self.schema()
        if schema is not None and self.structured_outputs is not None:
            raise ApiError(400, "structured_outputs: give either response_format or structured_outputs, not both",
                           param="structured_outputs", code="invalid_value")
        forced = self.forced_functions()
        if forced is not None:
            if schema is not None or self.structured_outputs is not None:
                raise ApiError(400, "tool_choice: a forced tool call cannot be combined with response_format or "
                                    "structured_outputs", param="tool_choice", code="invalid_value")
            return {"tools": forced}
        if schema is None and self.structured_outputs is None:
            return None
        if schema is None:
            return self.structured_outputs
        return {"json_object": True} if self.response_format.get("type") == "json_object" else {"json": schema}

    def constraint_renames(self) -> dict[str, str]:
        """Errors about the constraint name the field the client used."""
        if self.forced_functions() is not None:
            return {"structured_outputs": "tools"}
        return {"structured_outputs": "response_format"} if self.schema() is not None else {}

    def schema(self) -> dict | None:
        """response_format's schema: rendered into the prompt (V4's chat format has a section for it) and
        enforced (``constraint``)."""
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return None
        if rf.get("type") == "json_object":
            return {"type": "object"}
        if rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict):
            schema = rf["json_schema"].get("schema")
            if isinstance(schema, dict):
                return schema
        raise ApiError(400, "response_format: expected type text, json_object or json_schema with a schema",
                       param="response_format", code="invalid_value")

    def completion_limit(self) -> tuple[int | None, str]:
        """The token limit asked for and the field it came in: max_completion_tokens (OpenAI's current name)
        wins over the older max_tokens. None: the rest of the context."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs",
                           code="invalid_value")
        limit, _ = self.completion_limit()
        kw = self._sampling_kwargs(limit)  # None: up to the model length, as OpenAI's chat default
        # The parser needs </think>, EOS and the DSML markers in the text, so specials are kept.
        kw.update(logprobs=(self.top_logprobs or 0) if self.logprobs else None, skip_special_tokens=False)
        renames = {"seq_seed": "seed", "logprobs": "top_logprobs", **self.constraint_renames()}
        if self.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise bad_request(e, renames) from None


# ---- responses -------------------------------------------------------------------------------------------
# Responses are plain dicts in OpenAI's shapes. The builders are pure functions of RequestOutputs, so tests
# drive them with hand-made outputs (a tool call or a </think> that the random demo weights never produce).

def usage(finals: list[RequestOutput], count_generated: bool = True) -> dict[str, Any]:
    """``count_generated=False``: the generated tokens were dropped (echo with max_tokens 0).
    ``prompt_tokens_details.cached_tokens``: prompt tokens served from the prefix cache (OpenAI's field)."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs) if count_generated else 0
    cached = sum(o.num_cached_tokens for o in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finite_logprob(x: float) -> float:
    # JSON has no -Infinity; a token the sampler masked out gets a very negative number instead.
    return x if math.isfinite(x) else -9999.0


def sampled_entry(token_id: int, pos: PositionLogprobs) -> tuple[str, float]:
    lp = pos.get(token_id)
    return (lp.decoded_token or "", finite_logprob(lp.logprob)) if lp else ("", -9999.0)


def chat_logprobs(token_ids: tuple[int, ...], positions: tuple[PositionLogprobs, ...], top_n: int) -> dict:
    def entry(tok: str, value: float) -> dict[str, Any]:
        return {"token": tok, "logprob": value, "bytes": list(tok.encode("utf-8"))}

    content = []
    for tid, pos in zip(token_ids, positions):
        top = sorted((v for v in pos.values() if v.rank is not None and v.rank <= top_n), key=lambda v: v.rank)
        item = entry(*sampled_entry(tid, pos))
        item["top_logprobs"] = [entry(v.decoded_token or "", finite_logprob(v.logprob)) for v in top]
        content.append(item)
    return {"content": content}


def delta_positions(c: CompletionOutput, delta_ids: tuple[int, ...]) -> tuple[tuple, tuple]:
    start = len(c.token_ids) - len(delta_ids)
    return c.token_ids[start:], (c.logprobs or ())[start:]


class ChatBuilder:
    """/v1/chat/completions responses: the text of each sample split into reasoning_content, content and
    tool_calls by the DeepSeek-V4 parsers (one streaming parser per choice)."""

    def __init__(self, request_id: str, model: str, n: int, thinking: bool, top_logprobs: int | None) -> None:
        self.id, self.model, self.thinking, self.top_logprobs = request_id, model, thinking, top_logprobs
        self.created = int(time.time())
        self._parsers = [StreamingChatParser(thinking) for _ in range(n)]
        self._started = [False] * n
        self._calls = [0] * n
        self._done = [False] * n

    def _wrap(self, choices: list[dict], obj: str = "chat.completion.chunk", **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "system_fingerprint": SYSTEM_FINGERPRINT, **extra}

    def _chunk(self, i: int, delta: dict, logprobs: dict | None = None, finish: str | None = None,
               stop_reason: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        return self._wrap([choice])

    def _tool_call(self, i: int, call: ToolCall) -> dict[str, Any]:
        k = self._calls[i]
        self._calls[i] += 1
        return {"index": k, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        chunks: list[dict[str, Any]] = []
        for c, text, ids in zip(out.outputs, out.delta_text, out.delta_token_ids):
            i = c.index
            if self._done[i] or not (text or ids or c.finished):
                continue
            if not self._started[i]:  # OpenAI opens every choice with the role
                self._started[i] = True
                chunks.append(self._chunk(i, {"role": "assistant", "content": ""}))
            deltas = self._parsers[i].feed(text) + (self._parsers[i].finish() if c.finished else [])
            step = []
            for d in deltas:  # one chunk per parser delta keeps reasoning / content / calls in order
                if d.tool_call is not None:
                    step.append({"tool_calls": [self._tool_call(i, d.tool_call)]})
                elif d.reasoning:
                    step.append({"reasoning_content": d.reasoning})
                elif d.content:
                    step.append({"content": d.content})
            lp = chat_logprobs(*delta_positions(c, ids), self.top_logprobs) \
                if self.top_logprobs is not None and c.logprobs is not None and ids else None
            if lp is not None and not step:
                step.append({})  # the text is held back by the parser, the logprobs are not
            for k, delta in enumerate(step):
                chunks.append(self._chunk(i, delta, lp if k == len(step) - 1 else None))
            if c.finished:
                self._done[i] = True
                reason = "tool_calls" if self._calls[i] else c.finish_reason
                chunks.append(self._chunk(i, {}, None, reason, c.stop_reason))
        return chunks

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        return self._wrap([], usage=usage(finals))

    def response(self, final: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in final.outputs:
            parsed = parse_assistant_output(c.text, thinking=self.thinking)
            message: dict[str, Any] = {"role": "assistant",
                                       "content": parsed.content or (None if parsed.tool_calls else "")}
            if self.thinking:
                message["reasoning_content"] = parsed.reasoning
            if parsed.tool_calls:
                message["tool_calls"] = [{"id": t.id, "type": "function",
                                          "function": {"name": t.name, "arguments": t.arguments}}
                                         for t in parsed.tool_calls]
            lp = None
            if self.top_logprobs is not None and c.logprobs is not None:
                lp = chat_logprobs(c.token_ids, c.logprobs, self.top_logprobs)
            choices.append({"index": c.index, "message": message, "logprobs": lp,
                            "finish_reason": "tool_calls" if parsed.tool_calls else c.finish_reason,
                            "stop_reason": c.stop_reason})
        return self._wrap(choices, "chat.completion", usage=usage([final]))

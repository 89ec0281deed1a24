"""Request intake: validate what a user submitted and turn it into a RequestState with its sequences.

Everything a user controls is checked here, at the edge, with a ValueError that names the field; nothing
that fails here ever reaches the scheduler, so one bad request cannot disturb the others.
"""

from __future__ import annotations

import itertools
from typing import Any

from deepinfer.chat.encoding import DSML
from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.engine.sequence import RequestState, Sequence
from deepinfer.sampling import SamplingParams, child_seed, resolve_seed
from deepinfer.tokenizer import Tokenizer

PromptInput = str | dict | list


class Intake:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, max_cached_tokens: int,
                 eos_token_id: int | None = None, refused_token_id: int | None = None, pin_masks: bool = False) -> None:
        """``refused_token_id``: an id no prompt may hold (V4.1's image token: its vision encoder is not built).
        ``pin_masks``: grammar masks are computed into page-locked memory (an engine on CUDA uploads them)."""
        self.tokenizer = tokenizer
        self.refused_token_id = refused_token_id
        self.eos_token_id = eos_token_id
        self._grammars = None  # GrammarBackend, built on the first structured request
        self.pin_masks = pin_masks
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_cached_tokens = max_cached_tokens
        self._arrivals = itertools.count()

    def tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"prompt: unknown key {sorted(unknown)[0]!r}; allowed: prompt, prompt_token_ids, "
                                 "cache_salt")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise ValueError(f"prompt: expected a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids: expected a list of ints, got {type(ids).__name__}")
        if not ids:
            raise ValueError("prompt_token_ids: must not be empty")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids[{i}]: must be an int in [0, {self.vocab_size}), got {t!r}")
        return [int(t) for t in ids]

    def build(self, request_id: str, prompt: Any, params: Any) -> RequestState:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        params.check_vocab(self.vocab_size)
        text, ids = self.tokenize(prompt)
        if self.refused_token_id is not None and self.refused_token_id in ids:
            raise ValueError(f"prompt: contains image_token_id {self.refused_token_id} (an image span); this model's "
                             "vision encoder is not implemented, only text input is supported")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        if len(ids) + 1 > self.max_cached_tokens:
            raise ValueError(f"prompt: {len(ids)} tokens do not fit in the KV cache ({self.max_cached_tokens} tokens)")
        grammar = self._compile(params)
        req = RequestState(request_id, text, tuple(ids), params, cache_salt=self._salt(prompt))
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        seed = resolve_seed(params, request_id)
        for i in range(params.n):
            s = seed if i == 0 else child_seed(seed, i)
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output, min_tokens=params.min_tokens)
            req.seqs.append(Sequence(f"{request_id}#{i}", i, req, list(ids), len(ids), s, next(self._arrivals),
                                     detok, params.max_new_tokens(len(ids), self.max_model_len)))
            if grammar is not None:
                req.seqs[-1].grammar = self._grammars.matcher(grammar)
                req.seqs[-1].grammar_after = self._thinking_end(ids)
        return req

    @staticmethod
    def _salt(prompt: Any) -> str | None:
        """The prompt's ``cache_salt`` (vLLM's prompt-dict key): requests share cache blocks only with
        requests of the same salt (or none)."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt: must be a non-empty string, got {salt!r}")
        return salt

    def _thinking_end(self, ids: list[int]) -> int | None:
        """``</think>``'s id when the prompt ends inside a thinking block (V4's chat format opens one with
        ``<think>`` in thinking mode and closes it in the prompt otherwise), else None."""
        start, end = self.tokenizer.token_to_id("<think>"), self.tokenizer.token_to_id("</think>")
        if start is None or end is None:
            return None
        last_start = max((i for i, t in enumerate(ids) if t == start), default=-1)
        last_end = max((i for i, t in enumerate(ids) if t == end), default=-1)
        return end if last_start > last_end else None

    def _compile(self, params: SamplingParams) -> str | None:
        """The request's grammar, compiled now so that a bad constraint is a ValueError naming the field
        before anything is queued."""
        if params.structured_outputs is None:
            return None
        if self._grammars is None:
            from deepinfer.structured.backend import GrammarBackend

            self._grammars = GrammarBackend(self.tokenizer.backend.to_str(), self.vocab_size, self.eos_token_id,
                                            self.tokenizer.token_to_id(DSML), pin_memory=self.pin_masks)
        return self._grammars.compile(params.structured_outputs)

    @property
    def grammars(self):
        """The grammar backend (``structured/backend.py``), or None before the first structured request."""
        return self._grammars

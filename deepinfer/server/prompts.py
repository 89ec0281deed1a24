"""Prompts resolved to token ids before they reach the engine, and the context-length rules.

The server tokenizes itself (as the engine would: BOS added to text prompts, token ids taken as given) so it
can refuse a request whose prompt plus ``max_tokens`` does not fit the context length with a 400 naming
the field, instead of letting the engine silently cut the generation short at the context length; and so
that ``echo`` knows the prompt's tokens. The engine receives ``{"prompt", "prompt_token_ids"}`` and does
not tokenize again, so what is checked here is exactly what runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer.chat import chat_prompt
from deepinfer.server.errors import ApiError
from deepinfer.tokenizer import Tokenizer

CONTEXT_CODE = "context_length_exceeded"


@dataclass(frozen=True, slots=True)
class PromptEcho:
    """What ``echo`` puts in front of a choice.

    ``text`` is the prompt as the client wrote it (a text prompt) or its ids decoded (a token-id prompt).
    ``tokens`` holds each prompt token decoded on its own and ``widths`` how many characters of ``text`` it
    covers, for the logprobs' ``text_offset``: 0 for the BOS the server added to a text prompt and for
    special tokens that ``skip_special_tokens`` leaves out of the decoded text. Both are empty unless
    logprobs were asked for.
    """

    text: str
    tokens: tuple[str, ...] = ()
    widths: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ResolvedPrompt:
    field: str  # where the client sent it: "prompt", or "prompt[k]" for one of several
    engine_prompt: dict[str, Any]  # {"prompt": text or None, "prompt_token_ids": ids}: add_request's input
    num_tokens: int
    echo: PromptEcho | None = None


def render_chat(req, tokenizer: Tokenizer, thinking: bool) -> dict[str, Any]:
    """A ``ChatCompletionRequest``'s DeepSeek-V4 prompt text and ids (as llm.py: the text carries BOS, so no
    special tokens are added). The server's, and the router's to key a chat by the ids the replica will see."""
    return chat_prompt(tokenizer, req.messages, thinking=thinking, tools=req.active_tools(),
                       reasoning_effort=req.effort(), response_format=req.schema())


def resolve_completion_prompts(prompts: Sequence[str | list[int]], tokenizer: Tokenizer, vocab_size: int, *,
                               echo: bool, token_strings: bool, skip_special_tokens: bool) -> list[ResolvedPrompt]:
    """Token ids (and, with ``echo``, what to echo) of each completion prompt. CPU work: run it off the loop.

    ``token_strings``: also decode each token, for echo with logprobs."""
    several = len(prompts) > 1
    out = []
    for k, prompt in enumerate(prompts):
        field = f"prompt[{k}]" if several else "prompt"
        if isinstance(prompt, str):
            if prompt == "":
                raise ApiError(400, f"{field}: must not be empty", param=field, code="invalid_value")
            ids = tokenizer.encode(prompt, add_special_tokens=True)  # as the engine encodes a text prompt
        else:
            _check_ids(prompt, vocab_size, field)
            ids = list(prompt)
        engine_prompt = {"prompt": prompt if isinstance(prompt, str) else None, "prompt_token_ids": ids}
        prompt_echo = _echo(prompt, ids, tokenizer, token_strings, skip_special_tokens) if echo else None
        out.append(ResolvedPrompt(field, engine_prompt, len(ids), prompt_echo))
    return out


def _echo(prompt: str | list[int], ids: list[int], tokenizer: Tokenizer, token_strings: bool,
          skip_special_tokens: bool) -> PromptEcho:
    is_text = isinstance(prompt, str)
    text = prompt if is_text else tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if not token_strings:
        return PromptEcho(text)
    if isinstance(prompt, str):  # the client's text has everything but what the tokenizer added in front
        hidden = set(range(_added_prefix(tokenizer, prompt, ids)))
    else:
        hidden = {i for i, t in enumerate(ids) if tokenizer.is_special(t)} if skip_special_tokens else set()
    # Decoded one at a time, as the engine decodes the tokens of its logprobs (specials kept).
    tokens = tuple(tokenizer.decode([t], skip_special_tokens=False) for t in ids)
    return PromptEcho(text, tokens, tuple(0 if i in hidden else len(t) for i, t in enumerate(tokens)))


def _added_prefix(tokenizer: Tokenizer, text: str, ids: list[int]) -> int:
    """How many ids the tokenizer's post-processor put in front of the text's own (the BOS)."""
    plain = tokenizer.encode(text, add_special_tokens=False)
    extra = len(ids) - len(plain)
    return extra if extra > 0 and ids[extra:] == plain else 0


def _check_ids(ids: list[int], vocab_size: int, field: str) -> None:
    # The engine checks this too; it is checked here first because echo decodes the ids before submission.
    if not ids:
        raise ApiError(400, f"{field}: must not be empty", param=field, code="invalid_value")
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ApiError(400, f"{field}[{i}]: must be a token id in [0, {vocab_size}), got {t}",
                           param=f"{field}[{i}]", code="invalid_value")


def check_context(lengths: Sequence[int], names: Sequence[str], max_tokens: int | None, max_model_len: int, *,
                  max_tokens_param: str, what: str = "the prompt") -> None:
    """Refuse what cannot fit the context length (``max_model_len`` tokens of prompt and output together).

    ``lengths[k]`` is the token count of the prompt the client sent as field ``names[k]`` (``prompt``,
    ``prompt[1]``, ``messages``). A prompt needs room for at least one generated token. An explicit
    ``max_tokens`` must fit beside the longest prompt; left out, the engine's default applies (capped at
    what is left of the context).
    """
    for n, name in zip(lengths, names):
        if n >= max_model_len:
            raise ApiError(400, f"{name}: {what} has {n} tokens, but the context length is {max_model_len} "
                                f"tokens, so a prompt may have at most {max_model_len - 1} (one is left to generate)",
                           param=name, code=CONTEXT_CODE)
    longest = max(lengths)
    if max_tokens is not None and longest + max_tokens > max_model_len:
        name = names[lengths.index(longest)]
        subject = what if len(lengths) == 1 else name
        raise ApiError(400, f"{max_tokens_param}: {max_tokens} is too large: {subject} has {longest} tokens and "
                            f"the context length is {max_model_len} tokens, so at most {max_model_len - longest} "
                            f"can be generated", param=max_tokens_param, code=CONTEXT_CODE)

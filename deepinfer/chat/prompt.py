"""Chat messages -> the engine prompt: the DeepSeek-V4 rendering and its token ids, in one place.

The offline ``LLM.chat``, the HTTP server and ``deepinfer chat`` all build their chat prompts here.
"""

from __future__ import annotations

from typing import Any

from deepinfer.chat.encoding import encode_messages


def chat_prompt(tokenizer, messages: list[dict], *, thinking: bool = False, tools: list[dict] | None = None,
                reasoning_effort: str | None = None, response_format: dict | None = None) -> dict[str, Any]:
    """``{"prompt": text, "prompt_token_ids": ids}`` for ``messages`` rendered by :func:`encode_messages`.

    The rendered text already starts with BOS, so the tokenizer adds no special tokens of its own.
    Raises ValueError naming the offending field on malformed messages, tools or options.
    """
    text = encode_messages(messages, thinking=thinking, tools=tools, reasoning_effort=reasoning_effort,
                           response_format=response_format)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

"""What the router knows of a request before choosing its replica: the prompt's block chain, keyed by the token
ids the replica will see (the server's own tokenizer call for a completions prompt, its chat template for
messages), and the session key (``X-Session-ID`` header, else the body's ``user``)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from deepinfer.router.policies import RequestKey
from deepinfer.router.prefix_index import block_chain
from deepinfer.server.prompts import render_chat
from deepinfer.server.protocol import ChatCompletionRequest
from deepinfer.tokenizer import Tokenizer

SESSION_HEADER = "x-session-id"


class PromptKeys:
    def __init__(self, tokenizer: Tokenizer, block_size: int) -> None:
        self.tokenizer, self.block_size = tokenizer, block_size

    def of(self, path: str, body: bytes, headers: Mapping[str, str]) -> RequestKey:
        """CPU work (tokenizing, rendering the template): run it off the event loop."""
        session = headers.get(SESSION_HEADER)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None
        if not isinstance(data, dict):  # the replica answers it (400): any replica will do
            return RequestKey(session=session)
        if session is None and isinstance(data.get("user"), str):
            session = data["user"]
        salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None
        ids = self._ids(path, data)
        if not ids:
            return RequestKey(session=session)
        return RequestKey(tuple(block_chain(ids, self.block_size, salt)), session, len(ids))

    def _ids(self, path: str, data: dict) -> list[int] | None:
        if path.endswith("/completions") and not path.endswith("/chat/completions"):
            prompt = data.get("prompt")
            if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
                prompt = prompt[0]  # a batch of prompts goes to one replica: key it by the first
            if isinstance(prompt, str) and prompt:
                return self.tokenizer.encode(prompt, add_special_tokens=True)  # as the server encodes it
            if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return list(prompt)
            return None
        try:
            req = ChatCompletionRequest.model_validate(data)
            return render_chat(req, self.tokenizer, req.thinking())["prompt_token_ids"]
        except ValueError:  # malformed (pydantic's ValidationError is one): the replica names the field
            return None

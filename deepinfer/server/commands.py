"""What the HTTP side asks of the engine thread: one frozen dataclass per command.

The engine thread takes commands off a deque and dispatches on their type, so every field a command
carries is typed and a new command cannot be half-handled by a stray string comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deepinfer.sampling import SamplingParams

if TYPE_CHECKING:  # only for annotations: async_engine imports this module
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.server.async_engine import RequestStream

# How the engine thread answers a command that has a caller waiting: (result, None) or (None, error).
# It runs on the engine thread, so it must hand over to the caller's own thread or loop and return.
Reply = Callable[[Any, BaseException | None], None]


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One ``LLMEngine.add_request`` call: a completion with several prompts submits several."""

    request_id: str
    prompt: Any  # what add_request takes: text, token ids, or {"prompt": text, "prompt_token_ids": ids}
    params: SamplingParams | None = None


@dataclass(frozen=True, slots=True)
class Submit:
    """Admit ``requests`` all or none; their outputs go to ``stream``."""

    stream: RequestStream
    requests: tuple[EngineRequest, ...]
    reply: Reply


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop these requests and free their cache; nobody waits for the answer (it is sent from finally
    blocks and disconnect handlers)."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn(engine)`` between steps and reply with its result (inspection from tests and tools)."""

    fn: Callable[[LLMEngine], Any]
    reply: Reply


Command = Submit | Abort | Call

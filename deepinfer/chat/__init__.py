"""DeepSeek-V4 chat: prompts (text and token ids) and output parsing, no torch; ``repl.py`` is ``deepinfer chat``."""

from deepinfer.chat.encoding import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    LATEST_REMINDER,
    REASONING_EFFORT_MAX,
    SPECIAL_TOKENS,
    THINK_END,
    THINK_START,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    USER,
    encode_messages,
)
from deepinfer.chat.parsing import (
    ChatDelta,
    ParsedOutput,
    StreamingChatParser,
    ToolCall,
    parse_assistant_output,
)
from deepinfer.chat.prompt import chat_prompt

__all__ = [
    "ASSISTANT",
    "BOS",
    "DSML",
    "EOS",
    "LATEST_REMINDER",
    "REASONING_EFFORT_MAX",
    "SPECIAL_TOKENS",
    "THINK_END",
    "THINK_START",
    "TOOL_CALLS_CLOSE",
    "TOOL_CALLS_OPEN",
    "USER",
    "ChatDelta",
    "ParsedOutput",
    "StreamingChatParser",
    "ToolCall",
    "chat_prompt",
    "encode_messages",
    "parse_assistant_output",
]

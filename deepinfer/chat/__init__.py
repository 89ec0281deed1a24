"""DeepSeek-V4 chat format: prompt rendering and output parsing (no torch)."""

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
    "encode_messages",
    "parse_assistant_output",
]

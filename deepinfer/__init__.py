"""deepinfer: an inference engine for the DeepSeek-V4 model family.

    from deepinfer import LLM, SamplingParams
"""

from deepinfer.config.engine import EngineArgs
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.llm import LLM, ChatOutput
from deepinfer.sampling import SamplingParams
from deepinfer.structured import StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "ChatOutput",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]

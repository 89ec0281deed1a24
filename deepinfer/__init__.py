"""deepinfer: an inference engine for the DeepSeek-V4 model family."""

__version__ = "0.1.0"

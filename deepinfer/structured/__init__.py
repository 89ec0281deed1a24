"""Structured outputs: constraints (JSON schema, any JSON object, regex, choice, Lark grammar) enforced by
token masks from llguidance. The engine owns each sequence's matcher; the runner applies the masks."""

from deepinfer.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]

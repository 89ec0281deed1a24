"""The grammar backend: llguidance, over the model's tokenizer.

Why llguidance: a Rust library with no Python dependencies (xgrammar brings transformers and Triton along),
JSON schema / regex / Lark in one grammar format, and masks computed lazily per token (no vocabulary-wide
precompilation per grammar, so a new schema costs nothing up front). The engine owns the lifecycle: it
compiles a request's constraint when the request is added (errors name the field), keeps one matcher per
sequence, asks it for the next token's mask before a step, and feeds it every accepted token.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from deepinfer.structured.params import StructuredOutputsParams
from deepinfer.structured.tool_calls import tool_call_grammar

try:
    import llguidance
    import llguidance.numpy as llg_np
except ImportError:  # pragma: no cover - llguidance is a core dependency; a clear error beats an import crash
    llguidance = None


# Compact JSON (", " and ": " between items, no other whitespace) unless the schema's own "x-guidance" says
# otherwise: free whitespace lets a model pad its output with newlines and spaces (the demo model does).
_JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarBackend:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int,
                 dsml_token_id: int | None = None) -> None:
        if llguidance is None:
            raise RuntimeError("structured outputs need llguidance: pip install llguidance")
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
        self.words = (vocab_size + 31) // 32  # int32 words of one mask row
        self.dsml_token_id = dsml_token_id  # V4's tool-call marker, for forced tool calls

    def compile(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of ``params``; ValueError naming the field if it does not compile."""
        try:
            grammar = self._grammar(params)
            error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        except ValueError:
            raise
        except Exception as e:  # whatever the library raises, the client hears of its field
            error = str(e) or type(e).__name__
        if error:
            raise ValueError(f"structured_outputs.{params.kind}: {error.strip().splitlines()[0]}")
        return grammar

    def _grammar(self, params: StructuredOutputsParams) -> str:
        kind = params.kind
        M = llguidance.LLMatcher
        if kind == "json":
            try:
                schema = json.loads(params.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
            grammar = M.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_DEFAULTS)
        elif kind == "json_object":
            grammar = M.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=_JSON_DEFAULTS)
        elif kind == "regex":
            grammar = M.grammar_from_regex(params.regex)
        elif kind == "choice":
            # A Lark alternation of quoted literals: no escaping rules of a regex dialect to get wrong.
            grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        elif kind == "tools":
            dsml = self.dsml_token_id
            if dsml is None:
                raise ValueError("structured_outputs.tools: this tokenizer has no DSML marker token")
            grammar = M.grammar_from_lark(tool_call_grammar(params.tools, dsml))
        else:
            grammar = M.grammar_from_lark(params.grammar)
        return grammar

    def matcher(self, grammar: str) -> "llguidance.LLMatcher":
        m = llguidance.LLMatcher(self.tokenizer, grammar)
        if m.is_error():
            raise ValueError(f"structured_outputs: {m.get_error()}")
        return m

    def masks(self, matchers: list) -> list[bytes]:
        """Each matcher's next-token mask: ``words`` little-endian int32 words, bit t set = token t allowed."""
        bitmask = llg_np.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, m in enumerate(matchers):
            llg_np.fill_next_token_bitmask(m, bitmask, i)
        return [bitmask[i, : self.words].astype(np.int32).tobytes() for i in range(len(matchers))]


def apply_masks(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with the tokens whose bit is clear in ``words`` ([B, ceil(V/32)] int32) set to -inf.
    Plain tensor ops (the same on the CPU and the GPU); allowed logits keep their bits."""
    v = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # arithmetic shift of a negative word still leaves bit k at 0
    allowed = bits.reshape(len(words), -1)[:, :v].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def words_of(mask: bytes) -> np.ndarray:
    return np.frombuffer(mask, dtype=np.int32)

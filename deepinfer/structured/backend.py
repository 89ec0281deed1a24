"""The grammar backend: llguidance, over the model's tokenizer.

Why llguidance: a Rust library with no Python dependencies (xgrammar brings transformers and Triton along),
JSON schema / regex / Lark in one grammar format, and masks computed lazily per token (no vocabulary-wide
precompilation per grammar, so a new schema costs nothing up front). The engine owns the lifecycle: it
compiles a request's constraint when the request is added (errors name the field), keeps one matcher per
sequence, has the step's masks filled while the device runs the step's forward (``fill``: all constrained
sequences in one call, on llguidance's thread pool), and feeds each matcher every accepted token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.structured.params import StructuredOutputsParams
from deepinfer.structured.tool_calls import tool_call_grammar

try:
    import llguidance
    import llguidance.numpy as llg_np
except ImportError:  # pragma: no cover - llguidance is a core dependency; a clear error beats an import crash
    llguidance = None
# Masks after draft tokens in one parallel call (llguidance since late 2025); ``fill`` falls back without it.
_PAR_DRAFTS = getattr(llg_np, "fill_next_token_bitmask_par_with_draft_tokens", None) if llguidance else None


@dataclass(frozen=True, slots=True)
class MaskJob:
    """One constrained sequence's share of a step's masks: its matcher's mask goes to drawn row ``row``, and
    after each of ``drafts`` (the tokens verified at the following rows) to the next row."""

    matcher: object  # llguidance.LLMatcher
    row: int
    drafts: tuple[int, ...] = ()


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
        # llguidance's thread pool for batched masks (its default size: most of the cores, at most 32).
        self.executor = llguidance.LLExecutor()

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
        bitmask = self.fill([MaskJob(m, i) for i, m in enumerate(matchers)], len(matchers))
        return [bitmask[i].tobytes() for i in range(len(matchers))]

    def fill(self, jobs: Sequence[MaskJob], num_rows: int) -> np.ndarray:
        """The masks of a step's ``num_rows`` draws, [num_rows, words] int32 (rows no job covers: all allowed),
        in one call across the jobs. A job with drafts fills rows ``row .. row + len(drafts)``: the matcher's
        mask, then its mask after each draft in turn; llguidance advances the matcher over the drafts and
        rolls it back, so it leaves the call as it came. Rows past a draft the grammar forbids stay all
        allowed: the draw before them is masked, cannot equal that draft, and verification drops them."""
        bitmask = llg_np.allocate_token_bitmask(num_rows, self.vocab_size)
        plain = [(j.matcher, j.row) for j in jobs if not j.drafts]
        if plain:
            llg_np.fill_next_token_bitmask_par(self.executor, plain, bitmask)
        drafted = [(j.matcher, j.row, list(j.drafts)) for j in jobs if j.drafts]
        if drafted and _PAR_DRAFTS is None:  # an llguidance older than its draft-aware filler
            return self.fill_one_at_a_time(jobs, num_rows)
        if drafted:  # (llguidance's draft-aware call refuses an empty draft list)
            _PAR_DRAFTS(self.executor, drafted, bitmask)
        return bitmask

    def fill_one_at_a_time(self, jobs: Sequence[MaskJob], num_rows: int) -> np.ndarray:
        """``fill``'s reference: one matcher after another, advanced over its drafts one token at a time (up to
        one the grammar forbids, or the grammar's end) with a mask after each, then rolled back."""
        bitmask = llg_np.allocate_token_bitmask(num_rows, self.vocab_size)
        for job in jobs:
            m = job.matcher
            llg_np.fill_next_token_bitmask(m, bitmask, job.row)
            taken = 0
            for t in job.drafts:
                if m.is_stopped() or m.validate_tokens([t]) != 1 or not m.consume_token(t):
                    break
                taken += 1
                llg_np.fill_next_token_bitmask(m, bitmask, job.row + taken)
            m.rollback(taken)
        return bitmask


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

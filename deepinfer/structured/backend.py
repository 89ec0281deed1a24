"""The grammar backend: llguidance, over the model's tokenizer.

Why llguidance: a Rust library with no Python dependencies (xgrammar brings transformers and Triton along),
JSON schema / regex / Lark in one grammar format, and masks computed lazily per token (no vocabulary-wide
precompilation per grammar, so a new schema costs nothing up front). The engine owns the lifecycle: it
compiles a request's constraint when the request is added (errors name the field), keeps one matcher per
sequence, has the step's masks filled while the device runs the step's forward (``fill_rows``: all
constrained sequences in one call, on llguidance's thread pool, straight into the buffer the device copies
from), and feeds the matchers the accepted tokens (``consume``: a step's single tokens in one call, on the
same pool).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.ops.ref.token_mask import token_mask as ref_token_mask
from deepinfer.structured.params import StructuredOutputsParams
from deepinfer.structured.tool_calls import tool_call_grammar

try:
    import llguidance
    import llguidance.numpy as llg_np
except ImportError:  # pragma: no cover - llguidance is a core dependency; a clear error beats an import crash
    llguidance = None
# Masks after draft tokens in one parallel call (llguidance since late 2025); ``fill`` falls back without it.
_PAR_DRAFTS = getattr(llg_np, "fill_next_token_bitmask_par_with_draft_tokens", None) if llguidance else None
# One token for each of many matchers in one parallel call (llguidance 1.x); ``consume`` falls back without it.
_PAR_CONSUME = getattr(llg_np, "consume_token_par", None) if llguidance else None
# Fewer matchers than this advance one after another: a token costs 1-3 us, handing a batch to the pool ~10 us
# (measured on a 2-core host, demo tokenizer, JSON schema), so the pool pays only from a few dozen tokens.
_PAR_CONSUME_MIN = 16


@dataclass(frozen=True, slots=True)
class MaskJob:
    """One constrained sequence's share of a step's masks: its matcher's mask goes to drawn row ``row``, and
    after each of ``drafts`` (the tokens verified at the following rows) to the next row."""

    matcher: object  # llguidance.LLMatcher
    row: int
    drafts: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepMasks:
    """A step's grammar masks for its constrained drawn rows only: ``words[r]`` ([R, W] int32, bit t set =
    token t allowed) is the mask of drawn row ``rows[r]``. Both are views of ``host`` ([R * W + R] int32: the
    words, then the rows), page-locked when the engine runs on CUDA, so the upload is one asynchronous copy."""

    host: torch.Tensor
    words: np.ndarray  # [R, W] view of host
    rows: np.ndarray  # [R] view of host

    @classmethod
    def allocate(cls, num_rows: int, num_words: int, pin_memory: bool = False) -> "StepMasks":
        host = torch.empty(num_rows * (num_words + 1), dtype=torch.int32, pin_memory=pin_memory)
        flat, n = host.numpy(), num_rows * num_words
        return cls(host, flat[:n].reshape(num_rows, num_words), flat[n:])

    @classmethod
    def of_rows(cls, bitmask: np.ndarray, rows: Sequence[int], num_words: int,
                pin_memory: bool = False) -> "StepMasks":
        """``bitmask[i]`` (its first ``num_words`` words) as the mask of drawn row ``rows[i]``."""
        out = cls.allocate(len(rows), num_words, pin_memory)
        out.words[:] = bitmask[:, :num_words]
        out.rows[:] = rows
        return out

    @property
    def num_rows(self) -> int:
        return self.words.shape[0]

    @property
    def num_words(self) -> int:
        return self.words.shape[1]

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(words [R, W], rows [R]) of ``flat``, ``host`` or its copy on a device."""
        r, w = self.words.shape
        return flat[: r * w].view(r, w), flat[r * w :]


# Compact JSON (", " and ": " between items, no other whitespace) unless the schema's own "x-guidance" says
# otherwise: free whitespace lets a model pad its output with newlines and spaces (the demo model does).
_JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarBackend:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int,
                 dsml_token_id: int | None = None, pin_memory: bool = False) -> None:
        """``pin_memory``: ``fill_rows`` writes into page-locked memory (an engine on CUDA)."""
        if llguidance is None:
            raise RuntimeError("structured outputs need llguidance: pip install llguidance")
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
        self.words = (vocab_size + 31) // 32  # int32 words of one mask row
        self.dsml_token_id = dsml_token_id  # V4's tool-call marker, for forced tool calls
        # llguidance's thread pool for batched masks and advances, of its default size (80% of the cores this
        # process may use, at most 32), spelled out so that ``consume`` knows whether it has a pool at all.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.threads = min(32, max(1, cores * 4 // 5))
        self.executor = llguidance.LLExecutor(self.threads)
        self.pin_memory = pin_memory

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

    def fill_rows(self, jobs: Sequence[MaskJob], num_rows: int) -> StepMasks:
        """``fill``'s masks of the rows the jobs cover only (each job's row and the rows of its drafts, in job
        order), written by llguidance straight into the host buffer the runner uploads. ``num_rows``: the
        step's drawn rows (the rows a job covers lie below it)."""
        if not any(j.drafts for j in jobs):  # the usual step: one row per job, no per-row loop of our own
            rows = [j.row for j in jobs]
            if rows and max(rows) >= num_rows:
                raise ValueError(f"grammar masks: row {max(rows)} of a step of {num_rows} draws")
            out = StepMasks.allocate(len(jobs), self.words, self.pin_memory)
            out.rows[:] = rows
            llg_np.fill_next_token_bitmask_par(self.executor, [(j.matcher, i) for i, j in enumerate(jobs)],
                                               out.words)
            return out
        sizes = [1 + len(j.drafts) for j in jobs]
        out = StepMasks.allocate(sum(sizes), self.words, self.pin_memory)
        words = out.words
        rows, at, plain, drafted = out.rows, 0, [], []
        for j, n in zip(jobs, sizes):
            if j.row + n > num_rows:
                raise ValueError(f"grammar masks: rows {j.row}..{j.row + n - 1} of a step of {num_rows} draws")
            rows[at : at + n] = range(j.row, j.row + n)
            if n == 1:
                plain.append((j.matcher, at))
            else:
                drafted.append((j.matcher, at, list(j.drafts)))
            at += n
        if drafted:
            # Rows past a draft the grammar forbids are not written: they stay all allowed, as in ``fill``.
            words.fill(-1)
            if _PAR_DRAFTS is None:  # an llguidance older than its draft-aware filler
                words[:] = self.fill_one_at_a_time([MaskJob(m, r, tuple(d)) for m, r, d in drafted] +
                                                   [MaskJob(m, r) for m, r in plain], len(words))
                return out
            _PAR_DRAFTS(self.executor, drafted, words)
        if plain:
            llg_np.fill_next_token_bitmask_par(self.executor, plain, words)
        return out

    def consume(self, matchers: Sequence, tokens: Sequence[int]) -> list[bool]:
        """Feed ``matchers[i]`` the token ``tokens[i]`` (distinct matchers), on llguidance's thread pool when
        several; per matcher, ``consume_token``'s result (False: the matcher is now in its error state)."""
        if len(matchers) >= _PAR_CONSUME_MIN and self.threads > 1 and _PAR_CONSUME is not None:
            return list(_PAR_CONSUME(self.executor, list(zip(matchers, tokens))))
        return [m.consume_token(t) for m, t in zip(matchers, tokens)]

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
    """``logits`` [B, V] with the tokens whose bit is clear in ``words`` ([B, ceil(V/32)] int32) set to -inf
    (a copy; the op table's ``token_mask`` does it in place for listed rows). Allowed logits keep their bits."""
    out = logits.clone()
    ref_token_mask(out, words, torch.arange(len(words), device=logits.device))
    return out


def words_of(mask: bytes) -> np.ndarray:
    return np.frombuffer(mask, dtype=np.int32)

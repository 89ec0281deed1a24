"""Sampling: request parameters, the batched seeded sampler and logprobs.

Public API:
- :class:`SamplingParams` -- per-request parameters (validated, frozen).
- :class:`SamplingRow`, :func:`resolve_seed` -- per-row sampler metadata built from params + history.
- :class:`Sampler`, :func:`sample`, :class:`SamplerOutput`, :func:`process_logits` -- the sampler.
- :class:`TokenLogprobs`, :func:`prompt_logprobs` -- logprob results.
- :func:`derive_seed`, :func:`child_seed`, :func:`gumbel_argmax`, ``SALT_TARGET`` / ``SALT_DRAFT`` -- the
  counter-based RNG (see ``rng.py`` for the exact hash contract).
"""

from deepinfer.sampling.logprobs import TokenLogprobs, prompt_logprobs, token_logprobs
from deepinfer.sampling.metadata import SamplingRow, resolve_seed
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.rng import SALT_DRAFT, SALT_TARGET, child_seed, derive_seed, gumbel_argmax
from deepinfer.sampling.sampler import Sampler, SamplerOutput, process_logits, process_random_rows, sample

__all__ = [
    "SALT_DRAFT",
    "SALT_TARGET",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingRow",
    "TokenLogprobs",
    "child_seed",
    "derive_seed",
    "gumbel_argmax",
    "process_logits",
    "process_random_rows",
    "prompt_logprobs",
    "resolve_seed",
    "sample",
    "token_logprobs",
]

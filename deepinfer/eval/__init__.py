"""Model evaluation: held-out perplexity, top-1 next-token accuracy and MTP draft acceptance.

    deepinfer eval --model deepinfer/assets/demo --max-tokens 32768

computes every number twice, with deepinfer's own model (through ``SequenceCache``, chunked prefill) and with
Hugging Face ``transformers`` on the same (dequantized) weights, see :mod:`deepinfer.eval.perplexity`.
"""

from deepinfer.eval.perplexity import EvalResult, evaluate, heldout_windows

__all__ = ["EvalResult", "evaluate", "heldout_windows"]

"""Model evaluation: held-out perplexity, top-1 next-token accuracy and MTP draft acceptance, deepinfer vs HF.

    deepinfer eval --model deepinfer/assets/demo --max-tokens 32768

computes every number twice, with deepinfer's own model (through ``SequenceCache``, chunked prefill) and with
Hugging Face ``transformers`` on the same (dequantized) weights: the data in :mod:`deepinfer.eval.windows`, the
scorers in :mod:`deepinfer.eval.scoring`, the command in :mod:`deepinfer.eval.perplexity`.
"""

from deepinfer.eval.perplexity import EvalResult, evaluate
from deepinfer.eval.windows import heldout_windows

__all__ = ["EvalResult", "evaluate", "heldout_windows"]

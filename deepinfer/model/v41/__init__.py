"""DeepSeek-V4.1-Flash text model in plain PyTorch (spec: ``deepseek-v41-spec.md``).

CSA2 attention (compressed KV computed by ratio-2 and ratio-1 source layers and reused by later layers),
the two-level indexer (candidate blocks from one source layer, re-indexing layers), Engram n-gram memory,
single-pass ("lagged") mHC and score-only MoE routing. ``model.DeepseekV41`` runs a full sequence or one
chunk of it against a simple per-sequence cache (``cache.V41Cache``); ``loader.load_v41_model`` builds it
from a checkpoint directory.
"""

"""Bridge to Hugging Face ``transformers``' DeepSeek-V4: config conversion, weight names, and the MTP block.

Used by ``deepinfer eval``, the tests and ``tools/train_demo.py``. ``transformers`` is a test and evaluation
dependency only, so it is imported inside the functions that need it, never at import time.
"""

from deepinfer.hf_bridge.config import hf_config
from deepinfer.hf_bridge.models import load_hf
from deepinfer.hf_bridge.mtp import HFMTP, mtp_rename
from deepinfer.hf_bridge.weights import hf_state_to_native, native_to_hf_state

__all__ = ["HFMTP", "hf_config", "hf_state_to_native", "load_hf", "mtp_rename", "native_to_hf_state"]

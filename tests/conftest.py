"""Suite-wide fixtures."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True, scope="module")
def _free_engines_between_modules():
    """Engines hold their cache pools (up to 2 GiB each on the CPU) and some sit in reference cycles, which
    Python frees only when the cycle collector runs: collect after every module so the suite's memory stays
    that of one module, not the sum of all."""
    yield
    gc.collect()

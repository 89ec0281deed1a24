"""Options of the whole test suite."""

from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser) -> None:
    parser.addoption("--server-mode", default="process", choices=("process", "thread"),
                     help="how the server tests run the engine: its own process (deepinfer serve's default) or a "
                          "thread of the server (--no-engine-process); a representative subset runs in thread "
                          "mode either way")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: their small GEMMs run many times faster on one torch thread
    (and the timings stay steady). Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)

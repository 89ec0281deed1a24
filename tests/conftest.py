"""Options of the whole test suite."""

from __future__ import annotations


def pytest_addoption(parser) -> None:
    parser.addoption("--server-mode", default="process", choices=("process", "thread"),
                     help="how the server tests run the engine: its own process (deepinfer serve's default) or a "
                          "thread of the server (--no-engine-process); a representative subset runs in thread "
                          "mode either way")

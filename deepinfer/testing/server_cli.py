"""Start ``python -m deepinfer.server`` as its own process and wait for the port it bound: for tests of the
command line server's lifecycle (signals, exit codes, engine death)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time


def start_server(args: list[str], timeout: float = 90) -> tuple[subprocess.Popen, int]:
    """The server process (stderr piped as text) and its port. ``args`` follow ``--device cpu --block-size 128
    --port 0 --log-level info``; the port is read from the start-up log line."""
    cmd = [sys.executable, "-m", "deepinfer.server", "--device", "cpu", "--block-size", "128", "--port", "0",
           "--log-level", "info", *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    port, deadline = None, time.monotonic() + timeout
    while port is None:
        line = proc.stderr.readline()
        if not line or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server did not start")
        m = re.search(r"running on http://127\.0\.0\.1:(\d+)", line)
        port = int(m.group(1)) if m else None
    return proc, port

"""Two "nodes" of two ranks each, started on this machine as separate processes exactly as the README's
multi-node commands start them, generate the single-process engine's greedy tokens:

  * deepinfer's own flags (``--nnodes 2 --node-rank n --master-addr --master-port``): one command per node,
    which spawns that node's ranks; DP2 x TP2 + EP, so each TP group lies inside a node (TP8 x DP2 on two
    8-GPU nodes) and the DP groups and the expert all-to-all cross the nodes;
  * torchrun (``--nnodes 2 --nproc-per-node 2 --node-rank n``): one agent per node starting every rank,
    DP4 + EP (DP16 + EP on two 8-GPU nodes).
Node 0 writes the outputs; node 1's processes write nothing and exit 0 once the engine shuts down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.distributed.world import free_port

PROMPTS = ["def f(x):", "class Stack:", "import os", "for i in range("]
TIMEOUT_S = 150


def _generate(out: Path) -> list[str]:
    # A small cache: every rank of every world allocates its own, and the default one takes seconds.
    return ["-m", "deepinfer.cli", "generate", *PROMPTS, "--max-tokens", "6", "--device", "cpu", "--quiet",
            "--num-cache-blocks", "8", "--max-model-len", "256", "--output", str(out)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("single") / "out.jsonl"
    subprocess.run([sys.executable, *_generate(out)], env=_env(), timeout=TIMEOUT_S, check=True)
    text = out.read_text()
    assert text.count("\n") == len(PROMPTS)
    return text


def _node_commands(launcher: str, tmp_path: Path) -> list[list[str]]:
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    if launcher == "flags":
        world = ["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--enable-expert-parallel"]
        return [[sys.executable, *_generate(tmp_path / f"node{n}.jsonl"), *world, "--nnodes", "2",
                 "--node-rank", str(n), *rendezvous] for n in range(2)]
    world = ["--data-parallel-size", "4", "--enable-expert-parallel"]
    return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--node-rank", str(n), *rendezvous, *_generate(tmp_path / f"node{n}.jsonl"), *world]
            for n in range(2)]


@pytest.mark.parametrize("launcher", ["flags", "torchrun"])
def test_two_nodes_of_two_ranks_equal_single_process(single, tmp_path, launcher) -> None:
    # Each node in its own session, so a hang ends with every process it started.
    nodes = [subprocess.Popen(cmd, env=_env(), start_new_session=True) for cmd in _node_commands(launcher, tmp_path)]
    try:
        assert [p.wait(timeout=TIMEOUT_S) for p in nodes] == [0, 0]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert not (tmp_path / "node1.jsonl").exists()
    assert (tmp_path / "node0.jsonl").read_text() == single

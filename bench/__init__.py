"""Benchmark harnesses (run as scripts; see the README); results and their commands in bench/results/."""

"""Fixtures and checks shared by the tests, the benchmarks and users: random checkpoints, compiled-kernel SASS."""

"""Kernel benchmarks and codegen reports: each weight-streaming or attention kernel against its bytes floor."""

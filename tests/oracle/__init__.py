"""Hugging Face reference models for the tests: random tiny DeepseekV4ForCausalLM oracles."""

"""Component tests on the CPU: ops, the model against HF, loader, cache, sampler, chat format, tokenizer, demo."""

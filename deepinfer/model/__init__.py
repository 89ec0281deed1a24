"""The DeepSeek-V4 model: plain-PyTorch math, the checkpoint loader and formats, and the batched GPU step path."""

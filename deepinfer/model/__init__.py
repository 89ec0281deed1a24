"""The DeepSeek-V4 model as plain-PyTorch math, its checkpoint loader and its chat format."""

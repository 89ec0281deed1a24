"""Ops: ``ref`` holds the plain-PyTorch specification; accelerated twins share its signatures."""
